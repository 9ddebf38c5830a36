"""Dominance reduction (autopar/dominance.py): it drops exactly strategies that can never be needed, the solver's
optimum is the same with and without it, and on llama-tiny's 2x2 plan (examples/train.py's configuration) it is
what makes the LP relaxation integral (no branch and bound)."""

import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

import autopar
from autopar import dominance
from autopar.solver import solve


@st.composite
def planted(draw):
    """A random problem with bucket and shared charges where some strategies are copies of another one made no
    better in every term (cost, memory, edge rows/columns, charge weights): those must be dropped."""
    n = draw(st.integers(2, 4))
    K = [draw(st.integers(1, 3)) for _ in range(n)]
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lin = [rng.uniform(0, 10, k) for k in K]
    mem = [rng.uniform(0, 5, k) for k in K]
    edges = {
        (a, b): rng.uniform(0, 10, (K[a], K[b])) for a, b in itertools.combinations(range(n), 2) if rng.random() < 0.7
    }
    shared = (
        [(0.5, [(key, (rng.random(C.shape) < 0.5) * rng.uniform(0, 3, C.shape)) for key, C in list(edges.items())[:2]])]
        if edges
        else []
    )
    fixed = [(0.3, [((0, 0), np.diag(rng.uniform(0, 1, K[0])))])]
    copies = []  # (group, index of the worse copy)
    for g in range(n):
        if rng.random() < 0.6:
            src, k = int(rng.integers(K[g])), K[g]
            lin[g] = np.append(lin[g], lin[g][src] + rng.uniform(0, 1))
            mem[g] = np.append(mem[g], mem[g][src] + rng.uniform(0, 1) * (rng.random() < 0.5))
            for key, C in list(edges.items()):
                if key[0] == g:
                    edges[key] = np.vstack([C, C[src] + rng.uniform(0, 1, C.shape[1])])
                elif key[1] == g:
                    edges[key] = np.hstack([C, C[:, src : src + 1] + rng.uniform(0, 1, (C.shape[0], 1))])
            for _, where in shared:
                for i, (key, W) in enumerate(where):
                    if key[0] == g:
                        where[i] = (key, np.vstack([W, W[src]]))
                    elif key[1] == g:
                        where[i] = (key, np.hstack([W, W[:, src : src + 1]]))
            if g == 0:
                d = np.diag(fixed[0][1][0][1])
                fixed = [(0.3, [((0, 0), np.diag(np.append(d, d[src])))])]
            K[g] += 1
            copies.append((g, k))
    budget = float(sum(m.min() for m in mem) + 0.5 * sum(m.max() - m.min() for m in mem))
    return lin, edges, [(mem, budget)], fixed, shared, copies


@settings(max_examples=60, deadline=None)
@given(planted())
def test_dominated_copies_dropped_and_optimum_kept(p):
    lin, edges, mem, fixed, shared, copies = p
    keep = dominance.reduce(lin, edges, mem, None, fixed, shared)
    for g, k in copies:
        assert keep is not None and k not in keep[g], f"group {g}: the worse copy {k} was kept ({keep[g]})"
    full = solve(lin, edges, mem, fixed=fixed, shared=shared, reduce=False, mip_rel_gap=0.0)
    red = solve(lin, edges, mem, fixed=fixed, shared=shared, mip_rel_gap=0.0)
    assert abs(red.objective - full.objective) <= 1e-9 * max(1.0, abs(full.objective))
    assert all(keep is None or c in keep[g] for g, c in enumerate(red.choice))  # mapped back to the originals


def test_equal_strategies_keep_the_first():
    lin = [np.array([1.0, 1.0, 2.0]), np.array([0.0, 0.0])]
    edges = {(0, 1): np.array([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]])}
    keep = dominance.reduce(lin, edges, [([np.zeros(3), np.array([1.0, 0.0])], 10.0)])
    assert [list(k) for k in keep] == [[0, 2], [0, 1]]  # 1 equals 0; 2 is cheaper on the edge, dearer alone


def test_llama_tiny_train_config_lp_is_integral():
    """examples/train.py's llama-tiny 2x2 plan (cpu-gloo, fsdp+tp pinned): without the reduction its LP relaxation
    is fractional and branch and bound runs (seconds of presolve and root cuts); dominance leaves fewer than half
    of the candidate strategies and an integral LP."""
    from autopar.testing import fsdp_tp_force
    from autopar.models import build_model, example_inputs

    model = build_model("llama-tiny", device="cpu")
    plan, state = autopar.plan(
        model,
        (2, 2),
        example_inputs("llama-tiny"),
        cluster="cpu-gloo",
        force=fsdp_tp_force(model, (2, 2)),
        return_state=True,
    )
    assert plan.solver["status"] == "optimal (LP relaxation (integral))", plan.solver["status"]
    from autopar.passes.solve import objective

    lin, edges, _, fixed, shared = objective(state.cost, False)
    mem = [([state.cost["state_mem"][i] + state.cost["act_mem"][i] for i in range(len(lin))], state.budget)]
    keep = dominance.reduce(lin, edges, mem, None, fixed, shared)
    assert sum(map(len, keep)) < 0.5 * sum(map(len, lin))


def _dominated_by_definition(M):
    """Row i is dropped when some row j is <= it in every column (the module's tolerance) and is strictly better
    somewhere or equal and listed first: every pair, every column."""
    n = len(M)
    tol = dominance._TOL * np.maximum(1.0, np.abs(M).max(axis=0))
    le = np.all(M[:, None, :] <= M[None, :, :] + tol, axis=2)
    np.fill_diagonal(le, False)
    first = np.arange(n)[:, None] < np.arange(n)[None, :]
    return ~(le & (~(le & le.T) | first)).any(axis=0)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 90), st.integers(1, 300), st.integers(0, 2**31), st.sampled_from(["copies", "noise", "plain"]))
def test_undominated_keeps_exactly_the_rows_the_definition_keeps(n, cols, seed, kind):
    """The pairwise test (bit-identical rows dropped first above _DEDUP_MIN rows, column chunks that widen as pairs
    die, columns read in an interleaved order) keeps the same rows as the definition: few distinct values so many
    pairs tie or dominate, planted copies, and rows equal up to the tolerance."""
    rng = np.random.default_rng(seed)
    M = rng.integers(0, 3, size=(n, cols)).astype(float) * rng.uniform(0.5, 2.0, cols)
    if kind == "copies":
        M[rng.integers(0, n, n // 2)] = M[rng.integers(0, n)]
    elif kind == "noise":
        M = M + rng.normal(0, 1e-14, M.shape)
    assert (dominance._undominated(M) == _dominated_by_definition(M)).all()
