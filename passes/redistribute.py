"""Pass: an explicit redistribute (its collectives, on which mesh dim, how many bytes) wherever a consumer needs
a placement other than its producer's, including each gradient into its parameter's optimizer step and the loss
into Replicate (a training step returns the global loss on every rank).

Several consumers of one activation that need it at the same placement in the same phase (the normed input of
wq, wk and wv gathered from a sequence shard) share one redistribute: the first consumer runs it, the others
reuse its result (`state.shares`; no collectives of their own). The solver prices each edge (an upper bound);
the prediction and the executor count the shared redistribute once. Values rooted in a parameter are not shared:
holding a gathered weight from its first to its last use would change the memory the plan was solved for."""
from __future__ import annotations

from autopar.graph import param_root
from autopar.redistribute import collectives


def run(state) -> None:
    g, P, mesh_shape = state.graph, state.placement, state.mesh.shape
    red, shares, first = {}, {}, {}
    for n in g.ops():
        for j, r in enumerate(n.inputs()):
            src, dst = P[r.node].out[r.out], P[n.idx].ins[j]
            if src == dst:
                continue
            cs = collectives(src, dst, g.meta(r), mesh_shape)
            key = (r.node, r.out, dst, n.phase)
            if cs and key in first and param_root(g, r.node) is None:
                shares[(n.idx, j)] = first[key]
                cs = ()
            first.setdefault(key, (n.idx, j))
            red[(n.idx, j)] = (src, dst, cs)
    for fqn, r in g.grads.items():
        p = g.params[fqn]
        src, dst = P[r.node].out[r.out], P[p].out[0]
        if src != dst:
            red[(p, "opt")] = (src, dst, collectives(src, dst, g.meta(r), mesh_shape))
    src, dst = P[g.loss.node].out[g.loss.out], ("R",) * len(mesh_shape)
    if src != dst:                                     # the step returns the loss itself (global view)
        red[(g.loss.node, "loss")] = (src, dst, collectives(src, dst, g.meta(g.loss), mesh_shape))
    state.redistributes, state.shares = red, shares
