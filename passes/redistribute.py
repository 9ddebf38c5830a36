"""Pass: an explicit redistribute (its collectives, on which mesh dim, how many bytes) wherever a consumer needs
a placement other than its producer's, including each gradient into its parameter's optimizer step and the loss
into Replicate (a training step returns the global loss on every rank)."""
from __future__ import annotations

from autopar.redistribute import collectives


def run(state) -> None:
    g, P, mesh_shape = state.graph, state.placement, state.mesh.shape
    red = {}
    for n in g.ops():
        for j, r in enumerate(n.inputs()):
            src, dst = P[r.node].out[r.out], P[n.idx].ins[j]
            if src != dst:
                red[(n.idx, j)] = (src, dst, collectives(src, dst, g.meta(r), mesh_shape))
    for fqn, r in g.grads.items():
        p = g.params[fqn]
        src, dst = P[r.node].out[r.out], P[p].out[0]
        if src != dst:
            red[(p, "opt")] = (src, dst, collectives(src, dst, g.meta(r), mesh_shape))
    src, dst = P[g.loss.node].out[g.loss.out], ("R",) * len(mesh_shape)
    if src != dst:                                     # the step returns the loss itself (global view)
        red[(g.loss.node, "loss")] = (src, dst, collectives(src, dst, g.meta(g.loss), mesh_shape))
    state.redistributes = red
