"""Pass: the cost terms the solver minimizes, over decision groups.

Decision groups: a node with one tensor input inside the same layer instance *follows* its producer (views,
transposes, casts, unary pointwise ops), and a pointwise op follows its one largest input when the others are
smaller broadcast operands (norm weights, RoPE tables, scalars; Alpa's "follow" merging): it takes the strategy that best matches that producer's output, so it needs no variable of its own;
its other inputs stay priced edges. This restricts the search to plans where elementwise ops compute in their
main input's layout; the MILP is exact over that space. Every other node roots a group. Groups of repeated layers are shared (regions
pass), so the model has one set of variables per distinct node of the representative layer.

Per group strategy: compute time of its members (roofline on local shapes), the redistributes the followers
need, model-state bytes (parameters, grads, optimizer state at the storage placement) and saved-activation
bytes. Per edge between groups: a matrix of redistribute times (producer strategy x consumer strategy); where
consumers share a redistribute (passes/redistribute.py), one charge paid once replaces their prices of it.
Gradients flow into an optimizer-step edge whose required placement is the parameter's own: the data-parallel
all-reduce / reduce-scatter falls out of it (when it rides in a gradient bucket: its bandwidth, and the bucket
series' latency max(1, sum of its gradients' bucket fractions) times, a charge the solver adds once any gradient joins
the series, autopar.redistribute.grad_bucket_latency; the prediction counts each real bucket once).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from autopar.cost import global_flops, is_view, roofline_time
from autopar.graph import TensorMeta, param_root
from autopar.redistribute import (
    BUCKET_BYTES,
    all_reduced,
    collectives,
    grad_bucket_latency,
    grad_reduce_time,
    redistribute_time,
)
from autopar.loss_tail import HELD_NUMEL, can_be_partial, tail_values
from autopar.strategies import num_shards


def run(state) -> None:
    g, mesh_shape, cluster = state.graph, state.mesh.shape, state.cluster
    S, rep, region_of = state.strategies, state.rep, state.region_of
    dev = cluster.device
    prec = state.precision
    nodes = g.nodes
    ndev = 1
    for x in mesh_shape:
        ndev *= x
    flop_cache: dict = {}
    rt_cache: dict = {}

    def rtime(src, dst, meta):
        if src == dst:
            return 0.0
        key = (src, dst, meta.nbytes)
        t = rt_cache.get(key)
        if t is None:
            t = rt_cache[key] = redistribute_time(src, dst, meta, mesh_shape, cluster)
        return t

    tail = tail_values(g, can_be_partial(state))
    tail_share = max(1, len(tail))

    def ttime(src, dst, meta):
        """A loss-tail value's all_reduce (autopar/loss_tail.py: the redistribute pass groups them): its bandwidth and
        its share of one collective's latency, as a gradient's in a bucket (1 / the number of loss-tail values)."""
        if src == dst or not all_reduced(src, dst, meta, mesh_shape):
            return rtime(src, dst, meta)
        key = (src, dst, meta.nbytes, "tail")
        t = rt_cache.get(key)
        if t is None:
            t = rt_cache[key] = grad_reduce_time(src, dst, meta, mesh_shape, cluster, tail_share)
        return t

    def price(p, o):
        """How a redistribute of node p's output o is priced: rtime, or ttime for a loss-tail value."""
        return ttime if (p, o) in tail else rtime

    def node_time(n, s):
        """Roofline seconds of node n under strategy s (work split by the mesh dims its first output shards), plus
        the device's fixed time per op."""
        flops = global_flops(g, n, flop_cache)
        if flops == 0.0 and n.kind != "op":
            return 0.0
        if is_view(n.target):  # aliases its input: no data moves
            return dev.op_overhead
        work = 1
        o = next((p for p in s.out if p is not None), None)
        if o is not None:
            work = ndev // max(1, _replicated(o, mesh_shape))
        nbytes = sum(m.nbytes / num_shards(p, mesh_shape) for m, p in zip(n.outs, s.out) if m is not None and p) + sum(
            g.meta(r).nbytes / num_shards(p, mesh_shape) for r, p in zip(n.inputs(), s.ins)
        )
        dtype = next((m.dtype for m in n.outs if m is not None and m.dtype.is_floating_point), torch.float32)
        return roofline_time(flops / work, nbytes, dev, dtype) + dev.op_overhead

    # --- followers and groups, in representative space -------------------------------------------------------
    reps = [i for i in range(len(nodes)) if rep[i] == i]
    follow: dict[int, tuple[int, int, int]] = {}  # follower -> (producer, producer output, input position)
    for i in reps:
        n = nodes[i]
        if n.kind != "op":
            continue
        ins = n.inputs()
        lead = _lead_input(g, n, ins)
        if lead is None:
            continue
        r = ins[lead]
        if region_of[r.node] == region_of[i] and nodes[r.node].kind in ("op", "param"):
            follow[i] = (r.node, r.out, lead)
    root = {}
    for i in reps:  # topological order: producers first
        root[i] = root[follow[i][0]] if i in follow else i
    groups = [i for i in reps if root[i] == i]
    gid = {r: k for k, r in enumerate(groups)}
    K = [len(S[r]) for r in groups]
    # choice[i][k]: strategy index of rep node i when its group root takes strategy k
    best_memo: dict = {}  # (producer placement, follower's input options) -> best
    choice: dict[int, np.ndarray] = {}
    extra: dict[int, np.ndarray] = {}  # follower redistribute time per root strategy
    for i in reps:
        if i not in follow:
            choice[i] = np.arange(len(S[i])) if root[i] == i else None
            continue
        p, k_out, lead = follow[i]
        pc = choice[p]
        first: dict = {}  # distinct placement of the lead input -> first strategy
        for j, s in enumerate(S[i]):
            first.setdefault(s.ins[lead], j)
        meta = nodes[p].outs[k_out]
        best: dict = {}
        fkey = (tuple(first.items()), meta.nbytes)
        for s_p in S[p]:
            pl = s_p.out[k_out]
            if pl not in best:
                hit = best_memo.get((pl, fkey))
                if hit is None:
                    hit = best_memo[(pl, fkey)] = min((rtime(pl, d, meta), j) for d, j in first.items())
                best[pl] = hit
        ch = np.empty(len(pc), dtype=np.int64)
        ex = np.empty(len(pc))
        for r_k, pk in enumerate(pc):
            t, j = best[S[p][pk].out[k_out]]
            ch[r_k], ex[r_k] = j, t
        choice[i], extra[i] = ch, ex

    count = defaultdict(int)
    for i in range(len(nodes)):
        count[rep[i]] += 1

    # --- per-group linear terms ------------------------------------------------------------------------------
    compute = [np.zeros(k) for k in K]
    comm_lin = [np.zeros(k) for k in K]
    comm_ovl = [np.zeros(k) for k in K]  # the part of comm_lin that can overlap compute
    rooted: dict = {}

    def ovl_src(p):
        """Is a redistribute of node p's output a parameter gather (overlappable, as FSDP prefetches)?"""
        if p not in rooted:
            rooted[p] = param_root(g, p) is not None
        return rooted[p]

    state_mem = [np.zeros(k) for k in K]
    act_mem = [np.zeros(k) for k in K]
    bpp = prec.bytes_per_param
    for i in reps:
        n, gi, c = nodes[i], gid[root[i]], count[i]
        ch = choice[i]
        t_by_s = {}
        for k, j in enumerate(ch):
            if j not in t_by_s:
                t_by_s[j] = node_time(n, S[i][j])
            compute[gi][k] += c * t_by_s[j]
        if i in extra:
            comm_lin[gi] += c * extra[i]
            if ovl_src(follow[i][0]):
                comm_ovl[gi] += c * extra[i]
        if n.kind == "param":
            for k, j in enumerate(ch):
                state_mem[gi][k] += c * n.out.numel * bpp / num_shards(S[i][j].out[0], mesh_shape)
        elif n.kind == "op" and n.phase == "fw":
            saved = [o for o, m in enumerate(n.outs) if m is not None]
            if saved and any(nodes[u].phase == "bw" for u in n.users):
                for k, j in enumerate(ch):
                    s = S[i][j]
                    act_mem[gi][k] += c * sum(
                        n.outs[o].nbytes / num_shards(s.out[o], mesh_shape) for o in saved if s.out[o] is not None
                    )

    # --- edges between groups --------------------------------------------------------------------------------
    edge_count = defaultdict(int)
    for v in range(len(nodes)):
        rv = rep[v]
        if nodes[v].kind != "op":
            continue
        lead = follow[rv][2] if rv in follow else None
        for j, r in enumerate(nodes[v].inputs()):
            if j != lead:
                edge_count[(rep[r.node], r.out, rv, j)] += 1
    for fqn, r in g.grads.items():  # optimizer step: grad must match the parameter's placement
        edge_count[(rep[r.node], r.out, rep[g.params[fqn]], "opt")] += 1
    for fqn, r in g.state_updates.items():  # a buffer's new value is written at the buffer's placement
        edge_count[(rep[r.node], r.out, rep[g.buffers[fqn]], "state")] += 1
    matrices: dict[tuple[int, int], np.ndarray] = {}
    ovl_matrices: dict[tuple[int, int], np.ndarray] = {}  # the overlappable part of each matrix
    mat_cache: dict = {}
    bucket_delta: dict = {}  # (g1, g2) -> gradient-reduction price without bucket latency minus by share
    series: dict = {}  # bucket series -> [one bucket's latency, {(g1, g2): bucket fraction per choice pair}]
    for (p, o, v, j), c in sorted(edge_count.items(), key=lambda kv: tuple(map(str, kv[0]))):
        g1, g2 = gid[root[p]], gid[root[v]]
        meta = nodes[p].outs[o]
        src = [S[p][x].out[o] for x in choice[p]]
        dst = [S[v][x].out[0] if j in ("opt", "state") else S[v][x].ins[j] for x in choice[v]]
        us, ui = _uniq(src)
        vs, vi = _uniq(dst)
        opt = j == "opt"  # gradient into the optimizer step: bucketed reductions pay latency per bucket
        pr = price(p, o)
        mkey = (tuple(us), tuple(vs), meta.nbytes, opt, pr is ttime)
        small = mat_cache.get(mkey)
        if small is None:
            f = (
                (lambda a, b: 0.0 if a == b else grad_reduce_time(a, b, meta, mesh_shape, cluster, len(g.grads)))
                if opt
                else (lambda a, b: pr(a, b, meta))
            )
            small = mat_cache[mkey] = np.array([[f(a, b) for b in vs] for a in us])
        C = c * small[np.ix_(ui, vi)]
        if opt or pr is ttime and nodes[v].phase == "fw":
            joins = (_grad_joins if opt else _tail_joins)(meta, mesh_shape, cluster)
            _bucket_series(us, vs, ui, vi, meta, c, small, g1, g2, mesh_shape, cluster, bucket_delta, series, joins)
        ovl = opt or ovl_src(p)  # gradient reductions and parameter gathers overlap compute
        if g1 == g2:
            comm_lin[g1] += np.diag(C)
            if ovl:
                comm_ovl[g1] += np.diag(C)
        elif not C.any():
            continue
        else:
            key = (g1, g2)
            matrices[key] = matrices[key] + C if key in matrices else C
            if ovl:
                ovl_matrices[key] = ovl_matrices[key] + C if key in ovl_matrices else C
    share_delta, shared = _shared(g, rep, S, choice, gid, root, price, mesh_shape, ovl_src)
    _coalesce(edge_count, nodes, S, choice, gid, root, matrices, price, mesh_shape, tail)
    lr, li = g.loss, rep[g.loss.node]  # the step returns the loss replicated (global view)
    rep_pl = ("R",) * len(mesh_shape)
    comm_lin[gid[root[li]]] += np.array(
        [rtime(S[li][x].out[lr.out], rep_pl, nodes[li].outs[lr.out]) for x in choice[li]]
    )
    state.groups, state.group_of = groups, {i: gid[root[rep[i]]] for i in range(len(nodes))}
    state.choice, state.follow = choice, follow
    state.cost = {
        "compute": compute,
        "comm": comm_lin,
        "state_mem": state_mem,
        "act_mem": act_mem,
        "edges": matrices,
        "rtime": rtime,
        "node_time": node_time,
        "comm_ovl": comm_ovl,
        "edges_ovl": ovl_matrices,
        "bucket_delta": bucket_delta,
        "share_delta": share_delta,
        "shared": shared,
        "bucket_series": [(F, list(t.items())) for _, (F, t) in sorted(series.items(), key=lambda kv: str(kv[0]))],
    }


