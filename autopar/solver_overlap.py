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
            h.clearSolver()  # cold dual simplex: a warm start after a cost change can stall for minutes
        left = time_limit - (time.perf_counter() - t0)
        cap = left if n_lp == 0 else min(left, max(1.0, 5 * slowest_lp))  # a stalling lam is given up on
        h.setOptionValue("time_limit", h.getRunTime() + max(cap, 0.01))  # HiGHS's clock runs across runs
        t_lp = time.perf_counter()
        h.run()
        slowest_lp = max(slowest_lp, time.perf_counter() - t_lp)
        n_lp += 1
        if n_lp > 1 and h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            break  # a degenerate lam that simplex cannot settle in time: keep what we have
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
            break  # lam = 0 hides everything it exposes: larger lam only bound lower
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
    found = sorted({tuple(c): (_value(m, c, mem_rows, mem_hi), list(c)) for c in cands}.values(), key=lambda fc: fc[0])
    gap = (best_F - bound) / best_F if best is not None and best_F > 0 else 0.0
    method = f"Lagrangian search, {n_lp} LPs"
    if best is not None and gap <= 1e-4:
        return SolveResult(
            best, best_F, bound, max(gap, 0.0), time.perf_counter() - t0, f"optimal ({method})", nz, m.A.shape[0], found
        )
    left = time_limit - (time.perf_counter() - t0)
    if nz <= EXACT_OVERLAP_VARS and left > 1.0:
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
        if x is not None:
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
