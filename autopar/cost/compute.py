"""Roofline compute model for single aten ops on fake/meta tensors.

FLOPs come from torch.utils.flop_counter's registry (the same formulas FlopCounterMode uses; attention is
counted without a causal discount, as torch does). Ops without a formula count 0 FLOPs and are memory bound.
"""

from __future__ import annotations
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from ..graph import Ref
from .cluster import DeviceSpec

aten = torch.ops.aten

# The CPU flash-attention kernels have the same math as the CUDA flash variant (fwd 4*B*H*Sq*Sk*D, bwd 2.5x),
# and their leading args line up (q, k, v, ... / grad_out, q, k, v, ...), so reuse torch's formulas directly.
# Registered into torch's registry so FlopCounterMode counts them too; skipped if torch already has them.
_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
for _op, _src in _ALIASES.items():
    if _op not in flop_registry and _src in flop_registry:
        flop_registry[_op] = flop_registry[_src]


def _packet(func):
    return getattr(func, "overloadpacket", func)


def has_flop_formula(func) -> bool:
    return _packet(func) in flop_registry


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op call (func: OpOverload or OpOverloadPacket) on real/fake/meta tensors; 0 if no formula."""
    f = flop_registry.get(_packet(func))
    if f is None:
        return 0
    return int(f(*args, **(kwargs or {}), out_val=out))


def _tensors(tree) -> list[torch.Tensor]:
    seen, ts = set(), []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            ts.append(t)
    return ts


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_bytes(args, out, kwargs=None) -> int:
    """Bytes read (distinct tensor inputs in args/kwargs) + bytes written (tensor outputs)."""
    return sum(map(tensor_bytes, _tensors((args, kwargs or {})))) + sum(map(tensor_bytes, _tensors(out)))


def is_view(op) -> bool:
    """An op whose output aliases its input (view, t, permute, expand, squeeze, slice...; `_unsafe_view` too): it
    moves no data, so it costs the device's per-op overhead and no memory traffic."""
    return bool(getattr(op, "is_view", False)) or op is torch.ops.aten._unsafe_view.default


def roofline_time(flops: float, nbytes: float, device: DeviceSpec, dtype: torch.dtype) -> float:
    """Seconds: max(compute at matmul_eff of the dtype's peak, traffic at mem_eff of memory bandwidth)."""
    return max(flops / (device.flops_for(dtype) * device.matmul_eff), nbytes / (device.mem_bw * device.mem_eff))


def compute_dtype(args, out=None) -> torch.dtype:
    """The dtype an op computes in: that of its first floating-point tensor (inputs first), else fp32."""
    for t in _tensors((args, out)):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def op_time(func, args, kwargs, out, device: DeviceSpec) -> float:
    """Roofline seconds of one aten op call."""
    return roofline_time(
        op_flops(func, args, kwargs, out), op_bytes(args, out, kwargs), device, compute_dtype(args, out)
    )


def _meta_tensor(m):
    return torch.empty(m.shape, dtype=m.dtype, device="meta")


def global_flops(g, n, cache) -> float:
    """FLOPs of graph node n at its global shapes (torch's flop formulas on meta tensors; 0 without a formula).
    cache: a dict shared across calls, keyed by op, input shapes and constant arguments."""
    if n.kind != "op" or not has_flop_formula(n.target):
        return 0.0
    key = (n.target, tuple(g.meta(r).shape for r in n.inputs()), repr(_plain(n.args)), repr(_plain(n.kwargs)))
    if key not in cache:
        conv = lambda a: (
            _meta_tensor(g.meta(a))
            if isinstance(a, Ref)
            else type(a)(conv(x) for x in a)
            if isinstance(a, (list, tuple))
            else a
        )
        args = conv(n.args)
        kwargs = {k: conv(v) for k, v in n.kwargs.items()}
        outs = [_meta_tensor(m) if m is not None else None for m in n.outs]
        out = outs[0] if len(outs) == 1 else tuple(outs)
        try:
            cache[key] = float(op_flops(n.target, args, kwargs, out))
        except Exception:
            cache[key] = 0.0
    return cache[key]


def _plain(a):
    if isinstance(a, Ref):
        return "T"
    if isinstance(a, (list, tuple)):
        return tuple(_plain(x) for x in a)
    return a
