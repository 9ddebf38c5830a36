"""The Plan of a stage search (passes/stage_search.py): `stages` (per stage its clusters, parameter FQNs, the
modules it holds in forward order, submesh, modeled time and memory, the p2p transfer to the next stage), `schedule`
(name, micro-batch count and shapes, bubble, timeline, the runner-up candidates and the even-split baseline),
`params` (placements on the stage submesh, from the intra-op plan of the stage that holds each parameter) and
`predicted` (whole-step collectives: activation redistributes per micro-batch, dp comm per step, p2p)."""

from __future__ import annotations

import math
import re

from autopar import pipeline_model as pm
from autopar.plan import Plan


def _finite(x):
    """JSON-safe: the closed form of a hand layout (no DP ran) is None, not NaN."""
    return float(x) if x is not None and math.isfinite(x) else None


def _cluster_names(prefix: str, n_blocks: int) -> list[str]:
    return ["pre"] + [f"{prefix}.{i}" for i in range(n_blocks)] + ["post"]


def _placements(best, ops, model, prefix, reps, pos_of, smesh, post=()):
    """Each parameter's placements on the stage submesh (from the intra-op plan of the stage holding it: blocks
    map to their representative block of the sub-model) and the parameter FQNs of each stage; a tensor tied to a
    module of `post` (the output head of a tied embedding) is on the last stage too, under the head's name."""
    part, costs, S = best["part"], ops.costs(), best["p"] * best["v"]
    n_blocks = len(pos_of)
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    pos = costs[0].param_pos
    post_sub = len(reps) + 1

    def where(fqn):
        """parameter -> (full cluster index, sub-model FQN for placements)"""
        mt = pat.match(fqn)
        if mt:
            i = int(mt.group(1))
            return 1 + i, f"{prefix}.{pos_of[i]}.{mt.group(2)}"
        return (0 if pos.get(fqn, 0) != post_sub else n_blocks + 1), fqn

    stage_of_cluster = {}
    for k in range(S):
        for c in range(part.bounds[k], part.bounds[k + 1]):
            stage_of_cluster[c] = k
    params, per_stage_params = {}, [[] for _ in range(S)]
    for fqn, _ in model.named_parameters():
        c, sub = where(fqn)
        k = stage_of_cluster[c]
        per_stage_params[k].append(fqn)
        plan_k = ops.plans[costs[part.variants[k]].base]
        params[fqn] = list(plan_k.params.get(sub, ["R"] * len(smesh.shape)))
    first, on_last = {}, set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        name = first.setdefault(id(p), fqn)
        owner = fqn.rsplit(".", 1)[0]
        if name != fqn and any(owner == m or owner.startswith(m + ".") for m in post):  # a tied head: its alias
            if name in per_stage_params[S - 1] or id(p) in on_last:
                continue  # the last stage holds the tensor already (one name per tensor, its first after the blocks)
            on_last.add(id(p))
            params[fqn] = params[name]  # on the last stage, placed as the tensor it shares
            per_stage_params[S - 1].append(fqn)
    return params, per_stage_params


def _outer_modules(main, prefix: str) -> tuple[list, list]:
    """The modules outside the layer list that the forward runs before its first block and after its last one, in
    forward order: per forward op of the plan's graph, its module's outermost ancestor that does not hold the layer
    list (the model's own ops, module "", are the loss and what depends on no input: not a stage's module)."""
    holders = {".".join(prefix.split(".")[:i]) for i in range(1, prefix.count(".") + 1)}
    pre, post, seen_block = [], [], False
    for n in main.nodes:
        m = n["module"]
        if n["kind"] != "op" or n["phase"] != "fw" or not m:
            continue
        if m == prefix or m.startswith(prefix + "."):
            seen_block = True
            continue
        parts = m.split(".")
        top = next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) not in holders), None)
        where = post if seen_block else pre
        if top is not None and top not in where:
            where.append(top)
    return pre, post


