"""Predicted step time and memory of a solved PlanState, and its conversion into a Plan.

Step time = compute + exposed communication. Parameter gathers (FSDP-style) and gradient reductions can overlap
with compute (prefetch, bucketing): exposed = activation comm + max(0, param/grad comm - compute); with
`plan(..., overlap=False)` (autopar's graph executor: collectives block) exposed = all comm.

On a cluster whose links NCCL runs (LinkSpec.nccl: the GPU presets) the step is priced as torch's engines schedule
it (autopar/cost/overlap.py): with overlap=True the FSDP2 timeline over the plan's units (one per block of the
layer list, the rest in the root unit) replaces the global max(0, comm - compute): each unit's gathers run one unit
ahead under the unit before, its gradient reductions on their own stream after its backward, activation (TP)
collectives on the compute stream; and on every NCCL cluster the optimizer step (memory bound, over each rank's
shard) is added. Other clusters (cpu-gloo, the analytic ring presets) keep the formula above exactly. Memory per
rank = model state at the storage placements (params, grads, optimizer state) + the activation liveness peak of
the fw+bw order, with each redistributed input held while its consumer runs.
"""

from __future__ import annotations

import dataclasses

import torch

from .cost import async_tp, collective_time
from .cost.cluster import ClusterSpec
from .cost.memory import TrainingPrecision
from .cost.overlap import Unit, fsdp_timeline, optimizer_step_time
from .graph import Graph, Node, Ref, TensorMeta, param_root
from .liveness import liveness_peak, recomputed_seconds, state_bytes
from .plan import Plan, _dim, execution_record, node_record
from .strategies import Strategy, num_shards, vocab_parallel
from .collectives import grad_reduce_time, link_of, redistribute_time


def build_plan(state) -> Plan:
    """The Plan of a solved state: its records (placements, redistributes with their collectives, buckets, node
    times) and `pricing`; its prediction is `predict` of those records, so a saved plan predicts the same."""
    g, P, cluster = state.graph, state.placement, state.cluster
    times = _node_times(state)
    red_by_node = _redistribute_records(state, times)
    sol = state.solution
    records = [
        node_record(n, P[n.idx], red_by_node.get(n.idx, []), times[n.idx], state.sources[n.idx], _internal(state, n))
        for n in g.nodes
    ]
    params = {fqn: list(P[i].out[0]) for fqn, i in g.params.items()}
    for alias, base in g.aliases.items():
        params.setdefault(alias, params[base])
    plan = Plan(
        state.mesh.shape,
        state.mesh.names,
        cluster.name,
        records,
        params,
        {},
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
        pricing=pricing_record(state),
    )
    plan.predicted = predict_records(g, P, records, plan.buckets, plan.pricing, cluster, state.mesh.shape)
    return plan


def pricing_record(state) -> dict:
    """Plan.pricing: what the prediction needs beyond the node records and buckets (the cluster's figures, the
    options and decisions it depends on, the graph's outputs for the memory walk), as JSON."""
    g = state.graph
    ref = lambda r: [r.node, r.out]
    return {
        "cluster": state.cluster.to_json(),
        "overlap": bool(state.options.get("overlap", False)),
        "precision": dataclasses.asdict(state.precision),
        "budget_bytes": state.budget,
        "recompute": [{"block": b["block"], "nodes": list(b["nodes"])} for b in state.recompute or []],
        "outputs": {
            "loss": ref(g.loss),
            "grads": {f: ref(r) for f, r in g.grads.items()},
            "input_grads": [[k, ref(r)] for k, r in g.input_grads.items()],
            "state_updates": {f: ref(r) for f, r in g.state_updates.items()},
        },
    }


def _state_meta(g) -> dict:
    """The buffers the step updates (Graph.state_updates) and the node output holding each new value; absent when
    none (plans without state keep their hash)."""
    if not g.state_updates:
        return {}
    return {"state_updates": {fqn: [r.node, r.out] for fqn, r in g.state_updates.items()}}


