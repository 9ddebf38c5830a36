"""Pass: gradient buckets. Gradient reductions that are one P -> R (all_reduce) or P -> S(d) (reduce_scatter)
collective on a mesh dim, or a chain of all_reduces over several mesh dims (autopar.redistribute.bucket_steps),
are grouped, as DDP and FSDP2 group them, into buckets of up to BUCKET_BYTES: gradients in the order the backward
produces them, one bucket series per (steps, dtype). Each bucket is one collective of the summed size; a chain is
one bucket per step, over the same gradients ("chain": the index of its first bucket, "step" its position), run
one after the other. The executor issues exactly these."""
from __future__ import annotations

from autopar.redistribute import BUCKET_BYTES, bucket_steps


def run(state) -> None:
    g = state.graph
    open_: dict = {}
    buckets: list[dict] = []
    ready = sorted(g.grads, key=lambda f: (g.grads[f].node, f))          # backward order: last layer first
    for fqn in ready:
        key = (g.params[fqn], "opt")
        if key not in state.redistributes:
            continue
        src, dst, cs = state.redistributes[key]
        todo = bucket_steps(src, dst)
        if todo is None or len(cs) != len(todo):   # a size-1 mesh dim issues nothing
            continue
        k = (todo, str(g.meta(g.grads[fqn]).dtype))
        chain = open_.get(k)
        if chain is None or (chain[0]["bytes"] and chain[0]["bytes"] + cs[0].nbytes > BUCKET_BYTES):
            first = len(buckets)
            chain = open_[k] = [{"kind": c.kind, "mesh_dim": c.mesh_dim, "group": c.group, "from": st[1], "to": st[2],
                                 "dtype": k[1], "params": [], "bytes": 0, "chain": first, "step": i}
                                for i, (c, st) in enumerate(zip(cs, todo))]
            buckets += chain
        for b, c in zip(chain, cs):
            b["params"].append(fqn)
            b["bytes"] += c.nbytes
    state.buckets = buckets
