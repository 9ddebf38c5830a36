"""Per-cluster metrics of one intra-op plan for the pipeline stage search: forward / backward-input /
backward-weight seconds, data-parallel communication, model state and the activation bytes each micro-batch
keeps for backward (each saved buffer once, however many views of it backward reads), and the most bytes each
cluster's run holds at once (autopar/liveness.py cluster_peaks: its transients above those saved activations) and
what the caching allocator keeps reserved beyond that over the cluster's own buffers (cluster_idle)."""

from __future__ import annotations

import re

import numpy as np

from autopar.cost import collective_time, is_view
from autopar.liveness import cluster_idle, cluster_peaks
from autopar.strategies import data_parallel, num_shards

INF = float("inf")


def _feeds_earlier(g, where) -> list:
    """Per node: a backward node whose results reach an earlier cluster's backward (input-gradient work, B);
    the others are weight-gradient work (W)."""
    feeds = [False] * len(g.nodes)
    for n in reversed(g.nodes):
        if n.kind != "op" or n.phase != "bw":
            continue
        c = where[n.idx]
        feeds[n.idx] = any(
            g.nodes[u].phase == "bw" and where[u] is not None and (where[u] < c or (where[u] == c and feeds[u]))
            for u in n.users
        )
    return feeds


# torchtitan's selective op activation checkpointing ("op" SAC, torchtitan/distributed/activation_checkpoint.py):
# a block saves the outputs of its matmuls, except every second one (counted per block in forward order), and of
# the attention kernels; everything else it runs again before its backward
SAC_SAVED = ("aten.mm.default", "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient")


def _sac_saved(target: str, mm_seen: int) -> bool:
    if target == "aten.mm.default":
        return mm_seen % 2 == 1
    return target.startswith(SAC_SAVED[1:])


def _read_after_blocks(g, where, i: int, K: int) -> bool:
    """Whether parameter node i is read by a forward op after the blocks (cluster K - 1: the output head of a tied
    embedding)."""
    return any(where[u] == K - 1 for u in g.nodes[i].users if g.nodes[u].phase == "fw")


def node_metrics(state, plan, where, K: int) -> dict:
    """Per cluster F/B/W seconds (compute + activation redistributes), dp comm seconds, model-state bytes,
    saved-activation bytes, its peak live bytes while it runs (cluster_peaks), and the collectives (kind -> [count,
    bytes]) of its activation and dp redistributes."""
    g, P, mesh_shape = state.graph, state.placement, state.mesh.shape
    F, B, W, dp, st, act, st_dp = (np.zeros(K) for _ in range(7))
    bpp = state.precision.bytes_per_param
    dp_dims = data_parallel.dp_dims(state.mesh.names, mesh_shape)
    feeds = _feeds_earlier(g, where)
    coll = [{"act": {}, "dp": {}} for _ in range(K)]
    saved, saved_in = {}, {}  # alias root -> per-rank bytes kept for backward, and the cluster that holds them
    sac_t, sac_b, mm_seen = np.zeros(K), np.zeros(K), np.zeros(K, dtype=int)  # op SAC: saved ops' time and bytes
    for rec in plan.nodes:
        i = rec["idx"]
        c = where[i]
        if c is None:
            continue
        n = g.nodes[i]
        t_act = sum(r["time_s"] - r.get("hidden_s", 0.0) for r in rec.get("redistribute", []) if r["class"] == "act")
        dp[c] += sum(r["time_s"] for r in rec.get("redistribute", []) if r["class"] != "act")
        for r in rec.get("redistribute", []):
            d = coll[c]["act" if r["class"] == "act" else "dp"]
            for kind, _, nbytes, _ in r["collectives"]:
                cnt = d.setdefault(kind, [0, 0])
                cnt[0] += 1
                cnt[1] += nbytes
        t = (rec.get("time_s") or 0.0) + t_act
        if n.kind == "param":
            share = num_shards(P[i].out[0], mesh_shape)
            held = [c] + ([K - 1] if c != K - 1 and _read_after_blocks(g, where, i, K) else [])
            for h in held:  # a tensor tied across the blocks (embedding and head): a copy on the last stage too
                st[h] += n.out.numel * bpp / share
                if any(P[i].out[0][d][0] == "S" for d in dp_dims):  # FSDP-sharded: scales with the dp size
                    st_dp[h] += n.out.numel * bpp / share
            if len(held) > 1:  # ... its gradient summed between the two stages once per step (over the network)
                dp[K - 1] += collective_time("all_reduce", n.out.nbytes / share, 2, state.cluster.inter)
        elif n.phase == "fw":
            F[c] += t
            target = str(n.target)
            mm_seen[c] += target == "aten.mm.default"
            if _sac_saved(target, mm_seen[c]):
                sac_t[c] += t
                sac_b[c] += sum(nb for _, nb in _saved_buffers(g, P, i, mesh_shape))
            if any(g.nodes[u].phase == "bw" for u in n.users):
                for key, nbytes in _saved_buffers(g, P, i, mesh_shape):
                    saved[key] = nbytes
                    saved_in.setdefault(key, c)  # the first (earliest) cluster that keeps it
        elif feeds[i]:
            B[c] += t
        else:
            W[c] += t
    for root, nbytes in saved.items():
        act[saved_in[root]] += nbytes
    peak = np.array(cluster_peaks(g, P, mesh_shape, where, K))
    idle = np.array(cluster_idle(g, P, mesh_shape, where, K))
    out = {"F": F, "B": B, "W": W, "dp": dp, "state": st, "act": act, "coll": coll, "state_dp": st_dp}
    out |= {"sac_time": sac_t, "sac_bytes": sac_b}
    return out | {"peak": peak, "idle": idle}


