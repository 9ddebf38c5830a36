"""Exact placement solver: a mixed-integer linear program solved by HiGHS (highspy).

Variables: x[g, k] = 1 when decision group g takes strategy k (exactly one per group). Each edge between two
groups with a redistribute-time matrix C gets transportation variables z[a, b] over the distinct rows a and
columns b of C, whose marginals are the producer's and consumer's x; since the marginals are one-hot, z is the
product of the two choices and sum C[a, b] z[a, b] is exactly the edge's cost. A bucket charge (one gradient bucket
series' latency F, paid max(1, sum of its gradients' bucket fractions) times when any gradient joins the series)
is y >= every x or z column that joins it and e >= sum w col - y, costing F (y + e). A shared charge (what
several consumers of one value pay once: the max over them of a price per choice pair) is y >= each consumer
edge's W-weighted x or z columns, costing F y. Memory rows bound the bytes per rank.
Strategies dominated in every term are dropped first (autopar/dominance.py; exact): near-tied candidates of small
models otherwise leave the LP fractional and branch and bound runs for seconds. Same inputs give the same model and
the same answer on every rank (HiGHS is deterministic, run single threaded).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import highspy
from scipy.sparse import coo_array

from . import dominance


class InfeasibleMemoryError(ValueError):
    """No plan fits the memory budget; the message states the smallest achievable peak."""


class SolverTimeLimitError(RuntimeError):
    """The solver stopped at `time_limit` before it found any plan (not a sign that none fits)."""


def _no_solution(status: str, time_limit: float):
    """The error for a solve that returned no plan: out of time, or infeasible (the memory rows)."""
    if "infeasible" in status.lower():
        return InfeasibleMemoryError(f"the placement model has no solution ({status})")
    return SolverTimeLimitError(f"the solver found no plan within time_limit={time_limit:g} s (HiGHS: {status}); "
                                f"raise autopar.plan(time_limit=...)")


@dataclass
class SolveResult:
    choice: list[int]
    objective: float
    bound: float
    gap: float
    seconds: float
    status: str
    n_vars: int
    n_constraints: int
    candidates: list = None        # other plans found on the way, [(objective, choice)] best first (overlap search)


def _classes(C: np.ndarray, axis: int):
    """Distinct rows (axis 0) or columns (axis 1) of C, in first-seen order, and each row's class index."""
    M = np.ascontiguousarray(C if axis == 0 else C.T)
    seen: dict = {}
    inv = np.array([seen.setdefault(row.tobytes(), len(seen)) for row in M], dtype=np.int64)
    first = np.zeros(len(seen), dtype=np.int64)
    first[inv[::-1]] = np.arange(len(inv))[::-1]
    return M[first], inv


@dataclass
class _Model:
    """The MILP's arrays: x (one-hot strategy per group) then z (transportation variables per edge)."""
    A: object                  # constraint matrix (csc)
    lo: np.ndarray
    hi: np.ndarray
    cost: np.ndarray           # objective per variable (seconds)
    ovl: np.ndarray            # overlap row per variable: overlappable comm - capacity (seconds)
    off: np.ndarray            # group g's x variables: off[g]:off[g+1]
    edges: list                # (z0, A, B, a_of, b_of, g1, g2) per edge with transportation variables
    cap: np.ndarray            # the compute capacity part of ovl, per variable (x only)
    fixed: list = ()           # (y column, e column, columns that join it, their weights) per bucket charge
    shared: list = ()          # (y column, [(columns, weights) of one consumer edge]) per shared charge

    @property
    def upper(self) -> np.ndarray:
        """Column upper bounds: 1 (x, z, y; a shared charge's y is in units of its largest price), unbounded for each
        bucket charge's e."""
        u = np.ones(self.A.shape[1])
        for _, e, _, _ in self.fixed:
            u[e] = np.inf
        return u

    @property
    def nx(self) -> int:
        return int(self.off[-1])

    def one_hot(self, choice) -> np.ndarray:
        """The 0/1 vector (x and z) of an integral choice."""
        v = np.zeros(self.A.shape[1])
        v[self.off[:-1] + np.asarray(choice)] = 1.0
        for z0, A, B, a_of, b_of, g1, g2 in self.edges:
            v[z0 + a_of[choice[g1]] * B + b_of[choice[g2]]] = 1.0
        for y, e, cols, w in self.fixed:
            v[y] = v[cols].max()
            v[e] = max(0.0, float(w @ v[cols]) - v[y])
        for y, parts in self.shared:
            v[y] = max(float(w @ v[c]) for c, w in parts)
        return v


