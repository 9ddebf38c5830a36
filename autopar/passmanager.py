"""The pass manager: runs passes in order on one PlanState, times each, verifies the state after each, and can dump
the annotated graph after any pass. The passes themselves and their order are autopar.passes.PASSES (passes/); a
pass is a module whose `run(state)` reads and annotates the state, and is named after its module."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable

from .cost import ClusterSpec, TrainingPrecision
from .graph import Graph
from .mesh import MeshSpec
from .plan import dump_state


@dataclass
class PlanState:
    graph: Graph
    mesh: MeshSpec
    cluster: ClusterSpec
    precision: TrainingPrecision
    budget: float
    options: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    dumps: dict = field(default_factory=dict)
    # filled by passes (see each pass's docstring)
    rep: Any = None
    region_of: Any = None
    regions: Any = None
    strategies: Any = None
    sources: Any = None
    coverage: Any = None
    groups: Any = None
    group_of: Any = None
    choice: Any = None
    follow: Any = None
    cost: Any = None
    solution: Any = None
    placement: Any = None  # per node: chosen Strategy
    redistributes: Any = None  # (consumer node, input index | "opt") -> (src, dst, collectives)
    shares: Any = None  # (consumer, input) -> (consumer, input) whose redistribute of the same value it reuses
    coalesced: Any = None  # (consumer, input) -> (consumer, input) whose all_reduce also carries this input
    fw_order: Any = None  # forward op nodes in order of execution where a loss-tail group reorders them
    buckets: Any = None  # gradient buckets [{kind, mesh_dim, group, from, to, dtype, params, bytes}]
    recompute: Any = None  # checkpointed blocks [{"block": FQN, "nodes": [idx]}] (checkpointing pass)
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
