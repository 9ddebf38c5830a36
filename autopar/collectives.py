"""Redistribute planning: the collectives that turn one placement into another, and their alpha-beta time.

Mesh dims are visited in order; each dim whose placement changes costs one collective on that dim's
sub-group, sized by the tensor as it is split over the other mesh dims at that moment:
S->R all_gather, P->R all_reduce, P->S reduce_scatter, S(i)->S(j) all_to_all, S->P all_gather;
R->S, R->P and P(sum)<->P(avg) are local (chunk, zero, rescale).

Nested sharding (two mesh dims sharding the same tensor dim, e.g. [S0,S0]) follows DTensor's layout: the
lower mesh dim splits the tensor dim first, so only the innermost (highest) mesh dim sharding a tensor dim can
be removed or added by one collective plus local reshuffles. When the in-order walk would violate that,
`steps` falls back to an executable order: unshard from the innermost mesh dim outwards, then shard outer
first (as DTensor does). The backends execute exactly these steps, so predicted == measured collectives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .cost import collective_time
from .graph import TensorMeta


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all
    mesh_dim: int  # a tuple of mesh dims for one collective over their flattened group (gradient buckets)
    nbytes: int  # full size over the group (the all_gather output, reduce_scatter input, all_reduce size)
    group: int  # ranks in the group

    def to_json(self):
        return [self.kind, self.mesh_dim, self.nbytes, self.group]


def _partial(p):
    return p[0] == "P"


def collectives(
    src: tuple[str, ...], dst: tuple[str, ...], meta: TensorMeta, mesh_shape, cluster=None
) -> tuple[Collective, ...]:
    """The collectives that take a tensor from `src` to `dst`; with a `cluster`, a chain of all_reduces over several
    mesh dims is one all_reduce over their flattened group where the cluster's cost model says that is faster
    (`flat_reduce`), as the planner prices it and the executor runs it."""
    src, dst, mesh_shape = tuple(src), tuple(dst), tuple(mesh_shape)
    flat = flat_reduce(src, dst, meta.nbytes, mesh_shape, cluster) if cluster is not None else None
    return (flat,) if flat else _collectives(src, dst, meta.nbytes, mesh_shape)


def all_reduced(src: tuple[str, ...], dst: tuple[str, ...], meta: TensorMeta, mesh_shape) -> bool:
    """Whether src -> dst is only all_reduces into Replicate: inputs of one op that take the same such move can
    share one collective of their summed size (passes/redistribute.py coalesces them, passes/costs.py prices it)."""
    cs = collectives(src, dst, meta, mesh_shape)
    return bool(cs) and all(c.kind == "all_reduce" for c in cs) and all(p == "R" for p in dst)


def _sharders(pl, d) -> list[int]:
    return [m for m, p in enumerate(pl) if p == f"S{d}"]


def _step_ok(cur, m, b) -> bool:
    """Can mesh dim m go from cur[m] to b with one collective (standard DTensor layouts before and after)?"""
    a = cur[m]
    if a[0] == "S" and _sharders(cur, int(a[1:]))[-1] != m:
        return False  # m is not the innermost mesh dim sharding that tensor dim
    if b[0] == "S" and any(k > m for k in _sharders(cur, int(b[1:])) if k != m):
        return False  # a mesh dim inside m already shards the target tensor dim
    return True


@functools.lru_cache(maxsize=1 << 16)
def steps(src: tuple[str, ...], dst: tuple[str, ...]) -> tuple[tuple[int, str, str], ...]:
    """The ordered single-mesh-dim changes (mesh_dim, from, to) that turn `src` into `dst`."""
    cur, out = list(src), []
    for m in range(len(src)):  # the plain walk over mesh dims, when every step is legal
        if cur[m] != dst[m]:
            if not _step_ok(cur, m, dst[m]):
                break
            out.append((m, cur[m], dst[m]))
            cur[m] = dst[m]
    else:
        return tuple(out)
    cur, out = list(src), []
    ndim = 1 + max([int(p[1:]) for p in src + dst if p[0] == "S"], default=0)
    keep = set()  # per tensor dim: mesh dims in the common prefix of src/dst sharders
    for d in range(ndim):
        for a, b in zip(_sharders(src, d), _sharders(dst, d)):
            if a != b:
                break
            keep.add(a)
    for m in reversed(range(len(src))):  # unshard innermost first (all_to_all straight to dst when legal)
        if cur[m][0] == "S" and m not in keep:
            b = dst[m]
            if b[0] == "S":
                e = int(b[1:])
                later = [k for k in _sharders(dst, e) if k < m and cur[k] != b]
                blocked = [k for k in _sharders(cur, e) if k not in keep]
                b = b if not later and not blocked and _step_ok(cur, m, b) else "R"
            out.append((m, cur[m], b))
            cur[m] = b
    for m in range(len(src)):  # then reduce / shard / rescale, outer first
        if cur[m] != dst[m]:
            assert _step_ok(cur, m, dst[m]), (src, dst, m, cur)
            out.append((m, cur[m], dst[m]))
            cur[m] = dst[m]
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _route(src, dst, mesh_shape) -> tuple[tuple[str, int, int, int], ...]:
    """(kind, mesh dim, ranks of the tensor's other shards, group) of each collective src -> dst takes: all but
    the byte count, so the ~10^6 (placement pair, size) prices of one plan share ~10^3 routes."""
    cur = list(src)
    out = []
    for i, a, b in steps(src, dst):
        others = 1
        for j, p in enumerate(cur):
            if j != i and p[0] == "S":
                others *= mesh_shape[j]
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
            out.append((kind, i, others, n))
        cur[i] = b
    return tuple(out)


def communicates(src, dst, mesh_shape) -> bool:
    """Whether src -> dst takes any collective (rather than local chunking, zeroing or rescaling)."""
    return bool(_route(tuple(src), tuple(dst), tuple(mesh_shape)))


@functools.lru_cache(maxsize=1 << 18)
def _collectives(src, dst, nbytes, mesh_shape):
    return tuple(Collective(kind, i, nbytes // others, n) for kind, i, others, n in _route(src, dst, mesh_shape))


def redistribute_time(src, dst, meta: TensorMeta, mesh_shape, cluster) -> float:
    return _time(tuple(src), tuple(dst), meta.nbytes, tuple(mesh_shape), cluster)


@functools.lru_cache(maxsize=1 << 18)
def _time(src, dst, nbytes, mesh_shape, cluster):
    route = _route(src, dst, mesh_shape)
    if len(route) > 1 and _may_flatten(route, dst):  # the cached route first: flat_reduce lists the collectives
        flat = flat_reduce(src, dst, nbytes, mesh_shape, cluster)
        if flat:
            return collective_time("all_reduce", flat.nbytes, flat.group, link_of(cluster, mesh_shape, flat.mesh_dim))
    links = _links(cluster, mesh_shape)
    return sum(collective_time(kind, nbytes // others, n, links[i]) for kind, i, others, n in route)


def _may_flatten(route, dst) -> bool:
    return all(r[0] == "all_reduce" for r in route) and all(p == "R" for p in dst)


@functools.lru_cache(maxsize=1 << 16)
def flat_reduce(src, dst, nbytes, mesh_shape, cluster):
    """One all_reduce over the flattened group of the mesh dims where src -> dst is a chain of P -> R steps (the
    same partial on each) on two or more mesh dims, when `flatten_chain` says it beats the chain: the Collective,
    else None. A loss's (sum, count) on a 2-D mesh: one collective's latency instead of two."""
    cs = _collectives(src, dst, nbytes, mesh_shape)
    if len(cs) < 2 or not _may_flatten(_route(src, dst, mesh_shape), dst):
        return None
    todo = tuple(t for t in steps(src, dst) if mesh_shape[t[0]] > 1)
    if not flatten_chain(todo, cs[0].nbytes, mesh_shape, cluster):
        return None
    return Collective("all_reduce", tuple(c.mesh_dim for c in cs), cs[0].nbytes, math.prod(c.group for c in cs))


@functools.lru_cache(maxsize=256)
def _links(cluster, mesh_shape):
    return [cluster.link_for(mesh_shape, d) for d in range(len(mesh_shape))]


# ---- gradient buckets ----------------------------------------------------------------------------------------------
# Gradient reductions into the optimizer step do not feed any op of the step, so (as DDP and FSDP2 do) the ones
# that are a single P -> R (all_reduce) or P -> S(d) (reduce_scatter) collective on the same mesh dim are issued
# together: one collective per bucket of up to BUCKET_BYTES, paying the latency once. passes/buckets.py forms
# the buckets; the MILP prices each such reduction as its bandwidth plus a share of a bucket's latency
# (grad_reduce_time), the prediction counts each real bucket's latency once.
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


@functools.lru_cache(maxsize=1 << 12)
def bucket_steps(src: tuple[str, ...], dst: tuple[str, ...]):
    """The steps (mesh_dim, from, to) of reducing a gradient from `src` to `dst` when buckets can carry them, else
    None: one P -> R or P -> S(d) step (no other mesh dim shards tensor dim d), or a chain of P -> R steps on
    several mesh dims (data parallel over a 2-D mesh: one bucket per mesh dim, reduced one after the other)."""
    todo = steps(tuple(src), tuple(dst))
    if not todo:
        return None
    if len(todo) > 1:
        return tuple(todo) if all(a in ("P", "Pa") and b == "R" for _, a, b in todo) else None
    m, a, b = todo[0]
    if a not in ("P", "Pa") or not (b == "R" or b[0] == "S"):
        return None
    if b[0] == "S" and any(k != m and p == b for k, p in enumerate(src)):
        return None
    return tuple(todo)


def dims_of(mesh_dim) -> tuple[int, ...]:
    """The mesh dims of a collective's group: (d,) for one mesh dim, the dims of a flattened group as they are."""
    return tuple(mesh_dim) if isinstance(mesh_dim, (tuple, list)) else (mesh_dim,)


def link_of(cluster, mesh_shape, mesh_dim):
    """The link a collective's group runs on; a ring over a flattened group runs at its slowest mesh dim's link."""
    links = [cluster.link_for(tuple(mesh_shape), d) for d in dims_of(mesh_dim)]
    if len(links) == 1:
        return links[0]
    if cluster.inter.nccl:  # NCCL's model prices the flattened group by its own span (rail or hierarchical)
        return cluster.group_link(tuple(mesh_shape), dims_of(mesh_dim))
    kinds = {r[0] for k in links for r in k.kinds}
    return type(links[0])(
        "+".join(dict.fromkeys(k.name for k in links)),
        max(k.alpha for k in links),
        min(k.bw for k in links),
        tuple(
            (
                kind,
                max(k.of(kind)[0] for k in links),
                min(k.of(kind)[1] for k in links),
                max(k.launch_of(kind) for k in links),
            )
            for kind in kinds
        ),
        max(k.launch for k in links),
    )


def _all_reduce_time(nbytes, mesh_shape, cluster, mesh_dim, share):
    """One all_reduce on mesh dim (or flattened dims) `mesh_dim`, with `share` of its latency."""
    n = math.prod(mesh_shape[d] for d in dims_of(mesh_dim))
    return collective_time("all_reduce", nbytes, n, link_of(cluster, mesh_shape, mesh_dim), share)


def _chain_time(todo, nbytes, mesh_shape, cluster, share):
    """(time as a chain of all_reduces, one per mesh dim; time as one all_reduce over the flattened group), with
    `share` of each collective's latency."""
    chain = sum(_all_reduce_time(nbytes, mesh_shape, cluster, m, share) for m, _, _ in todo)
    return chain, _all_reduce_time(nbytes, mesh_shape, cluster, tuple(m for m, _, _ in todo), share)


def _flattenable(todo) -> bool:
    """A chain of P -> R steps that one all_reduce over the flattened group can replace (mixed sum / average
    partials stay a chain)."""
    return len(todo) > 1 and len({a for _, a, _ in todo}) == 1


def flatten_chain(todo, nbytes: int, mesh_shape, cluster) -> bool:
    """A bucket whose gradients take a chain of P -> R steps on several mesh dims (bucket_steps) runs as ONE
    all_reduce over the flattened group of those dims when the cost model says it is faster for the bucket's
    `nbytes` (fewer bytes per rank, 2(n-1) latency steps on the slowest link instead of a sum over the dims)."""
    if not _flattenable(todo):
        return False
    chain, flat = _chain_time(todo, nbytes, tuple(mesh_shape), cluster, 1.0)
    return flat < chain


def grad_reduce_time(src, dst, meta: TensorMeta, mesh_shape, cluster, n_grads: int | None = 1) -> float:
    """Seconds a gradient reduction src -> dst adds to the step. In a bucket: its bandwidth plus its share of
    the bucket's latency, by bytes (a full bucket is BUCKET_BYTES) and at least 1/n_grads of one bucket (a
    model's gradients fill at least one); a chain over several mesh dims at the cheaper of chain and flattened group
    (flatten_chain). n_grads=None: its bandwidth alone (the solver charges each bucket series' latency by
    grad_bucket_latency), a chain as what a full bucket takes. The prediction (autopar/predict.py) counts the real
    buckets."""
    todo = bucket_steps(tuple(src), tuple(dst))
    if todo is None:
        return redistribute_time(src, dst, meta, mesh_shape, cluster)
    mesh_shape = tuple(mesh_shape)
    if n_grads is None:
        return _series_time(todo, src, dst, meta, mesh_shape, cluster, 0.0)
    share = max(meta.nbytes / BUCKET_BYTES, 1.0 / max(1, n_grads))
    if len(todo) > 1:
        chain, flat = _chain_time(todo, meta.nbytes, mesh_shape, cluster, share)
        return min(chain, flat) if _flattenable(todo) else chain
    return _steps_time(src, dst, meta, mesh_shape, cluster, share)


def _steps_time(src, dst, meta, mesh_shape, cluster, share) -> float:
    """Bandwidth of each collective src -> dst plus `share` of its latency."""
    links, t = _links(cluster, mesh_shape), 0.0
    for c in collectives(src, dst, meta, mesh_shape):
        t += collective_time(c.kind, c.nbytes, c.group, links[c.mesh_dim], share)
    return t


def _series_time(todo, src, dst, meta, mesh_shape, cluster, share) -> float:
    """A gradient's reduction in its bucket series with `share` of the latency: a chain over several mesh dims as a
    full bucket of the series runs it (chain or flattened group, flatten_chain at BUCKET_BYTES)."""
    if len(todo) > 1:
        chain, flat = _chain_time(todo, meta.nbytes, mesh_shape, cluster, share)
        return flat if flatten_chain(todo, BUCKET_BYTES, mesh_shape, cluster) else chain
    return _steps_time(src, dst, meta, mesh_shape, cluster, share)


def grad_bucket_latency(src, dst, meta: TensorMeta, mesh_shape, cluster):
    """(bucket series, seconds, fraction): the series a gradient reduction src -> dst joins (passes/buckets.py
    groups gradients by (steps, dtype)), the latency of one of its buckets, and the fraction of a bucket
    (BUCKET_BYTES) the gradient fills: a series of total fraction f takes about max(1, f) buckets, one at least
    however few gradients it holds; (None, 0.0, 0.0) for a reduction that is not bucketed."""
    todo = bucket_steps(tuple(src), tuple(dst))
    if todo is None:
        return None, 0.0, 0.0
    mesh_shape = tuple(mesh_shape)
    first = collectives(tuple(src), tuple(dst), meta, mesh_shape)
    frac = (first[0].nbytes if first else meta.nbytes) / BUCKET_BYTES
    empty = TensorMeta((0,) * len(meta.shape), meta.dtype)
    return (todo, str(meta.dtype)), _series_time(todo, src, dst, empty, mesh_shape, cluster, 1.0), frac