def predict(plan: Plan) -> dict:
    """The predicted step, memory and collectives of a Plan, from its records alone (no planner state, no cost
    closures): a saved and loaded plan predicts what the fresh one did. Pipeline plans are priced by their schedule
    (plan.schedule), not here."""
    if plan.stages:
        raise ValueError("a pipeline plan's prediction is its schedule's (plan.schedule and plan.predicted)")
    pr = plan.pricing
    if not pr:
        raise ValueError("the plan has no pricing record (saved by an older autopar): plan again to predict it")
    graph = graph_of(plan)
    placement = [
        Strategy(
            tuple(tuple(p) if p is not None else None for p in r["placement"]["out"]),
            tuple(tuple(p) for p in r["placement"]["ins"]),
        )
        for r in plan.nodes
    ]
    cluster = ClusterSpec.from_json(pr["cluster"])
    return predict_records(graph, placement, plan.nodes, plan.buckets, pr, cluster, plan.mesh_shape)


def _internal(state, n) -> list:
    """The collectives op n issues inside itself at its placement (kind, mesh dim, bytes, group size)."""
    if n.kind != "op" or n.target not in vocab_parallel.OPS:
        return []
    ins, shape = [state.graph.meta(r) for r in n.inputs()], tuple(state.mesh.shape)
    return [
        (k, m, b, shape[m]) for k, m, b in vocab_parallel.internal_collectives(n, state.placement[n.idx], ins, shape)
    ]


def predict_state(state) -> dict:
    """`predict` of the Plan a solved state would give, without building its node records (the solver compares
    candidate plans by it)."""
    times = _node_times(state)
    red_by_node = _redistribute_records(state, times)
    records = [
        {"kind": n.kind, "time_s": times[n.idx], "redistribute": red_by_node.get(n.idx, [])} for n in state.graph.nodes
    ]
    pricing = {
        "overlap": bool(state.options.get("overlap", False)),
        "precision": dataclasses.asdict(state.precision),
        "budget_bytes": state.budget,
        "recompute": state.recompute or [],
    }
    buckets = state.buckets or []
    return predict_records(state.graph, state.placement, records, buckets, pricing, state.cluster, state.mesh.shape)


def predict_records(graph, placement, records, buckets, pricing, cluster, mesh_shape) -> dict:
    """The prediction of node records (their compute seconds, redistributes and collectives), gradient buckets and
    a pricing record on `graph` (the plan's, or one rebuilt from its records) at per-node `placement`."""
    mesh_shape = tuple(mesh_shape)
    comm = {"act": 0.0, "param": 0.0, "grad": 0.0}  # seconds per class: activations, parameter gathers, gradients
    hidden = 0.0  # of the activation comm: the seconds async TP runs under matmuls
    kinds: dict[str, dict] = {}  # collective kind -> {"count", "bytes"}
    for rec in records:
        for r in rec["redistribute"]:
            if "bucket" in r:
                continue  # carried by its bucket's one collective
            if "shares" not in r and "coalesced" not in r:  # a shared or coalesced one costs nothing of its own
                comm[r["class"]] += sum(
                    collective_time(c[0], c[2], c[3], link_of(cluster, mesh_shape, _dim(c[1])))
                    for c in r["collectives"]
                )
                hidden += r.get("hidden_s", 0.0)
            for c in r["collectives"]:
                _count(kinds, c[0], c[2])
        for c in rec.get("internal", []):  # inside an op: priced in its time_s
            _count(kinds, c[0], c[2])
    for b in buckets:
        link = link_of(cluster, mesh_shape, _dim(b["mesh_dim"]))
        comm["grad"] += collective_time(b["kind"], b["bytes"], b["group"], link)
        _count(kinds, b["kind"], b["bytes"])
    times = [rec["time_s"] if rec["kind"] == "op" else 0.0 for rec in records]
    compute = sum(times)
    recompute = pricing["recompute"] or None
    recompute_s = 0.0
    if recompute:  # activation checkpointing: checkpointed blocks run their forward twice
        recompute_s = recomputed_seconds(graph, recompute, times)
        compute += recompute_s
    overlappable = comm["param"] + comm["grad"]
    act = comm["act"] - hidden
    exposed = act + (max(0.0, overlappable - compute) if pricing["overlap"] else overlappable)
    precision = TrainingPrecision(**pricing["precision"])
    optimizer_s = 0.0
    if engine_priced(cluster):
        if pricing["overlap"]:
            units = engine_units(graph, records, buckets, cluster, mesh_shape, times, recompute)
            exposed = act + fsdp_timeline(units)["exposed_s"]
        optimizer_s = optimizer_seconds(graph, placement, mesh_shape, precision, cluster)
    state_mem = state_bytes(graph, placement, mesh_shape, precision)
    act_peak = liveness_peak(graph, placement, mesh_shape, recompute)
    out = {
        "step_s": compute + exposed + optimizer_s,
        "compute_s": compute,
        "comm_s": sum(comm.values()),
        "exposed_comm_s": exposed,
        "comm_by_class_s": comm,
        "state_mem_bytes": state_mem,
        "act_peak_bytes": act_peak,
        "peak_mem_bytes": state_mem + act_peak,
        "collectives": kinds,
        "budget_bytes": pricing["budget_bytes"],
        "recompute_s": recompute_s,
    }
    if engine_priced(cluster):
        out["optimizer_s"] = optimizer_s
    if hidden:
        out["async_tp_hidden_s"] = hidden
    return out


