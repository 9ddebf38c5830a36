"""Predicted step time and memory of a solved PlanState, and its conversion into a Plan.

Step time = compute + exposed communication. Parameter gathers (FSDP-style) and gradient reductions can overlap
with compute (prefetch, bucketing): exposed = activation comm + max(0, param/grad comm - compute); with
`plan(..., overlap=False)` (autopar's graph executor: collectives block) exposed = all comm. Memory per
rank = model state at the storage placements (params, grads, optimizer state) + the activation liveness peak of
the fw+bw order, with each redistributed input held while its consumer runs.
"""

from __future__ import annotations

import torch

from .graph import TensorMeta, param_root
from .plan import Plan, execution_record, node_record
from .cost import collective_time
from .redistribute import grad_reduce_time, link_of, redistribute_time
from .strategies import num_shards


def build_plan(state) -> Plan:
    g, P, cluster = state.graph, state.placement, state.cluster
    predicted, red_by_node, times = predict(state)
    sol = state.solution
    records = [
        node_record(n, P[n.idx], red_by_node.get(n.idx, []), times[n.idx], state.sources[n.idx]) for n in g.nodes
    ]
    params = {fqn: list(P[i].out[0]) for fqn, i in g.params.items()}
    for alias, base in g.aliases.items():
        params.setdefault(alias, params[base])
    return Plan(
        state.mesh.shape,
        state.mesh.names,
        cluster.name,
        records,
        params,
        predicted,
        {
            "status": sol.status,
            "objective": sol.objective,
            "bound": sol.bound,
            "gap": sol.gap,
            "seconds": sol.seconds,
            "n_vars": sol.n_vars,
            "n_constraints": sol.n_constraints,
        },
        [[k, v] for k, v in state.timings.items()],
        state.regions,
        {k: len(v) for k, v in (state.coverage or {}).items()},
        {
            "torch": torch.__version__,
            "budget_bytes": state.budget,
            "precision": repr(state.precision),
            **state.extras,
            **_state_meta(g),
        },
        buckets=[dict(b) for b in state.buckets or []],
        execution=execution_record(state),
    )


def _state_meta(g) -> dict:
    """The buffers the step updates (Graph.state_updates) and the node output holding each new value; absent when
    none (plans without state keep their hash)."""
    if not g.state_updates:
        return {}
    return {"state_updates": {fqn: [r.node, r.out] for fqn, r in g.state_updates.items()}}


def predict(state):
    """(predicted step / memory / collectives, redistribute records per node, compute seconds per node) of the
    state's placement, redistributes and gradient buckets."""
    g, P, mesh_shape, cluster = state.graph, state.placement, state.mesh.shape, state.cluster
    node_time = state.cost["node_time"]
    nodes = g.nodes
    red_by_node: dict[int, list] = {}
    comm = {"act": 0.0, "param": 0.0, "grad": 0.0}
    kinds: dict[str, dict] = {}
    buckets = state.buckets or []
    bucket_of = {f: k for k, b in enumerate(buckets) for f in b["params"]}
    coalesced, leads = state.coalesced or {}, {}
    for (i, j), lead in coalesced.items():
        leads.setdefault(lead, []).append((i, j))
    for (i, j), (src, dst, cs) in sorted(state.redistributes.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        bucket = bucket_of.get(nodes[i].target) if j == "opt" else None
        if bucket is not None:  # carried by its bucket's one collective (counted below)
            t = grad_reduce_time(src, dst, g.meta(g.grads[nodes[i].target]), mesh_shape, cluster, len(g.grads))
            red_by_node.setdefault(i, []).append(
                {
                    "input": j,
                    "src": list(src),
                    "dst": list(dst),
                    "time_s": t,
                    "collectives": [c.to_json() for c in cs],
                    "class": "grad",
                    "param": nodes[i].target,
                    "bucket": bucket,
                }
            )
            continue
        if j == "opt":
            meta, cls = g.meta(g.grads[nodes[i].target]), "grad"
        elif j == "loss":
            meta, cls = g.meta(g.loss), "act"
        elif j == "state":
            meta, cls = g.meta(g.state_updates[nodes[i].target]), "act"
        else:
            r = nodes[i].inputs()[j]
            meta = g.meta(r)
            cls = "param" if param_root(g, r.node) is not None else "act"
        shared = (state.shares or {}).get((i, j)) or coalesced.get((i, j))
        if (i, j) in leads:  # its all_reduce carries the coalesced inputs too
            meta = TensorMeta(
                (meta.numel + sum(g.meta(nodes[a].inputs()[b]).numel for a, b in leads[(i, j)]),), meta.dtype
            )
        t = 0.0 if shared else redistribute_time(src, dst, meta, mesh_shape, cluster)
        comm[cls] += t
        red_by_node.setdefault(i, []).append(
            {
                "input": j,
                "src": list(src),
                "dst": list(dst),
                "time_s": t,
                "collectives": [c.to_json() for c in cs],
                "class": cls,
            }
        )
        if (i, j) in coalesced:
            a, b = coalesced[(i, j)]  # an input of this op, or of a later one (the loss tail's group)
            red_by_node[i][-1]["coalesced"] = b if a == i else f"{nodes[a].name}:{b}"
        elif shared:
            red_by_node[i][-1]["shares"] = [nodes[shared[0]].name, shared[1]]
        if cls != "act":  # which parameter this gather / gradient reduction is for (backends group them)
            red_by_node[i][-1]["param"] = nodes[i].target if j == "opt" else param_root(g, r.node)
        for c in cs:
            k = kinds.setdefault(c.kind, {"count": 0, "bytes": 0})
            k["count"] += 1
            k["bytes"] += c.nbytes
    for b in buckets:
        comm["grad"] += collective_time(b["kind"], b["bytes"], b["group"], link_of(cluster, mesh_shape, b["mesh_dim"]))
        k = kinds.setdefault(b["kind"], {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += b["bytes"]
    rep, tcache = state.rep, {}
    times = []
    for n in nodes:
        key = (rep[n.idx], P[n.idx])
        if key not in tcache:
            tcache[key] = node_time(n, P[n.idx]) if n.kind == "op" else 0.0
        times.append(tcache[key])
    compute = sum(times)
    recompute_s = 0.0
    if state.recompute:  # activation checkpointing: checkpointed blocks run their forward twice
        from autopar.passes.checkpointing import recompute_seconds

        recompute_s = recompute_seconds(state, times)
        compute += recompute_s
    overlappable = comm["param"] + comm["grad"]
    exposed = comm["act"] + (max(0.0, overlappable - compute) if state.options.get("overlap", False) else overlappable)
    state_mem = state_bytes(g, P, mesh_shape, state.precision)
    act_peak = liveness_peak(g, P, mesh_shape, state.recompute)
    predicted = {
        "step_s": compute + exposed,
        "compute_s": compute,
        "comm_s": sum(comm.values()),
        "exposed_comm_s": exposed,
        "comm_by_class_s": comm,
        "state_mem_bytes": state_mem,
        "act_peak_bytes": act_peak,
        "peak_mem_bytes": state_mem + act_peak,
        "collectives": kinds,
        "budget_bytes": state.budget,
        "recompute_s": recompute_s,
    }
    return predicted, red_by_node, times


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
        from autopar.passes.checkpointing import liveness_peak_checkpointed

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
        peak = max(peak, live)
        for key in frees.pop(n.idx, []):
            live -= size[key]
    return peak