def _stage_modules(clusters, prefix: str, pre: list, post: list) -> list:
    """The module FQNs a stage holds, in forward order: the outer modules before the blocks with "pre", its blocks,
    the outer modules after them with "post"."""
    blocks = [c for c in clusters if c.startswith(prefix + ".")]
    return (pre if "pre" in clusters else []) + blocks + (post if "post" in clusters else [])


def _stage_record(best, k: int, cv, names, held: list, numel: dict, smesh, modules: list) -> dict:
    """Stage k of the best configuration: clusters, parameters, modules, submesh, modeled time and memory, its
    send."""
    a, b = best["part"].bounds[k], best["part"].bounds[k + 1]
    r = best["rank_of"][k]
    rec = {
        "index": k,
        "pp_rank": r,
        "clusters": names[a:b],
        "params": held,
        "modules": modules,
        "n_params": sum(numel[f] for f in held),
        "graph_ops": int(sum(cv.ops[a:b])),
        "submesh": {
            "shape": list(smesh.shape),
            "names": list(smesh.names),
            "ranks": [r * smesh.size, (r + 1) * smesh.size - 1],
        },
        "intra_op": cv.name,
        "recompute_blocks": best["recompute"][k],
        "time": {
            "F_s": best["F"][k],
            "B_s": best["B"][k],
            "W_s": best["W"][k],
            "per_microbatch_s": best["F"][k] + best["B"][k] + best["W"][k],
            "dp_comm_s": best["dp"][k],
        },
        "memory": {
            "state_bytes": best["state"][k],
            "act_bytes_per_microbatch": best["act"][k],
            "inflight_microbatches": best["inflight"][k],
            "transient_bytes": best["transient"][k],
            "allocator_idle_bytes": best["idle"][k] if "idle" in best else 0.0,
            "rank_peak_bytes": best["rank_mem"][r],
        },
    }
    if k < best["p"] * best["v"] - 1:
        nb, link, t = best["xfer"][k]
        rec["send"] = {"bytes": nb, "tensors": int(cv.ntensors[b - 1]), "link": link, "time_s": t}
    return rec


def _main_plan(best, ops):
    """The intra-op plan most stages use (its nodes, solver and meta represent the pipeline plan)."""
    costs, part = ops.costs(), best["part"]
    count = {}
    for k in range(best["p"] * best["v"]):
        count[costs[part.variants[k]].base] = count.get(costs[part.variants[k]].base, 0) + 1
    return ops.plans[max(count, key=count.get)]


