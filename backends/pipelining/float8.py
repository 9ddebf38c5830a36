"""Float8 linears in pipeline stages: each nn.Linear a float8 pipeline plan converts (`Plan.meta["float8"]["linears"]`,
read off the stage plans' graphs by passes/float8.py) computes its three GEMMs as torchao's tensorwise Float8Linear
does, the recipe the stages were priced with: the input and the weight cast to e4m3, the output gradient to e5m2,
each scaled by `max(dtype) / amax(|t|)`, multiplied by `torch._scaled_mm` with the inverse scales, the output in
the input's dtype; the high-precision input and weight are saved for the backward and cast again there.

On a tensor-parallel stage the operands are DTensors (parallelize_module's styles run around the linear): the amax
of a sharded operand is all-reduced over the tp group before its cast, as torchao's Float8ColwiseParallel /
Float8RowwiseParallel do and as the plan prices it, and DTensor runs `_scaled_mm` on the shards. Data-parallel
ranks scale the rows they hold, each micro-batch alone (one scale per tensor per GEMM call).
"""

from __future__ import annotations

import torch
from torch import nn

from ..spmd.float8 import probe, scaled

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _mm(a, a_dtype, b, b_dtype, out_dtype):
    """a @ b with both operands cast to float8 (a row-major, b column-major, as _scaled_mm takes them)."""
    qa, ia = scaled(a, a_dtype)
    qb, ib = scaled(b, b_dtype)
    return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=ia, scale_b=ib, out_dtype=out_dtype)


class _Float8Linear(torch.autograd.Function):
    """x @ w^T with x, w in e4m3; grad_input = g @ w and grad_weight = g^T @ x with g in e5m2."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        return _mm(x2, E4M3, w.t(), E4M3, x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gi = _mm(g2, E5M2, w, E4M3, g.dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = _mm(g2.t(), E5M2, x.reshape(-1, x.shape[-1]), E4M3, w.dtype) if ctx.needs_input_grad[1] else None
        return gi, gw


def _forward(linear: nn.Linear):
    def forward(x):
        out = _Float8Linear.apply(x, linear.weight)
        return out if linear.bias is None else out + linear.bias

    return forward


def check(model: nn.Module, plan, device) -> None:
    """Raise on every rank alike, before any stage is built, unless each linear the plan converts (on any stage) is
    an nn.Linear of `model` and `_scaled_mm` runs on `device`: NotImplementedError naming the module, or
    Float8LoweringError (backends/spmd/float8.py)."""
    f8 = plan.meta.get("float8") or {}
    if not f8:
        return
    if "linears" not in f8:
        raise NotImplementedError(
            "the pipeline plan prices float8 linears but does not name them (a plan from an older autopar): plan it "
            "again"
        )
    for f in f8["linears"]:
        mod = model.get_submodule(f)
        if not isinstance(mod, nn.Linear):
            leaf = f.rsplit(".")[-1]
            raise NotImplementedError(
                f"the plan computes module '{f}' ({type(mod).__name__}) in float8; the pipelining runtime runs float8 "
                f"GEMMs in nn.Linear modules only: plan with float8={{'filter_fqns': ['output', '{leaf}']}}"
            )
    if f8["linears"]:
        probe(device)


def convert(stage: nn.Module, plan, k: int) -> list[str]:
    """Give each linear of stage k that the plan converts (and the stage holds) the float8 forward (check() has
    passed); returns their FQNs."""
    held = set(plan.stages[k]["params"])
    mine = [f for f in (plan.meta.get("float8") or {}).get("linears", []) if f"{f}.weight" in held]
    for f in mine:
        mod = stage.get_submodule(f)
        mod.forward = _forward(mod)
    return mine
