"""Pass: pick one strategy per decision group with the exact MILP (autopar/solver.py) and expand the choice to
every node: the roots take their group's strategy, followers the strategy that matches their producer.

The MILP's memory row counts model state and saved activations; the true peak also holds transients (the
liveness peak of the fw+bw order). When the chosen plan's liveness peak exceeds the budget, the row is
tightened by the excess and the model solved again (at most 4 rounds), so the plan returned fits the budget."""
from __future__ import annotations

from autopar.predict import liveness_peak, state_bytes
from autopar.solver import InfeasibleMemoryError, min_memory, solve


def run(state) -> None:
    c = state.cost
    lin = [a + b for a, b in zip(c["compute"], c["comm"])]
    mem_rows = [c["state_mem"][i] + c["act_mem"][i] for i in range(len(lin))]
    floor = min_memory(mem_rows)
    if floor > state.budget:
        raise InfeasibleMemoryError(
            f"no plan fits {state.budget / 1e9:.3f} GB per rank on mesh {state.mesh}: the smallest achievable "
            f"(parameters, gradients, optimizer state and saved activations, all maximally sharded) is "
            f"{floor / 1e9:.3f} GB")
    row_budget = state.budget
    for _ in range(4):
        res = solve(lin, c["edges"], [(mem_rows, row_budget)], time_limit=state.options.get("time_limit", 60.0))
        placement = _expand(state, res)
        peak = state_bytes(state.graph, placement, state.mesh.shape, state.precision) + \
            liveness_peak(state.graph, placement, state.mesh.shape, state.recompute)
        if peak <= state.budget:
            break
        row_budget -= 1.05 * (peak - state.budget)
        if row_budget < floor:
            raise InfeasibleMemoryError(
                f"no plan fits {state.budget / 1e9:.3f} GB per rank on mesh {state.mesh}: the best plan found peaks "
                f"at {peak / 1e9:.3f} GB (transient activations included); the smallest achievable without "
                f"transients is {floor / 1e9:.3f} GB")
    else:
        raise InfeasibleMemoryError(f"no plan found under {state.budget / 1e9:.3f} GB per rank after 4 rounds; "
                                    f"last peak {peak / 1e9:.3f} GB")
    state.solution, state.placement = res, placement


def _expand(state, res):
    rep, choice, S = state.rep, state.choice, state.strategies
    return [S[rep[i]][int(choice[rep[i]][res.choice[state.group_of[i]]])] for i in range(len(state.graph.nodes))]
