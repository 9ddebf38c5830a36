"""The pass manager: runs passes in order on one PlanState, times each, verifies the state after each, and can dump
the annotated graph after any pass. The passes themselves and their order are autopar.passes.PASSES (passes/); a
pass is a module whose `run(state)` reads and annotates the state, and is named after its module."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Iterable, TypedDict

import numpy as np

from .cost import ClusterSpec, TrainingPrecision
from .graph import Graph, Node
from .mesh import MeshSpec
from .milp import SolveResult
from .plan import dump_state
from .collectives import Collective
from .strategies import Placements, Strategy

InputKey = int | str  # a tensor input's position, or "opt" (optimizer step: the gradient), "loss", "state"
Use = tuple[int, InputKey]  # (consumer node, input): where a value is used at a placement
GroupPair = tuple[int, int]  # (producer decision group, consumer decision group)


class CostTerms(TypedDict):
    """The costs pass's terms, per decision group (one array entry per strategy of the group's root) and per edge
    between groups (a producer strategy x consumer strategy matrix); seconds and bytes per rank."""

    compute: list[np.ndarray]  # compute time of the group's members
    comm: list[np.ndarray]  # redistributes inside the group (followers, the loss's gather)
    state_mem: list[np.ndarray]  # parameters, gradients, optimizer state at the storage placement
    act_mem: list[np.ndarray]  # saved activations
    edges: dict[GroupPair, np.ndarray]  # redistribute time between groups
    rtime: Callable  # (src placements, dst placements, TensorMeta) -> seconds of one redistribute
    node_time: Callable[[Node, Strategy], float]  # compute seconds of one node at one strategy
    comm_ovl: list[np.ndarray]  # the part of `comm` that can overlap compute (gathers, gradient reductions)
    edges_ovl: dict[GroupPair, np.ndarray]  # the part of `edges` that can overlap compute
    bucket_delta: dict[GroupPair, np.ndarray]  # gradient reductions' bandwidth-only price minus the by-share one
    share_delta: dict[GroupPair, np.ndarray]  # added to the edges: the shared prices moved into `shared`
    shared: list  # what several consumers share, paid once (solve(shared=...); passes/costs.py _shared)
    bucket_series: list  # [(one bucket's latency, [(GroupPair, bucket fraction per choice pair)])]


@dataclass
class PlanState:
    """What the passes read and write: the inputs first, then each pass's results (None until it ran; the pass
    named after the field's comment writes it)."""

    graph: Graph
    mesh: MeshSpec
    cluster: ClusterSpec
    precision: TrainingPrecision
    budget: float  # bytes per rank
    options: dict = field(default_factory=dict)  # plan()'s options (force, pin, time_limit, overlap, ...)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass
    dumps: dict[str, str] = field(default_factory=dict)  # the state as text after the passes in dump_after
    # regions: repeated layers
    rep: list[int] | None = None  # per node, its representative (itself unless a copy in a repeated layer)
    region_of: list[tuple[str, int] | None] | None = None  # per node, (layer list prefix, layer index) or None
    regions: list[dict] | None = None  # [{"prefix", "layers": [index], "nodes_per_layer"}] per repeated region
    # candidates
    strategies: list[list[Strategy]] | None = None  # per node, its candidate placements
    sources: list[str] | None = None  # per node, where its candidates come from ("autopar", "dtensor", "leaf", ...)
    coverage: dict[str, list[tuple[str, str, str]]] | None = None  # replicate-only op -> [(node, module, source)]
    # costs: decision groups and their cost terms
    groups: list[int] | None = None  # per decision group, its root node
    group_of: dict[int, int] | None = None  # node -> its decision group
    choice: dict[int, np.ndarray | None] | None = None  # representative node -> its strategy per root strategy
    follow: dict[int, tuple[int, int, int]] | None = None  # follower -> (producer, producer output, input position)
    cost: CostTerms | None = None
    # solve
    solution: SolveResult | None = None
    placement: list[Strategy] | None = None  # per node: chosen Strategy
    # redistribute
    redistributes: dict[Use, tuple[Placements, Placements, list[Collective]]] | None = None  # (src, dst, collectives)
    shares: dict[Use, Use] | None = None  # a use -> the use whose redistribute of the same value it reuses
    coalesced: dict[Use, Use] | None = None  # a use -> the use whose all_reduce also carries it
    fw_order: list[int] | None = None  # forward op nodes in order of execution where a loss-tail group reorders them
    # buckets
    buckets: list[dict] | None = None  # gradient buckets [{kind, mesh_dim, group, from, to, dtype, params, bytes}]
    # checkpointing (runs before solve)
    recompute: list[dict] | None = None  # checkpointed blocks [{"block": FQN, "nodes": [idx]}] (checkpointing pass)
    extras: dict = field(default_factory=dict)  # decisions copied into Plan.meta (precision, checkpointing)


