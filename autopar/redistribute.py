"""Redistribute planning: the collectives that turn one placement into another, and their alpha-beta time.

Mesh dims are visited in order; each dim whose placement changes costs one collective on that dim's
sub-group, sized by the tensor as it is split over the other mesh dims at that moment:
S->R all_gather, P->R all_reduce, P->S reduce_scatter, S(i)->S(j) all_to_all, S->P all_gather;
R->S, R->P and P(sum)<->P(avg) are local (chunk, zero, rescale).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .cost import collective_time
from .graph import TensorMeta


@dataclass(frozen=True)
class Collective:
    kind: str          # all_gather | all_reduce | reduce_scatter | all_to_all
    mesh_dim: int
    nbytes: int        # full size over the group (the all_gather output, reduce_scatter input, all_reduce size)
    group: int         # ranks in the group

    def to_json(self):
        return [self.kind, self.mesh_dim, self.nbytes, self.group]


def _partial(p):
    return p[0] == "P"


def collectives(src: tuple[str, ...], dst: tuple[str, ...], meta: TensorMeta, mesh_shape) -> tuple[Collective, ...]:
    return _collectives(tuple(src), tuple(dst), meta.shape, meta.dtype.itemsize, tuple(mesh_shape))


@functools.lru_cache(maxsize=1 << 18)
def _collectives(src, dst, shape, itemsize, mesh_shape):
    cur = list(src)
    out = []
    numel = 1
    for s in shape:
        numel *= s
    for i, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        others = 1
        for j, p in enumerate(cur):
            if j != i and p[0] == "S":
                others *= mesh_shape[j]
        full = numel * itemsize // others
        n = mesh_shape[i]
        kind = None
        if a[0] == "S":
            kind = "all_to_all" if b[0] == "S" else "all_gather"
        elif _partial(a):
            if b == "R":
                kind = "all_reduce"
            elif b[0] == "S":
                kind = "reduce_scatter"
        if kind is not None and n > 1:
            out.append(Collective(kind, i, full, n))
        cur[i] = b
    return tuple(out)


def redistribute_time(src, dst, meta: TensorMeta, mesh_shape, cluster) -> float:
    links = _links(cluster, tuple(mesh_shape))
    return sum(collective_time(c.kind, c.nbytes, c.group, links[c.mesh_dim])
               for c in collectives(src, dst, meta, mesh_shape))


@functools.lru_cache(maxsize=256)
def _links(cluster, mesh_shape):
    return [cluster.link_for(mesh_shape, d) for d in range(len(mesh_shape))]
