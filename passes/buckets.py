"""Pass: gradient buckets. Gradient reductions that are one P -> R (all_reduce) or P -> S(d) (reduce_scatter)
collective on a mesh dim, or a chain of all_reduces over several mesh dims (autopar.collectives.bucket_steps),
are grouped, as DDP and FSDP2 group them, into buckets of up to BUCKET_BYTES: gradients in the order the backward
produces them, one bucket series per (steps, dtype). Each bucket is one collective of the summed size; a chain is
one bucket per step, over the same gradients ("chain": the index of its first bucket, "step" its position), run
one after the other, or, when the cost model prices it lower for the bucket's size (autopar.collectives.
flatten_chain), one all_reduce over the flattened group of the chain's mesh dims ("mesh_dim": the list of dims,
as DDP over a 2-D data-parallel mesh runs). The executor issues exactly these."""

from __future__ import annotations

import math

from autopar.collectives import BUCKET_BYTES, bucket_steps, flatten_chain


def run(state) -> None:
    g = state.graph
    open_: dict = {}
    buckets: list[dict] = []
    ready = sorted(g.grads, key=lambda f: (g.grads[f].node, f))  # backward order: last layer first
    for fqn in ready:
        key = (g.params[fqn], "opt")
        if key not in state.redistributes:
            continue
        src, dst, cs = state.redistributes[key]
        todo = bucket_steps(src, dst)
        if todo is None or len(cs) != len(todo):  # a size-1 mesh dim issues nothing
            continue
        k = (todo, str(g.meta(g.grads[fqn]).dtype))
        chain = open_.get(k)
        if chain is None or (chain[0]["bytes"] and chain[0]["bytes"] + cs[0].nbytes > BUCKET_BYTES):
            first = len(buckets)
            chain = open_[k] = [
                {
                    "kind": c.kind,
                    "mesh_dim": c.mesh_dim,
                    "group": c.group,
                    "from": st[1],
                    "to": st[2],
                    "dtype": k[1],
                    "params": [],
                    "bytes": 0,
                    "chain": first,
                    "step": i,
                }
                for i, (c, st) in enumerate(zip(cs, todo))
            ]
            buckets += chain
        for b, c in zip(chain, cs):
            b["params"].append(fqn)
            b["bytes"] += c.nbytes
    chains: dict[int, list] = {}
    for b in buckets:
        chains.setdefault(b["chain"], []).append(b)
    out = []
    for chain in chains.values():
        todo = tuple((c["mesh_dim"], c["from"], c["to"]) for c in chain)
        if len(chain) > 1 and flatten_chain(todo, chain[0]["bytes"], state.mesh.shape, state.cluster):
            chain = [
                {**chain[0], "mesh_dim": [c["mesh_dim"] for c in chain], "group": math.prod(c["group"] for c in chain)}
            ]
        first = len(out)
        out += [{**c, "chain": first} for c in chain]
    state.buckets = out
