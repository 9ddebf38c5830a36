"""The pipeline simulation (autopar/pipeline_simulation.py: one numpy pass per level of the order's dependency graph)
against its definition, an action-by-action list schedule written out here: the same step, per-rank busy time and
events to the bit, for every schedule class, with p2p transfers, exposed first-forward gathers and gather-ready
times; and a clear error for an order that deadlocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar.pipeline_model as pm


def reference(order, rank_of, F, B, W, p2p, first_f=None, ready_f=None):
    """Each rank runs its actions in order; an action starts when the rank is free and its inputs arrived (F: the
    previous stage's F + transfer; B/I: its own F and the next stage's B/I + transfer; W: its own I)."""
    S = len(F)
    lat = [p2p[k] if k < S - 1 and rank_of[k] != rank_of[k + 1] else 0.0 for k in range(S)]
    end_f, end_g, pos, free = {}, {}, [0] * len(order), [0.0] * len(order)
    events = [[] for _ in order]
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts):
                s, kind, i = acts[pos[r]]
                need = [end_f.get((s - 1, i)) if s else 0.0] if kind == "F" else []
                if kind == "W":
                    need = [end_g.get((s, i))]
                elif kind in "BI":
                    need = [end_f.get((s, i))] + ([end_g.get((s + 1, i))] if s < S - 1 else [])
                if None in need:
                    break
                start = free[r]
                if kind == "F":
                    if ready_f is not None and i == 0:
                        start = max(start, ready_f[s])
                    if s:
                        start = max(start, need[0] + lat[s - 1])
                    dur = F[s] + (first_f[s] if first_f is not None and i == 0 else 0.0)
                elif kind == "W":
                    start, dur = max(start, need[0]), W[s]
                else:
                    start = max(start, need[0])
                    if s < S - 1:
                        start = max(start, need[1] + lat[s])
                    dur = B[s] + W[s] if kind == "B" else B[s]
                e = start + dur
                if kind == "F":
                    end_f[(s, i)] = e
                elif kind != "W":
                    end_g[(s, i)] = e
                free[r] = e
                events[r].append((start, e, s, kind, i))
                pos[r] += 1
                progress = True
    assert all(p == len(a) for p, a in zip(pos, order)), "the reference deadlocked"
    busy = [sum(e - s for s, e, *_ in ev) for ev in events]
    return max(free), busy, events


CASES = [
    ("GPipe", 4, 1, 6),
    ("1F1B", 4, 1, 8),
    ("Interleaved1F1B", 2, 2, 4),
    ("InterleavedZeroBubble", 2, 2, 4),
    ("ZBVZeroBubble", 3, 2, 6),
    ("DualPipeV", 2, 2, 4),
]


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from(CASES),
    times=st.lists(st.floats(0.01, 3.0), min_size=48, max_size=48),
    extras=st.sampled_from(["none", "first", "ready"]),
)
def test_simulation_equals_the_action_by_action_schedule(case, times, extras):
    name, p, v, m = case
    spec = pm.get_schedule(name)
    S = p * v
    F, B, W, x = times[:S], times[S : 2 * S], times[2 * S : 3 * S], times[3 * S : 4 * S]
    kw = {"first_f": times[4 * S : 5 * S]} if extras == "first" else {}
    kw = {"ready_f": times[5 * S : 6 * S]} if extras == "ready" else kw
    order, rank_of = pm.actions(spec, p, m, v), pm.stage_ranks(spec, p, v)
    sim = pm.simulate(order, rank_of, F, B, W, x, **kw)
    step, busy, events = reference(order, rank_of, F, B, W, x, **kw)
    assert sim.step_s == step and sim.busy_s == busy and sim.events == events
    assert sim.rank_ends == [ev[-1][1] for ev in events]
    again = pm.simulate(order, rank_of, W, F, B, x, **kw)  # the order's graph is reused: other times, other step
    assert again.step_s == reference(order, rank_of, W, F, B, x, **kw)[0]


def test_an_order_that_deadlocks_names_the_stuck_actions():
    order = (((0, "F", 0), (0, "B", 0)), ((1, "B", 0), (1, "F", 0)))  # rank 1's backward before its forward
    with pytest.raises(
        RuntimeError, match=r"deadlocked; next actions per rank: \{0: \(0, 'B', 0\), 1: \(1, 'B', 0\)\}"
    ):
        pm.simulate(order, (0, 1), [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0])