def _bucket_series(us, vs, ui, vi, meta, c, small, g1, g2, mesh_shape, cluster, delta, series, joins) -> None:
    """For the exact objective (overlap=False): the reductions of an edge that ride in a series of one collective
    each (gradient buckets; the loss tail's one all_reduce) at their bandwidth alone (`delta`, added to the edge's
    by-share price), and per series which (producer, consumer) choices join it with the fraction of a collective
    they fill (c instances each); the solver charges the series' latency max(1, total fraction) times when any
    choice joining it is taken. joins(src, dst) -> (series, its latency, fraction) or None."""
    key, D = (g1, g2), np.zeros_like(small)
    for a_i, a in enumerate(us):
        for b_i, b in enumerate(vs):
            j = joins(a, b) if a != b else None
            if j is None:
                continue
            s, F, frac = j
            D[a_i, b_i] = grad_reduce_time(a, b, meta, mesh_shape, cluster, None) - small[a_i, b_i]
            entry = series.setdefault(s, [F, {}])
            W = entry[1].setdefault(key, np.zeros((len(ui), len(vi))))
            W += c * frac * ((ui == a_i)[:, None] & (vi == b_i)[None, :])
    D = c * D[np.ix_(ui, vi)]
    delta[key] = delta[key] + D if key in delta else D