def engine_priced(cluster) -> bool:
    """The step is priced as torch's engines schedule it (NCCL links: the GPU presets), not by the plain formula."""
    return bool(cluster.intra.nccl or cluster.inter.nccl)


def optimizer_seconds(graph, placement, mesh_shape, precision, cluster) -> float:
    """The optimizer step of one rank: memory bound over the parameter elements the rank stores."""
    local = sum(graph.nodes[i].out.numel / num_shards(placement[i].out[0], mesh_shape) for i in graph.params.values())
    return optimizer_step_time(local, precision, cluster.device)


def unit_of(name: str) -> str:
    """The FSDP unit of a module or parameter FQN: its block of a layer list (the path through the first numbered
    component, e.g. "layers.3" of "layers.3.attention.wq.weight"), as torchtitan wraps each block; "" (the root
    unit: embeddings, final norm, head) for everything outside the blocks."""
    parts = (name or "").split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return ""


def engine_units(graph, records, buckets, cluster, mesh_shape, times, recompute) -> list[Unit]:
    """The plan as FSDP2 units in forward order (the root first: its parameters are gathered before any block):
    per unit its forward / backward seconds (op compute + its activation collectives, which block the compute
    stream; checkpointed blocks' recompute in the backward), its parameter gathers into forward and into backward
    consumers, and its gradient reductions (buckets by their first parameter)."""
    per: dict[str, dict] = {}
    unit = lambda key: per.setdefault(key, dict.fromkeys(("fw", "bw", "ag", "ag_bw", "rs"), 0.0))
    unit("")  # the root unit first
    for i, rec in enumerate(records):
        node = graph.nodes[i]
        phase = "fw" if node.phase == "fw" else "bw"
        unit(unit_of(node.module))[phase] += times[i]
        for r in rec["redistribute"]:
            if "bucket" in r or "shares" in r or "coalesced" in r:
                continue
            t = sum(
                collective_time(c[0], c[2], c[3], link_of(cluster, mesh_shape, _dim(c[1]))) for c in r["collectives"]
            )
            if r["class"] == "act":
                unit(unit_of(node.module))[phase] += t
            else:
                key = "rs" if r["class"] == "grad" else "ag" if phase == "fw" else "ag_bw"
                unit(unit_of(r.get("param") or ""))[key] += t
    for b in buckets:
        link = link_of(cluster, mesh_shape, _dim(b["mesh_dim"]))
        unit(unit_of(b["params"][0] if b.get("params") else ""))["rs"] += collective_time(
            b["kind"], b["bytes"], b["group"], link
        )
    for blk in recompute or ():
        unit(unit_of(blk["block"]))["bw"] += recomputed_seconds(graph, [blk], times)
    return [Unit(d["fw"], d["bw"], d["ag"], d["rs"], regather=True, ag_bw=d["ag_bw"]) for d in per.values()]


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


