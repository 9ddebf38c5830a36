"""Pass: pick one strategy per decision group with the exact MILP (autopar/solver.py) and expand the choice to
every node: the roots take their group's strategy, followers the strategy that matches their producer. The
objective is the predicted step: compute + all comm (default), or with `plan(overlap=True)` compute + activation
comm + the part of parameter gathers and gradient reductions that the compute cannot hide (the solver's overlap
search; among the plans it finds the one with the lowest full prediction is kept).

The MILP's memory row counts model state and saved activations; the true peak also holds transients (the
liveness peak of the fw+bw order). When the chosen plan's liveness peak exceeds the budget, the row is
tightened by the excess and the model solved again (at most 4 rounds), so the plan returned fits the budget.

Plans are solved to a relative gap of MIP_GAP (0.1%, the `mip_rel_gap` option): the plan's objective is within
that of the proven bound, both reported in `plan.solver`. On the 8B shape the LP relaxation leaves ~16 of 90
groups fractional with a 0.08% integrality gap; proving the last 0.08% costs HiGHS's root cuts ~4 s."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopar.liveness import liveness_peak, state_bytes
from autopar.passes import buckets, redistribute
from autopar.predict import predict_state
from autopar.solver import InfeasibleMemoryError, SolverTimeLimitError, min_memory, solve

MIP_GAP = 1e-3


def run(state) -> None:
    c = state.cost
    lin, edges, overlap, fixed, shared = objective(c, state.options.get("overlap", False))
    thorough = len(state.graph.nodes) < THOROUGH_BELOW_NODES
    mem_rows = [c["state_mem"][i] + c["act_mem"][i] for i in range(len(lin))]
    floor = min_memory(mem_rows)
    if floor > state.budget:
        raise InfeasibleMemoryError(
            f"no plan fits {state.budget / 1e9:.3f} GB per rank on mesh {state.mesh}: the smallest achievable "
            f"(parameters, gradients, optimizer state and saved activations, all maximally sharded) is "
            f"{floor / 1e9:.3f} GB",
            smallest_bytes=floor,
        )
    row_budget = state.budget
    for attempt in range(4):
        res = solve(
            lin,
            edges,
            [(mem_rows, row_budget)],
            time_limit=state.options.get("time_limit", 60.0),
            mip_rel_gap=state.options.get("mip_rel_gap", MIP_GAP),
            overlap=overlap,
            fixed=fixed,
            shared=shared,
            lambda_search_s=float("inf") if thorough else 0.0,
        )
        placement = expand_choice(state, res)
        peak = state_bytes(state.graph, placement, state.mesh.shape, state.precision) + liveness_peak(
            state.graph, placement, state.mesh.shape, state.recompute
        )
        if peak <= state.budget:
            break
        # the rows underestimate the liveness peak; a plan with slack under the rows comes back unchanged unless
        # the cut grows (doubling from the second cut on)
        row_budget -= 1.05 * (peak - state.budget) * 2**attempt
        if row_budget < floor:
            raise InfeasibleMemoryError(
                f"no plan fits {state.budget / 1e9:.3f} GB per rank on mesh {state.mesh}: the best plan found peaks "
                f"at {peak / 1e9:.3f} GB (transient activations included); the smallest achievable without "
                f"transients is {floor / 1e9:.3f} GB",
                smallest_bytes=peak,
            )
    else:
        raise InfeasibleMemoryError(
            f"no plan found under {state.budget / 1e9:.3f} GB per rank after 4 rounds; last peak {peak / 1e9:.3f} GB",
            smallest_bytes=peak,
        )
    if res.candidates is not None:
        if thorough:  # small graphs: the classic layouts as candidates too
            res.candidates = res.candidates + _seeds(state, lin, edges, overlap, mem_rows, row_budget)
        res, placement = _by_prediction(state, res, placement, 3 if thorough else 2)
    state.solution, state.placement = res, placement


def _seeds(state, lin, edges, overlap, mem_rows, budget) -> list:
    """The two classic layouts as extra candidates: every parameter replicated (DDP-like) and every parameter at
    its most sharded storage (FSDP/ZeRO-3-like), the rest of each plan chosen by the same search. A parameter
    pinned by `force` keeps its placement."""
    c, out = state.cost, []
    groups = state.groups
    nodes = state.graph.nodes
    S, choice = state.strategies, state.choice
    params = [g for g, r in enumerate(groups) if nodes[r].kind == "param"]
    if not params:
        return out
    big = 1e3 * max(float(max(v.max() for v in lin if len(v))), 1e-9)
    for layout in ("replicate", "shard"):
        pen = [np.zeros(len(v)) for v in lin]
        for g in params:
            r = groups[g]
            if layout == "replicate":
                bad = [any(p != "R" for p in S[r][j].out[0]) for j in choice[r]]
            else:
                sm = c["state_mem"][g]
                bad = list(sm > sm.min() * (1 + 1e-9))
            if not all(bad):
                pen[g] = big * np.asarray(bad, float)
        try:
            r = solve(
                [a + p for a, p in zip(lin, pen)],
                edges,
                [(mem_rows, budget)],
                time_limit=state.options.get("time_limit", 60.0),
                overlap=overlap,
                max_lps=1,
            )
        except (InfeasibleMemoryError, SolverTimeLimitError):  # an extra candidate only: skip it
            continue
        out += [(None, ch) for _, ch in (r.candidates or [(None, r.choice)])[:1]]
    return out


def _by_prediction(state, res, placement, top):
    """Among the plans the overlap search found, the one with the lowest predicted step (within the budget): the
    MILP prices gradient-bucket latency by share, the prediction counts the real buckets."""
    best = None
    for F, choice in res.candidates[:top] + [fc for fc in res.candidates[top:] if fc[0] is None]:
        cand = replace(res, choice=choice, objective=F)
        state.placement = expand_choice(state, cand)
        redistribute.run(state)
        buckets.run(state)
        pred = predict_state(state)
        if pred["peak_mem_bytes"] <= state.budget and (best is None or pred["step_s"] < best[0] - 1e-15):
            best = (pred["step_s"], replace(cand, objective=pred["step_s"] if F is None else F), state.placement)
    state.redistributes = state.buckets = None
    return (best[1], best[2]) if best is not None else (res, placement)


def objective(c, overlap: bool):
    """The step time the prediction reports (autopar/predict.py), as the MILP's pieces: compute and activation comm
    are paid in full; parameter gathers and gradient reductions (comm_ovl / edges_ovl) only where they exceed the
    compute they overlap with, each gradient's bucket latency by share. overlap=False: everything is paid in full (a
    plain MILP), each gradient bucket series' latency as a bucket charge ([(seconds, [((g1, g2), bucket fraction per
    choice pair joining the series)])]) and each redistribute several consumers can share as one charge paid once
    (returned last; passes/costs.py _shared), see autopar.solver.solve."""
    if not overlap:  # every collective blocks: compute + all comm, bucket latency as bucket charges
        lin = [a + b for a, b in zip(c["compute"], c["comm"])]
        edges = dict(c["edges"])
        for (g1, g2), D in list(c["bucket_delta"].items()) + list(c["share_delta"].items()):
            if g1 == g2:
                lin[g1] = lin[g1] + np.diag(D)
            elif D.any():
                edges[(g1, g2)] = edges[(g1, g2)] + D if (g1, g2) in edges else D
        return lin, edges, None, c["bucket_series"], c["shared"]
    lin = [a + b - (1 - HIDDEN_COMM_WEIGHT) * o for a, b, o in zip(c["compute"], c["comm"], c["comm_ovl"])]
    edges = {
        k: C - (1 - HIDDEN_COMM_WEIGHT) * c["edges_ovl"][k] if k in c["edges_ovl"] else C for k, C in c["edges"].items()
    }
    return lin, edges, (c["comm_ovl"], c["edges_ovl"], c["compute"]), (), ()


# Graphs under this many nodes get the thorough overlap search (every Lagrangian weight, the DDP/FSDP seeds, three
# plans re-predicted); larger ones (the 8B shape: 7.4k nodes) lam = 0 and the plain objective, to plan in seconds.
THOROUGH_BELOW_NODES = 3000

# Overlappable comm that compute hides still costs a little here: among plans of equal predicted step the one that
# communicates less wins (the overlap model is optimistic; fewer bytes contend less), e.g. DDP over FSDP when
# memory is ample.
HIDDEN_COMM_WEIGHT = 0.01


def expand_choice(state, res):
    """Per node, the strategy the solver's choice gives it: its decision group's (a root), the one matching its
    producer (a follower), its representative's (a copy of a repeated layer)."""
    rep, choice, S = state.rep, state.choice, state.strategies
    return [S[rep[i]][int(choice[rep[i]][res.choice[state.group_of[i]]])] for i in range(len(state.graph.nodes))]