def _build(lin, edges, mem, overlap, fixed=(), shared=()) -> _Model:
    off = np.cumsum([0] + [len(c) for c in lin])
    nx = int(off[-1])
    cost = [np.concatenate(lin)]
    ovl_lin, ovl_edges, capacity = overlap if overlap is not None else (None, {}, None)
    ocost = [np.concatenate(ovl_lin) - np.concatenate(capacity)] if overlap is not None else [np.zeros(nx)]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for gi, c in enumerate(lin):                          # one strategy per group
        rows += [r] * len(c); cols += list(range(off[gi], off[gi + 1])); vals += [1.0] * len(c)
        lo.append(1.0); hi.append(1.0); r += 1
    nz, zs = nx, []
    trig: dict = {}                                       # edge -> [(bucket charge, weights of the choices joining it)]
    trig_cols = [{} for _ in fixed]                       # per bucket charge: {column joining it: weight}

    def join(s, cols, w):
        for c, x in zip(cols, w):
            trig_cols[s][int(c)] = trig_cols[s].get(int(c), 0.0) + float(x)
    for s, (_, where) in enumerate(fixed):
        for (g1, g2), W in where:
            if g1 == g2:                                  # inside one group: its own choices
                k = np.flatnonzero(np.diag(W) > 0)
                join(s, off[g1] + k, np.diag(W)[k])
            else:
                trig.setdefault((g1, g2), []).append((s, W))
    weights: dict = {}                                    # edge -> the W of the shared charges on it
    for _, where in shared:
        for (g1, g2), W in where:
            if g1 != g2:
                weights.setdefault((g1, g2), []).append(np.asarray(W, float))
    where_x: dict = {}                                    # edge -> how its pairs are columns: ("z", ...) or ("x", ...)
    for key in sorted(set(edges) | set(ovl_edges) | set(trig) | set(weights)):
        g1, g2 = key
        C, O = edges.get(key), ovl_edges.get(key)
        C = np.zeros((len(lin[g1]), len(lin[g2]))) if C is None and O is None else C
        C = np.zeros_like(O) if C is None else C
        O = np.zeros_like(C) if O is None else O
        Ts = trig.get(key, [])
        Ws = weights.get(key, [])
        _, a_of = _classes(np.hstack([C, O] + [T for _, T in Ts] + Ws), 0)   # distinct producer rows
        _, b_of = _classes(np.vstack([C, O] + [T for _, T in Ts] + Ws), 1)   # distinct consumer columns
        A, B = int(a_of.max()) + 1, int(b_of.max()) + 1
        fa = [int(np.flatnonzero(a_of == a)[0]) for a in range(A)]
        fb = [int(np.flatnonzero(b_of == b)[0]) for b in range(B)]
        small, osmall = C[np.ix_(fa, fb)], O[np.ix_(fa, fb)]
        if A == 1:
            where_x[key] = ("x", g2)
            cost[0][off[g2]:off[g2 + 1]] += small[0][b_of]
            ocost[0][off[g2]:off[g2 + 1]] += osmall[0][b_of]
            for s, W in Ts:
                k = np.flatnonzero(W[0] > 0)
                join(s, off[g2] + k, W[0][k])
            continue
        if B == 1:
            where_x[key] = ("x", g1)
            cost[0][off[g1]:off[g1 + 1]] += small[:, 0][a_of]
            ocost[0][off[g1]:off[g1 + 1]] += osmall[:, 0][a_of]
            for s, W in Ts:
                k = np.flatnonzero(W[:, 0] > 0)
                join(s, off[g1] + k, W[:, 0][k])
            continue
        z0 = nz
        nz += A * B
        zs.append((z0, A, B, a_of, b_of, g1, g2))
        where_x[key] = ("z", z0, B, fa, fb)
        for s, W in Ts:
            Ws = W[np.ix_(fa, fb)]
            ab = np.argwhere(Ws > 0)
            join(s, [z0 + a * B + b for a, b in ab], [Ws[a, b] for a, b in ab])
        cost.append(small.reshape(-1))
        ocost.append(osmall.reshape(-1))
        for a in range(A):                                # sum_b z[a, b] = sum_{k in a} x[g1, k]
            rows += [r] * B; cols += [z0 + a * B + b for b in range(B)]; vals += [1.0] * B
            ks = np.flatnonzero(a_of == a)
            rows += [r] * len(ks); cols += list(off[g1] + ks); vals += [-1.0] * len(ks)
            lo.append(0.0); hi.append(0.0); r += 1
        for b in range(B):                                # sum_a z[a, b] = sum_{k in b} x[g2, k]
            rows += [r] * A; cols += [z0 + a * B + b for a in range(A)]; vals += [1.0] * A
            ks = np.flatnonzero(b_of == b)
            rows += [r] * len(ks); cols += list(off[g2] + ks); vals += [-1.0] * len(ks)
            lo.append(0.0); hi.append(0.0); r += 1
    ys = []
    for s, (F, _) in enumerate(fixed):                   # y >= each column joining; e >= sum w col - y; F (y + e)
        cols_s = sorted(trig_cols[s])
        if not cols_s:
            continue
        w = np.array([trig_cols[s][c] for c in cols_s])
        y, e = nz, nz + 1
        nz += 2
        ys.append((y, e, np.array(cols_s), w))
        cost.append(np.array([F, F]))
        ocost.append(np.zeros(2))
        for c in cols_s:
            rows += [r, r]; cols += [y, c]; vals += [1.0, -1.0]
            lo.append(0.0); hi.append(np.inf); r += 1
        rows += [r] * (len(cols_s) + 2); cols += [y, e] + cols_s; vals += [1.0, 1.0] + list(-w)
        lo.append(0.0); hi.append(np.inf); r += 1
    sh = []
    for F, where in shared:                               # y >= each consumer edge's W-weighted columns; F y
        y = nz
        nz += 1
        parts = []
        unit = max(max(float(np.abs(W).max()) for _, W in where), 1e-300)   # y in units of the largest price:
        for (g1, g2), W in where:                                           # matrix entries of order 1
            W = np.asarray(W, float) / unit
            if g1 == g2:                                  # the group's own choices
                k = np.flatnonzero(np.diag(W))
                part, w = off[g1] + k, np.diag(W)[k]
            elif where_x[(g1, g2)][0] == "x":             # one side has a single class
                g = where_x[(g1, g2)][1]
                w = W[0, :] if g == g2 else W[:, 0]
                k = np.flatnonzero(w)
                part, w = off[g] + k, w[k]
            else:                                         # W is constant on each (producer, consumer) class block
                _, z0, B, fa, fb = where_x[(g1, g2)]
                Wc = W[np.ix_(fa, fb)]
                ab = np.argwhere(Wc != 0)
                part, w = z0 + ab[:, 0] * B + ab[:, 1], Wc[ab[:, 0], ab[:, 1]]
            if not len(part):
                continue
            parts.append((part, w))
            rows += [r] * (len(part) + 1); cols += [y] + list(part); vals += [1.0] + list(-w)
            lo.append(0.0); hi.append(np.inf); r += 1
        sh.append((y, parts))
        cost.append(np.array([F * unit]))
        ocost.append(np.zeros(1))
    for coefs, budget in mem:
        vec = np.concatenate(coefs)
        idx = np.flatnonzero(vec)
        rows += [r] * len(idx); cols += list(idx); vals += list(vec[idx])
        lo.append(-np.inf); hi.append(budget); r += 1
    A_ = coo_array((vals, (rows, cols)), shape=(r, nz)).tocsc()
    cap = np.zeros(nz)
    if overlap is not None:
        cap[:nx] = np.concatenate(capacity)
    return _Model(A_, np.asarray(lo, float), np.asarray(hi, float), np.concatenate(cost), np.concatenate(ocost),
                  off, zs, cap, ys, sh)


