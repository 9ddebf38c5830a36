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
models otherwise leave the LP fractional and branch and bound runs for seconds. A fractional LP goes to a branch and
bound over its fractional groups, then (no binding memory row) to one over what reduced-cost fixing leaves
(autopar/solver_fixing.py), else to the full one (_fractional). Same inputs give the same model and the same answer
on every rank (HiGHS is deterministic, run single threaded).
"""

from __future__ import annotations

import time

import numpy as np
from scipy.sparse import coo_array

from . import dominance, solver_fixing
from .milp import (
    InfeasibleMemoryError,
    SolverTimeLimitError,
    SolveResult,
    _branch_and_bound,
    _choice,
    _integral,
    _Model,
    _model,
    _no_solution,
    _solution,
)
from .solver_overlap import LAMBDAS, _plain_edges, solve_overlap

__all__ = ["InfeasibleMemoryError", "SolverTimeLimitError", "SolveResult", "min_memory", "solve"]


def _classes(C: np.ndarray, axis: int):
    """Each distinct row (axis 0) or column (axis 1) of C's first index, in first-seen order, and each row's class."""
    M = np.ascontiguousarray(C if axis == 0 else C.T)
    seen: dict = {}
    inv = np.array([seen.setdefault(row.tobytes(), len(seen)) for row in M], dtype=np.int64)
    first = np.zeros(len(seen), dtype=np.int64)
    first[inv[::-1]] = np.arange(len(inv))[::-1]
    return first, inv


class _Rows:
    """The constraint matrix's entries, collected as arrays: row(cols, vals, lo, hi) appends one row."""

    def __init__(self):
        self.r, self.rows, self.cols, self.vals, self.lo, self.hi = 0, [], [], [], [], []

    def block(self, rows, cols, vals, n, lo, hi):
        """n rows at once: entries (rows relative to the first new row, cols, vals)."""
        self.rows.append(self.r + np.asarray(rows, np.int64))
        self.cols.append(np.asarray(cols, np.int64))
        self.vals.append(np.broadcast_to(np.asarray(vals, float), (len(self.cols[-1]),)))
        self.lo.append(np.full(n, lo, float))
        self.hi.append(np.full(n, hi, float))
        self.r += n

    def row(self, cols, vals, lo, hi):
        self.block(np.zeros(len(cols), np.int64), cols, vals, 1, lo, hi)

    def matrix(self, ncols):
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        A = coo_array(
            (cat(self.vals, float), (cat(self.rows, np.int64), cat(self.cols, np.int64))), shape=(self.r, ncols)
        ).tocsc()
        return A, cat(self.lo, float), cat(self.hi, float)


