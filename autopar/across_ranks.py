"""Planning under a process group of several ranks: one rank plans, every rank runs that plan, and no rank is left
waiting in a collective for a rank that failed.

Each rank planning on its own spends a node's CPUs once per rank, and the solver's limits are wall-clock (the
MILP's time_limit, the overlap search's budget): under load, ranks can find different plans (the graph backend
then refuses them, PlanMismatchError) or some none at all. So the mesh's first rank plans alone and sends its plan,
as Plan.save writes it, to the other ranks of the mesh (one broadcast on a gloo group of the mesh's ranks, made once
per mesh: _planning_group); they capture the model again and take the plan's placements from the record
(autopar/execution.py, as for a loaded plan), which checks node for node that they captured the plan's graph. The
first rank's options decide: a rank called with other model code or shapes fails at that check, one called with
other planning options runs the first rank's plan.

After planning every rank says whether it succeeded (`planned_on_every_rank`); where one failed, the failed ranks
raise their own error and the others PlanningFailedError naming them, at once. Without a process group of several
ranks, or under the fake one (LocalTensorMode: one process plans for every rank), nothing is exchanged.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch

from .plan import Plan


class PlanningFailedError(RuntimeError):
    """Planning raised on another rank: this rank's plan is not run (its collectives would wait for that rank)."""


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


_GROUPS: dict = {}  # mesh ranks -> (the default group it was made under, the planning group)


def _planning_group(mesh):
    """A gloo group over the mesh's ranks for planning's exchanges, made once per mesh: on the CPU (a pickled plan;
    an NCCL mesh's GPUs stay out of it) and with gloo's default timeout (30 minutes), since the other ranks wait in
    it while the first rank plans (a process group made with a short collective timeout would cut that wait)."""
    import torch.distributed as dist

    ranks = tuple(sorted(int(r) for r in mesh.mesh.reshape(-1).tolist()))
    world = dist.group.WORLD
    made = _GROUPS.get(ranks)
    if made is None or made[0] is not world:  # none yet, or made under a process group since destroyed
        made = _GROUPS[ranks] = (world, dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True))
    return made[1]


@contextlib.contextmanager
def planned_on_every_rank(mesh):
    """Run the block on every rank, then exchange one status per rank (one all_reduce): where the block
    raised on some rank, it raises there and PlanningFailedError on every other rank, naming the failed ranks."""
    import torch.distributed as dist

    if not _several_ranks():
        yield
        return
    failed = None
    try:
        yield
    except Exception as e:  # every rank must reach the exchange below, this one too
        failed = e
    status = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    status[dist.get_rank()] = int(failed is not None)
    dist.all_reduce(status, group=_planning_group(mesh))
    bad = [r for r, v in enumerate(status.tolist()) if v]
    if failed is not None:
        raise failed
    if bad:
        raise PlanningFailedError(
            f"planning failed on ranks {bad} (their error says why); rank {dist.get_rank()} does not run its plan alone"
        )


def first_rank(mesh) -> int:
    """The global rank at the mesh's origin: the one that plans."""
    return int(mesh.mesh.reshape(-1)[0])


def decided_once(mesh, make, send, receive):
    """`make()` on the mesh's first rank alone, whose result is returned there; `send(result)` (picklable) reaches
    every other rank of the mesh, which returns `receive(it)`. An error of `make` raises on the first rank and as
    PlanningFailedError on the others (after the broadcast, so none waits in it)."""
    import torch.distributed as dist

    if not _several_ranks():
        return make()
    first = first_rank(mesh)
    mine = dist.get_rank() == first
    group = _planning_group(mesh)  # made by every rank of the mesh together, before the first rank plans
    box, made, failed = [None], None, None
    if mine:
        try:
            made = make()
            box[0] = ("ok", send(made))
        except Exception as e:  # the other ranks wait in the broadcast: tell them
            failed = e
            box[0] = ("error", (type(e).__module__, type(e).__qualname__, f"{type(e).__name__}: {e}"))
    dist.broadcast_object_list(box, src=first, group=group)
    if failed is not None:
        raise failed
    if mine:
        return made
    kind, body = box[0]
    if kind == "error":
        module, qualname, text = body
        raise _failed_like(module, qualname)(f"planning failed on rank {first}, which plans for the mesh: {text}")
    return receive(body)


def _failed_like(module: str, qualname: str) -> type:
    """PlanningFailedError that is also an instance of the first rank's error class where this process knows that
    class (a ValueError there is one here: code that catches it on every rank stays in step), else plain."""
    cls = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not isinstance(cls, type) or not issubclass(cls, Exception) or issubclass(cls, PlanningFailedError):
        return PlanningFailedError
    try:
        return type("PlanningFailedError", (PlanningFailedError, cls), {"__module__": __name__})
    except TypeError:  # an exception class whose layout does not mix with RuntimeError's
        return PlanningFailedError


def plan_text(plan: Plan) -> str:
    return json.dumps(plan.to_json())


def plan_of(text: str) -> Plan:
    return Plan.from_json(json.loads(text), source="the first rank's plan")


def planned_once(mesh, make, rebuild) -> tuple:
    """(plan, state): `make()` -> (plan, state) on the mesh's first rank; on every other rank its plan and
    `rebuild(plan)`, the plan's Executable on this rank's own capture of the model (autopar.execution.finished), which
    stands for the planner's state downstream (the same attribute names)."""

    def receive(text):
        plan = plan_of(text)
        return plan, rebuild(plan)

    return decided_once(mesh, make, lambda made: plan_text(made[0]), receive)