def solve(lin: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray], mem: list[tuple[list[np.ndarray], float]],
          time_limit: float = 60.0, mip_rel_gap: float = 1e-6, overlap=None, max_lps: int | None = None,
          lambda_search_s: float = float("inf"), fixed=(), shared=(), reduce: bool = True) -> SolveResult:
    """Minimize sum lin[g][x_g] + sum edges[g1,g2][x_g1, x_g2] (+ exposed overlappable time) subject to `mem`.

    overlap: (ovl_lin, ovl_edges, capacity) for comm that overlaps compute (parameter gathers, gradient
    reductions), given in the same shapes as lin / edges and NOT included in them; capacity is the compute time
    it can hide under. The objective is then F = base + max(0, overlappable - capacity): the step time the
    prediction reports (compute + other comm + exposed overlappable comm). See _solve_overlap.
    fixed: [(seconds F, [((g1, g2), W)])] (plain objective only), one per gradient bucket series: F (one bucket's
    latency) times max(1, sum of W[a, b] over the choice pairs taken) when any pair with W[a, b] > 0 (the fraction
    of a bucket its gradient fills) is taken on a listed edge (g1 == g2: the group's own choices, W's diagonal);
    continuous y >= each joining x or z column and e >= sum W col - y, costing F (y + e).
    shared: [(F, [((g1, g2), W)])] (plain objective only): F times the max over the listed edges of W[choice of g1,
    choice of g2] (g1 == g2: W's diagonal), e.g. a redistribute several consumers share, paid once (W: its price
    where the pair makes that transition); y >= each edge's W-weighted columns, costing F y.
    reduce: drop dominated strategies first (autopar/dominance.py; exact; the choice is in the original indices).
    It costs ~0.15 s on 4k strategies and an integral LP gains little (its time is in the z columns, which the
    reduction barely shrinks), but a fractional one gains much: torchtitan's 8B at 64 layers went from 19 to 7 CPU s
    (the fractional groups' branch and bound), llama-tiny 2x2 (examples/train.py) from 3.9 to 0.6 (integral LP)."""
    t0 = time.perf_counter()
    if overlap is not None and (fixed or shared):
        raise ValueError("bucket and shared charges are priced by the plain objective only (overlap=None)")
    args = (lin, edges, mem, time_limit, mip_rel_gap, overlap, max_lps, lambda_search_s, fixed, shared, t0)
    res = _reduced(*args) if reduce else None
    return res if res is not None else _solve(*args)