class _Builder:
    """The MILP's columns and rows as `_build` adds them: x (one per group strategy, columns off[g]:off[g+1]), then
    per edge with several classes on both sides its transportation variables z, then the bucket charges' (y, e) and
    the shared charges' y; `cost` / `ocost` collect each block's objective and overlap-row coefficients in column
    order."""

    def __init__(self, lin, overlap, n_fixed: int):
        self.lin = lin
        self.off = np.cumsum([0] + [len(c) for c in lin])
        self.nx = int(self.off[-1])
        self.cost = [np.concatenate(lin)]
        ovl_lin, self.ovl_edges, self.capacity = overlap if overlap is not None else (None, {}, None)
        self.has_overlap = overlap is not None
        self.ocost = (
            [np.concatenate(ovl_lin) - np.concatenate(self.capacity)] if self.has_overlap else [np.zeros(self.nx)]
        )
        self.rows = _Rows()
        sizes = np.diff(self.off)  # one strategy per group
        self.rows.block(np.repeat(np.arange(len(lin)), sizes), np.arange(self.nx), 1.0, len(lin), 1.0, 1.0)
        self.nz, self.zs = self.nx, []
        self.trig_cols = [{} for _ in range(n_fixed)]  # per bucket charge: {column joining it: weight}
        self.where_x: dict = {}  # edge -> how its pairs are columns: ("z", ...) or ("x", ...)

    def join(self, s, cols, w) -> None:
        for c, x in zip(cols, w):
            self.trig_cols[s][int(c)] = self.trig_cols[s].get(int(c), 0.0) + float(x)

    def bucket_triggers(self, fixed) -> dict:
        """Edge -> [(bucket charge, weights of the choices joining it)]; a charge's choices inside one group join
        it directly."""
        trig: dict = {}
        for s, (_, where) in enumerate(fixed):
            for (g1, g2), W in where:
                if g1 == g2:  # inside one group: its own choices
                    k = np.flatnonzero(np.diag(W) > 0)
                    self.join(s, self.off[g1] + k, np.diag(W)[k])
                else:
                    trig.setdefault((g1, g2), []).append((s, W))
        return trig

    def edge(self, key, C, Ts, Ws) -> None:
        """One edge's price matrix C (and overlappable part): on the x columns of the side with several classes when
        the other side has one, else as transportation variables z over the (producer class, consumer class)
        pairs with their two marginal rows. Ts: bucket charges joined on it; Ws: shared charges' weights."""
        g1, g2 = key
        off, lin = self.off, self.lin
        O = self.ovl_edges.get(key)
        C = np.zeros((len(lin[g1]), len(lin[g2]))) if C is None and O is None else C
        C = np.zeros_like(O) if C is None else C
        O = np.zeros_like(C) if O is None else O
        fa, a_of = _classes(np.hstack([C, O] + [T for _, T in Ts] + Ws), 0)  # distinct producer rows
        fb, b_of = _classes(np.vstack([C, O] + [T for _, T in Ts] + Ws), 1)  # distinct consumer columns
        A, B = len(fa), len(fb)
        small, osmall = C[np.ix_(fa, fb)], O[np.ix_(fa, fb)]
        if A == 1 or B == 1:
            g = g2 if A == 1 else g1
            self.where_x[key] = ("x", g)
            row = (lambda M: M[0][b_of]) if A == 1 else (lambda M: M[:, 0][a_of])
            self.cost[0][off[g] : off[g + 1]] += row(small)
            self.ocost[0][off[g] : off[g + 1]] += row(osmall)
            for s, W in Ts:
                w = W[0] if A == 1 else W[:, 0]
                k = np.flatnonzero(w > 0)
                self.join(s, off[g] + k, w[k])
            return
        z0 = self.nz
        self.nz += A * B
        self.zs.append((z0, A, B, a_of, b_of, g1, g2))
        self.where_x[key] = ("z", z0, B, fa, fb, a_of)
        for s, W in Ts:
            Wc = W[np.ix_(fa, fb)]
            ab = np.argwhere(Wc > 0)
            self.join(s, z0 + ab[:, 0] * B + ab[:, 1], Wc[ab[:, 0], ab[:, 1]])
        self.cost.append(small.reshape(-1))
        self.ocost.append(osmall.reshape(-1))
        za, zb = np.divmod(np.arange(A * B), B)
        ka, kb = np.arange(len(a_of)), np.arange(len(b_of))
        # sum_b z[a, b] = sum_{k in a} x[g1, k]; then sum_a z[a, b] = sum_{k in b} x[g2, k]
        self.rows.block(
            np.concatenate([za, a_of]),
            np.concatenate([z0 + za * B + zb, off[g1] + ka]),
            np.concatenate([np.ones(A * B), -np.ones(len(ka))]),
            A,
            0.0,
            0.0,
        )
        self.rows.block(
            np.concatenate([zb, b_of]),
            np.concatenate([z0 + za * B + zb, off[g2] + kb]),
            np.concatenate([np.ones(A * B), -np.ones(len(kb))]),
            B,
            0.0,
            0.0,
        )

    def bucket_charges(self, fixed) -> list:
        """y >= each column joining; e >= sum w col - y; F (y + e). [(y, e, columns, weights)] per charge joined."""
        ys = []
        for s, (F, _) in enumerate(fixed):
            cols_s = np.array(sorted(self.trig_cols[s]), np.int64)
            if not len(cols_s):
                continue
            w = np.array([self.trig_cols[s][c] for c in cols_s])
            y, e = self.nz, self.nz + 1
            self.nz += 2
            ys.append((y, e, cols_s, w))
            self.cost.append(np.array([F, F]))
            self.ocost.append(np.zeros(2))
            n = len(cols_s)
            self.rows.block(
                np.repeat(np.arange(n), 2),
                np.column_stack([np.full(n, y), cols_s]).reshape(-1),
                np.tile([1.0, -1.0], n),
                n,
                0.0,
                np.inf,
            )
            self.rows.row(np.concatenate([[y, e], cols_s]), np.concatenate([[1.0, 1.0], -w]), 0.0, np.inf)
        return ys

    def shared_charge(self, F, where) -> tuple:
        """y >= each consumer edge's W-weighted columns; F y. (y, parts, (producer choices, classes) or None)."""
        off, lin = self.off, self.lin
        y = self.nz
        self.nz += 1
        parts, grps = [], []
        unit = max(max(float(np.abs(W).max()) for _, W in where), 1e-300)  # y in units of the largest price:
        for (g1, g2), W in where:  # matrix entries of order 1
            W = np.asarray(W, float) / unit
            n1 = len(lin[g1])
            if g1 == g2:  # the group's own choices
                k = np.flatnonzero(np.diag(W))
                part, w, ks, grp = off[g1] + k, np.diag(W)[k], k, None
            elif self.where_x[(g1, g2)][0] == "x":  # one side has a single class
                g = self.where_x[(g1, g2)][1]
                w = W[0, :] if g == g2 else W[:, 0]
                k = np.flatnonzero(w)
                part, w = off[g] + k, w[k]
                ks, grp = (np.zeros(len(k), np.int64), np.zeros(n1, np.int64)) if g == g2 else (k, None)
            else:  # W is constant on each (producer, consumer) class block
                _, z0, B, fa, fb, a_of = self.where_x[(g1, g2)]
                Wc = W[np.ix_(fa, fb)]
                ab = np.argwhere(Wc != 0)
                part, w = z0 + ab[:, 0] * B + ab[:, 1], Wc[ab[:, 0], ab[:, 1]]
                ks, grp = fa[ab[:, 0]], a_of
            if not len(part):
                continue
            parts.append((part, w, ks))
            grps.append(grp)
            self.rows.row(np.concatenate([[y], part]), np.concatenate([[1.0], -w]), 0.0, np.inf)
        one = len(parts) > 1 and len({k[0] for k, _ in where}) == 1  # one producer: a cut can tighten it
        self.cost.append(np.array([F * unit]))
        self.ocost.append(np.zeros(1))
        return (y, parts, (len(lin[where[0][0][0]]), grps) if one else None)

    def model(self, mem, ys, sh) -> _Model:
        for coefs, budget in mem:
            vec = np.concatenate(coefs)
            idx = np.flatnonzero(vec)
            self.rows.row(idx, vec[idx], -np.inf, budget)
        A_, lo, hi = self.rows.matrix(self.nz)
        cap = np.zeros(self.nz)
        if self.has_overlap:
            cap[: self.nx] = np.concatenate(self.capacity)
        return _Model(A_, lo, hi, np.concatenate(self.cost), np.concatenate(self.ocost), self.off, self.zs, cap, ys, sh)


