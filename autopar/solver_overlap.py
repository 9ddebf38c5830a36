"""The overlap objective of autopar/solver.py's MILP (plan(overlap=True)): min base(x) + max(0, ovl(x)), by a
Lagrangian search over LPs, a local search, and branch and bound on small models."""

from __future__ import annotations

import time

import numpy as np
import highspy
from scipy.sparse import coo_array

from .milp import SolveResult, _Model, _branch_and_bound, _choice, _model, _no_solution, _solution

# Up to this many variables, an overlap objective whose Lagrangian search leaves a gap is finished by branch and
# bound (seeded with the search's best plan); above it the search's plan is returned with its proven gap.
EXACT_OVERLAP_VARS = 20_000
LAMBDAS = (0.0, 0.5)  # the Lagrangian weights tried, in order (each one LP)


class _Search:
    """The Lagrangian search's running state: the HiGHS LP (costs scaled by `scale`), the best plan and its F,
    the best lower bound, the LPs run and the slowest one's seconds, every plan found (`candidates`)."""

    def __init__(self, m: _Model, time_limit):
        self.m, self.nz = m, m.A.shape[1]
        self.scale = max(float(np.abs(m.cost).max()), float(np.abs(m.ovl).max()), 1e-30)
        self.h = _model(m.cost / self.scale, m.A, m.lo, m.hi, m.upper, time_limit)
        self.idx = np.arange(self.nz, dtype=np.int32)
        self.best, self.best_F, self.bound, self.n_lp, self.slowest_lp = None, np.inf, -np.inf, 0, 0.0
        self.mem_rows = m.A[m.lo == -np.inf] if np.any(m.lo == -np.inf) else None
        self.mem_hi = m.hi[m.lo == -np.inf]
        self.candidates = []

    def value(self, ch):
        return _value(self.m, ch, self.mem_rows, self.mem_hi)

    def offer(self, ch) -> None:
        """A plan found: a candidate when it fits, the best when it is better."""
        F = self.value(ch)
        if F is not None:
            self.candidates.append(ch)
            if F < self.best_F - 1e-15:
                self.best, self.best_F = ch, F

    def gap_left(self) -> bool:
        return self.best_F - self.bound > 1e-4 * max(self.best_F, 1e-30)

    def lambdas(self, time_limit, t0, max_lps, lambda_search_s) -> None:
        """L(lam) = min_x base(x) + lam * ovl(x) for lam = 0 then the LAMBDAS, within max_lps and the time."""
        m, h, lam, tried = self.m, self.h, 0.0, []
        for _ in range(max_lps):
            if lam > 0:
                h.changeColsCost(self.nz, self.idx, (m.cost + lam * m.ovl) / self.scale)
                h.clearSolver()  # cold dual simplex: a warm start after a cost change can stall for minutes
            left = time_limit - (time.perf_counter() - t0)
            cap = left if self.n_lp == 0 else min(left, max(1.0, 5 * self.slowest_lp))  # a stalling lam: given up
            h.setOptionValue("time_limit", h.getRunTime() + max(cap, 0.01))  # HiGHS's clock runs across runs
            t_lp = time.perf_counter()
            h.run()
            self.slowest_lp = max(self.slowest_lp, time.perf_counter() - t_lp)
            self.n_lp += 1
            if self.n_lp > 1 and h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                break  # a degenerate lam that simplex cannot settle in time: keep what we have
            x = _solution(h, self.nz)
            if x is None:
                raise _no_solution(h.modelStatusToString(h.getModelStatus()), time_limit)
            self.bound = max(self.bound, float(h.getInfo().objective_function_value) * self.scale)
            self.offer(_choice(x, m.off))
            if not self.gap_left():
                break
            tried.append(lam)
            if float(m.ovl @ x) <= 0 or len(tried) >= len(LAMBDAS) or time.perf_counter() - t0 > lambda_search_s:
                break  # lam = 0 hides everything it exposes: larger lam only bound lower
            lam = LAMBDAS[len(tried)]

    def plain_and_polish(self, problem) -> None:
        """One more plan: every collective paid in full (the plain objective; good when little can hide); then a
        local search from each distinct plan found: one group at a time to its best strategy."""
        m, h = self.m, self.h
        h.changeColsCost(self.nz, self.idx, (m.cost + m.ovl + m.cap) / self.scale)
        h.clearSolver()
        h.setOptionValue("time_limit", h.getRunTime() + max(1.0, 5 * self.slowest_lp))
        h.run()
        self.n_lp += 1
        x = _solution(h, self.nz) if h.getModelStatus() == highspy.HighsModelStatus.kOptimal else None
        ch = None if x is None else _choice(x, m.off)
        if ch is not None and self.value(ch) is not None:
            self.candidates.append(ch)
        for ch in list({tuple(c): c for c in self.candidates}.values()):
            self.offer(_polish(ch, *problem))