def _reduced(lin, edges, mem, time_limit, mip_rel_gap, overlap, max_lps, lambda_search_s, fixed, shared, t0):
    """The solve of the problem without its dominated strategies (choice mapped back to the original indices), or
    None when no strategy is dominated."""
    keep = dominance.reduce(lin, edges, mem, overlap, fixed, shared)
    if keep is None:
        return None
    lin, edges, mem, overlap, fixed, shared = dominance.restrict(keep, lin, edges, mem, overlap, fixed, shared)
    res = _solve(lin, edges, mem, time_limit, mip_rel_gap, overlap, max_lps, lambda_search_s, fixed, shared, t0)
    back = lambda ch: [int(k[c]) for k, c in zip(keep, ch)]    # noqa: E731
    res.choice = back(res.choice)
    if res.candidates is not None:
        res.candidates = [(F, back(ch)) for F, ch in res.candidates]
    res.seconds = time.perf_counter() - t0
    return res


def _solve(lin, edges, mem, time_limit, mip_rel_gap, overlap, max_lps, lambda_search_s, fixed, shared, t0):
    m = _build(lin, edges, mem, overlap, fixed, shared)
    if overlap is not None:
        return _solve_overlap(m, (lin, edges, overlap, mem), time_limit, mip_rel_gap, t0,
                              max_lps or len(LAMBDAS), lambda_search_s)
    scale = max(float(np.abs(m.cost).max()), 1e-30)
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, time_limit)
    # The LP relaxation is a lower bound; when its optimum is integral it is the MILP optimum (gap 0). This is
    # the common case for placement problems and several times faster than branch-and-bound's set-up (dual
    # simplex without presolve measured fastest on the 8B plan: 0.35 s vs 0.9 s with presolve, 3 s with IPM);
    # otherwise the model is solved again, in a fresh HiGHS instance, with integral placement variables.
    h.run()
    x = _solution(h, m.A.shape[1])
    method = "LP relaxation (integral)"
    lp_bound = float(h.getInfo().objective_function_value) * scale if x is not None else None
    if x is not None and not _integral(x[:m.nx]):
        # the groups the LP left fractional, solved as a MILP with every other group fixed at its LP choice (a
        # small problem): when that plan is within the gap of the LP bound it is proven optimal (within the gap)
        # and the full branch and bound (seconds of root cuts on the 8B plan) is skipped
        left = max(1.0, time_limit - (time.perf_counter() - t0))
        restricted = _restricted(m, x, scale, mip_rel_gap, left)
        if restricted is not None and restricted[1] <= lp_bound * (1 + mip_rel_gap) + 1e-15:
            h, x, method = restricted[2], restricted[0], "LP relaxation, fractional groups by branch and bound"
        else:
            h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper,
                       max(1.0, time_limit - (time.perf_counter() - t0)))
            x, h = _branch_and_bound(h, m.nx, mip_rel_gap)   # unseeded: seeded, HiGHS returned stale vectors
            method = "branch and bound"
    status = h.modelStatusToString(h.getModelStatus())
    if x is None:
        raise _no_solution(status, time_limit)
    info = h.getInfo()
    obj = float(info.objective_function_value) * scale
    if method == "branch and bound":
        bound, gap = float(info.mip_dual_bound) * scale, float(info.mip_gap)
    else:       # the LP relaxation's optimum bounds every plan (equal to obj when it was integral)
        bound = lp_bound
        gap = max(0.0, (obj - bound) / max(abs(obj), 1e-30))
    return SolveResult(_choice(x, m.off), obj, bound, gap, time.perf_counter() - t0,
                       (f"optimal within {mip_rel_gap:g} relative gap ({method})" if gap > 1e-9 else
                        f"optimal ({method})") if status == "Optimal" else status, m.A.shape[1], m.A.shape[0])