def _saved_buffers(g, P, i: int, mesh_shape) -> list:
    """[((node, out), per-rank bytes)] of the buffers that saving node i's outputs for backward keeps alive. A view
    (view, t, transpose, split, ...) keeps its base's storage, not a copy: its views share one key, so a buffer saved
    through several views (a norm output feeding wq, wk and wv) counts once and a split's pieces count their base;
    a view of a parameter is model state (counted there), not an activation."""
    n = g.nodes[i]
    if not (n.kind == "op" and is_view(n.target) and n.inputs()):
        return [
            ((i, k), m.nbytes / num_shards(p, mesh_shape))
            for k, (m, p) in enumerate(zip(n.outs, P[i].out))
            if m is not None and p is not None
        ]
    r = n.inputs()[0]
    while g.nodes[r.node].kind == "op" and is_view(g.nodes[r.node].target) and g.nodes[r.node].inputs():
        r = g.nodes[r.node].inputs()[0]
    base = g.nodes[r.node]
    if base.kind != "op":
        return []
    m, p = base.outs[r.out], P[r.node].out[r.out] if P[r.node] is not None else None
    if m is None or p is None:
        return []
    return [((r.node, r.out), m.nbytes / num_shards(p, mesh_shape))]


def cluster_of_nodes(g, prefix: str, n_layers: int) -> list:
    """Sub-model cluster position per node: 0 = pre, 1..n_layers = blocks, n_layers + 1 = post, None = free."""
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(?:\.|$)")
    post = n_layers + 1
    where = [None] * len(g.nodes)
    lay = [None] * len(g.nodes)
    for n in g.nodes:
        key = n.target if n.kind == "param" else n.module
        m = pat.match(key) if isinstance(key, str) else None
        lay[n.idx] = int(m.group(1)) + 1 if m else None
    fw_layer = [i for i, n in enumerate(g.nodes) if n.kind == "op" and n.phase == "fw" and lay[i]]
    bw_layer = [i for i, n in enumerate(g.nodes) if n.kind == "op" and n.phase == "bw" and lay[i]]
    fw_first, fw_last = (fw_layer[0], fw_layer[-1]) if fw_layer else (INF, -1)
    bw_first, bw_last = (bw_layer[0], bw_layer[-1]) if bw_layer else (INF, -1)
    cur = 0
    for n in g.nodes:
        if n.kind != "op":
            continue
        if lay[n.idx]:
            where[n.idx] = cur = lay[n.idx]
            continue
        root = n.module == ""
        if n.phase == "fw":
            where[n.idx] = 0 if n.idx < fw_first else post if n.idx > fw_last or not root else cur
        else:
            where[n.idx] = post if n.idx < bw_first else 0 if n.idx > bw_last or not root else cur
    for fqn, i in g.params.items():  # a parameter lives with its first forward consumer
        m = pat.match(fqn)
        if m:
            where[i] = int(m.group(1)) + 1
            continue
        users = sorted(u for u in g.nodes[i].users if g.nodes[u].phase == "fw")
        where[i] = where[users[0]] if users else 0
    return where


def crossings(state, where, K: int):
    """Per boundary after position q (0..K-2): local bytes and count of the forward tensors crossing it."""
    g, P, mesh_shape = state.graph, state.placement, state.mesh.shape
    # data dependence: recomputable tensors (no input/param upstream) never cross a boundary
    dep = [False] * len(g.nodes)
    for n in g.nodes:
        dep[n.idx] = n.kind in ("param", "input", "buffer") or any(dep[r.node] for r in n.inputs())
    cross_bytes, cross_n = np.zeros(K - 1), np.zeros(K - 1, dtype=int)
    for n in g.nodes:
        if n.kind != "op" or n.phase != "fw" or not dep[n.idx]:
            continue
        c = where[n.idx]
        for o, m in enumerate(n.outs):
            if m is None:
                continue
            last = max(
                (
                    where[u]
                    for u in n.users
                    if g.nodes[u].phase == "fw"
                    and where[u] is not None
                    and any(r.node == n.idx and r.out == o for r in g.nodes[u].inputs())
                ),
                default=c,
            )
            for q in range(c, last):  # crosses boundaries after positions c .. last-1
                cross_bytes[q] += m.nbytes / num_shards(P[n.idx].out[o], mesh_shape)
                cross_n[q] += 1
    return cross_bytes, cross_n
