"""Why each decision group got its placement: the chosen strategy's cost and its runner-up's, for `autopar explain`.

Read after the solve pass; changes nothing. A group's *local* cost of a strategy is what the solver's objective
charges that group with every other group kept at its chosen strategy: its compute, the redistributes inside it
and on its edges to the neighbours (passes/solve.py `objective`, the same terms the MILP minimized). The bucket
series' latency charges and the shared-redistribute charges span several groups and are left out, so a runner-up
can look locally cheaper than the choice; then memory (the budget row) or those shared charges decided it.
"""

from __future__ import annotations

import numpy as np

from autopar.passes.solve import objective


def runner_ups(state) -> dict:
    """{"groups": [per decision group: root node, candidate count, chosen and runner-up figures], "group_of": the
    group of each node}, JSON-ready, for Plan.meta["alternatives"]."""
    c, chosen = state.cost, [int(k) for k in state.solution.choice]
    lin, edges, *_ = objective(c, state.options.get("overlap", False))
    local = [np.array(v, dtype=float) for v in lin]
    for (g1, g2), E in edges.items():
        local[g1] += E[:, chosen[g2]]
        local[g2] += E[chosen[g1], :]
    groups = []
    for g, root in enumerate(state.groups):
        k, cost = chosen[g], local[g]
        others = [j for j in range(len(cost)) if j != k]
        best = min(others, key=lambda j: (cost[j], j)) if others else None
        groups.append(
            {
                "node": int(root),
                "candidates": len(cost),
                "chosen": _figures(state, c, g, root, k, cost[k]),
                "runner_up": _figures(state, c, g, root, best, cost[best]) if best is not None else None,
            }
        )
    return {"groups": groups, "group_of": [int(state.group_of[i]) for i in range(len(state.graph.nodes))]}


def _figures(state, c, g, root, j, total) -> dict:
    strategy = state.strategies[root][int(state.choice[root][j])]
    compute = float(c["compute"][g][j])
    return {
        "placement": _text(strategy),
        "cost_s": float(total),
        "compute_s": compute,
        "comm_s": float(total) - compute,
        "memory_bytes": float(c["state_mem"][g][j] + c["act_mem"][g][j]),
    }


def _text(strategy) -> str:
    out = " ".join("[" + ",".join(p) + "]" if p is not None else "-" for p in strategy.out)
    ins = " ".join("[" + ",".join(p) + "]" for p in strategy.ins)
    return f"out {out}" + (f" in {ins}" if ins else "")