def _restricted(m: _Model, x, scale, mip_rel_gap, time_limit):
    """(column vector, objective, solved instance) of the best plan that keeps every group the LP solution `x`
    left integral at its LP choice (branch and bound over the fractional groups only); None if infeasible."""
    lo, hi = np.zeros(m.nx), np.ones(m.nx)
    for g in range(len(m.off) - 1):
        seg = x[m.off[g]:m.off[g + 1]]
        if _integral(seg):
            lo[m.off[g]:m.off[g + 1]] = hi[m.off[g]:m.off[g + 1]] = np.round(seg)
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, time_limit)
    h.changeColsBounds(m.nx, np.arange(m.nx, dtype=np.int32), lo, hi)
    xr, h = _branch_and_bound(h, m.nx, mip_rel_gap)
    if xr is None or h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return None
    return xr, float(h.getInfo().objective_function_value) * scale, h


def _branch_and_bound(h, nx, mip_rel_gap, incumbent=None):
    """Solve `h` as a MILP (its first nx variables integral); returns (column vector or None, the instance that
    solved it). `h` must be a fresh instance: re-running one that already solved the LP relaxation returned the
    MILP's objective with a stale column vector (highspy 1.17, found by tests/test_solver.py's brute-force
    comparison). Seeded with an incumbent, HiGHS has also returned the optimum's objective with the incumbent's
    vector (found the same way); so a vector whose cost is not the reported objective is solved again, unseeded,
    in a fresh instance."""
    h.changeColsIntegrality(nx, np.arange(nx, dtype=np.int32), np.full(nx, highspy.HighsVarType.kInteger))
    h.setOptionValue("presolve", "on")
    h.setOptionValue("mip_rel_gap", mip_rel_gap)
    if incumbent is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(incumbent)
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    x = _solution(h, h.getNumCol())
    if incumbent is not None and x is not None:
        obj, cost = h.getInfo().objective_function_value, float(np.dot(h.getLp().col_cost_, x))
        if abs(obj - cost) > 1e-6 * max(1.0, abs(obj)):
            fresh = _highs()
            for k in ("output_flag", "threads", "random_seed", "time_limit"):
                fresh.setOptionValue(k, h.getOptionValue(k)[1])
            fresh.passModel(h.getModel())
            return _branch_and_bound(fresh, nx, mip_rel_gap)
    return x, h


