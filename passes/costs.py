"""Pass: the cost terms the solver minimizes, over decision groups.

Decision groups: a node with one tensor input inside the same layer instance *follows* its producer (views,
transposes, casts, unary pointwise ops), and a pointwise op follows its one largest input when the others are
smaller broadcast operands (norm weights, RoPE tables, scalars; Alpa's "follow" merging): it takes the strategy
that best matches that producer's output, so it needs no variable of its own; its other inputs stay priced
edges. This restricts the search to plans where elementwise ops compute in their main input's layout; the MILP is
exact over that space. Every other node roots a group. Groups of repeated layers are shared (regions pass), so
the model has one set of variables per distinct node of the representative layer.

Per group strategy: compute time of its members (roofline on local shapes), the redistributes the followers
need, model-state bytes (parameters, grads, optimizer state at the storage placement) and saved-activation
bytes. Per edge between groups: a matrix of redistribute times (producer strategy x consumer strategy); where
consumers share a redistribute (passes/redistribute.py), one charge paid once replaces their prices of it.
Gradients flow into an optimizer-step edge whose required placement is the parameter's own: the data-parallel
all-reduce / reduce-scatter falls out of it (when it rides in a gradient bucket: its bandwidth, and the bucket
series' latency max(1, sum of its gradients' bucket fractions) times, a charge the solver adds once any gradient joins
the series, autopar.collectives.grad_bucket_latency; the prediction counts each real bucket once).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from autopar.cost import collective_time, fusion, global_flops, is_view
from autopar.cost.kernels import node_time as kernel_node_time
from autopar.graph import TensorMeta, param_root
from autopar.collectives import (
    BUCKET_BYTES,
    all_reduced,
    communicates,
    grad_bucket_latency,
    grad_reduce_time,
    link_of,
    redistribute_time,
)
from autopar.loss_tail import HELD_NUMEL, can_be_partial, tail_values
from autopar.strategies import num_shards, vocab_parallel

from . import float8


@dataclass
class Pricing:
    """How this plan prices time: `redistribute(src, dst, meta)` (a value's move between placements, cached),
    `tail(src, dst, meta)` (a loss-tail value's all_reduce: its bandwidth and a share of one collective's latency),
    `node_time(node, strategy)` (roofline seconds), and `of(producer, output)`: which of the first two prices a
    redistribute of that value. predict.py reads `node_time` and `redistribute` again from state.cost."""

    redistribute: Callable
    tail: Callable
    node_time: Callable
    tail_values: set

    def of(self, producer: int, output: int) -> Callable:
        return self.tail if (producer, output) in self.tail_values else self.redistribute


def _pricing(state) -> Pricing:
    graph, mesh_shape, cluster = state.graph, state.mesh.shape, state.cluster
    device = cluster.device
    n_devices = 1
    for size in mesh_shape:
        n_devices *= size
    flop_cache: dict = {}
    time_cache: dict = {}
    # torch.compile: the reads and writes its fused kernels skip (autopar/cost/fusion.py); none when eager
    fused = fusion.FusedIO(frozenset(), frozenset())
    kept = 1.0 - device.fusion_eff  # the share of a skipped read or write a compiled program still moves
    if fusion.check(device):
        fused = fusion.fused_io(graph, fusion.compile_units(device, graph, state.region_of))

    def redistribute(src, dst, meta):
        if src == dst:
            return 0.0
        key = (src, dst, meta.nbytes)
        t = time_cache.get(key)
        if t is None:
            t = time_cache[key] = redistribute_time(src, dst, meta, mesh_shape, cluster)
        return t

    tail = tail_values(graph, can_be_partial(state))
    tail_share = max(1, len(tail))

    def tail_time(src, dst, meta):
        """A loss-tail value's all_reduce (autopar/loss_tail.py: the redistribute pass groups them): its bandwidth and
        its share of one collective's latency, as a gradient's in a bucket (1 / the number of loss-tail values)."""
        if src == dst or not all_reduced(src, dst, meta, mesh_shape):
            return redistribute(src, dst, meta)
        key = (src, dst, meta.nbytes, "tail")
        t = time_cache.get(key)
        if t is None:
            t = time_cache[key] = grad_reduce_time(src, dst, meta, mesh_shape, cluster, tail_share)
        return t

    def node_time(n, s):
        """Seconds of node n under strategy s (work split by the mesh dims its first output shards; the device's
        kernel model or roofline, autopar/cost/kernels.py; the bytes a fused program moves under torch.compile),
        plus the device's fixed time per op."""
        flops = global_flops(graph, n, flop_cache)
        if flops == 0.0 and n.kind != "op":
            return 0.0
        if is_view(n.target):  # aliases its input: no data moves
            return device.op_overhead
        work = 1
        out = next((p for p in s.out if p is not None), None)
        if out is not None:
            work = n_devices // max(1, _replicated(out, mesh_shape))
        nbytes = sum(
            m.nbytes / num_shards(p, mesh_shape) * (kept if (n.idx, o) in fused.skip_writes else 1.0)
            for o, (m, p) in enumerate(zip(n.outs, s.out))
            if m is not None and p
        ) + sum(
            graph.meta(r).nbytes / num_shards(p, mesh_shape) * (kept if (n.idx, j) in fused.skip_reads else 1.0)
            for j, (r, p) in enumerate(zip(n.inputs(), s.ins))
        )
        dtype = next((m.dtype for m in n.outs if m is not None and m.dtype.is_floating_point), torch.float32)
        ins = [graph.meta(r) for r in n.inputs()]  # GEMMs and attention priced by their local shapes
        t = kernel_node_time(n.target, n.args, n.kwargs, ins, s.ins, mesh_shape, flops / work, nbytes, device, dtype)
        # collectives inside the op (the row reductions of a class-sharded loss): blocking, so part of its time
        for kind, m, b in vocab_parallel.internal_collectives(n, s, ins, mesh_shape):
            t += collective_time(kind, b, mesh_shape[m], link_of(cluster, mesh_shape, m))
        return t + device.op_overhead

    return Pricing(redistribute, tail_time, float8.priced(state, node_time), tail)


@dataclass
class Groups:
    """Decision groups in representative space. follow: follower -> (producer, producer output, input position);
    root: rep node -> its group's root; roots: the group roots in order; group_id: root -> group index;
    choice[i][k]: strategy index of rep node i when its group root takes strategy k; extra[i]: a follower's
    redistribute time per root strategy."""

    reps: list
    follow: dict
    root: dict
    roots: list
    group_id: dict
    choice: dict
    extra: dict


def _groups(state, redistribute) -> Groups:
    nodes, strategies, rep, region_of = state.graph.nodes, state.strategies, state.rep, state.region_of
    reps = [i for i in range(len(nodes)) if rep[i] == i]
    follow: dict[int, tuple[int, int, int]] = {}
    for i in reps:
        n = nodes[i]
        if n.kind != "op":
            continue
        ins = n.inputs()
        lead = _lead_input(state.graph, n, ins)
        if lead is None:
            continue
        ref = ins[lead]
        if region_of[ref.node] == region_of[i] and nodes[ref.node].kind in ("op", "param"):
            follow[i] = (ref.node, ref.out, lead)
    root = {}
    for i in reps:  # topological order: producers first
        root[i] = root[follow[i][0]] if i in follow else i
    roots = [i for i in reps if root[i] == i]
    group_id = {r: k for k, r in enumerate(roots)}
    best_memo: dict = {}  # (producer placement, follower's input options) -> best
    choice: dict[int, np.ndarray] = {}
    extra: dict[int, np.ndarray] = {}
    for i in reps:
        if i not in follow:
            choice[i] = np.arange(len(strategies[i])) if root[i] == i else None
            continue
        producer, out, lead = follow[i]
        first: dict = {}  # distinct placement of the lead input -> first strategy
        for j, s in enumerate(strategies[i]):
            first.setdefault(s.ins[lead], j)
        meta = nodes[producer].outs[out]
        best: dict = {}
        first_key = (tuple(first.items()), meta.nbytes)
        for s_p in strategies[producer]:
            placement = s_p.out[out]
            if placement not in best:
                hit = best_memo.get((placement, first_key))
                if hit is None:
                    hit = best_memo[(placement, first_key)] = min(
                        (redistribute(placement, d, meta), j) for d, j in first.items()
                    )
                best[placement] = hit
        producer_choice = choice[producer]
        chosen = np.empty(len(producer_choice), dtype=np.int64)
        seconds = np.empty(len(producer_choice))
        for k, pk in enumerate(producer_choice):
            t, j = best[strategies[producer][pk].out[out]]
            chosen[k], seconds[k] = j, t
        choice[i], extra[i] = chosen, seconds
    return Groups(reps, follow, root, roots, group_id, choice, extra)


@dataclass
class Terms:
    """Per-group linear terms (one array per group, one entry per root strategy)."""

    compute: list
    comm: list
    comm_overlappable: list  # the part of comm that can overlap compute
    state_mem: list
    act_mem: list


def _gathers_param(graph) -> Callable:
    """p -> is a redistribute of node p's output a parameter gather (overlappable, as FSDP prefetches)? (cached)"""
    rooted: dict = {}

    def gathers(p):
        if p not in rooted:
            rooted[p] = param_root(graph, p) is not None
        return rooted[p]

    return gathers


def _group_terms(state, groups: Groups, node_time, gathers_param) -> Terms:
    nodes, strategies, rep, mesh_shape = state.graph.nodes, state.strategies, state.rep, state.mesh.shape
    count = defaultdict(int)
    for i in range(len(nodes)):
        count[rep[i]] += 1
    sizes = [len(strategies[r]) for r in groups.roots]
    terms = Terms(*([np.zeros(k) for k in sizes] for _ in range(5)))
    bytes_per_param = state.precision.bytes_per_param
    for i in groups.reps:
        n, gi, c = nodes[i], groups.group_id[groups.root[i]], count[i]
        chosen = groups.choice[i]
        time_of = {}
        for k, j in enumerate(chosen):
            if j not in time_of:
                time_of[j] = node_time(n, strategies[i][j])
            terms.compute[gi][k] += c * time_of[j]
        if i in groups.extra:
            terms.comm[gi] += c * groups.extra[i]
            if gathers_param(groups.follow[i][0]):
                terms.comm_overlappable[gi] += c * groups.extra[i]
        if n.kind == "param":
            for k, j in enumerate(chosen):
                terms.state_mem[gi][k] += (
                    c * n.out.numel * bytes_per_param / num_shards(strategies[i][j].out[0], mesh_shape)
                )
        elif n.kind == "op" and n.phase == "fw":
            saved = [o for o, m in enumerate(n.outs) if m is not None]
            if saved and any(nodes[u].phase == "bw" for u in n.users):
                for k, j in enumerate(chosen):
                    s = strategies[i][j]
                    terms.act_mem[gi][k] += c * sum(
                        n.outs[o].nbytes / num_shards(s.out[o], mesh_shape) for o in saved if s.out[o] is not None
                    )
    return terms


def _edge_counts(graph, rep, follow) -> dict:
    """(rep producer, output, rep consumer, input position | "opt" | "state") -> instances, for every input that is
    not a follower's lead, every gradient into its optimizer step and every buffer update."""
    edge_count = defaultdict(int)
    for v in range(len(graph.nodes)):
        rv = rep[v]
        if graph.nodes[v].kind != "op":
            continue
        lead = follow[rv][2] if rv in follow else None
        for j, r in enumerate(graph.nodes[v].inputs()):
            if j != lead:
                edge_count[(rep[r.node], r.out, rv, j)] += 1
    for fqn, r in graph.grads.items():  # optimizer step: grad must match the parameter's placement
        edge_count[(rep[r.node], r.out, rep[graph.params[fqn]], "opt")] += 1
    for fqn, r in graph.state_updates.items():  # a buffer's new value is written at the buffer's placement
        edge_count[(rep[r.node], r.out, rep[graph.buffers[fqn]], "state")] += 1
    return edge_count


@dataclass
class Edges:
    """Between groups: (g1, g2) -> redistribute-time matrix (producer choice x consumer choice), its overlappable
    part, the bucket-latency corrections and the bucket series (see _bucket_series)."""

    matrices: dict = field(default_factory=dict)
    overlappable: dict = field(default_factory=dict)
    bucket_delta: dict = field(default_factory=dict)
    series: dict = field(default_factory=dict)


def _edge_matrix(state, meta, us, vs, gradient: bool, price) -> np.ndarray:
    """Seconds of each (distinct source placement, distinct destination placement) move of one value."""
    mesh_shape, cluster, n_grads = state.mesh.shape, state.cluster, len(state.graph.grads)
    if gradient:  # gradient into the optimizer step: bucketed reductions pay latency per bucket
        return np.array(
            [[0.0 if a == b else grad_reduce_time(a, b, meta, mesh_shape, cluster, n_grads) for b in vs] for a in us]
        )
    return np.array([[price(a, b, meta) for b in vs] for a in us])


def _edge_terms(state, groups: Groups, edge_count, pricing: Pricing, gathers_param, terms: Terms) -> Edges:
    nodes, strategies, mesh_shape, cluster = state.graph.nodes, state.strategies, state.mesh.shape, state.cluster
    edges, matrix_cache = Edges(), {}
    for (p, o, v, j), c in sorted(edge_count.items(), key=lambda kv: tuple(map(str, kv[0]))):
        g1, g2 = groups.group_id[groups.root[p]], groups.group_id[groups.root[v]]
        meta = nodes[p].outs[o]
        src = [strategies[p][x].out[o] for x in groups.choice[p]]
        dst = [strategies[v][x].out[0] if j in ("opt", "state") else strategies[v][x].ins[j] for x in groups.choice[v]]
        us, ui = _uniq(src)
        vs, vi = _uniq(dst)
        gradient = j == "opt"
        price = pricing.of(p, o)
        key = (tuple(us), tuple(vs), meta.nbytes, gradient, price is pricing.tail)
        small = matrix_cache.get(key)
        if small is None:
            small = matrix_cache[key] = _edge_matrix(state, meta, us, vs, gradient, price)
        cost = c * small[np.ix_(ui, vi)]
        if gradient or price is pricing.tail and nodes[v].phase == "fw":
            joins = (_grad_joins if gradient else _tail_joins)(meta, mesh_shape, cluster)
            _bucket_series(
                us, vs, ui, vi, meta, c, small, g1, g2, mesh_shape, cluster, edges.bucket_delta, edges.series, joins
            )
        overlappable = gradient or gathers_param(p)  # gradient reductions and parameter gathers overlap compute
        if g1 == g2:
            terms.comm[g1] += np.diag(cost)
            if overlappable:
                terms.comm_overlappable[g1] += np.diag(cost)
        elif not cost.any():
            continue
        else:
            pair = (g1, g2)
            edges.matrices[pair] = edges.matrices[pair] + cost if pair in edges.matrices else cost
            if overlappable:
                ovl = edges.overlappable
                ovl[pair] = ovl[pair] + cost if pair in ovl else cost
    return edges


def run(state) -> None:
    graph, strategies, rep = state.graph, state.strategies, state.rep
    pricing = _pricing(state)
    groups = _groups(state, pricing.redistribute)
    gathers_param = _gathers_param(graph)
    terms = _group_terms(state, groups, pricing.node_time, gathers_param)
    edge_count = _edge_counts(graph, rep, groups.follow)
    edges = _edge_terms(state, groups, edge_count, pricing, gathers_param, terms)
    choice, group_id, root = groups.choice, groups.group_id, groups.root
    mesh_shape = state.mesh.shape
    share_delta, shared, unshared = _shared(
        graph, rep, strategies, choice, group_id, root, pricing.of, mesh_shape, gathers_param
    )
    if unshared:  # Plan.meta: the values whose shared moves are priced once per consumer
        state.extras["shared_moves_priced_per_consumer"] = unshared
    _coalesce(
        edge_count,
        graph.nodes,
        strategies,
        choice,
        group_id,
        root,
        edges.matrices,
        pricing.of,
        mesh_shape,
        pricing.tail_values,
    )
    loss, loss_rep = graph.loss, rep[graph.loss.node]  # the step returns the loss replicated (global view)
    replicated = ("R",) * len(mesh_shape)
    terms.comm[group_id[root[loss_rep]]] += np.array(
        [
            pricing.redistribute(
                strategies[loss_rep][x].out[loss.out], replicated, graph.nodes[loss_rep].outs[loss.out]
            )
            for x in choice[loss_rep]
        ]
    )
    state.groups, state.group_of = groups.roots, {i: group_id[root[rep[i]]] for i in range(len(graph.nodes))}
    state.choice, state.follow = choice, groups.follow
    series = edges.series
    state.cost = {
        "compute": terms.compute,
        "comm": terms.comm,
        "state_mem": terms.state_mem,
        "act_mem": terms.act_mem,
        "edges": edges.matrices,
        "rtime": pricing.redistribute,
        "node_time": pricing.node_time,
        "comm_ovl": terms.comm_overlappable,
        "edges_ovl": edges.overlappable,
        "bucket_delta": edges.bucket_delta,
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


# The dense charge-matrix elements (producer choices x consumer choices x destination placements) one shared value
# may take: 2e7 float64 is 160 MB. An MoE's dispatch on a mesh of 4 dims of 2 has 625 x 2401 choices per edge and
# hundreds of destinations, tens of GB in all (the planner died of memory); beyond the cap the value's consumers
# each pay their own move, the edges' price, which bounds the shared one from above.
SHARED_MAX_ELEMENTS = 2e7


def _shared(g, rep, S, choice, gid, root, pricing, mesh_shape, rooted):
    """Redistributes several consumers share (passes/redistribute.py: one value taken to one placement in one phase,
    any phase for a value of at most HELD_NUMEL elements, not rooted in a parameter, runs once). The edges price
    each consumer's; for the exact objective, per value and destination placement d that at least two of its
    consumers can need, their price of the transitions into d moves to one charge paid once: the max over those
    consumers of W[producer choice, consumer choice] = price(src, d) where that consumer takes d (the solver's `shared`,
    (producer nodes with these consumers, [((g1, g2), W)])); `delta` ((g1, g2) -> matrix, added to the edges;
    g1 == g2: its diagonal, to the group) takes it off the edges. A value feeding consumers in several layers (a
    RoPE table) is counted per producer node. rooted(p): is node p's output rooted in a parameter. Also returns the
    values left to the edges' prices (SHARED_MAX_ELEMENTS)."""
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
    delta, charges, skipped = {}, [], []
    for (p, o, us), c in sorted(sigs.items(), key=lambda kv: str(kv[0])):
        meta, g1, rtime = nodes[p].outs[o], gid[root[p]], pricing(p, o)
        pls, si = _uniq([S[p][x].out[o] for x in choice[p]])
        n_src = len(pls)  # the producer's placements come first in `ids`; only they are ever a move's source
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
        dests = np.unique(np.concatenate([di for _, di, _ in cons]))
        if len(si) * sum(len(di) for _, di, _ in cons) * len(dests) > SHARED_MAX_ELEMENTS:
            skipped.append(nodes[p].name)  # each consumer pays its own move (the edges' price): a bound from above
            continue
        for d in dests:
            price = np.array(
                [
                    rtime(pls[a], pls[d], meta) if a != d and communicates(pls[a], pls[d], mesh_shape) else 0.0
                    for a in range(n_src)
                ]
            )[si]  # per producer choice: its move into d
            if not price.any():
                continue
            joined = []
            for g2, di, m in cons:  # a consumer's charge matrix, where it is not all zero (in its group: its diagonal)
                hit = di == d
                if (price * hit).any() if g2 == g1 else hit.any():
                    joined.append((g2, np.outer(price, hit), m))
            if sum(m for _, _, m in joined) < 2:
                continue
            for g2, W, m in joined:
                key = (g1, g2)
                delta[key] = delta[key] - c * m * W if key in delta else -c * m * W
            charges.append((float(c), [((g1, g2), W) for g2, W, _ in joined]))
    return delta, charges, skipped


def _lead_input(g, n, ins):
    """The input a node follows: its only tensor input, for pointwise ops the largest input (first on ties), for the
    loss ops after log_softmax its log-probabilities (vocab_parallel.LOG_PROBS_INPUT: where the log-probs are
    class-sharded the loss computes there; as decisions of their own these ops made the LP relaxation of an 8B
    plan on an (8, 8) mesh take 60 s of dual simplex instead of 1)."""
    if len(ins) == 1:
        return 0
    if n.target in vocab_parallel.LOG_PROBS_INPUT and len(ins) > vocab_parallel.LOG_PROBS_INPUT[n.target]:
        return vocab_parallel.LOG_PROBS_INPUT[n.target]
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
