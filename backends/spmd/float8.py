"""Float8 GEMMs on the graph executor: the converted linears' GEMMs of a float8 plan (passes/float8.py, recorded in
Plan.meta["float8"]["nodes"]) run as tensorwise-scaled `torch._scaled_mm` on this rank's local operands.

Each operand is scaled by `max(dtype) / amax(|t|)` over the tensor this rank holds (the plan's per-rank scaling),
cast with saturation, and multiplied with the inverse scales; the result comes out in the GEMM's own dtype, so a
partial (contraction-sharded) output is summed afterwards by the plan's collectives like any other. Where torch
cannot run `_scaled_mm` on the device (CUDA before compute capability 8.9, other backends), lowering fails with
the reason, before any step.
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.strategies._torch_adapter import scaled_mm

aten = torch.ops.aten

_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class Float8LoweringError(RuntimeError):
    """A float8 plan cannot run on this device; the message says why."""


def scaled(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in float8 `dtype`, the inverse scale): one scale for the whole tensor, from its amax. A DTensor's amax is
    the whole logical tensor's (all-reduced where t is sharded; the pipelining runtime's tensor-parallel stages)."""
    top = torch.finfo(dtype).max
    amax = _replicated(t.detach().abs().amax().float())
    scale = top / amax.clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def _replicated(t):
    """t as a Replicate DTensor where it is a DTensor, else t."""
    if not hasattr(t, "device_mesh"):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)


def scaled_gemm(a, a_dtype, b, b_dtype, out_dtype):
    """a @ b with each operand cast to its float8 dtype with its own tensorwise scale, in out_dtype."""
    qa, ia = scaled(a, a_dtype)
    qb, ib = scaled(b, b_dtype)
    # _scaled_mm takes its first operand row-major and its second column-major
    return scaled_mm(qa.contiguous(), qb.t().contiguous().t(), ia, ib, out_dtype)


def _gemm(a_dtype, b_dtype, bias_first: bool):
    """The kernel replacing mm(a, b) (or addmm(bias, a, b)) with float8 operands of these dtypes."""

    def run(*args):
        bias, a, b = args if bias_first else (None, *args)
        out = scaled_gemm(a, a_dtype, b, b_dtype, a.dtype)
        return out if bias is None else out + bias

    run.__name__ = f"float8_{a_dtype}_{b_dtype}".replace("torch.float8_", "")
    return run


def probe(device) -> None:
    """Run one tiny scaled GEMM on `device`; Float8LoweringError naming the device and torch's reason if it fails."""
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        scaled_mm(a, a.t().contiguous().t(), one, one, torch.float32)
    except Exception as e:
        raise Float8LoweringError(
            f"the plan computes its linears in float8 (Plan.meta['float8']), but torch._scaled_mm does not run on "
            f"{device} (float8 GEMMs need CUDA compute capability 8.9+, or a CPU): {type(e).__name__}: {e}"
        ) from e


def lower(local, plan, device):
    """The local program with the plan's float8 GEMMs replaced by their scaled kernels (local unchanged without)."""
    rows = (plan.meta or {}).get("float8", {}).get("nodes", []) if plan is not None else []
    if not rows:
        return local
    probe(device)
    roles = {r[0]: (_DTYPES[r[1]], _DTYPES[r[2]]) for r in rows}

    def swap(op):
        if op.node.idx not in roles:
            return op
        if op.mode != "local" or op.node.target not in (aten.mm.default, aten.addmm.default):
            raise Float8LoweringError(f"{op.name} ({op.node.module}): a float8 GEMM must run on local shards")
        return dataclasses.replace(op, fn=_gemm(*roles[op.node.idx], op.node.target is aten.addmm.default))

    return dataclasses.replace(
        local, forward=tuple(map(swap, local.forward)), backward=tuple(map(swap, local.backward))
    )
