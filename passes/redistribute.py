"""Pass: an explicit redistribute (its collectives, on which mesh dim, how many bytes) wherever a consumer needs
a placement other than its producer's, including each gradient into its parameter's optimizer step and the loss
into Replicate (a training step returns the global loss on every rank), and each buffer update (BatchNorm's
running statistics) into its buffer's placement.

Several consumers of one activation that need it at the same placement in the same phase (the normed input of
wq, wk and wv gathered from a sequence shard) share one redistribute: the first consumer runs it, the others
reuse its result (`state.shares`; no collectives of their own). The prediction, the executor and the solver's
exact objective (passes/costs.py `_shared`) count the shared redistribute once. Values rooted in a parameter are not
shared: holding a gathered weight from its first to its last use would change the memory the plan was solved for. A
value of at most HELD_NUMEL elements is shared across phases too (the loss's count of targets, an MoE layer's
expert load, reduced in the forward, read by the backward): holding it costs next to nothing.

Inputs of one op that the same all_reduces take to Replicate (the loss sum and the count of targets into their
quotient) are coalesced, as all_reduce_coalesced does: one collective of their summed size on the first of them,
none on the others (`state.coalesced`: (consumer, input) -> (consumer, input) whose collective carries it). So are
the all_reduces of loss-tail values across ops (autopar/loss_tail.py: an MoE's per-layer expert loads, one collective
at the end of the forward), with the forward's order of execution that allows it (`state.fw_order`)."""

from __future__ import annotations

from autopar.graph import TensorMeta, param_root
from autopar.collectives import all_reduced, bucket_steps, collectives
from autopar.loss_tail import HELD_NUMEL, can_be_partial, coalesce_tail


def run(state) -> None:
    g, P, mesh_shape, cluster = state.graph, state.placement, state.mesh.shape, state.cluster
    red, shares, first, coalesced = {}, {}, {}, {}
    for n in g.ops():
        alike: dict = {}  # (src, dst, dtype) -> [(input, numel)] all-reduced alike
        for j, r in enumerate(n.inputs()):
            src, dst = P[r.node].out[r.out], P[n.idx].ins[j]
            if src == dst:
                continue
            meta = g.meta(r)
            cs = collectives(src, dst, meta, mesh_shape, cluster)
            key = (r.node, r.out, dst, n.phase if meta.numel > HELD_NUMEL else None)
            if cs and key in first and param_root(g, r.node) is None:
                shares[(n.idx, j)] = first[key]
                cs = ()
            first.setdefault(key, (n.idx, j))
            red[(n.idx, j)] = (src, dst, cs)
            if cs and all_reduced(src, dst, meta, mesh_shape):
                alike.setdefault((src, dst, meta.dtype), []).append((j, meta.numel))
        for (src, dst, dtype), js in alike.items():
            if len(js) > 1:
                total = TensorMeta((sum(k for _, k in js),), dtype)
                red[(n.idx, js[0][0])] = (src, dst, collectives(src, dst, total, mesh_shape, cluster))
                for j, _ in js[1:]:
                    red[(n.idx, j)] = (src, dst, ())
                    coalesced[(n.idx, j)] = (n.idx, js[0][0])
    for fqn, r in g.grads.items():
        p = g.params[fqn]
        src, dst = P[r.node].out[r.out], P[p].out[0]
        if src != dst:  # a bucketed reduction is flattened, or not, per bucket (passes/buckets.py)
            flat = None if bucket_steps(src, dst) else cluster
            red[(p, "opt")] = (src, dst, collectives(src, dst, g.meta(r), mesh_shape, flat))
    for fqn, r in g.state_updates.items():  # a buffer's new value, written at the buffer's placement
        b = g.buffers[fqn]
        src, dst = P[r.node].out[r.out], P[b].out[0]
        if src != dst:
            red[(b, "state")] = (src, dst, collectives(src, dst, g.meta(r), mesh_shape, cluster))
    src, dst = P[g.loss.node].out[g.loss.out], ("R",) * len(mesh_shape)
    if src != dst and not g.activation:  # the step returns the loss itself (global view)
        red[(g.loss.node, "loss")] = (src, dst, collectives(src, dst, g.meta(g.loss), mesh_shape, cluster))
    state.fw_order = coalesce_tail(g, red, shares, coalesced, mesh_shape, cluster, can_be_partial(state))
    state.redistributes, state.shares, state.coalesced = red, shares, coalesced
