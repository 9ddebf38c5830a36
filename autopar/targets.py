"""What a backend cannot run as planned, given to the planner up front: `autopar.plan(..., target=...)`.

target="torch" (autopar.backends.torch: FSDP2, parallelize_module, checkpointing and torch.compile on the user's
eager module). An engine rank runs the user's module on its own batch shard. Where the plan computes a value
replicated over the data-parallel dims from inputs it gathers there, the engines cannot: they compute it on the
shard and reduce it afterwards. Two such values matter in practice:
  * the loss: the plan may gather the log-probabilities and compute nll_loss on the whole batch (cheaper under
    its cost model than reducing the loss sum and count); the engines compute it on the shard and reduce
    (weighted loss, count) in the loss hook (backends/torch/loss.py);
  * a parameter gradient: the plan may gather a backward input (the embedding's output gradient) and compute
    the gradient replicated instead of reducing it; the engines reduce every replicated gradient in buckets.
So those nodes are pinned to partial sums on the data dims (the nll_loss forward, the node making each parameter
gradient): the best plan among the ones the engines run as planned, whose prediction is what they issue. The data
dims are the mesh dims the engines feed batch-sharded. Where the caller declares them (target=TorchTarget(
data_dims=("dp",))) the pins are known before solving and the model is solved once with them (`EnginePins`, bound
to the captured graph by the planner); the plan's data dims, read from its node records as
backends/torch/recognize.py reads them (`data_dims`, `_fed`), must then be the declared ones. Otherwise (nothing
declared, no plan with those pins, or other data dims) the free plan is solved, and where it has such values it is
solved again with the pins on its own data dims. The mesh's names alone do not declare them: the free optimum may
leave a dim named "dp" idle (a small batch computed again on every rank is cheaper than its gradient reductions)
or split the batch over "tp" as well, and pinning the loss partial on "dp" up front would change that plan. A plan solved with the caller's own `pin` is kept as it is (the
caller decided those placements), and so is a pipeline plan. plan.meta["engine_replan"] says which path ran and
which nodes were pinned.

This module reads plan records and the planner's state only: the planner imports it, never a backend.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from .capture import NLL_LOSSES
from .mesh import as_mesh_spec
from .solver import InfeasibleMemoryError

TARGETS = ("torch",)


_ROW_VIEWS = {"view", "_unsafe_view", "reshape"}
_SAME_SHAPE = {"_to_copy", "clone", "detach", "alias", "contiguous"}


def _batch_uses(G, i, o, d, seen) -> bool:
    """Whether every use of output `o` of node `i` (replicated on mesh dim d) takes it batch-sharded there (a
    local R -> S0 chunk; seen["batch"]), or is a loss op (seen["loss"]: the plan runs the loss replicated, on the
    whole batch), or is a backward op (seen["bw"]: the plan gathers some backward inputs; autograd on each rank's
    shard computes partial sums instead, which the data-parallel reduction adds up), following row-preserving
    views / copies that the plan runs replicated (flatten(0, 1) of the labels: a batch chunk of the input is a row
    chunk of the view)."""
    uses = [(u, j) for u, j, uo in G.users[i] if uo == o]
    if not uses:
        return False
    src_shape = G.rec(i).shapes[o]
    for u, j in uses:
        ur = G.rec(u)
        if ur.ins[j][d] == "S0":
            seen["batch" if ur.phase == "fw" else "bw_batch"].append(u)
            continue
        if ur.kind != "op":
            return False
        op = ur.op
        if op in _LOSS_OPS:
            seen["loss"].append(u)
            continue
        if ur.phase == "bw":
            seen["bw"].append(u)
            continue
        out = ur.shapes[0] if ur.shapes else None
        rows = (op in _SAME_SHAPE and out == src_shape) or (
            op in _ROW_VIEWS
            and out
            and src_shape
            and any(
                math.prod(src_shape[:k]) == out[0] and math.prod(src_shape[k:]) == math.prod(out[1:])
                for k in range(1, len(src_shape) + 1)
            )
        )
        if not (rows and len(ur.inputs) == 1 and ur.out[0][d] == "R" and _batch_uses(G, u, 0, d, seen)):
            return False
    return True


def _fed(G, inp, loss_fed=None) -> list:
    """How a rank is fed an input: its placement, except that a dim the plan keeps replicated only to chunk it
    by batch at every forward consumer (a local R -> S0) is fed batch-sharded right away (the same local values;
    backward consumers that take it whole compute partial sums on a shard instead, see _batch_uses). With
    `loss_fed` (a list), a forward consumer that is the loss also counts (the plan gathers the loss inputs and
    computes the mean over the whole batch): the engines compute each rank's mean over its equal batch shard and
    average the gradients (the same values; _check_batch_shards says when not); (input name, mesh dim, loss node)
    of those are appended to it."""
    pl = list(inp.out[0])
    for d, p in enumerate(pl):
        seen = {"batch": [], "bw_batch": [], "loss": [], "bw": []}
        if p != "R" or not _batch_uses(G, inp.idx, 0, d, seen):
            continue
        if seen["batch"] and not seen["loss"] or loss_fed is not None and (seen["batch"] or seen["loss"]):
            pl[d] = "S0"
            if loss_fed is not None:
                loss_fed += [(inp.name, d, u) for u in seen["loss"]]
    return pl


_LOSS_OPS = {"nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward"}


class _Records:
    """A plan's node records, typed, with their users (what _fed reads; backends/torch/lowering._Graph is a
    superset)."""

    def __init__(self, plan):
        self.nodes = plan.node_records()
        self.users = defaultdict(list)  # node -> [(user, input position, producer output)]
        for n in self.nodes:
            for j, (p, o) in enumerate(n.inputs):
                self.users[p].append((n.idx, j, o))

    def rec(self, i):
        return self.nodes[i]


def data_dims(plan) -> list[int]:
    """The mesh dims on which the engines feed every input batch-sharded (their data-parallel dims)."""
    if not plan.nodes or "inputs" not in plan.nodes[-1]:
        return []
    G = _Records(plan)
    inputs = [n for n in G.nodes if n.kind == "input"]
    if not inputs:
        return []
    strict, loose = [_fed(G, n) for n in inputs], [_fed(G, n, []) for n in inputs]
    # a mesh dim is batch-fed when every input is (a loss input counts only where the batch really is sharded)
    batch = [
        all(f[d] == "S0" for f in loose) and any(f[d] == "S0" for f in strict) for d in range(len(plan.mesh_shape))
    ]
    fed = lambda n, d: "S0" if batch[d] else n.out[0][d]
    return [d for d in range(len(plan.mesh_shape)) if all(fed(n, d) == "S0" for n in inputs)]


@dataclass(frozen=True)
class TorchTarget:
    """target="torch" with the mesh dims the engines will feed batch-sharded declared (names or indices): the
    engines' pins on them are then known before solving, and the model is solved once (module docstring).
    data_dims=None is target="torch": the free plan's own data dims decide."""

    data_dims: tuple | None = None

    def resolve(self, mesh) -> list[int] | None:
        """The declared data dims as sorted mesh dim indices; a clear error for a dim the mesh does not have."""
        if self.data_dims is None:
            return None
        names, out = as_mesh_spec(mesh).names, set()
        for d in self.data_dims:
            if isinstance(d, int) and 0 <= d < len(names):
                out.add(d)
            elif isinstance(d, str) and d in names:
                out.add(names.index(d))
            else:
                raise ValueError(f"TorchTarget data_dims: {d!r} is not a dim of the mesh {names}")
        return sorted(out)


