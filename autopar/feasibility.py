"""Can any plan fit the memory budget, and if not, what would?

`memory_bound` is a lower bound on every plan's peak memory per rank, computed after capture and the regions pass
(which names the blocks checkpointing may drop), before candidates, costs and the solve, so a budget no plan can
meet fails in seconds. It evaluates the planner's own memory model (autopar/predict.py: model state at the
parameters' storage placements + the liveness peak of the fw+bw order) at the best any placement can do:
  * every parameter's state and every activation split over all ranks of the mesh (a placement shards over at
    most every mesh dim, so no value is smaller per rank than its bytes / ranks);
  * every repeated block checkpointed when checkpointing is allowed: a checkpointed block's values are live over
    a subset of the steps they are live without it, so more checkpointed blocks never raise the liveness at any
    step, and the pass (passes/checkpointing.py) only ever picks some of these blocks;
  * outputs that a candidate strategy may leave unplaced are not counted (DTensor's full strategies pad the
    outputs they do not place with None; the liveness walk skips those).
So the bound never rejects a plan the solver could return. `what_would_fit` turns a bound (or the solver's
smallest peak, when the bound passes and the solver still finds nothing) into the changes that would bring it under
the budget: more ranks, a pp dim, checkpointing, lower-precision optimizer states, bf16 activations.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from .cost import TrainingPrecision
from .predict import liveness_peak
from .solver import InfeasibleMemoryError
from .strategies import RULES, Strategy
from .strategies import _torch_adapter as adapter

GB = 1e9


@dataclass(frozen=True)
class MemoryBound:
    """Per-rank lower bounds (bytes) of one captured graph on `ranks` ranks, and what the alternatives change."""

    ranks: int
    budget: float
    n_params: int
    precision: TrainingPrecision
    state_bytes: float  # parameters, gradients, master copy and optimizer state, over all ranks
    act_bytes: float  # the liveness peak's bound under the checkpointing allowed
    blocks: int  # repeated blocks checkpointing may drop
    checkpointing: bool  # allowed (the bound assumes every block checkpointed)
    act_bytes_checkpointed: float | None = None  # with every block checkpointed, when checkpointing is off
    act_bytes_bf16: float | None = None  # fp32 activations at bf16's 2 bytes, for an fp32 model without allow_bf16
    seconds: float = 0.0

    @property
    def total(self) -> float:
        return self.state_bytes + self.act_bytes

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


def memory_bound(state, allow_bf16: bool = False) -> MemoryBound:
    """The bound of a PlanState after the precision and regions passes (see the module docstring)."""
    t = time.perf_counter()
    g, mesh_shape = state.graph, state.mesh.shape
    ranks = math.prod(mesh_shape)
    n_params = sum(g.nodes[i].out.numel for i in g.params.values())
    blocks = block_members(state)
    ckpt = bool(state.options.get("allow_checkpointing", True)) and bool(blocks)
    recompute = [{"block": fqn, "nodes": nodes} for fqn, nodes in blocks]
    act = _activation_bound(g, mesh_shape, recompute if ckpt else None)
    act_ckpt = None
    if blocks and not ckpt:
        act_ckpt = _activation_bound(g, mesh_shape, recompute)
    act_bf16 = None
    fp32 = any(n.out.dtype == torch.float32 for n in (g.nodes[i] for i in g.params.values()))
    if fp32 and not allow_bf16 and not state.options.get("mixed_precision"):
        act_bf16 = _activation_bound(g, mesh_shape, recompute if ckpt else None, fp32_at_half=True)
    return MemoryBound(
        ranks=ranks,
        budget=float(state.budget),
        n_params=n_params,
        precision=state.precision,
        state_bytes=n_params * state.precision.bytes_per_param / ranks,
        act_bytes=act,
        blocks=len(blocks),
        checkpointing=ckpt,
        act_bytes_checkpointed=act_ckpt,
        act_bytes_bf16=act_bf16,
        seconds=time.perf_counter() - t,
    )


def block_members(state) -> list[tuple[str, list[int]]]:
    """(module FQN, node indices) of every layer of every repeated region, in execution order: the blocks the
    checkpointing pass may checkpoint (its `_blocks`, from the regions pass's `region_of` and `regions`)."""
    if not state.regions:
        return []
    members: dict = {}
    for n in state.graph.nodes:
        key = state.region_of[n.idx]
        if key is not None:
            members.setdefault(key, []).append(n.idx)
    out = [(f"{r['prefix']}.{i}", members.get((r["prefix"], i), [])) for r in state.regions for i in r["layers"]]
    return sorted((b for b in out if b[1]), key=lambda b: b[1][0])


def _activation_bound(g, mesh_shape, recompute, fp32_at_half: bool = False) -> float:
    """predict.liveness_peak with every counted value split over all ranks: a placement sharding every mesh dim
    gives num_shards == ranks. fp32_at_half: fp32 values count 2 bytes per element (a bf16 plan's activations),
    by splitting them over one more mesh dim of size 2 that only they shard."""
    ndim = len(mesh_shape)
    shape = tuple(mesh_shape) + ((2,) if fp32_at_half else ())
    every, half = ("S0",) * ndim, ("S0",) * (ndim + 1)
    keep = every + ("R",) if fp32_at_half else every

    def placed(m):
        return half if fp32_at_half and m.dtype == torch.float32 else keep

    P = []
    for n in g.nodes:
        if n.kind == "op" and _may_leave_unplaced(n.target):
            P.append(Strategy(tuple(None for _ in n.outs), ()))
        else:
            P.append(Strategy(tuple(None if m is None else placed(m) for m in n.outs), ()))
    return liveness_peak(g, P, shape, recompute)


def _may_leave_unplaced(op) -> bool:
    """Whether a candidate of this op may give a tensor output no placement: the ops whose strategies come from
    DTensor's full strategy functions (autopar.strategies.node_strategies pads their unplaced outputs with None)."""
    return op not in RULES and not adapter.has_single_dim(op) and adapter.has_full(op)


def check(bound: MemoryBound, mesh) -> None:
    """Raise InfeasibleMemoryError, with the numbers and what would fit, when the bound exceeds the budget."""
    if bound.fits:
        return
    acts = (
        f"activations >= {bound.act_bytes / GB:.3f} GB with activation checkpointing of all {bound.blocks} blocks"
        if bound.checkpointing
        else f"activations >= {bound.act_bytes / GB:.3f} GB"
    )
    msg = (
        f"no plan fits {bound.budget / GB:.3f} GB per rank on mesh {mesh}: the smallest achievable peak is at least "
        f"{bound.total / GB:.3f} GB (a lower bound, found in {bound.seconds:.2f} s before any solve: model state "
        f"{bound.state_bytes / GB:.3f} GB = {bound.n_params / 1e9:.3f} B parameters x "
        f"{_bytes_per_param(bound.precision)} over all {bound.ranks} ranks; {acts}, split over all ranks)"
    )
    err = InfeasibleMemoryError(msg)
    add_fixes(err, bound, mesh, bound.total)
    raise err


def add_fixes(err: InfeasibleMemoryError, bound: MemoryBound, mesh, smallest: float | None = None) -> None:
    """Append what would fit to an InfeasibleMemoryError's message (and set its `fixes`). smallest: the smallest
    per-rank peak known (the bound, or the solver's); default: the bound."""
    need = max(bound.total, smallest or 0.0)
    err.fixes = tuple(what_would_fit(bound, mesh, need))
    err.args = (str(err) + "\nwhat would fit:\n" + "\n".join(f"  - {f}" for f in err.fixes),) + err.args[1:]


def what_would_fit(bound: MemoryBound, mesh, need: float) -> list[str]:
    """One line per change, with the per-rank peak it would leave from `need` (bytes); the ones that fit first.
    Ranks and pp stages scale the peak as 1 / ranks, its best (bound: every term is split over all ranks); the
    others subtract what they save from the bound."""
    budget, fit = bound.budget, []
    factor = max(2, math.ceil(need / budget))  # the bound falls as 1 / ranks at best
    least = max(bound.ranks + 1, math.ceil(need * bound.ranks / budget))
    fit.append(
        (
            need / factor,
            f"more ranks: >= {least} ranks, e.g. mesh {_grown(mesh, factor)}: {need / factor / GB:.3f} GB per rank "
            f"if everything shards that far",
        )
    )
    if bound.blocks + 2 >= factor and "pp" not in mesh.names:
        fit.append(
            (
                need / factor,
                f"a pp dim: pp={factor} in front (mesh {_with_pp(mesh, factor)}, {bound.ranks * factor} ranks; stages "
                f"split the {bound.blocks} blocks): ~{need / factor / GB:.3f} GB per rank",
            )
        )
    if bound.act_bytes_checkpointed is not None:
        left = need - (bound.act_bytes - bound.act_bytes_checkpointed)
        fit.append((left, f"activation checkpointing (allow_checkpointing=True): ~{left / GB:.3f} GB per rank"))
    p = bound.precision
    if p.optim_states and p.optim_bytes > 2:
        low = replace(p, optim_bytes=2)
        left = need - bound.n_params * (p.bytes_per_param - low.bytes_per_param) / bound.ranks
        fit.append((left, f"bf16 optimizer states (precision={_precision_repr(low)}): ~{left / GB:.3f} GB per rank"))
    if bound.act_bytes_bf16 is not None:
        left = need - (bound.act_bytes - bound.act_bytes_bf16)
        fit.append((left, f"bf16 activations (allow_bf16=True, or a bf16 model): ~{left / GB:.3f} GB per rank"))
    fit.sort(key=lambda t: t[0] > budget)  # stable: the ones that fit first, each kind in its order
    return [line + ("" if left <= budget else f" (still over {budget / GB:.3f} GB alone)") for left, line in fit]


def _grown(mesh, factor: int) -> str:
    """The mesh with its data-parallel dim (named dp, else the first) `factor` times larger."""
    d = mesh.names.index("dp") if "dp" in mesh.names else 0
    shape = list(mesh.shape)
    shape[d] *= factor
    return "x".join(map(str, shape)) + f"({','.join(mesh.names)})"


def _with_pp(mesh, p: int) -> str:
    """The mesh with a pp dim of size p in front."""
    return f"{p}x" + "x".join(map(str, mesh.shape)) + f"(pp,{','.join(mesh.names)})"


def _bytes_per_param(p: TrainingPrecision) -> str:
    parts = f"params {p.param}, grads {p.grad}" + (f", master {p.master}" if p.master else "")
    if p.optim_states:
        parts += f", optimizer {p.optim_states}x{p.optim_bytes}"
    return f"{p.bytes_per_param} B ({parts})"


def _precision_repr(p: TrainingPrecision) -> str:
    return (
        f"TrainingPrecision(param={p.param}, grad={p.grad}, master={p.master}, optim_states={p.optim_states}, "
        f"optim_bytes={p.optim_bytes})"
    )


# ---- why a plan replicates everything ---------------------------------------------------------------------------


def is_replicated(plan) -> bool:
    """Every parameter whole on every rank (replicated, or sharded over a dim of one rank only), and no collective
    but gradient all-reduces (or none)."""
    if any(p != "R" and size > 1 for pl in plan.params.values() for p, size in zip(pl, plan.mesh_shape)):
        return False
    for n in plan.nodes:
        for r in n.get("redistribute", []):
            if r["collectives"] and (r["class"] != "grad" or any(c[0] != "all_reduce" for c in r["collectives"])):
                return False
    return all(b["kind"] == "all_reduce" for b in plan.buckets)


def replicated_why(state, plan) -> dict | None:
    """For a replicated plan, the cluster's figures that made it cheapest, per mesh dim of more than one rank: the
    link's all_gather latency, launch cost and bandwidth, and what sharding the plan's costliest op on that dim alone
    would save in compute against the redistributes it would add (its inputs from replicated, its outputs back to
    replicated), from the planner's own cost tables (state.cost's node_time and rtime). None for other plans."""
    if not is_replicated(plan):
        return None
    g, mesh, cluster = state.graph, state.mesh, state.cluster
    node_time, rtime = state.cost["node_time"], state.cost["rtime"]
    ops = [n for n in g.ops() if n.phase == "fw"] or list(g.ops())
    top = max(ops, key=lambda n: node_time(n, state.placement[n.idx])) if ops else None
    dims = []
    for d, (name, size) in enumerate(zip(mesh.names, mesh.shape)):
        if size <= 1:
            continue
        link = cluster.link_for(mesh.shape, d)
        alpha, bw = link.of("all_gather")
        row = {"dim": name, "size": size, "link": link.name, "alpha_s": alpha, "bw": bw}
        row["launch_s"] = link.launch_of("all_gather")
        if top is not None:
            row["op"] = _sharded_on(state, top, d, node_time, rtime)
        dims.append(row)
    return {"compute_s": plan.predicted["compute_s"], "dims": dims}


def _sharded_on(state, n, d, node_time, rtime) -> dict:
    """Op n replicated vs its best candidate that shards on mesh dim d alone (compute + redistributes)."""
    g, mesh_shape = state.graph, state.mesh.shape
    rep = tuple("R" for _ in mesh_shape)
    here = node_time(n, state.placement[n.idx])
    out = {"op": str(n.target), "module": n.module, "shape": list(n.outs[0].shape) if n.outs[0] else None}
    out["replicated_s"] = here
    best = None
    for s in state.strategies[n.idx]:
        pls = [p for p in (*s.out, *s.ins) if p is not None]
        if not any(p[d] != "R" for p in pls) or any(p[k] != "R" for p in pls for k in range(len(p)) if k != d):
            continue
        comm = sum(rtime(rep, p, g.meta(r)) for r, p in zip(n.inputs(), s.ins))
        comm += sum(rtime(p, rep, m) for m, p in zip(n.outs, s.out) if m is not None and p is not None)
        t = node_time(n, s)
        if best is None or t + comm < best[0] + best[1]:
            best = (t, comm, s)
    if best is not None:
        out.update(sharded_s=best[0], comm_s=best[1], placement=[list(p) if p else None for p in best[2].out])
    return out
