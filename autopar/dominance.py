"""Dominance reduction of a placement problem before the MILP (autopar/solver.py).

Strategy j of a decision group dominates its strategy i when every term of the objective and of every constraint
that the group's choice enters is no larger with j than with i, whatever the other groups choose: its own cost,
its memory coefficients, its row (as producer) or column (as consumer) of every edge matrix, and its weights in
every bucket or shared charge (both are nondecreasing in their weights). Replacing i by j in any plan then keeps
it feasible and no worse, so i can be dropped with no loss of optimality. Of strategies equal in every term, the
first is kept (deterministic). Dropping strategies of one group shrinks its neighbours' edge rows, which can
make more of theirs dominated; the reduction repeats until nothing changes.

Why it matters: candidate enumeration on a 2-D mesh offers many strategies per op that differ only in ways no
cost term sees, or are beaten everywhere (e.g. a partial placement whose every redistribute costs more). They
leave the LP relaxation with fractional mixes of near-equal columns, and branch and bound then spends seconds
(presolve and root cuts on ~50k columns) proving what one dominance check settles: llama-tiny on a 2x2 mesh with
the cpu-gloo preset and fsdp+tp pinned went from branch and bound (5-10 s) to an integral LP (~1 s).
"""

from __future__ import annotations

import numpy as np

_TOL = 1e-12  # relative to each block's largest magnitude: equal up to rounding counts as equal


def _undominated(M: np.ndarray) -> np.ndarray:
    """Mask of the rows of M (strategies x every term they enter) to keep: row j <= row i everywhere (up to a
    tolerance relative to each column's magnitude) means j dominates i. Rows equal bit for bit to an earlier
    one are dropped first (many strategies differ in no term), then the distinct rows are compared pairwise."""
    n = len(M)
    if n <= _DEDUP_MIN:
        return _pairwise(M)
    rows = np.ascontiguousarray(M).view(np.dtype((np.void, M.dtype.itemsize * M.shape[1]))).ravel()
    _, first = np.unique(rows, return_index=True)
    first.sort()
    keep = np.zeros(n, dtype=bool)
    keep[first[_pairwise(M[first])]] = True
    return keep


