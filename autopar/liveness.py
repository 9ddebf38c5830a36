"""Memory per rank of a placed graph (model state, the activation liveness peak of the fw+bw order, with or without
checkpointed blocks) and the forward time that checkpointing recomputes: what the prediction reports and what the
solve and checkpointing passes check a candidate plan against.

A placement P is one Strategy per node (P[i].out[o]: output o's placement per mesh dim); recompute is the
checkpointing pass's [{"block": FQN, "nodes": [node indices]}] or None.
"""

from __future__ import annotations

from collections import defaultdict

from .cost import is_view
from .cost.memory import idle_cached_bytes
from .strategies import num_shards, vocab_parallel


def workspace(g, P, n, mesh_shape) -> float:
    """Bytes op n holds inside itself beyond its inputs and outputs at its placement (a class-sharded loss's
    temporaries: autopar/strategies/vocab_parallel.py); 0 for every other op."""
    if n.kind != "op" or n.target not in vocab_parallel.OPS:
        return 0.0
    return vocab_parallel.workspace_bytes(n, P[n.idx], [g.meta(r) for r in n.inputs()], mesh_shape)


def state_bytes(g, P, mesh_shape, precision) -> float:
    """Parameters, gradients and optimizer state per rank at the parameters' storage placements."""
    return sum(
        g.nodes[i].out.numel * precision.bytes_per_param / num_shards(P[i].out[0], mesh_shape)
        for i in g.params.values()
    )


def last_uses(g):
    """(last consumer index per (node, output), the gradient refs): the lifetimes a liveness walk needs; the loss
    lives to the end of the step."""
    last = {}
    for n in g.nodes:
        for r in n.inputs():
            last[(r.node, r.out)] = n.idx
    for r in [g.loss, *g.input_grads.values(), *g.state_updates.values()]:
        last[(r.node, r.out)] = len(g.nodes)
    return last, {(r.node, r.out) for r in g.grads.values()}


def liveness_peak(g, P, mesh_shape, recompute=None) -> float:
    """Max over the fw+bw order of live activation bytes per rank (parameters are model state, not counted).
    recompute: checkpointed blocks (passes/checkpointing.py), whose saved activations are dropped and recomputed."""
    if recompute:
        return liveness_peak_checkpointed(g, P, mesh_shape, recompute)
    last, grad_refs = last_uses(g)
    frees: dict[int, list] = {}
    live = peak = 0.0
    size = {}
    for n in g.nodes:
        if n.kind == "op":
            for o, m in enumerate(n.outs):
                if m is None or P[n.idx].out[o] is None:
                    continue
                b = m.nbytes / num_shards(P[n.idx].out[o], mesh_shape)
                size[(n.idx, o)] = b
                live += b
                end = n.idx if (n.idx, o) in grad_refs else last.get((n.idx, o), n.idx)
                frees.setdefault(end, []).append((n.idx, o))
        elif n.kind == "input":
            b = n.out.nbytes / num_shards(P[n.idx].out[0], mesh_shape)
            size[(n.idx, 0)] = b
            live += b
            frees.setdefault(last.get((n.idx, 0), n.idx), []).append((n.idx, 0))
        peak = max(peak, live + workspace(g, P, n, mesh_shape))
        for key in frees.pop(n.idx, []):
            live -= size[key]
    return peak


def recompute_seconds(state, times) -> float:
    """Forward time recomputed in the backward: the fw op nodes of every checkpointed block."""
    return recomputed_seconds(state.graph, state.recompute, times)


def recomputed_seconds(g, recompute, times) -> float:
    """recompute_seconds of checkpointed blocks `recompute` ([{"block", "nodes"}]) on graph g, per-node `times`."""
    return sum(
        times[i] for b in recompute or () for i in b["nodes"] if g.nodes[i].kind == "op" and g.nodes[i].phase == "fw"
    )


def liveness_peak_checkpointed(g, P, mesh_shape, recompute) -> float:
    """liveness_peak with checkpointed blocks: a block's saved activations (fw outputs with a bw use,
    other than the block's outputs) are freed after its last forward node and live again from its first
    backward node (the recompute) until their last use."""
    last, grad_refs = last_uses(g)
    in_block, fw_end, bw_start = {}, {}, {}
    for b, blk in enumerate(recompute):
        for i in blk["nodes"]:
            in_block[i] = b
            if g.nodes[i].phase == "fw":
                fw_end[b] = max(fw_end.get(b, -1), i)
            elif g.nodes[i].kind == "op":
                bw_start[b] = min(bw_start.get(b, len(g.nodes)), i)
    adds: dict[int, list] = defaultdict(list)
    frees: dict[int, list] = defaultdict(list)
    size = {}
    for n in g.nodes:
        if n.kind not in ("op", "input"):
            continue
        for o, m in enumerate(n.outs):
            if m is None or P[n.idx].out[o] is None:
                continue
            key = (n.idx, o)
            size[key] = m.nbytes / num_shards(P[n.idx].out[o], mesh_shape)
            end = n.idx if key in grad_refs else last.get(key, n.idx)
            b = in_block.get(n.idx)
            users = n.users
            dropped = (
                b is not None
                and n.phase == "fw"
                and b in bw_start
                and end > fw_end[b]
                and all(in_block.get(u) == b or g.nodes[u].phase == "bw" for u in users)
                and bw_start[b] < end
            )
            adds[n.idx].append(key)
            if dropped:
                frees[fw_end[b]].append(key)
                adds[bw_start[b] - 0.5].append(key)
            frees[end].append(key)
    live = peak = 0.0
    for n in g.nodes:
        for key in adds.pop(n.idx - 0.5, []):
            live += size[key]
        for key in adds.pop(n.idx, []):
            live += size[key]
        peak = max(peak, live + workspace(g, P, n, mesh_shape))
        for key in frees.pop(n.idx, []):
            live -= size[key]
    return peak