def _build(lin, edges, mem, overlap, fixed=(), shared=()) -> _Model:
    build = _Builder(lin, overlap, len(fixed))
    trig = build.bucket_triggers(fixed)
    weights: dict = {}  # edge -> the W of the shared charges on it
    for _, where in shared:
        for (g1, g2), W in where:
            if g1 != g2:
                weights.setdefault((g1, g2), []).append(np.asarray(W, float))
    for key in sorted(set(edges) | set(build.ovl_edges) | set(trig) | set(weights)):
        build.edge(key, edges.get(key), trig.get(key, []), weights.get(key, []))
    ys = build.bucket_charges(fixed)
    sh = [build.shared_charge(F, where) for F, where in shared]
    return build.model(mem, ys, sh)


def _joined_classes(n, grps):
    """Classes of a charge's n producer choices that no consumer edge's columns straddle (the join of the edges'
    producer classes; grps: per edge its class per choice, None where each choice is its own column)."""
    from scipy.sparse.csgraph import connected_components

    src = [np.arange(n)]
    dst = [np.arange(n)]
    for grp in grps:
        if grp is None:
            continue
        _, first, inv = np.unique(grp, return_index=True, return_inverse=True)
        src.append(np.arange(n))
        dst.append(first[inv])
    a, b = np.concatenate(src), np.concatenate(dst)
    return connected_components(coo_array((np.ones(len(a)), (a, b)), shape=(n, n)), directed=False)[1]