def _pins(g, data) -> dict:
    """{node name: pin}: each node making a parameter gradient and each loss nll_loss (capture records a mean one as
    nll_loss(sum)) partial on the data dims, as the engines compute them on each rank's batch shard."""
    want = {}
    for r in g.grads.values():
        want.setdefault(g.nodes[r.node].name, {}).update({(d, r.out): "P" for d in data})
    for n in g.ops():
        if n.target in NLL_LOSSES:
            want[n.name] = {d: "P" for d in data}
    return want


class EnginePins:
    """The engines' pins on declared data dims, as a `pin` for autopar.plan: the planner binds it to the captured
    graph (`for_graph`), whose gradient nodes it needs, before any pass reads it."""

    def __init__(self, data):
        self.data = tuple(data)
        self.count = 0  # nodes pinned, once bound

    def for_graph(self, g):
        want = _pins(g, self.data)
        self.count, self.losses = len(want), [n.name for n in g.ops() if n.target in NLL_LOSSES]
        return lambda n: want.get(n.name)


def engine_pins(state, data: list[int]) -> dict:
    """{node name: pin} for the nodes the plan computes replicated over a data dim where the engines compute a
    partial sum: a mean loss's nll_loss, the nodes whose output is a parameter gradient. Empty when none."""
    g, P = state.graph, state.placement
    differ = any(P[r.node].out[r.out][d] != "P" for r in g.grads.values() for d in data) or any(
        o is not None and o[d] != "P" for n in g.ops() if n.target in NLL_LOSSES for o in P[n.idx].out for d in data
    )
    return _pins(g, data) if differ else {}