def _pairwise(M: np.ndarray) -> np.ndarray:
    """_undominated's mask over distinct rows."""
    n, cols = M.shape
    # the own terms first, then the others interleaved (a golden-ratio stride): the terms that tell two strategies
    # apart cluster in a few neighbours' blocks, so sampling every block early rules pairs out soonest
    head = min(_CHUNK, cols)
    order = np.argsort((np.arange(cols - head) * _GOLDEN) % 1.0, kind="stable") + head
    M = M[:, np.concatenate([np.arange(head), order])]
    tol = _TOL * np.maximum(1.0, np.abs(M).max(axis=0))
    J, I = np.nonzero(~np.eye(n, dtype=bool))  # candidate pairs: j may dominate i
    c = 0
    while c < cols and len(J):  # a few columns rule out most pairs; the survivors take wider chunks
        w = max(_CHUNK, _PAIR_ELEMS // len(J))
        S, t = M[:, c : c + w], tol[c : c + w]
        ok = np.all(S[J] <= S[I] + t, axis=1)
        J, I, c = J[ok], I[ok], c + w
    if not len(J):
        return np.ones(n, dtype=bool)
    le = np.zeros((n, n), dtype=bool)
    le[J, I] = True
    eq = le & le.T
    idx = np.arange(n)
    dom = le & (~eq | (idx[:, None] < idx[None, :]))  # strictly better somewhere, or equal and listed first
    return ~dom.any(axis=0)


_CHUNK = 16
_GOLDEN = (5**0.5 - 1) / 2
_DEDUP_MIN = 32  # below this the pairwise test is cheaper than sorting the rows
_PAIR_ELEMS = 1 << 18  # elements of one pair-chunk test (pairs x columns): bounds the temporaries, not the result


def _terms(lin, edges, mem, overlap, fixed, shared):
    """Per group: its own vectors (cost, memory rows...) and [(matrix, other group, transposed)] of the matrices
    its choice indexes (edges; bucket and shared charge weights, a diagonal one as a vector)."""
    G = len(lin)
    own = [[np.asarray(lin[g], dtype=float)] for g in range(G)]
    mats = [[] for _ in range(G)]
    if overlap is not None:  # the overlap objective's exposed part, and olin alone for its plain one
        olin, oedges, cap = overlap
        for g in range(G):
            own[g] += [np.asarray(olin[g], float) - np.asarray(cap[g], float), np.asarray(olin[g], float)]
    for coefs, _ in mem:
        for g in range(G):
            own[g].append(np.asarray(coefs[g], dtype=float))
    pairs = list(edges.items()) + (list(overlap[1].items()) if overlap is not None else [])
    pairs += [(key, W) for _, where in list(fixed) + list(shared) for key, W in where]
    for (g1, g2), W in pairs:
        W = np.asarray(W, dtype=float)
        if g1 == g2:
            own[g1].append(np.diag(W).copy())
        else:
            mats[g1].append((W, g2, False))
            mats[g2].append((W, g1, True))
    return own, mats


def reduce(lin, edges, mem, overlap=None, fixed=(), shared=(), rounds: int = 8):
    """The strategies kept per group (sorted original indices), or None when nothing is dominated."""
    G = len(lin)
    keep = [np.arange(len(c)) for c in lin]
    own, mats = _terms(lin, edges, mem, overlap, fixed, shared)
    dirty = set(range(G))
    for _ in range(rounds):
        changed = set()
        for g in sorted(dirty):
            k = keep[g]
            if len(k) < 2:
                continue
            cols = [v[k, None] for v in own[g]]
            cols += [(_sub(W, keep[o], k).T if tr else _sub(W, k, keep[o])) for W, o, tr in mats[g]]
            M = np.hstack(cols)
            M = M[:, np.any(M != M[:1], axis=0)]  # a term equal for all strategies decides nothing
            alive = _undominated(M) if M.shape[1] else np.arange(len(k)) == 0
            if not alive.all():
                keep[g] = k[alive]
                changed.add(g)
        if not changed:
            break
        dirty = {o for g in changed for _, o, _ in mats[g]}  # only a shrunk group's neighbours can change
    if all(len(k) == len(c) for k, c in zip(keep, lin)):
        return None
    return keep


def _sub(W: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """W[rows][:, cols] (sorted index arrays), skipping an axis the indices cover whole."""
    if len(rows) < W.shape[0]:
        W = W[rows]
    return W[:, cols] if len(cols) < W.shape[1] else W


def restrict(keep, lin, edges, mem, overlap=None, fixed=(), shared=()):
    """The problem with only the kept strategies (same argument shapes as autopar.solver.solve's)."""

    def ix(W, g1, g2):
        W = np.asarray(W, dtype=float)
        return np.diag(np.diag(W)[keep[g1]]) if g1 == g2 else W[np.ix_(keep[g1], keep[g2])]

    lin2 = [np.asarray(c)[k] for c, k in zip(lin, keep)]
    edges2 = {(a, b): ix(C, a, b) for (a, b), C in edges.items()}
    mem2 = [([np.asarray(c)[k] for c, k in zip(coefs, keep)], budget) for coefs, budget in mem]
    if overlap is not None:
        olin, oedges, cap = overlap
        overlap = (
            [np.asarray(c)[k] for c, k in zip(olin, keep)],
            {(a, b): ix(O, a, b) for (a, b), O in oedges.items()},
            [np.asarray(c)[k] for c, k in zip(cap, keep)],
        )
    fixed2 = [(F, [(key, ix(W, *key)) for key, W in where]) for F, where in fixed]
    shared2 = [(F, [(key, ix(W, *key)) for key, W in where]) for F, where in shared]
    return lin2, edges2, mem2, overlap, fixed2, shared2
