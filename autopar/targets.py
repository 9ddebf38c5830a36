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
Where the solved plan has them, it is solved again with those nodes pinned to partial sums on the data dims (the
nll_loss forward, the node making each parameter gradient): the best plan among the ones the engines run as
planned, whose prediction is what they issue. The data dims are the mesh dims the engines feed batch-sharded,
read from the plan's node records as backends/torch/recognize.py reads them (`data_dims`, `_fed`). A plan solved
with the caller's own `pin` is kept as it is (the caller decided those placements), and so is a pipeline plan.
The note in plan.meta["engine_replan"] says which nodes were pinned and what it cost.

This module reads plan records and the planner's state only: the planner imports it, never a backend.
"""

from __future__ import annotations

import math
from collections import defaultdict

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


def engine_pins(state, data: list[int]) -> dict:
    """{node name: pin} for the nodes the plan computes replicated over a data dim where the engines compute a
    partial sum: a mean loss's nll_loss, the nodes whose output is a parameter gradient. Empty when none."""
    g, P = state.graph, state.placement
    want, differ = {}, False
    for r in g.grads.values():
        pin = want.setdefault(g.nodes[r.node].name, {})
        for d in data:
            pin[(d, r.out)] = "P"
            differ |= P[r.node].out[r.out][d] != "P"
    for n in g.ops():
        if n.target in NLL_LOSSES:  # a loss nll_loss (capture records a mean one as nll_loss(sum))
            want[n.name] = {d: "P" for d in data}
            differ |= any(o is not None and o[d] != "P" for o in P[n.idx].out for d in data)
    return want if differ else {}


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


def plan_for_target(target: str, solve, mesh, **plan_kwargs):
    """The plan for a backend `target` (module docstring); solve(**kwargs) is autopar.plan on the caller's model,
    mesh and example inputs with those planner options."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS} or None, got {target!r}")
    return_state = plan_kwargs.pop("return_state", False)
    if plan_kwargs.get("pipeline") or "pp" in as_mesh_spec(mesh).names:
        return solve(return_state=return_state, **plan_kwargs)
    first = solve(return_state=True, **plan_kwargs)
    result, note = first, None
    if plan_kwargs.get("pin") is None:
        kw = {k: v for k, v in plan_kwargs.items() if k != "pin"}
        result, note = _replan_for_torch(lambda pin: solve(return_state=True, pin=pin, **kw), first)
    result[0].meta["target"] = target
    if note:
        result[0].meta["engine_replan"] = note
    return result if return_state else result[0]
