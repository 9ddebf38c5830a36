"""The pass manager: runs the passes of `passes/` in order on one PlanState, times each, verifies the state
after each, and can dump the annotated graph after any pass."""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from .cost import ClusterSpec, TrainingPrecision
from .graph import Graph
from .mesh import MeshSpec

PASSES = ("precision", "regions", "candidates", "costs", "checkpointing", "solve", "redistribute")


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
    placement: Any = None         # per node: chosen Strategy
    redistributes: Any = None     # (consumer node, input index | "opt") -> (src, dst, collectives)
    recompute: Any = None         # checkpointed blocks [{"block": FQN, "nodes": [idx]}] (checkpointing pass)
    extras: dict = field(default_factory=dict)   # decisions copied into Plan.meta (precision, checkpointing)


class VerificationError(AssertionError):
    pass


def verify(state: PlanState, after: str) -> None:
    g = state.graph
    if state.strategies is not None and after == "candidates":
        for n in g.nodes:
            if not state.strategies[n.idx]:
                raise VerificationError(f"after {after}: node {n.name} has no candidate placement")
    if state.placement is not None:
        for n in g.nodes:
            s = state.placement[n.idx]
            if s is None or s not in state.strategies[n.idx]:
                raise VerificationError(f"after {after}: node {n.name} has no single chosen placement")
    if state.redistributes is not None:
        for n in g.ops():
            for j, r in enumerate(n.inputs()):
                have = state.placement[r.node].out[r.out]
                want = state.placement[n.idx].ins[j]
                if have != want and (n.idx, j) not in state.redistributes:
                    raise VerificationError(f"after {after}: {n.name} input {j} is {have} but needs {want} and no "
                                            f"redistribute is planned")


def run_passes(state: PlanState, passes=PASSES, dump_after=(), check=True) -> PlanState:
    for name in passes:
        mod = importlib.import_module(f"autopar.passes.{name}")
        t = time.perf_counter()
        mod.run(state)
        state.timings[name] = time.perf_counter() - t
        if check:
            verify(state, name)
        if name in dump_after or "all" in dump_after:
            from .plan import dump_state
            state.dumps[name] = dump_state(state)
    return state