def _redistribute_records(state, times) -> dict[int, list]:
    """Per consumer node, a record of each redistribute into it (the Plan's node "redistribute" list): its
    placements, collectives, class and seconds. A bucketed gradient's reduction is carried by its bucket's one
    collective; a shared or coalesced one costs nothing of its own. Under async TP, a TP collective fused with its
    matmuls records the seconds they hide (`hidden_s`, autopar/cost/async_tp.py; `times`: node seconds)."""
    g, nodes, mesh_shape, cluster = state.graph, state.graph.nodes, state.mesh.shape, state.cluster
    bucket_of = {f: k for k, b in enumerate(state.buckets or []) for f in b["params"]}
    coalesced, leads = state.coalesced or {}, {}
    for (i, j), lead in coalesced.items():
        leads.setdefault(lead, []).append((i, j))
    fused = async_tp.enabled(cluster)
    leads_of: dict = {}  # under async TP, a shared redistribute's consumer -> the other consumers that share it
    for sharer, lead in (state.shares or {}).items() if fused else ():
        leads_of.setdefault(tuple(lead), []).append(sharer)
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
        rec["time_s"] = 0.0 if shared else redistribute_time(src, dst, meta, mesh_shape, cluster)
        rec["class"] = cls
        if (i, j) in coalesced:
            a, b = coalesced[(i, j)]  # an input of this op, or of a later one (the loss tail's group)
            rec["coalesced"] = b if a == i else f"{nodes[a].name}:{b}"
        elif shared:
            rec["shares"] = [nodes[shared[0]].name, shared[1]]
        if cls != "act":  # which parameter this gather / gradient reduction is for (backends group them)
            rec["param"] = root
        elif not shared and fused:
            _async_tp(state, i, j, cs, meta, rec, times, leads_of)
    return red_by_node


def _async_tp(state, i, j, cs, meta, rec, times, leads_of) -> None:
    """Record the seconds async TP hides of the activation redistribute into node i's input j: an all_gather
    under every matmul that takes the gathered value on its left (this consumer's and those sharing it), a
    reduce_scatter under the matmul that produced the value."""
    g, mesh_shape, cluster = state.graph, state.mesh.shape, state.cluster
    kind = async_tp.fused_kind(cs, cluster, mesh_shape)
    if kind == "all_gather":
        gemms = {m for a, b in [(i, j), *leads_of.get((i, j), ())] for m in async_tp.lhs_gemms(g, a, b)}
    elif kind == "reduce_scatter":
        m = async_tp.producer_gemm(g, g.nodes[i].inputs()[j].node)
        gemms = {m} if m is not None else set()
    else:
        return
    if gemms:
        comm = rec["time_s"]
        group = cs[0].group
        shard = meta.nbytes / num_shards(tuple(rec["dst"]), mesh_shape)  # the rank's output (reduce_scatter)
        hid = async_tp.hidden(kind, comm, sum(times[m] for m in gemms), group, shard, cluster.device)
        if hid > 0.0:
            rec["hidden_s"] = hid


def graph_of(plan: Plan) -> Graph:
    """The plan's graph rebuilt from its node records and `pricing` outputs: kinds, phases, output shapes and dtypes,
    producers (what the memory walk reads; op targets are their names, not callables)."""
    nodes = [
        Node(
            r["idx"],
            r["kind"],
            r["target"],
            args=tuple(Ref(a, b) for a, b in r["inputs"]),
            outs=tuple(
                TensorMeta(tuple(s), getattr(torch, d)) if s is not None else None
                for s, d in zip(r["shape"], r["dtype"])
            ),
            phase=r["phase"],
            module=r["module"],
        )
        for r in plan.nodes
    ]
    out = plan.pricing["outputs"]
    ref = lambda x: Ref(x[0], x[1])
    by_kind = lambda k: {n.target: n.idx for n in nodes if n.kind == k}
    return Graph(
        nodes,
        by_kind("param"),
        by_kind("buffer"),
        [n.idx for n in nodes if n.kind == "input"],
        ref(out["loss"]),
        {f: ref(r) for f, r in out["grads"].items()},
        input_grads={int(k): ref(r) for k, r in out["input_grads"]},
        state_updates={f: ref(r) for f, r in out["state_updates"].items()},
    )
