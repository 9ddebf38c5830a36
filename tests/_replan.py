"""A plan's placements costed from scratch at other example inputs, without solving again: what the symbolic batch
formula must reproduce. Imported as `from _replan import same_placements_at` (tests/ is on sys.path under pytest)."""

from __future__ import annotations

from autopar.capture import capture
from autopar.passes import buckets, candidates, costs, redistribute, regions
from autopar.passmanager import PlanState, run_passes
from autopar.predict import build_plan


def same_placements_at(state, model, inputs):
    """The Plan of `state`'s placements on `model` captured at `inputs` (same mesh, cluster, precision, options)."""
    other = PlanState(
        capture(model, inputs), state.mesh, state.cluster, state.precision, state.budget, dict(state.options)
    )
    run_passes(other, (regions, candidates, costs))
    other.placement, other.solution = state.placement, state.solution
    run_passes(other, (redistribute, buckets))
    return build_plan(other)