def _grad_joins(meta, mesh_shape, cluster):
    """A gradient reduction's bucket series (passes/buckets.py groups gradients by (steps, dtype))."""

    def joins(a, b):
        s, F, frac = grad_bucket_latency(a, b, meta, mesh_shape, cluster)
        return None if s is None else (s, F, frac)

    return joins


def _tail_joins(meta, mesh_shape, cluster):
    """A loss-tail value's all_reduce in the forward (autopar/loss_tail.py): the one collective its group takes, a
    series per partial kind (a mean counted as a sum) and destination; exact where the plan's loss tail takes one
    group, as on every model planned here (values whose consumer computes another's take a second collective and
    are not in the tail: schedule.tail_values)."""
    empty = TensorMeta((0,), meta.dtype)  # its latency alone

    def joins(a, b):
        if not all_reduced(a, b, meta, mesh_shape):
            return None
        return (
            ("tail", tuple("P" if x == "Pa" else x for x in a), tuple(b), str(meta.dtype)),
            redistribute_time(a, b, empty, mesh_shape, cluster),
            meta.nbytes / BUCKET_BYTES,
        )

    return joins


def _shared(g, rep, S, choice, gid, root, pricing, mesh_shape, rooted):
    """Redistributes several consumers share (passes/redistribute.py: one value taken to one placement in one phase,
    any phase for a value of at most HELD_NUMEL elements, not rooted in a parameter, runs once). The edges price
    each consumer's; for the exact objective, per value and destination placement d that at least two of its
    consumers can need, their price of the transitions into d moves to one charge paid once: the max over those
    consumers of W[producer choice, consumer choice] = price(src, d) where that consumer takes d (the solver's `shared`,
    (producer nodes with these consumers, [((g1, g2), W)])); `delta` ((g1, g2) -> matrix, added to the edges;
    g1 == g2: its diagonal, to the group) takes it off the edges. A value feeding consumers in several layers (a
    RoPE table) is counted per producer node. rooted(p): is node p's output rooted in a parameter."""
    nodes = g.nodes
    users: dict = defaultdict(list)  # (producer, output, phase or None) -> [(rep consumer, input)]
    for v, n in enumerate(nodes):
        if n.kind != "op":
            continue
        for j, r in enumerate(n.inputs()):
            if not rooted(r.node):
                users[(r.node, r.out, n.phase if nodes[r.node].outs[r.out].numel > HELD_NUMEL else None)].append(
                    (rep[v], j)
                )
    sigs: dict = defaultdict(int)  # (rep producer, output, consumers) -> producers with them
    for (p, o, _), us in users.items():
        if len(us) > 1:
            sigs[(rep[p], o, tuple(sorted(us)))] += 1
    delta, charges = {}, []
    for (p, o, us), c in sorted(sigs.items(), key=lambda kv: str(kv[0])):
        meta, g1, rtime = nodes[p].outs[o], gid[root[p]], pricing(p, o)
        pls, si = _uniq([S[p][x].out[o] for x in choice[p]])
        ids = {pl: k for k, pl in enumerate(pls)}
        mult: dict = defaultdict(int)
        for v, j in us:
            mult[(v, j)] += 1
        cons = []
        for (v, j), m in mult.items():
            dst = [S[v][x].ins[j] for x in choice[v]]
            for x in dst:
                ids.setdefault(x, len(ids))
            cons.append((gid[root[v]], np.array([ids[x] for x in dst]), m))
        pls = list(ids)
        for d in np.unique(np.concatenate([di for _, di, _ in cons])):
            price = np.array(
                [
                    rtime(pls[a], pls[d], meta) if a != d and collectives(pls[a], pls[d], meta, mesh_shape) else 0.0
                    for a in range(len(pls))
                ]
            )[si]  # per producer choice: its move into d
            joined = [(g2, np.outer(price, di == d), m) for g2, di, m in cons]
            joined = [(g2, W, m) for g2, W, m in joined if (np.diag(W) if g2 == g1 else W).any()]
            if sum(m for _, _, m in joined) < 2:
                continue
            for g2, W, m in joined:
                key = (g1, g2)
                delta[key] = delta[key] - c * m * W if key in delta else -c * m * W
            charges.append((float(c), [((g1, g2), W) for g2, W, _ in joined]))
    return delta, charges


