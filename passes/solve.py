"""Pass: pick one strategy per decision group with the exact MILP (autopar/solver.py) and expand the choice to
every node: the roots take their group's strategy, followers the strategy that matches their producer."""
from __future__ import annotations

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
    res = solve(lin, c["edges"], [(mem_rows, state.budget)], time_limit=state.options.get("time_limit", 60.0))
    state.solution = res
    rep, choice, S = state.rep, state.choice, state.strategies
    placement = [None] * len(state.graph.nodes)
    for i in range(len(placement)):
        r = rep[i]
        k = res.choice[state.group_of[i]]
        placement[i] = S[r][int(choice[r][k])]
    state.placement = placement
