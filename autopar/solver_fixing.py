"""Reduced-cost fixing: the branch and bound that autopar/solver.py runs when the restricted one (the LP's fractional
groups only) could not prove its plan, on a model without the strategies that no plan better than that one can take.

The LP's duals y give, for every column vector v the rows allow, cost . v >= L + sum_j d_j v_j with d = cost - A^T y
(the reduced costs) and L the dual objective (each row at the bound its dual's sign picks, each column with d_j < 0 at
its upper bound). A plan taking strategy k (v_k = 1, d_k > 0) therefore costs at least L + d_k; where that exceeds
the restricted plan's cost U, no plan taking k beats it, and k is dropped (exact: every plan at least as good as U,
U's own included, keeps all its strategies). The bound is computed here from y, clipped to the signs the rows allow,
so HiGHS's tolerances cannot make it claim too much.

Why: PoolFormer's 2x2 plan (135 groups) leaves 53 groups fractional, a 0.45% integrality gap from odd cycles of
R / S0 / S1 choices around GroupNorm's decomposed backward; the restricted plan is 0.55% above the LP bound, so the
full branch and bound ran, and spent 7 of its 9.5 s finding an incumbent as good (HiGHS's heuristics). Fixing
against the restricted plan drops 972 of 2501 strategies and the branch and bound, seeded with that plan, takes 2 s.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csc_array

from . import dominance
from .milp import _branch_and_bound, _choice, _model

MARGIN = 1e-9  # relative: a strategy is dropped only when its bound exceeds U by more than rounding


def reduced_costs(h):
    """(L, d): the dual objective and reduced costs of the solved LP instance `h`, from its row duals with any
    sign its row's bounds do not allow set to zero; L is -inf when a column's reduced cost meets an infinite bound
    (no valid bound then)."""
    lp = h.getLp()
    a = lp.a_matrix_
    A = csc_array((np.asarray(a.value_), np.asarray(a.index_), np.asarray(a.start_)), shape=(lp.num_row_, lp.num_col_))
    y = np.asarray(h.getSolution().row_dual, float)
    lo, hi = np.asarray(lp.row_lower_), np.asarray(lp.row_upper_)
    y[(y > 0) & ~np.isfinite(lo) | (y < 0) & ~np.isfinite(hi)] = 0.0
    d = np.asarray(lp.col_cost_) - A.T @ y
    row_at = np.where(y > 0, lo, hi)  # the bound each row's dual prices; the cheapest end of each column's range
    col_at = np.where(d > 0, np.asarray(lp.col_lower_), np.asarray(lp.col_upper_))
    if not (np.isfinite(row_at[y != 0]).all() and np.isfinite(col_at[d != 0]).all()):
        return -np.inf, d
    return float(y[y != 0] @ row_at[y != 0] + d[d != 0] @ col_at[d != 0]), d


def fixed_keep(m, L, d, U, incumbent) -> list[np.ndarray] | None:
    """Per group the strategies a plan cheaper than U may take (L, d, U in the LP's scaled units; `incumbent`: the
    plan costing U, whose strategies are kept whatever the rounding), or None when none can be dropped."""
    cut = L + d[: m.nx] > U + MARGIN * max(1.0, abs(U))
    cut[m.off[:-1] + np.asarray(incumbent)] = False
    if not cut.any():
        return None
    return [np.flatnonzero(~cut[m.off[g] : m.off[g + 1]]) for g in range(len(m.off) - 1)]


def branch_on_fixed(problem, keep, incumbent, scale, mip_rel_gap, time_limit, build):
    """(the solved instance, its column vector, the choice in the problem's indices) of a branch and bound over the
    kept strategies only, seeded with the incumbent, or None when it found no plan. problem: (lin, edges, mem,
    fixed, shared) as autopar.solver._solve has them; build: autopar.solver._build. The instance's dual bound
    bounds the whole problem: every plan it leaves out costs more than the incumbent it holds."""
    lin, edges, mem, fixed, shared = problem
    lin2, edges2, mem2, _, fixed2, shared2 = dominance.restrict(keep, lin, edges, mem, None, fixed, shared)
    m2 = build(lin2, edges2, mem2, None, fixed2, shared2)
    seed = m2.one_hot([int(np.flatnonzero(k == c)[0]) for k, c in zip(keep, incumbent)])
    h = _model(m2.cost / scale, m2.A, m2.lo, m2.hi, m2.upper, time_limit)
    x, h = _branch_and_bound(h, m2.nx, mip_rel_gap, seed)
    if x is None:
        return None
    return h, x, [int(k[c]) for k, c in zip(keep, _choice(x, m2.off))]


def memory_binds(mem) -> bool:
    """Whether some memory row can bind: its budget is under the sum of the groups' largest coefficients."""
    return any(sum(float(np.max(c)) for c in coefs if len(c)) > budget for coefs, budget in mem)