def _lead_input(g, n, ins):
    """The input a node follows: its only tensor input, or for pointwise ops the largest input (first on ties)."""
    if len(ins) == 1:
        return 0
    if not ins or torch.Tag.pointwise not in getattr(n.target, "tags", ()):
        return None
    sizes = [g.meta(r).numel for r in ins]
    big = max(sizes)
    if sizes.count(big) > 1:
        return None  # same-size operands (residual adds, gated products): a real decision, keep a root
    return sizes.index(big)


def _uniq(items):
    idx: dict = {}
    inv = np.array([idx.setdefault(x, len(idx)) for x in items], dtype=np.int64)
    return list(idx), inv


def _replicated(pl, mesh_shape) -> int:
    """How many ranks compute the same piece: product of mesh sizes where the placement is Replicate."""
    r = 1
    for p, n in zip(pl, mesh_shape):
        if p == "R":
            r *= n
    return r


def _coalesce(edge_count, nodes, S, choice, gid, root, matrices, pricing, mesh_shape, tail) -> None:
    """Several outputs of one producer that one consumer needs all-reduced to Replicate (the loss sum and the count
    of targets into their quotient) take one collective (passes/redistribute.py coalesces them): where both sides'
    strategies make every such edge the same all_reduce-only transition, the edges' summed price is replaced by
    that of one all_reduce of their summed size."""
    by_pair = defaultdict(list)
    for (p, o, v, j), c in edge_count.items():
        if j not in ("opt", "state"):
            by_pair[(p, v)].append((o, j, c))
    fits: dict = {}  # (src, dst) -> all-reduced into Replicate
    for (p, v), es in by_pair.items():
        g1, g2 = gid[root[p]], gid[root[v]]
        metas = [nodes[p].outs[o] for o, _, _ in es]
        if (
            len({o for o, _, _ in es}) < 2
            or g1 == g2
            or len({c for _, _, c in es}) != 1
            or len({m.dtype for m in metas}) != 1
        ):
            continue
        total = TensorMeta((sum(m.numel for m in metas),), metas[0].dtype)
        in_tail = {(p, o) in tail for o, _, _ in es}
        if len(in_tail) > 1 or in_tail == {True} and nodes[v].phase == "fw":
            continue  # priced apart; or loss-tail values of the forward: one series charge (_tail_joins)
        rtime = pricing(p, es[0][0])
        D = np.zeros((len(choice[p]), len(choice[v])))
        for a_i, x in enumerate(choice[p]):
            for b_i, y in enumerate(choice[v]):
                moves = {(S[p][x].out[o], S[v][y].ins[j]) for o, j, _ in es}
                if len(moves) != 1:
                    continue
                a, b = next(iter(moves))
                if (a, b) not in fits:
                    fits[(a, b)] = a != b and all_reduced(a, b, total, mesh_shape)
                if fits[(a, b)]:
                    D[a_i, b_i] = es[0][2] * (rtime(a, b, total) - sum(rtime(a, b, m) for m in metas))
        if D.any():
            matrices[(g1, g2)] = matrices[(g1, g2)] + D if (g1, g2) in matrices else D
