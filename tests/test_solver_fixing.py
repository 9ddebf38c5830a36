"""Reduced-cost fixing (autopar/solver_fixing.py): when the restricted branch and bound cannot prove its plan against
the LP bound and no memory row can bind, the branch and bound runs over the strategies the LP's reduced costs leave
to plans cheaper than the restricted plan, seeded with it; the plan is still the optimum (within the gap)."""

import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

import autopar.solver_fixing as F
from autopar.solver import _build, solve

# Three groups in a triangle, each choosing A, B or C: two neighbours on the same one of A / B pay 1 (an odd cycle
# cannot alternate, so some edge pays), C costs 100 and meets anything for free. The LP relaxation takes A and B
# at 1/2 each with every edge on its free pairs (bound 0); the optimum is 1. All three groups are fractional, so the
# restricted branch and bound is the whole problem: it finds the optimum but cannot prove it against the bound 0,
# which is PoolFormer's case (its R / S0 / S1 cycles around GroupNorm's backward).
ODD = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
LIN = [np.array([0.0, 0.0, 100.0])] * 3
EDGES = {(0, 1): ODD, (1, 2): ODD, (0, 2): ODD}


def test_odd_cycle_is_proven_on_the_fixed_model(monkeypatch):
    """The plan comes from the branch and bound after fixing, which dropped C in every group (100 above the LP
    bound, against a restricted plan costing 1), and is the optimum with a bound that proves it."""
    kept = []
    real = F.branch_on_fixed
    monkeypatch.setattr(F, "branch_on_fixed", lambda problem, keep, *a: kept.append(keep) or real(problem, keep, *a))
    res = solve(LIN, EDGES, [([np.ones(3)] * 3, 10.0)])  # a memory row no plan can break
    assert res.status == "optimal (branch and bound after reduced-cost fixing)", res.status
    assert [list(k) for k in kept[0]] == [[0, 1]] * 3
    value = sum(ODD[res.choice[a], res.choice[b]] for a, b in EDGES)
    assert res.objective == value == 1.0 and res.bound <= res.objective + 1e-12 and res.gap <= 1e-9


def test_a_binding_memory_row_keeps_the_full_branch_and_bound():
    """With a memory row that can bind (at most two groups may take C), the full branch and bound runs as before
    (autopar/solver.py _fractional says why); same optimum."""
    res = solve(LIN, EDGES, [([np.array([0.0, 0.0, 1.0])] * 3, 2.0)])
    assert res.status == "optimal (branch and bound)" and res.objective == 1.0


def test_reduced_cost_bound_is_the_lp_bound():
    """reduced_costs' dual objective (from HiGHS's row duals, signs clipped) equals the LP optimum, and L + d of C
    exceeds the restricted plan's cost: the fixing rests on a bound, not on HiGHS's reported objective."""
    from autopar.milp import _model

    m = _build(LIN, EDGES, [], None)
    scale = float(np.abs(m.cost).max())
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, 10.0)
    h.run()
    L, d = F.reduced_costs(h)
    assert abs(L - h.getInfo().objective_function_value) < 1e-9 and abs(L) < 1e-9
    keep = F.fixed_keep(m, L, d, 1.0 / scale, [0, 1, 0])
    assert [list(k) for k in keep] == [[0, 1]] * 3


@st.composite
def frustrated(draw):
    """3-5 groups of 2-3 strategies and a costly one that meets anything for free, every pair joined by an edge
    that charges agreeing choices (so odd cycles stay fractional in the LP), random linear costs; no memory row
    can bind."""
    n = draw(st.integers(3, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    K = [int(rng.integers(2, 4)) for _ in range(n)]
    lin = [np.append(np.round(rng.uniform(0, 2, k), 3), np.round(rng.uniform(3, 9), 3)) for k in K]
    edges = {}
    for a, b in itertools.combinations(range(n), 2):
        C = np.zeros((K[a] + 1, K[b] + 1))
        C[:-1, :-1] = np.round(rng.uniform(0, 0.3, (K[a], K[b])), 3)
        for i in range(min(K[a], K[b])):
            C[i, i] += np.round(rng.uniform(1, 3), 3)
        edges[(a, b)] = C
    return lin, edges


@settings(max_examples=60, deadline=None)
@given(frustrated(), st.sampled_from([1e-6, 1e-3, 0.05]))
def test_fixed_branch_and_bound_equals_enumeration(prob, gap):
    """Whichever path solves it, the plan is within the gap of the enumerated optimum, its objective is its cost,
    and the bound it reports is below the optimum."""
    lin, edges = prob
    value = lambda c: sum(v[k] for v, k in zip(lin, c)) + sum(C[c[a], c[b]] for (a, b), C in edges.items())  # noqa: E731
    want = min(value(c) for c in itertools.product(*[range(len(v)) for v in lin]))
    res = solve(lin, edges, [([np.zeros(len(v)) for v in lin], 1.0)], mip_rel_gap=gap)
    got, tol = value(res.choice), 1e-6 * max(1.0, want)
    assert abs(got - res.objective) <= tol, (got, res.objective)
    assert res.bound <= want + tol and got - want <= gap * got + tol, (res.bound, want, got, res.status)