def _choice(x, off) -> list[int]:
    return [int(np.argmax(x[off[i]:off[i + 1]])) for i in range(len(off) - 1)]


# Up to this many variables, an overlap objective whose Lagrangian search leaves a gap is finished by branch and
# bound (seeded with the search's best plan); above it the search's plan is returned with its proven gap.
EXACT_OVERLAP_VARS = 20_000
LAMBDAS = (0.0, 0.5)     # the Lagrangian weights tried, in order (each one LP)


def _solve_overlap(m: _Model, problem, time_limit, mip_rel_gap, t0, max_lps, lambda_search_s) -> SolveResult:
    """min F(x) = base(x) + max(0, ovl(x)), ovl = overlappable comm - capacity.

    Since max(0, y) = max over lam in [0, 1] of lam * y, every lam gives a lower bound
    L(lam) = min_x base(x) + lam * ovl(x): an ordinary placement LP (solved cold: warm starts after a cost change
    measured to stall), whose plan x_lam is also a candidate (upper bound F(x_lam)). lam = 0 whose plan hides
    everything (ovl <= 0) is optimal outright, the common compute-bound case. Otherwise the LAMBDAS are tried
    (at most max_lps, all of them by default), then the plain objective (every collective in full), and each plan found is improved by
    a local search (_polish) under the exact F. A remaining gap is closed by branch and bound on the exact model
    (one continuous variable e >= ovl, e >= 0) when the model is small, seeded with the best plan; otherwise the
    best plan is returned with its gap to the best bound. All plans found are returned as candidates (the solve
    pass picks among them by the full prediction, which counts gradient buckets exactly)."""
    nz = m.A.shape[1]
    scale = max(float(np.abs(m.cost).max()), float(np.abs(m.ovl).max()), 1e-30)
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, time_limit)
    idx = np.arange(nz, dtype=np.int32)
    best, best_F, bound, n_lp = None, np.inf, -np.inf, 0
    mem_rows = m.A[m.lo == -np.inf] if np.any(m.lo == -np.inf) else None
    mem_hi = m.hi[m.lo == -np.inf]
    lam, slowest_lp, tried, cands = 0.0, 0.0, [], []
    for _ in range(max_lps):
        if lam > 0:
            h.changeColsCost(nz, idx, (m.cost + lam * m.ovl) / scale)
            h.clearSolver()               # cold dual simplex: a warm start after a cost change can stall for minutes
        left = time_limit - (time.perf_counter() - t0)
        cap = left if n_lp == 0 else min(left, max(1.0, 5 * slowest_lp))   # a stalling lam is given up on
        h.setOptionValue("time_limit", h.getRunTime() + max(cap, 0.01))     # HiGHS's clock runs across runs
        t_lp = time.perf_counter()
        h.run()
        slowest_lp = max(slowest_lp, time.perf_counter() - t_lp)
        n_lp += 1
        if n_lp > 1 and h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            break                         # a degenerate lam that simplex cannot settle in time: keep what we have
        x = _solution(h, nz)
        if x is None:
            raise _no_solution(h.modelStatusToString(h.getModelStatus()), time_limit)
        bound = max(bound, float(h.getInfo().objective_function_value) * scale)
        ch = _choice(x, m.off)
        F = _value(m, ch, mem_rows, mem_hi)
        if F is not None:
            cands.append(ch)
            if F < best_F - 1e-15:
                best, best_F = ch, F
        if best_F - bound <= 1e-4 * max(best_F, 1e-30):
            break
        tried.append(lam)
        if float(m.ovl @ x) <= 0 or len(tried) >= len(LAMBDAS) or time.perf_counter() - t0 > lambda_search_s:
            break                         # lam = 0 hides everything it exposes: larger lam only bound lower
        lam = LAMBDAS[len(tried)]
    if best is not None and best_F - bound > 1e-4 * max(best_F, 1e-30):
        # one more plan: every collective paid in full (the plain objective; good when little can hide)
        h.changeColsCost(nz, idx, (m.cost + m.ovl + m.cap) / scale)
        h.clearSolver()
        h.setOptionValue("time_limit", h.getRunTime() + max(1.0, 5 * slowest_lp))
        h.run()
        n_lp += 1
        x = _solution(h, nz) if h.getModelStatus() == highspy.HighsModelStatus.kOptimal else None
        ch = None if x is None else _choice(x, m.off)
        if ch is not None and _value(m, ch, mem_rows, mem_hi) is not None:
            cands.append(ch)
        # then a local search from each distinct plan found: one group at a time to its best strategy
        for ch in list({tuple(c): c for c in cands}.values()):
            ch = _polish(ch, *problem)
            F = _value(m, ch, mem_rows, mem_hi)
            if F is not None:
                cands.append(ch)
                if F < best_F - 1e-15:
                    best, best_F = ch, F
    found = sorted({tuple(c): (_value(m, c, mem_rows, mem_hi), list(c)) for c in cands}.values(),
                   key=lambda fc: fc[0])
    gap = (best_F - bound) / best_F if best is not None and best_F > 0 else 0.0
    method = f"Lagrangian search, {n_lp} LPs"
    if best is not None and gap <= 1e-4:
        return SolveResult(best, best_F, bound, max(gap, 0.0), time.perf_counter() - t0, f"optimal ({method})",
                           nz, m.A.shape[0], found)
    left = time_limit - (time.perf_counter() - t0)
    if nz <= EXACT_OVERLAP_VARS and left > 1.0:
        e_col = m.A.shape[1]
        A2 = _with_overlap_row(m, scale)
        h2 = _model(np.append(m.cost, scale) / scale, A2, np.append(m.lo, -np.inf), np.append(m.hi, 0.0),
                    np.append(m.upper, np.inf), left)
        seed = None if best is None else np.append(m.one_hot(best), max(0.0, float(m.ovl @ m.one_hot(best))) / scale)
        x, h2 = _branch_and_bound(h2, m.nx, mip_rel_gap, seed)
        if x is not None:
            info = h2.getInfo()
            status = h2.modelStatusToString(h2.getModelStatus())
            obj = float(info.objective_function_value) * scale
            return SolveResult(_choice(x[:e_col], m.off), obj, max(bound, float(info.mip_dual_bound) * scale),
                               float(info.mip_gap), time.perf_counter() - t0,
                               f"optimal (branch and bound after {method})" if status == "Optimal" else status,
                               e_col + 1, A2.shape[0])
    if best is None:                      # every LP optimum rounded out of the budget: the exact plain model
        plain = solve([c + o for c, o in zip(problem[0], problem[2][0])], _plain_edges(problem), problem[3],
                      time_limit=max(1.0, time_limit - (time.perf_counter() - t0)), mip_rel_gap=mip_rel_gap)
        plain.status = f"{plain.status}; plain objective (no overlap plan found within the budget)"
        return plain
    return SolveResult(best, best_F, bound, gap, time.perf_counter() - t0,
                       f"best found ({method}; gap {gap:.2%} to the Lagrangian bound)", nz, m.A.shape[0], found)