def _batch_layout(main, smesh, inputs, m: int) -> dict:
    """The batch's placement on the stage submesh and its global, micro-batch and per-rank shapes."""
    bsz = next(x.shape[0] for x in inputs if hasattr(x, "shape"))
    inp = next((nd for nd in main.nodes if nd["kind"] == "input"), None)
    batch_pl = inp["placement"]["out"][0] if inp else None
    dp = 1
    for d, (size, nm) in enumerate(zip(smesh.shape, smesh.names)):
        if batch_pl is not None and batch_pl[d] == "S0":
            dp *= size
    shapes = [list(x.shape) for x in inputs if hasattr(x, "shape")]
    return {
        "batch_shapes": shapes,
        "microbatch_shapes": [[bsz // m] + s[1:] if s and s[0] == bsz else s for s in shapes],
        "local_batch_shapes": [[bsz // dp] + s[1:] if s and s[0] == bsz else s for s in shapes],
        "batch_placement": batch_pl,
    }


def _candidate_row(r) -> dict:
    ev = r.get("even")
    return {
        "pp": r["p"],
        "stage_mesh": list(r["mesh"].shape),
        "stage_mesh_names": list(r["mesh"].names),
        "n_microbatches": r["m"],
        "schedule": r["spec"].name,
        "stages_per_rank": r["v"],
        "step_s": r["step_s"],
        "bubble": r["bubble"],
        "peak_mem_bytes": r["peak_mem"],
        "bounds": r["part"].bounds,
        "proxy_s": _finite(r["part"].proxy_s),
        "even_split_step_s": ev["step_s"] if ev else None,
    }


def _even_split(even) -> dict | None:
    if even is None:
        return None
    return {
        "step_s": even["step_s"],
        "bubble": even["bubble"],
        "peak_mem_bytes": even["peak_mem"],
        "fits": even["fits"],
        "bounds": even["bounds"],
        "recompute": even["recompute"],
        "stage_s": [f + b + w for f, b, w in zip(even["F"], even["B"], even["W"])],
    }


_SEARCH_STATS = (
    "configs",
    "pruned",
    "intra_op_keys",
    "estimated_keys",
    "refine_rounds",
    "pp_degrees",
    "stage_meshes",
    "total_s",
    "intra_op_s",
    "stage_plans_wall_s",
    "search_wall_s",
)


def _schedule(best, top, n_candidates, prefix, names, layout: dict, times) -> dict:
    p, v, m, spec, smesh, part = best["p"], best["v"], best["m"], best["spec"], best["mesh"], best["part"]
    S = p * v
    return {
        "name": spec.name if S > 1 else "none",
        "torch_class": spec.torch_class if S > 1 else None,
        "n_microbatches": m,
        "stages_per_rank": v,
        "num_stages": S,
        "pp": p,
        "stage_mesh_shape": list(smesh.shape),
        "stage_mesh_names": list(smesh.names),
        "layer_prefix": prefix,
        "clusters": names,
        "bounds": part.bounds,
        **layout,
        "step_s": best["step_s"],
        "pipeline_s": best["pipeline_s"],
        "exposed_dp_s": best["exposed_dp_s"],
        "bubble_fraction": best["bubble"],
        "proxy_step_s": _finite(part.proxy_s),
        "timeline": pm.timeline(best["sim"]),
        "first_actions": pm.first_events(best["sim"], 10),
        "even_split": _even_split(best["even"]),
        "candidates": [_candidate_row(r) for r in top],
        "n_candidates": n_candidates,
        "search": {k: times[k] for k in _SEARCH_STATS},
    }


def _step_collectives(best, costs) -> dict:
    """Whole-step collectives: activation redistributes once per micro-batch, dp comm once per step, p2p; each
    counted once per stage (the stage submesh's ranks issue it together, as an SPMD plan's collective is counted
    once), summed over the stages: what one rank of each pipeline position issues, not over every rank."""
    p, v, m, part = best["p"], best["v"], best["m"], best["part"]
    S = p * v
    coll = {}
    for k in range(S):
        cv = costs[part.variants[k]]
        for c in range(part.bounds[k], part.bounds[k + 1]):
            for cls, mult in (("act", m), ("dp", 1)):
                for kind, (cnt, nb) in cv.coll[c][cls].items():
                    d = coll.setdefault(kind, {"count": 0, "bytes": 0})
                    d["count"] += cnt * mult
                    d["bytes"] += nb * mult
    n_x = sum(1 for k in range(S - 1) if best["rank_of"][k] != best["rank_of"][k + 1])
    if n_x:
        d = coll.setdefault("send_recv", {"count": 0, "bytes": 0})
        d["count"] += 2 * m * n_x
        d["bytes"] += int(
            2 * m * sum(x[0] for k, x in enumerate(best["xfer"]) if best["rank_of"][k] != best["rank_of"][k + 1])
        )
    return coll


def _predicted(best, coll, budget) -> dict:
    p, m, S = best["p"], best["m"], best["p"] * best["v"]
    busy = max(best["sim"].busy_s)
    p2p_s = sum(x[2] for x in best["xfer"]) * 2 * m
    rank_state = [sum(best["state"][k] for k in range(S) if best["rank_of"][k] == r) for r in range(p)]
    exposed = best["exposed_dp_s"] + best["exposed_p2p_s"]
    opt = {"optimizer_s": best["optimizer_s"]} if "optimizer_s" in best else {}  # NCCL clusters (engine pricing)
    return {
        **opt,
        "step_s": best["step_s"],
        "compute_s": best["step_s"] - exposed - opt.get("optimizer_s", 0.0),
        "comm_s": p2p_s + max(best["dp"]),
        "exposed_comm_s": exposed,
        "busy_s": busy,
        "bubble_s": best["step_s"] - exposed - busy,
        "state_mem_bytes": max(rank_state),
        "act_peak_bytes": max(best["rank_mem"][r] - rank_state[r] for r in range(p)),
        "peak_mem_bytes": best["peak_mem"],
        "reserved_mem_bytes": best.get("reserved_mem", best["peak_mem"]),
        "collectives": coll,
        "budget_bytes": budget,
        "bubble_fraction": best["bubble"],
    }


def _model_linears(names, prefix: str, pos_of: list) -> list:
    """Module paths of the representative sub-model (its block j at `<prefix>.j`) named in the model: a block's
    module for every block it represents."""
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    out = []
    for n in names:
        mt = pat.match(n)
        out += [f"{prefix}.{i}.{mt.group(2)}" for i, j in enumerate(pos_of) if j == int(mt.group(1))] if mt else [n]
    return sorted(out)


def _float8_meta(main, prefix, pos_of) -> dict:
    """The float8 linears (converted and skipped) of the whole model, from the main plan's sub-model ones: what the
    pipelining runtime converts (backends/float8_linear.py)."""
    f8 = main.meta.get("float8")
    if not f8:
        return {}
    skipped = f8["skipped"]
    named = {m: skipped[n] for n in skipped for m in _model_linears([n], prefix, pos_of)}
    linears = _model_linears(f8["linears"], prefix, pos_of)
    return {"float8": {"linears": linears, "skipped": dict(sorted(named.items()))}}


def build_pipeline_plan(
    best, top, n_candidates, ops, model, prefix, reps, pos_of, mesh, inputs, cluster, budget, times
) -> Plan:
    p, smesh, part = best["p"], best["mesh"], best["part"]
    costs = ops.costs()
    names = _cluster_names(prefix, len(pos_of))
    main = _main_plan(best, ops)
    pre, post = _outer_modules(main, prefix)
    params, per_stage_params = _placements(best, ops, model, prefix, reps, pos_of, smesh, post)
    numel = {f: p.numel() for f, p in model.named_parameters(remove_duplicate=False)}
    stages = []
    for k in range(p * best["v"]):
        held = _stage_modules(names[part.bounds[k] : part.bounds[k + 1]], prefix, pre, post)
        stages.append(_stage_record(best, k, costs[part.variants[k]], names, per_stage_params[k], numel, smesh, held))
    layout = _batch_layout(main, smesh, inputs, best["m"])
    schedule = _schedule(best, top, n_candidates, prefix, names, layout, times)
    schedule["block_positions"] = list(pos_of)  # per block its block in the representative sub-model
    first = {}
    tied = {f: first.setdefault(id(q), f) for f, q in model.named_parameters(remove_duplicate=False)}
    tied = {f: o for f, o in tied.items() if f != o and f in stages[-1]["params"] and o not in stages[-1]["params"]}
    if tied:  # the last stage's alias -> the first stage's parameter: gradients summed between them each step
        schedule["tied"] = tied
    predicted = _predicted(best, _step_collectives(best, costs), budget)
    solver = dict(main.solver)
    solver["seconds"] = sum(pl.solver["seconds"] for pl in ops.plans)
    solver["intra_op_variants"] = [c.name for c in costs]
    full_shape = (p,) + tuple(smesh.shape) if "pp" not in getattr(mesh, "names", ()) else tuple(mesh.shape)
    full_names = ("pp",) + tuple(smesh.names) if "pp" not in getattr(mesh, "names", ()) else tuple(mesh.names)
    return Plan(
        full_shape,
        full_names,
        cluster.name,
        main.nodes,
        params,
        predicted,
        solver,
        [["stages: intra-op plans (summed over workers)", times["intra_op_s"]], ["stages: total", times["total_s"]]],
        main.regions,
        main.coverage,
        {
            **main.meta,
            **_float8_meta(main, prefix, pos_of),
            "pipeline": True,
            "nodes": "the per-op plan of the representative sub-model (one "
            "block per distinct block) of the stage plan most stages use",
        },
        stages,
        schedule,
    )
