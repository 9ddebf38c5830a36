"""The exact simulation of torch's pipeline action order: each action starts when its rank is free and its inputs
arrived (F after the previous stage's F plus the p2p transfer; B/I after its own F and the next stage's B/I plus the
transfer; W after its own I), so an action's start is the max over at most four values and the step is the
longest path of the order's dependency graph.

The graph depends on the order alone (one per schedule, p, v, m; up to millions of actions) while the stage search
simulates it under many stage times, so it is built once per order (`_Graph`: the actions renumbered level by
level, a level depending only on earlier ones) and each simulation is one numpy pass per level: the same max and
+ on the same values as a loop over the actions, so the same bits, at a few microseconds per level instead of per
action. The events (start, end, stage, kind, micro-batch) per rank are built only when read (the report's timeline).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

_KINDS = ("F", "B", "I", "W")
_F, _B, _I, _W = range(4)


class _Graph:
    """An action order as arrays in level order: `bounds[l]:bounds[l+1]` is level l; `prev`, `dep_a`, `dep_b` the
    predecessor on the rank, the action's input (F: the previous stage's F; B/I: its own F; W: its own I) and a
    backward's gradient input (the next stage's B/I), as new indices, `n` (a slot holding 0.0) where there is none;
    `lat_a` / `lat_b` the stage whose p2p transfer the input crosses (S: none)."""

    def __init__(self, order: tuple, S: int):
        self.order = order
        flat = [a for r in order for a in r]
        n = self.n = len(flat)
        self.counts = [len(r) for r in order]
        M = 1 + max((a[2] for a in flat), default=0)
        stage = np.array([a[0] for a in flat], dtype=np.int64)
        micro = np.array([a[2] for a in flat], dtype=np.int64)
        code = {k: c for c, k in enumerate(_KINDS)}
        kind = np.array([code[a[1]] for a in flat], dtype=np.int64)
        key = stage * M + micro
        pos_f, pos_g = np.full((S + 1) * M, -1), np.full((S + 1) * M, -1)
        idx = np.arange(n)
        pos_f[key[kind == _F]] = idx[kind == _F]
        grad = (kind == _B) | (kind == _I)
        pos_g[key[grad]] = idx[grad]
        dep_a, dep_b = np.full(n, n), np.full(n, n)
        lat_a, lat_b = np.full(n, S), np.full(n, S)
        fw = (kind == _F) & (stage > 0)
        dep_a[fw], lat_a[fw] = pos_f[key[fw] - M], stage[fw] - 1
        dep_a[kind == _W] = pos_g[key[kind == _W]]
        dep_a[grad] = pos_f[key[grad]]
        down = grad & (stage < S - 1)
        dep_b[down], lat_b[down] = pos_g[key[down] + M], stage[down]
        prev = idx - 1
        starts = np.cumsum([0] + self.counts[:-1]).astype(np.int64)
        prev[starts[np.array(self.counts) > 0]] = n
        level = self._levels(prev, dep_a, dep_b, n)
        new_of = np.empty(n + 1, dtype=np.int64)
        perm = np.argsort(level, kind="stable")
        new_of[perm], new_of[n] = np.arange(n), n
        self.bounds = np.searchsorted(level[perm], np.arange(level.max() + 2 if n else 1)).tolist()
        self.prev, self.dep_a, self.dep_b = new_of[prev[perm]], new_of[dep_a[perm]], new_of[dep_b[perm]]
        self.lat_a, self.lat_b = lat_a[perm], lat_b[perm]
        self.stage, self.kind, self.micro = stage[perm], kind[perm], micro[perm]
        self.first = (self.kind == _F) & (self.micro == 0)
        self.new_of = new_of[:n]  # original (rank-major) index -> level-order index
        last = np.cumsum(self.counts) - 1
        self.last = [int(self.new_of[j]) if c else -1 for j, c in zip(last, self.counts)]  # each rank's last action

    def _levels(self, prev, dep_a, dep_b, n) -> np.ndarray:
        """Each action's level (1 + its predecessors' highest), walking the ranks' orders as the engines would; a
        dependency that never runs (-1) or a cycle is torch's order deadlocking."""
        P, A, B = prev.tolist(), dep_a.tolist(), dep_b.tolist()
        level = [-2] * n + [-1]  # -2: not run yet; slot n ("no such input") counts as level -1, always done
        offs = np.cumsum([0] + self.counts).tolist()
        pos, waiting, ready = list(offs[:-1]), {}, list(range(len(self.counts)))
        while ready:
            r = ready.pop()
            j, end = pos[r], offs[r + 1]
            while j < end:
                a, b = A[j], B[j]
                blocker = a if a < 0 or level[a] == -2 else b if b < 0 or level[b] == -2 else None
                if blocker is not None:
                    if blocker >= 0:  # -1: the input's action is in no rank's order, it never runs
                        waiting.setdefault(blocker, []).append(r)
                    break
                level[j] = 1 + max(level[P[j]], level[a], level[b])
                for w in waiting.pop(j, ()):
                    ready.append(w)
                j += 1
            pos[r] = j
        if any(pos[r] < offs[r + 1] for r in range(len(self.counts))):
            stuck = {r: self.order[r][pos[r] - offs[r]] for r in range(len(self.counts)) if pos[r] < offs[r + 1]}
            raise RuntimeError(f"pipeline simulation deadlocked; next actions per rank: {stuck}")
        return np.array(level[:n], dtype=np.int64)


