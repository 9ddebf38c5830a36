"""Pass: gradient buckets. Gradient reductions that are one P -> R (all_reduce) or P -> S(d) (reduce_scatter)
collective on a mesh dim (autopar.redistribute.bucket_step) are grouped, as DDP and FSDP2 group them, into buckets
of up to BUCKET_BYTES: gradients in the order the backward produces them, one bucket series per (mesh dim,
from, to, dtype). Each bucket is one collective of the summed size; the executor issues exactly these."""
from __future__ import annotations

from autopar.redistribute import BUCKET_BYTES, bucket_step


def run(state) -> None:
    g, mesh_shape = state.graph, state.mesh.shape
    open_: dict = {}
    buckets: list[dict] = []
    ready = sorted(g.grads, key=lambda f: (g.grads[f].node, f))          # backward order: last layer first
    for fqn in ready:
        key = (g.params[fqn], "opt")
        if key not in state.redistributes:
            continue
        src, dst, cs = state.redistributes[key]
        step = bucket_step(src, dst)
        if step is None or len(cs) != 1:          # a size-1 mesh dim issues nothing; multi-step stays per tensor
            continue
        c = cs[0]
        k = (step, str(g.meta(g.grads[fqn]).dtype))
        b = open_.get(k)
        if b is None or (b["bytes"] and b["bytes"] + c.nbytes > BUCKET_BYTES):
            b = open_[k] = {"kind": c.kind, "mesh_dim": c.mesh_dim, "group": c.group, "from": step[1],
                            "to": step[2], "dtype": k[1], "params": [], "bytes": 0}
            buckets.append(b)
        b["params"].append(fqn)
        b["bytes"] += c.nbytes
    state.buckets = buckets