def _plain_edges(problem):
    """Edge costs with the overlappable part paid in full (with lin + ovl_lin: compute + all comm)."""
    edges, oedges = problem[1], problem[2][1]
    out = dict(edges)
    for k, O in oedges.items():
        out[k] = out[k] + O if k in out else O
    return out


def _value(m: _Model, ch, mem_rows, mem_hi):
    """F of an integral choice (base + exposed overlappable time), None when it breaks the memory budget."""
    v = m.one_hot(ch)
    if mem_rows is not None and not np.all(mem_rows @ v <= mem_hi + 1e-6 * np.maximum(1.0, np.abs(mem_hi))):
        return None
    return float(m.cost @ v) + max(0.0, float(m.ovl @ v))


def _polish(choice, lin, edges, overlap, mem, passes: int = 8) -> list[int]:
    """Coordinate descent on F = base + max(0, ovl - capacity): each group in turn moves to the strategy that
    lowers F most with the others fixed (within every memory row), until a pass changes nothing."""
    olin, oedges, cap = overlap
    G, ch = len(lin), list(choice)
    adj = [[] for _ in range(G)]
    for key in set(edges) | set(oedges):
        a, b = key
        adj[a].append((b, edges.get(key), oedges.get(key), False))
        adj[b].append((a, edges.get(key), oedges.get(key), True))

    def vecs(g):
        base, ov = lin[g].copy(), olin[g] - cap[g]
        for o, C, O, transposed in adj[g]:
            if C is not None:
                base = base + (C[ch[o], :] if transposed else C[:, ch[o]])
            if O is not None:
                ov = ov + (O[ch[o], :] if transposed else O[:, ch[o]])
        return base, ov
    B = sum(float(lin[g][ch[g]]) for g in range(G)) + sum(
        float(C[ch[a], ch[b]]) for (a, b), C in edges.items())
    V = sum(float(olin[g][ch[g]] - cap[g][ch[g]]) for g in range(G)) + sum(
        float(O[ch[a], ch[b]]) for (a, b), O in oedges.items())
    used = [sum(float(c[g][ch[g]]) for g in range(G)) for c, _ in mem]
    for _ in range(passes):
        moved = False
        for g in range(G):
            if len(lin[g]) < 2:
                continue
            base, ov = vecs(g)
            Bn, Vn = B - base[ch[g]] + base, V - ov[ch[g]] + ov
            F = Bn + np.maximum(0.0, Vn)
            ok = np.ones(len(F), dtype=bool)
            for (c, budget), u in zip(mem, used):
                ok &= u - c[g][ch[g]] + c[g] <= budget * (1 + 1e-9)
            F = np.where(ok, F, np.inf)
            k = int(np.argmin(F))
            if F[k] < B + max(0.0, V) - 1e-12 * max(1.0, abs(B)):
                used = [u - c[g][ch[g]] + c[g][k] for (c, _), u in zip(mem, used)]
                B, V, ch[g], moved = float(Bn[k]), float(Vn[k]), k, True
        if not moved:
            break
    return ch


