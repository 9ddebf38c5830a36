"""Pass: mixed precision as FSDP2 runs it, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).

Mixed precision is a planner decision (`autopar.plan(..., allow_bf16=True)`): the model is planned twice, once as
it is (fp32) and once as FSDP2's mixed precision computes it, and the plan with the lower predicted step time
that fits the memory budget wins (`choose`). For the mixed-precision candidate `autopar.plan` captures the graph
with bf16 parameters, which is what every FSDP unit computes with after its bf16 all-gather: matmuls, saved
activations and parameter gathers are bf16 (half the bytes, the device's bf16 peak), while explicit upcasts in
the model (`.float()` before a norm or the loss) stay fp32. This pass then inserts (autopar/mixed_precision.py), right after each gradient's
producer, a cast of the gradient to the reduce dtype, so the gradient's reduction into its fp32 sharded parameter
(the optimizer-step edge) is priced and executed in fp32, as FSDP2 does (it casts the unsharded bf16 gradient to
`reduce_dtype` before its reduce-scatter). Model state is unchanged by the decision: the sharded parameters, their
gradients and the optimizer state stay fp32 (the bf16 unsharded copies are transient).

Float8 linears are a decision of the same kind (`autopar.plan(..., float8=True | "auto" | {...})`,
passes/float8.py): this pass marks the converted linears' GEMMs (`float8.mark`), the costs pass prices them.

Runs first (before `regions`), so the casts join their layer's repeated region like any other node.
"""

from __future__ import annotations

import torch

from autopar.mixed_precision import cast_gradients

from . import float8

MIXED_BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def run(state) -> None:
    _mixed(state)
    float8.mark(state)  # after the casts: the GEMMs read their operands through them


def _mixed(state) -> None:
    mp = state.options.get("mixed_precision")
    if not mp:
        return
    n = cast_gradients(state.graph, getattr(torch, mp["reduce_dtype"]))
    if n:
        state.extras["mixed_precision"] = dict(mp, grad_casts=n)


def label(variant: dict) -> str:
    """A precision variant's name: its mixed precision ("fp32": the model as it is), " + float8 linears" if any."""
    base = "bf16 params / fp32 reduce" if variant.get("mixed_precision") else "fp32"
    return base + (" + float8 linears" if variant.get("float8") else "")


def choose(results: list, infeasible: list) -> tuple:
    """Pick the precision: results = [(variant, state, plan)], variant = {"mixed_precision": option or None,
    "float8": option or None}; infeasible = [(variant, reason)]. The lowest predicted step time wins (every result
    fits the budget; on a tie, the variant with fewer changes). Records the comparison in the chosen plan's
    meta["precision_decision"]."""
    rows = {
        label(v): {
            "step_s": p.predicted["step_s"],
            "compute_s": p.predicted["compute_s"],
            "comm_s": p.predicted["comm_s"],
            "peak_mem_bytes": p.predicted["peak_mem_bytes"],
        }
        for v, _, p in results
    }
    for v, err in infeasible:
        rows[label(v)] = {"infeasible": str(err).splitlines()[0]}
    changes = lambda v: sum(x is not None for x in v.values())
    best = min(results, key=lambda t: (t[2].predicted["step_s"], changes(t[0])))
    v, state, p = best
    others = [r for r in results if r is not best]
    why = (
        "the only candidate that fits the memory budget"
        if not others
        else f"predicted step {p.predicted['step_s'] * 1e3:.3f} ms vs "
        + ", ".join(f"{label(o[0])} {o[2].predicted['step_s'] * 1e3:.3f} ms" for o in others)
    )
    p.meta["precision_decision"] = {
        "chosen": label(v),
        "mixed_precision": v.get("mixed_precision"),
        "float8": v.get("float8"),
        "candidates": rows,
        "why": why,
    }
    return best