class VerificationError(AssertionError):
    pass


def verify(state: PlanState, after: str) -> None:
    g = state.graph
    if state.strategies is not None and after == "candidates":
        for n in g.nodes:
            if not state.strategies[n.idx]:
                raise VerificationError(f"after {after}: node {n.name} has no candidate placement")
        _verify_repeated_layers(state, after)
    if state.placement is not None:
        for n in g.nodes:
            s = state.placement[n.idx]
            if s is None or s not in state.strategies[n.idx]:
                r = state.rep[n.idx] if s is not None and state.rep is not None else n.idx
                why = (
                    ""
                    if r == n.idx
                    else (
                        f": {s} was chosen for its representative {g.nodes[r].name} (module "
                        f"'{g.nodes[r].module}') but is not among its own candidates"
                    )
                )
                raise VerificationError(f"after {after}: node {n.name} has no single chosen placement{why}")
    if state.redistributes is not None:
        for n in g.ops():
            for j, r in enumerate(n.inputs()):
                have = state.placement[r.node].out[r.out]
                want = state.placement[n.idx].ins[j]
                if have != want and (n.idx, j) not in state.redistributes:
                    raise VerificationError(
                        f"after {after}: {n.name} input {j} is {have} but needs {want} and no redistribute is planned"
                    )


def _verify_repeated_layers(state: PlanState, after: str) -> None:
    """Every node of a repeated layer must offer all its representative's candidates: the solver decides once per
    region, in the representative's candidate list, and that choice is applied to every copy (passes/solve.py
    `expand_choice`). A copy's own enumeration can differ (its boundary inputs come from other producers, e.g. the
    last block's backward from the final norm's), so the candidates pass must give copies the shared list."""
    g, S, rep = state.graph, state.strategies, state.rep
    if rep is None:
        return
    for n in g.nodes:
        r = rep[n.idx]
        if r == n.idx or S[n.idx] is S[r]:
            continue
        own = set(S[n.idx])
        missing = [s for s in S[r] if s not in own]
        if missing:
            raise VerificationError(
                f"after {after}: node {n.name} (module '{n.module}') repeats {g.nodes[r].name} (module "
                f"'{g.nodes[r].module}') but lacks {len(missing)} of its {len(S[r])} candidates, e.g. {missing[0]}; "
                f"the representative's choice would not be valid for it"
            )


def pass_name(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def run_passes(state: PlanState, passes: Iterable[ModuleType], dump_after=(), check=True) -> PlanState:
    """Run each pass module's `run(state)` in order; dump_after: pass names (or "all") whose state to keep as
    text in state.dumps."""
    for module in passes:
        name = pass_name(module)
        t = time.perf_counter()
        module.run(state)
        state.timings[name] = time.perf_counter() - t
        if check:
            verify(state, name)
        if name in dump_after or "all" in dump_after:
            state.dumps[name] = dump_state(state)
    return state