def _shared_cuts(m: _Model, x, tol=1e-9):
    """Cuts for the shared charges the LP solution x underprices. A charge max_e S_e (S_e: consumer edge e's
    weighted columns) is, for a one-hot plan, sum over producer classes c of max_e S_e(c) (only the producer's
    class is nonzero), so y >= sum_c S_{e(c)}(c) holds for every choice e(c) of one edge per class; the LP's max
    of sums is weaker (a producer split between classes pays the max of averages). Returns (rows: [(columns,
    coefficients)]) of the most violated such cut per charge."""
    out = []
    frac = (x > 1e-6) & (x < 1 - 1e-6)
    for y, parts, classes in m.shared:
        if classes is None or not any(frac[c].any() for c, _, _ in parts):
            continue  # integral columns: the producer's mass is in one class, nothing to cut
        labels = _joined_classes(*classes)
        parts = [(c, w, labels[ks]) for c, w, ks in parts]
        nc = 1 + int(labels.max())
        per = np.array([np.bincount(lab, weights=w * x[c], minlength=nc) for c, w, lab in parts])
        best = per.argmax(axis=0)
        if per.max(axis=0).sum() <= x[y] + tol:
            continue
        cs, ws = [np.array([y])], [np.array([1.0])]
        for e, (c, w, lab) in enumerate(parts):
            sel = best[lab] == e
            cs.append(c[sel])
            ws.append(-w[sel])
        out.append((np.concatenate(cs), np.concatenate(ws)))
    return out


def _add_cuts(h, m: _Model, cuts) -> None:
    """Add rows 0 <= coefficients . columns to the HiGHS instance and to the model (so later instances have them)."""
    from scipy.sparse import vstack

    starts = np.cumsum([0] + [len(c) for c, _ in cuts])[:-1].astype(np.int32)
    idx = np.concatenate([c for c, _ in cuts]).astype(np.int32)
    val = np.concatenate([w for _, w in cuts])
    n = len(cuts)
    h.addRows(n, np.zeros(n), np.full(n, np.inf), len(idx), starts, idx, val)
    rows = np.repeat(np.arange(n), [len(c) for c, _ in cuts])
    m.A = vstack([m.A, coo_array((val, (rows, idx)), shape=(n, m.A.shape[1]))]).tocsc()
    m.lo, m.hi = np.append(m.lo, np.zeros(n)), np.append(m.hi, np.full(n, np.inf))


def solve(
    lin: list[np.ndarray],
    edges: dict[tuple[int, int], np.ndarray],
    mem: list[tuple[list[np.ndarray], float]],
    time_limit: float = 60.0,
    mip_rel_gap: float = 1e-6,
    overlap=None,
    max_lps: int | None = None,
    lambda_search_s: float = float("inf"),
    fixed=(),
    shared=(),
    reduce: bool = True,
) -> SolveResult:
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
    back = lambda ch: [int(k[c]) for k, c in zip(keep, ch)]  # noqa: E731
    res.choice = back(res.choice)
    if res.candidates is not None:
        res.candidates = [(F, back(ch)) for F, ch in res.candidates]
    res.seconds = time.perf_counter() - t0
    return res


def _solve(lin, edges, mem, time_limit, mip_rel_gap, overlap, max_lps, lambda_search_s, fixed, shared, t0):
    m = _build(lin, edges, mem, overlap, fixed, shared)
    if overlap is not None:
        res = solve_overlap(
            m, (lin, edges, overlap, mem), time_limit, mip_rel_gap, t0, max_lps or len(LAMBDAS), lambda_search_s
        )
        return res if res is not None else _plain_fallback(lin, edges, overlap, mem, time_limit, mip_rel_gap, t0)
    scale = max(float(np.abs(m.cost).max()), 1e-30)
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, time_limit)
    # The LP relaxation is a lower bound; when its optimum is integral it is the MILP optimum (gap 0). This is
    # the common case for placement problems and several times faster than branch-and-bound's set-up (dual
    # simplex without presolve measured fastest on the 8B plan: 0.35 s vs 0.9 s with presolve, 3 s with IPM);
    # otherwise the model is solved again, in a fresh HiGHS instance, with integral placement variables.
    h.run()
    x = _solution(h, m.A.shape[1])
    for _ in range(CUT_ROUNDS):  # a fractional LP: tighten the shared charges it underprices, warm started
        cuts = [] if x is None or _integral(x[: m.nx]) else _shared_cuts(m, x)
        if not cuts:
            break
        _add_cuts(h, m, cuts)
        h.run()
        x = _solution(h, m.A.shape[1])
    method, choice = "LP relaxation (integral)", None
    lp_bound = float(h.getInfo().objective_function_value) * scale if x is not None else None
    if x is not None and not _integral(x[: m.nx]):
        problem = (lin, edges, mem, fixed, shared)
        h, x, choice, method = _fractional(h, m, x, scale, lp_bound, mip_rel_gap, time_limit, t0, problem)
    status = h.modelStatusToString(h.getModelStatus())
    if x is None:
        raise _no_solution(status, time_limit)
    choice = _choice(x, m.off) if choice is None else choice
    info = h.getInfo()
    obj = float(info.objective_function_value) * scale
    if method.startswith("branch and bound"):
        bound, gap = float(info.mip_dual_bound) * scale, float(info.mip_gap)
    else:  # the LP relaxation's optimum bounds every plan (equal to obj when it was integral)
        bound = lp_bound
        gap = max(0.0, (obj - bound) / max(abs(obj), 1e-30))
    return SolveResult(
        choice,
        obj,
        bound,
        gap,
        time.perf_counter() - t0,
        (f"optimal within {mip_rel_gap:g} relative gap ({method})" if gap > 1e-9 else f"optimal ({method})")
        if status == "Optimal"
        else status,
        m.A.shape[1],
        m.A.shape[0],
    )