def storage_roots(g) -> dict:
    """(node, output) -> (node, output) of the buffer that holds it: a view's outputs (view, t, split, ...) share
    their input's storage, so a chain of views names its first non-view producer."""
    root = {}
    for n in g.nodes:
        outs = range(len(n.outs))
        if n.kind == "op" and is_view(n.target) and n.inputs():
            r = n.inputs()[0]
            base = root.get((r.node, r.out), (r.node, r.out))
            root.update({(n.idx, o): base for o in outs})
        else:
            root.update({(n.idx, o): (n.idx, o) for o in outs})
    return root


def _buffers(g, P, mesh_shape, where):
    """The op-produced buffers of a placed graph (one per storage): per-rank bytes, the buffers freed after each
    node, their producer's cluster, and which are shared (backward buffers, forward ones nobody saves) rather than
    their cluster's saved activations (cluster_peaks)."""
    last, grad_refs = last_uses(g)
    root = storage_roots(g)
    end, size, shared, owner = {}, {}, set(), {}
    saved = set()
    for n in g.nodes:
        if n.kind != "op":
            continue
        for o, m in enumerate(n.outs):
            key = (n.idx, o)
            s = root[key]
            if g.nodes[s[0]].kind != "op":
                continue
            end[s] = max(end.get(s, -1), n.idx if key in grad_refs else last.get(key, n.idx))
            if n.phase == "fw" and any(g.nodes[u].phase == "bw" for u in n.users):
                saved.add(s)
            if s == key and m is not None and P[n.idx].out[o] is not None:
                size[s] = m.nbytes / num_shards(P[n.idx].out[o], mesh_shape)
                owner[s] = where[n.idx]
                if n.phase == "bw":
                    shared.add(s)
    shared |= {s for s in size if s not in saved}
    frees = defaultdict(list)
    for s in size:
        frees[end[s]].append(s)
    return size, frees, owner, shared


def cluster_peaks(g, P, mesh_shape, where, K: int) -> list[float]:
    """Per cluster (where[node] in 0..K-1; None: in no cluster) the most bytes per rank live at once while one of
    its nodes runs, over the buffers a stage's memory model does not already hold as another cluster's saved
    activations: the cluster's own (forward, saved or not, and backward), every backward buffer (the incoming
    gradient) and forward buffers nobody saves that are still in use (a block's output the next block reads). This
    is where the loss's logits copies (bf16 logits, their fp32 upcast, log_softmax's output and, in the backward,
    its gradient beside the saved output) and a block's gradient temporaries show. Each buffer counts once however
    many views read it; parameters, inputs and their views are model state; a parameter's gradient is freed as it
    is produced (FSDP's terms hold it)."""
    size, frees, owner, shared = _buffers(g, P, mesh_shape, where)
    peak = [0.0] * K
    live_shared, live_own = 0.0, defaultdict(float)
    for n in g.nodes:
        for o in range(len(n.outs)):
            s = (n.idx, o)
            if s in size:
                if s in shared:
                    live_shared += size[s]
                else:
                    live_own[owner[s]] += size[s]
        c = where[n.idx]
        if c is not None and n.kind == "op":
            peak[c] = max(peak[c], live_shared + live_own[c] + workspace(g, P, n, mesh_shape))
        for s in frees.pop(n.idx, []):
            if s in shared:
                live_shared -= size[s]
            else:
                live_own[owner[s]] -= size[s]
    return peak


def cluster_idle(g, P, mesh_shape, where, K: int) -> list[float]:
    """Per cluster the bytes the caching allocator keeps reserved beyond its allocated peak over the cluster's own
    buffers, in its nodes' order from a cold cache (autopar/cost/memory.py idle_cached_bytes; a buffer freed after
    the cluster's last node stays allocated): the loss's bf16 logits segment its backward cannot reuse."""
    size, frees, owner, _ = _buffers(g, P, mesh_shape, where)
    events = [[] for _ in range(K)]
    for n in g.nodes:
        c = where[n.idx]
        if c is None or n.kind != "op":
            continue
        events[c] += [(s, size[s]) for o in range(len(n.outs)) if (s := (n.idx, o)) in size and owner[s] == c]
        events[c] += [(s, None) for s in frees.pop(n.idx, []) if owner[s] == c]
    return [idle_cached_bytes(ev) for ev in events]
