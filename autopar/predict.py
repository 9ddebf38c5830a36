"""Predicted step time and memory of a solved PlanState, and its conversion into a Plan.

Step time = compute + exposed communication. Parameter gathers (FSDP-style) and gradient reductions can overlap
with compute (prefetch, bucketing): exposed = activation comm + max(0, param/grad comm - compute); with
`plan(..., overlap=False)` (autopar's graph executor: collectives block) exposed = all comm. Memory per
rank = model state at the storage placements (params, grads, optimizer state) + the activation liveness peak of
the fw+bw order, with each redistributed input held while its consumer runs.
"""

from __future__ import annotations

import torch

from .cost import collective_time
from .graph import TensorMeta, param_root
from .liveness import liveness_peak, recompute_seconds, state_bytes
from .plan import Plan, execution_record, node_record
from .collectives import grad_reduce_time, link_of, redistribute_time


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
    g, P, mesh_shape = state.graph, state.placement, state.mesh.shape
    comm = {"act": 0.0, "param": 0.0, "grad": 0.0}  # seconds per class: activations, parameter gathers, gradients
    kinds: dict[str, dict] = {}  # collective kind -> {"count", "bytes"}
    red_by_node = _redistribute_records(state, comm, kinds)
    for b in state.buckets or []:
        link = link_of(state.cluster, mesh_shape, b["mesh_dim"])
        comm["grad"] += collective_time(b["kind"], b["bytes"], b["group"], link)
        _count(kinds, b["kind"], b["bytes"])
    times = _node_times(state)
    compute = sum(times)
    recompute_s = 0.0
    if state.recompute:  # activation checkpointing: checkpointed blocks run their forward twice
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


def _count(kinds: dict, kind: str, nbytes) -> None:
    k = kinds.setdefault(kind, {"count": 0, "bytes": 0})
    k["count"] += 1
    k["bytes"] += nbytes


def _node_times(state) -> list[float]:
    """Compute seconds per node at its placement (a repeated layer's copies priced once, as their representative)."""
    P, node_time, rep, cache = state.placement, state.cost["node_time"], state.rep, {}
    times = []
    for n in state.graph.nodes:
        key = (rep[n.idx], P[n.idx])
        if key not in cache:
            cache[key] = node_time(n, P[n.idx]) if n.kind == "op" else 0.0
        times.append(cache[key])
    return times


def _value_of(g, i, j):
    """(meta, class, parameter FQN or None) of the value redistributed into node i's input j: an input position,
    "opt" (the gradient into the optimizer step), "loss" or "state" (a buffer's new value)."""
    nodes = g.nodes
    if j == "opt":
        return g.meta(g.grads[nodes[i].target]), "grad", nodes[i].target
    if j == "loss":
        return g.meta(g.loss), "act", None
    if j == "state":
        return g.meta(g.state_updates[nodes[i].target]), "act", None
    r = nodes[i].inputs()[j]
    root = param_root(g, r.node)
    return g.meta(r), "param" if root is not None else "act", root


def _redistribute_records(state, comm: dict, kinds: dict) -> dict[int, list]:
    """Per consumer node, a record of each redistribute into it (the Plan's node "redistribute" list); adds each
    one's time to comm[class] and its collectives to kinds. A bucketed gradient's reduction is carried by its
    bucket's one collective (counted by the caller); a shared or coalesced one costs nothing of its own."""
    g, nodes, mesh_shape, cluster = state.graph, state.graph.nodes, state.mesh.shape, state.cluster
    bucket_of = {f: k for k, b in enumerate(state.buckets or []) for f in b["params"]}
    coalesced, leads = state.coalesced or {}, {}
    for (i, j), lead in coalesced.items():
        leads.setdefault(lead, []).append((i, j))
    red_by_node: dict[int, list] = {}
    for (i, j), (src, dst, cs) in sorted(state.redistributes.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        rec = {"input": j, "src": list(src), "dst": list(dst), "time_s": 0.0, "collectives": [c.to_json() for c in cs]}
        red_by_node.setdefault(i, []).append(rec)
        bucket = bucket_of.get(nodes[i].target) if j == "opt" else None
        if bucket is not None:
            meta = g.meta(g.grads[nodes[i].target])
            rec["time_s"] = grad_reduce_time(src, dst, meta, mesh_shape, cluster, len(g.grads))
            rec.update({"class": "grad", "param": nodes[i].target, "bucket": bucket})
            continue
        meta, cls, root = _value_of(g, i, j)
        shared = (state.shares or {}).get((i, j)) or coalesced.get((i, j))
        if (i, j) in leads:  # its all_reduce carries the coalesced inputs too
            numel = meta.numel + sum(g.meta(nodes[a].inputs()[b]).numel for a, b in leads[(i, j)])
            meta = TensorMeta((numel,), meta.dtype)
        rec["time_s"] = t = 0.0 if shared else redistribute_time(src, dst, meta, mesh_shape, cluster)
        comm[cls] += t
        rec["class"] = cls
        if (i, j) in coalesced:
            a, b = coalesced[(i, j)]  # an input of this op, or of a later one (the loss tail's group)
            rec["coalesced"] = b if a == i else f"{nodes[a].name}:{b}"
        elif shared:
            rec["shares"] = [nodes[shared[0]].name, shared[1]]
        if cls != "act":  # which parameter this gather / gradient reduction is for (backends group them)
            rec["param"] = root
        for c in cs:
            _count(kinds, c.kind, c.nbytes)
    return red_by_node
