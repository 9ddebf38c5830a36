"""The MILP as HiGHS sees it, shared by the plain solve (autopar/solver.py) and the overlap search
(autopar/solver_overlap.py): the model's arrays, a quiet single-threaded HiGHS instance, branch and bound, reading
a solution back, and the results and errors of a solve."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import highspy
import numpy as np


class InfeasibleMemoryError(ValueError):
    """No plan fits the memory budget; the message states the smallest achievable peak (`smallest_bytes`, per
    rank, where the raiser knows it) and, from autopar.plan, what would fit (`fixes`, autopar/feasibility.py)."""

    fixes: tuple = ()

    def __init__(self, *args, smallest_bytes: float | None = None):
        super().__init__(*args)
        self.smallest_bytes = smallest_bytes


class SolverTimeLimitError(RuntimeError):
    """The solver stopped at `time_limit` before it found any plan (not a sign that none fits)."""


def _no_solution(status: str, time_limit: float):
    """The error for a solve that returned no plan: out of time, or infeasible (the memory rows)."""
    if "infeasible" in status.lower():
        return InfeasibleMemoryError(f"the placement model has no solution ({status})")
    return SolverTimeLimitError(
        f"the solver found no plan within time_limit={time_limit:g} s (HiGHS: {status}); "
        f"raise autopar.plan(time_limit=...)"
    )


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
    candidates: list = None  # other plans found on the way, [(objective, choice)] best first (overlap search)


@dataclass
class _Model:
    """The MILP's arrays: x (one-hot strategy per group) then z (transportation variables per edge)."""

    A: object  # constraint matrix (csc)
    lo: np.ndarray
    hi: np.ndarray
    cost: np.ndarray  # objective per variable (seconds)
    ovl: np.ndarray  # overlap row per variable: overlappable comm - capacity (seconds)
    off: np.ndarray  # group g's x variables: off[g]:off[g+1]
    edges: list  # (z0, A, B, a_of, b_of, g1, g2) per edge with transportation variables
    cap: np.ndarray  # the compute capacity part of ovl, per variable (x only)
    fixed: list = ()  # (y column, e column, columns that join it, their weights) per bucket charge
    shared: list = ()  # per shared charge: (y column, [(columns, weights, their producer choices) per consumer
    #                            edge], (number of producer choices, the edges' producer classes) or None)

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
        for y, parts, _ in self.shared:
            v[y] = max((float(w @ v[c]) for c, w, _ in parts), default=0.0)  # no parts: a charge nothing joins
        return v


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
    return [int(np.argmax(x[off[i] : off[i + 1]])) for i in range(len(off) - 1)]


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
    for k, v in (
        ("output_flag", False),
        ("presolve", "off"),
        ("threads", 1),
        ("random_seed", 0),
        ("time_limit", float(time_limit)),
    ):
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
    if h.getInfo().primal_solution_status != 2:  # kSolutionStatusFeasible
        return None
    return np.asarray(h.getSolution().col_value[:n])


def _integral(x, tol=1e-6) -> bool:
    return bool(np.all((x < tol) | (x > 1 - tol)))