def solve_overlap(m: _Model, problem, time_limit, mip_rel_gap, t0, max_lps, lambda_search_s) -> SolveResult | None:
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
    search = _Search(m, time_limit)
    search.lambdas(time_limit, t0, max_lps, lambda_search_s)
    if search.best is not None and search.gap_left():
        search.plain_and_polish(problem)
    best, best_F, bound, nz = search.best, search.best_F, search.bound, search.nz
    found = sorted({tuple(c): (search.value(c), list(c)) for c in search.candidates}.values(), key=lambda fc: fc[0])
    gap = (best_F - bound) / best_F if best is not None and best_F > 0 else 0.0
    method = f"Lagrangian search, {search.n_lp} LPs"
    if best is not None and gap <= 1e-4:
        return SolveResult(
            best, best_F, bound, max(gap, 0.0), time.perf_counter() - t0, f"optimal ({method})", nz, m.A.shape[0], found
        )
    left = time_limit - (time.perf_counter() - t0)
    if nz <= EXACT_OVERLAP_VARS and left > 1.0:
        exact = _exact(m, search.scale, best, bound, left, mip_rel_gap, method, t0)
        if exact is not None:
            return exact
    if best is None:  # every LP optimum rounded out of the budget: the caller solves the exact plain model
        return None
    return SolveResult(
        best,
        best_F,
        bound,
        gap,
        time.perf_counter() - t0,
        f"best found ({method}; gap {gap:.2%} to the Lagrangian bound)",
        nz,
        m.A.shape[0],
        found,
    )


def _exact(m: _Model, scale, best, bound, left, mip_rel_gap, method, t0):
    """Branch and bound on the exact model (a column e >= ovl, e >= 0), seeded with the search's best plan; None
    when it finds no plan in the time left."""
    e_col = m.A.shape[1]
    A2 = _with_overlap_row(m, scale)
    h2 = _model(
        np.append(m.cost, scale) / scale,
        A2,
        np.append(m.lo, -np.inf),
        np.append(m.hi, 0.0),
        np.append(m.upper, np.inf),
        left,
    )
    seed = None if best is None else np.append(m.one_hot(best), max(0.0, float(m.ovl @ m.one_hot(best))) / scale)
    x, h2 = _branch_and_bound(h2, m.nx, mip_rel_gap, seed)
    if x is None:
        return None
    info = h2.getInfo()
    status = h2.modelStatusToString(h2.getModelStatus())
    obj = float(info.objective_function_value) * scale
    return SolveResult(
        _choice(x[:e_col], m.off),
        obj,
        max(bound, float(info.mip_dual_bound) * scale),
        float(info.mip_gap),
        time.perf_counter() - t0,
        f"optimal (branch and bound after {method})" if status == "Optimal" else status,
        e_col + 1,
        A2.shape[0],
    )


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

    B = sum(float(lin[g][ch[g]]) for g in range(G)) + sum(float(C[ch[a], ch[b]]) for (a, b), C in edges.items())
    V = sum(float(olin[g][ch[g]] - cap[g][ch[g]]) for g in range(G)) + sum(
        float(O[ch[a], ch[b]]) for (a, b), O in oedges.items()
    )
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
    row = coo_array(
        (np.append(m.ovl / scale, -1.0), (np.zeros(nz + 1, dtype=np.int64), np.arange(nz + 1))), shape=(1, nz + 1)
    )
    return vstack([A, row]).tocsc()