def _one_solve(solve, mesh, data):
    """((plan, state), note) solved once with the engines' pins on the declared data dims, or None where the pins
    admit no plan or the plan feeds the batch over other dims than declared (then the two-solve path runs)."""
    pins = EnginePins(data)
    try:
        made = solve(pins)
    except (ValueError, InfeasibleMemoryError):
        return None
    if data_dims(made[0]) != data:
        return None
    names = "+".join(as_mesh_spec(mesh).names[d] for d in data)
    note = (
        f"planned for the engines in one solve (they compute the loss and every parameter gradient on each rank's "
        f"batch shard over the declared data dims {names}): {pins.count} nodes pinned partial up front"
        f"{' (loss ' + ', '.join(pins.losses) + ')' if pins.losses else ''}"
    )
    return made, note


def _replan_for_torch(solve, first):
    """((plan, state), note): `first`, or the plan solved again with the engines' pins (module docstring)."""
    data = data_dims(first[0])
    want = engine_pins(first[1], data) if data else {}
    if not want:
        return first, None
    try:
        again = solve(lambda n: want.get(n.name))
    except (ValueError, InfeasibleMemoryError) as e:
        return (
            first,
            f"not re-planned for the engines ({type(e).__name__}: {str(e)[:200]}); the lowering differs "
            f"from the plan where the plan gathers over the data dims",
        )
    pinned = [k for k in want if "nll_loss" in k]
    p0, p1 = first[0].predicted["step_s"], again[0].predicted["step_s"]
    note = (
        f"re-planned for the engines (they compute the loss and every parameter gradient on each rank's batch "
        f"shard): {len(want)} nodes pinned partial on the data dims"
        f"{' (loss ' + ', '.join(pinned) + ')' if pinned else ''}; predicted step {p1 * 1e3:.3f} ms, "
        f"{p0 * 1e3:.3f} ms with the gathers the engines cannot run"
    )
    return again, note


def _two_solves(pinned, mesh, declared):
    """((plan, state), note): the free plan, solved again with the engines' pins on the data dims it feeds the batch
    on where it computes a loss or gradient otherwise (_replan_for_torch)."""
    result, note = _replan_for_torch(pinned, pinned(None))
    if declared is None:
        return result, f"{note} [two solves: no data dims declared]" if note else None
    names = "+".join(as_mesh_spec(mesh).names[d] for d in declared)
    why = f"the pins on the declared data dims {names} did not hold (no plan, or the batch split over other dims)"
    return result, f"{note or 'the free plan runs on the engines as planned'} [two solves: {why}]"


def engine_target(target):
    """The planner's target for PyTorch's engines: "torch" (the free plan's data dims decide, one or two solves) or
    a TorchTarget declaring them (one solve, the engines' pins decided up front). Anything else would plan for what
    the engines do not run, so it is refused before planning."""
    if target == "torch" or isinstance(target, TorchTarget):
        return target
    raise ValueError(f"the torch backend plans for target='torch' or an autopar.TorchTarget, got {target!r}")


def plan_for_target(target: str, solve, mesh, **plan_kwargs):
    """The plan for a backend `target` (module docstring); solve(**kwargs) is autopar.plan on the caller's model,
    mesh and example inputs with those planner options."""
    if not isinstance(target, TorchTarget) and target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, a TorchTarget or None, got {target!r}")
    declared = target.resolve(mesh) if isinstance(target, TorchTarget) else None
    return_state = plan_kwargs.pop("return_state", False)
    if plan_kwargs.get("pipeline") or "pp" in as_mesh_spec(mesh).names:
        return solve(return_state=return_state, **plan_kwargs)
    if plan_kwargs.get("pin") is not None:  # the caller decided the placements
        result, note = solve(return_state=True, **plan_kwargs), None
    else:
        kw = {k: v for k, v in plan_kwargs.items() if k != "pin"}
        pinned = lambda pin: solve(return_state=True, pin=pin, **kw)
        result, note = (declared and _one_solve(pinned, mesh, declared)) or _two_solves(pinned, mesh, declared)
    result[0].meta["target"] = "torch"
    if note:
        result[0].meta["engine_replan"] = note
    return result if return_state else result[0]