def _with_overlap_row(m: _Model, scale):
    """The constraint matrix with a column e and the row ovl(x)/scale - e <= 0."""
    from scipy.sparse import hstack, vstack
    nz = m.A.shape[1]
    A = hstack([m.A, coo_array((m.A.shape[0], 1))])
    row = coo_array((np.append(m.ovl / scale, -1.0), (np.zeros(nz + 1, dtype=np.int64), np.arange(nz + 1))),
                    shape=(1, nz + 1))
    return vstack([A, row]).tocsc()


_BANNER_SHOWN = False


def _highs():
    """A Highs instance; the first one of a process prints HiGHS's banner on the C level stdout: kept quiet."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return highspy.Highs()
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved), os.close(devnull)
    _BANNER_SHOWN = True
    return h


def _model(c, A, lo, hi, upper, time_limit):
    h = _highs()
    for k, v in (("output_flag", False), ("presolve", "off"), ("threads", 1), ("random_seed", 0),
                 ("time_limit", float(time_limit))):
        h.setOptionValue(k, v)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = c, np.zeros(A.shape[1]), upper
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    h.passModel(lp)
    return h


def _solution(h, n):
    """The primal solution when one was found (optimal, or feasible at the time limit), else None."""
    if h.getInfo().primal_solution_status != 2:           # kSolutionStatusFeasible
        return None
    return np.asarray(h.getSolution().col_value[:n])


def _integral(x, tol=1e-6) -> bool:
    return bool(np.all((x < tol) | (x > 1 - tol)))


def min_memory(mem_coefs: list[np.ndarray]) -> float:
    """The smallest value a memory row can take (groups are independent in it): sum of per-group minima."""
    return float(sum(c.min() for c in mem_coefs if len(c)))