def _fractional(h, m: _Model, x, scale, lp_bound, mip_rel_gap, time_limit, t0, problem):
    """(solved instance, its column vector, the choice where it is not m's, method) for an LP relaxation `h` left
    fractional at x. First the groups the LP left fractional, solved as a MILP with every other group fixed at
    its LP choice (a small problem): when that plan is within the gap of the LP bound it is proven optimal (within
    the gap) and the full branch and bound (seconds of root cuts on the 8B plan) is skipped. Else, with no memory
    row that can bind, the branch and bound over what reduced-cost fixing against that plan leaves
    (autopar/solver_fixing.py); else the full branch and bound. With a binding memory row the restricted plan (the
    knapsack's 1-2 fractional groups re-chosen) was 0.3-1.6% above the optimum on the scale plans, and HiGHS seeded
    with it or on the fixed model stopped at other plans within the gap (llama3-405b 2048x8 h100): kept as it was."""
    left = lambda: max(1.0, time_limit - (time.perf_counter() - t0))  # noqa: E731
    restricted = _restricted(m, x, scale, mip_rel_gap, left())
    if restricted is not None and restricted[1] <= lp_bound * (1 + mip_rel_gap) + 1e-15:
        return restricted[2], restricted[0], None, "LP relaxation, fractional groups by branch and bound"
    if restricted is not None and not solver_fixing.memory_binds(problem[2]):
        incumbent = _choice(restricted[0], m.off)
        L, d = solver_fixing.reduced_costs(h)
        keep = solver_fixing.fixed_keep(m, L, d, restricted[1] / scale, incumbent)
        if keep is not None:
            out = solver_fixing.branch_on_fixed(problem, keep, incumbent, scale, mip_rel_gap, left(), _build)
            if out is not None:
                return (*out, "branch and bound after reduced-cost fixing")
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, left())
    x, h = _branch_and_bound(h, m.nx, mip_rel_gap)  # unseeded: seeded, HiGHS returned stale vectors
    return h, x, None, "branch and bound"


def _plain_fallback(lin, edges, overlap, mem, time_limit, mip_rel_gap, t0) -> SolveResult:
    """Every LP optimum of the overlap search rounded out of the budget: the exact plain model (all comm paid)."""
    plain = solve(
        [c + o for c, o in zip(lin, overlap[0])],
        _plain_edges((lin, edges, overlap, mem)),
        mem,
        time_limit=max(1.0, time_limit - (time.perf_counter() - t0)),
        mip_rel_gap=mip_rel_gap,
    )
    plain.status = f"{plain.status}; plain objective (no overlap plan found within the budget)"
    return plain


CUT_ROUNDS = 10  # rounds of shared-charge cuts on a fractional LP relaxation


def _restricted(m: _Model, x, scale, mip_rel_gap, time_limit):
    """(column vector, objective, solved instance) of the best plan that keeps every group the LP solution `x`
    left integral at its LP choice (branch and bound over the fractional groups only); None if infeasible."""
    lo, hi = np.zeros(m.nx), np.ones(m.nx)
    for g in range(len(m.off) - 1):
        seg = x[m.off[g] : m.off[g + 1]]
        if _integral(seg):
            lo[m.off[g] : m.off[g + 1]] = hi[m.off[g] : m.off[g + 1]] = np.round(seg)
    h = _model(m.cost / scale, m.A, m.lo, m.hi, m.upper, time_limit)
    h.changeColsBounds(m.nx, np.arange(m.nx, dtype=np.int32), lo, hi)
    xr, h = _branch_and_bound(h, m.nx, mip_rel_gap)
    if xr is None or h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return None
    return xr, float(h.getInfo().objective_function_value) * scale, h


def min_memory(mem_coefs: list[np.ndarray]) -> float:
    """The smallest value a memory row can take (groups are independent in it): sum of per-group minima."""
    return float(sum(c.min() for c in mem_coefs if len(c)))
