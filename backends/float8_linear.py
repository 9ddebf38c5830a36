"""Float8 linears as torchao's tensorwise Float8Linear computes them, for the engines that run the user's modules
(backends/torch: FSDP2 / parallelize_module; backends/pipelining: pipeline stages): each nn.Linear (or transformers'
Conv1D, GPT-2's linears: the same GEMM on its (in, out) weight) a float8 plan converts (`Plan.meta["float8"]
["linears"]`, read off the plan's graph by passes/float8.py) computes its three GEMMs as the plan priced them: the
input and the weight cast to e4m3, the output gradient to e5m2, each scaled by `max(dtype) / amax(|t|)`, multiplied
by `torch._scaled_mm` with the inverse scales, the output in the input's dtype; the high-precision input and weight
are saved for the backward and cast again there.

Under tensor parallelism the operands are DTensors (parallelize_module's styles run around the linear): the amax of
a sharded operand is all-reduced over the tp group before its cast, as torchao's Float8ColwiseParallel /
Float8RowwiseParallel do and as the plan prices it, and DTensor runs `_scaled_mm` on the shards. Under FSDP2 the
forward reads the gathered weight, so its scale is the whole weight's (a plan with `fsdp_float8_all_gather` prices
those gathers at one byte an element; they run at the parameter dtype here, with the same numerics). Data-parallel
ranks scale the rows they hold (one scale per tensor per GEMM call).
"""

from __future__ import annotations

import torch
from torch import nn

from .spmd.float8 import probe, scaled_gemm as _mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Float8Linear(torch.autograd.Function):
    """x @ w^T (x 2-D) with x, w in e4m3; grad_input = g @ w and grad_weight = g^T @ x with g in e5m2."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _mm(x, E4M3, w.t(), E4M3, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gi = _mm(g, E5M2, w, E4M3, g.dtype) if ctx.needs_input_grad[0] else None
        gw = _mm(g.t(), E5M2, x, E4M3, w.dtype) if ctx.needs_input_grad[1] else None
        return gi, gw


def _conv1d(mod: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's linears): x @ weight + bias, its weight stored (in, out)."""
    return type(mod).__name__ == "Conv1D" and type(mod).__module__ == "transformers.pytorch_utils"


def _forward(linear: nn.Module):
    """The float8 forward of an nn.Linear or a transformers Conv1D (the same GEMM on the transposed weight)."""

    def forward(x):
        # the GEMM on 2-D operands, its output reshaped out here: a view made inside a custom Function cannot be
        # modified in place (OLMo clamps its q/k/v projections in place)
        w = linear.weight.t() if _conv1d(linear) else linear.weight
        out = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
        return out if linear.bias is None else out + linear.bias

    return forward


def _convertible(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or _conv1d(mod)


def unconvertible(model: nn.Module, plan) -> str | None:
    """Why the plan's float8 linears cannot run as converted modules of `model` (None: they can, or there are
    none): a plan that does not name them, or a converted module that is no nn.Linear (named, with the filter that
    keeps it in high precision)."""
    f8 = plan.meta.get("float8") or {}
    if f8 and "linears" not in f8:
        return "the plan prices float8 linears but does not name them (a plan from an older autopar): plan it again"
    for f in f8.get("linears", []):
        mod = model.get_submodule(f)
        if not _convertible(mod):
            leaf = f.rsplit(".")[-1]
            return (
                f"the plan computes module '{f}' ({type(mod).__name__}) in float8; the engines run float8 GEMMs in "
                f"nn.Linear and transformers' Conv1D modules only (the graph backend runs any): plan with "
                f"float8={{'filter_fqns': ['output', '{leaf}']}}"
            )
    return None


def check(model: nn.Module, plan, device) -> None:
    """Raise on every rank alike, before any module is wrapped, unless the plan's float8 linears can run here:
    NotImplementedError (unconvertible's reason), or Float8LoweringError where `_scaled_mm` does not run on `device`
    (backends/spmd/float8.py)."""
    why = unconvertible(model, plan)
    if why:
        raise NotImplementedError(why)
    if (plan.meta.get("float8") or {}).get("linears"):
        probe(device)


def convert(model: nn.Module, fqns) -> list[str]:
    """Give each of these nn.Linear (or Conv1D) modules of `model` the float8 forward; returns their FQNs."""
    mods = [model.get_submodule(f) for f in fqns]
    bad = [f"{f} ({type(m).__name__})" for f, m in zip(fqns, mods) if not _convertible(m)]
    if bad:
        raise NotImplementedError(f"float8 conversion takes nn.Linear and Conv1D modules only, not {bad}")
    for mod in mods:
        mod.forward = _forward(mod)
    return list(fqns)