def by_order(store: dict, key: tuple, order: tuple, build, limit: int):
    """build(), kept in `store` under `key` (which includes id(order)) for as long as the key names the same order:
    the stage search asks the same few orders (one per configuration, up to millions of actions) for the same
    things many times, and hashing an order would cost as much as a pass over it. The entry keeps the order alive,
    so its id is not reused; beyond `limit` entries the oldest goes."""
    hit = store.get(key)
    if hit is None or hit[0] is not order:
        if len(store) >= limit:
            store.pop(next(iter(store)))
        hit = store[key] = (order, build())
    return hit[1]


_GRAPHS: dict = {}


def _graph(order: tuple, S: int) -> _Graph:
    # a graph is ~80 bytes per action: the most recent few
    return by_order(_GRAPHS, (id(order), S), order, lambda: _Graph(order, S), 16)


class Simulation:
    """One simulated step: `step_s` (the last rank's end), `rank_ends` (each rank's last action's end), and, read
    lazily, `busy_s` (per rank, the sum of its actions' durations) and `events` (per rank, in its order)."""

    def __init__(self, graph: _Graph, start: np.ndarray, end: np.ndarray):
        self._g, self._start, self._end = graph, start, end
        self.rank_ends = [float(end[j]) if j >= 0 else 0.0 for j in graph.last]
        self.step_s = max(self.rank_ends) if self.rank_ends else 0.0

    @cached_property
    def events(self) -> list:
        g, out, j = self._g, [], 0
        start, end = self._start.tolist(), self._end.tolist()
        for r, c in zip(g.order, g.counts):
            at = g.new_of[j : j + c].tolist()
            out.append([(start[k], end[k], s, kind, i) for k, (s, kind, i) in zip(at, r)])
            j += c
        return out

    @cached_property
    def busy_s(self) -> list:
        took = (self._end - self._start)[self._g.new_of].tolist()  # rank-major, each rank's actions in order
        out, j = [], 0
        for c in self._g.counts:
            out.append(sum(took[j : j + c]))
            j += c
        return out

    @property
    def bubble_fraction(self) -> float:
        p = len(self.busy_s)
        return 0.0 if self.step_s <= 0 else 1.0 - sum(self.busy_s) / (p * self.step_s)


def simulate(
    order: tuple, rank_of: tuple, F: list, B: list, W: list, p2p: list, first_f=None, ready_f=None
) -> Simulation:
    """List-schedule torch's action order. F/B/W: seconds per stage per micro-batch (a full backward "B" costs
    B+W); p2p[k]: seconds to move one micro-batch's activation (or its gradient) from stage k to k+1 when they sit
    on different ranks; first_f[k]: seconds stage k's first micro-batch forward adds (its exposed FSDP gathers);
    ready_f[k]: the earliest start of that forward (its stage's gathers, issued at the step's start, are done)."""
    S = len(F)
    g = _graph(order, S)
    n, st = g.n, g.stage
    f = np.asarray(F, dtype=float)
    full = np.array([b + w for b, w in zip(B, W)], dtype=float)
    dur = np.stack([f, full, np.asarray(B, dtype=float), np.asarray(W, dtype=float)])[g.kind, st]
    if first_f is not None:
        dur[g.first] = f[st[g.first]] + np.asarray(first_f, dtype=float)[st[g.first]]
    lat = np.array([p2p[k] if k < S - 1 and rank_of[k] != rank_of[k + 1] else 0.0 for k in range(S)] + [0.0])
    lat_a, lat_b = lat[g.lat_a], lat[g.lat_b]
    ready = np.zeros(n)
    if ready_f is not None:
        ready[g.first] = np.asarray(ready_f, dtype=float)[st[g.first]]
    start, end = np.zeros(n), np.zeros(n + 1)  # end[n]: "no such input", 0.0 like an idle rank's clock
    prev, dep_a, dep_b, bounds = g.prev, g.dep_a, g.dep_b, g.bounds
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = np.maximum(end[prev[lo:hi]], ready[lo:hi])
        s = np.maximum(s, end[dep_a[lo:hi]] + lat_a[lo:hi])
        s = np.maximum(s, end[dep_b[lo:hi]] + lat_b[lo:hi])
        start[lo:hi] = s
        end[lo:hi] = s + dur[lo:hi]
    return Simulation(g, start, end[:n])
