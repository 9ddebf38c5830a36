"""Turn the stage search's best candidate (passes/stages.py) into a Plan: `stages` (per stage its clusters,
parameter FQNs, submesh, modeled time and memory, the p2p transfer to the next stage), `schedule` (name, micro-batch
count and shapes, bubble, timeline, the runner-up candidates and the even-split baseline), `params` (placements on
the stage submesh, from the intra-op plan of the stage that holds each parameter) and `predicted`."""
from __future__ import annotations

import re

from . import pipeline_model as pm
from .plan import Plan


def _cluster_names(prefix: str, n_blocks: int) -> list[str]:
    return ["pre"] + [f"{prefix}.{i}" for i in range(n_blocks)] + ["post"]


def build_pipeline_plan(best, top, n_candidates, ops, model, prefix, reps, pos_of, mesh, inputs, cluster, budget,
                        times) -> Plan:
    p, v, m, spec, smesh = best["p"], best["v"], best["m"], best["spec"], best["mesh"]
    S = p * v
    part = best["part"]
    costs = ops.variants
    n_blocks = len(pos_of)
    names = _cluster_names(prefix, n_blocks)
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    # parameter -> full cluster index; sub-model FQN for placements
    pos = costs[0].param_pos
    post_sub = len(reps) + 1

    def where(fqn):
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
        plan_k = ops.plans[part.variants[k]]
        params[fqn] = list(plan_k.params.get(sub, ["R"] * len(smesh.shape)))
    ranks_per_stage = smesh.size
    stages = []
    for k in range(S):
        a, b = part.bounds[k], part.bounds[k + 1]
        cv = costs[part.variants[k]]
        r = best["rank_of"][k]
        rec = {"index": k, "pp_rank": r, "clusters": names[a:b], "params": per_stage_params[k],
               "n_params": sum(dict(model.named_parameters())[f].numel() for f in per_stage_params[k]),
               "graph_ops": int(sum(cv.ops[a:b])),
               "submesh": {"shape": list(smesh.shape), "names": list(smesh.names),
                           "ranks": [r * ranks_per_stage, (r + 1) * ranks_per_stage - 1]},
               "intra_op": cv.name,
               "time": {"F_s": best["F"][k], "B_s": best["B"][k], "W_s": best["W"][k],
                        "per_microbatch_s": best["F"][k] + best["B"][k] + best["W"][k], "dp_comm_s": best["dp"][k]},
               "memory": {"state_bytes": best["state"][k], "act_bytes_per_microbatch": best["act"][k],
                          "inflight_microbatches": best["inflight"][k],
                          "rank_peak_bytes": best["rank_mem"][r]}}
        if k < S - 1:
            nb, link, t = best["xfer"][k]
            rec["send"] = {"bytes": nb, "link": link, "time_s": t}
        stages.append(rec)
    sim = best["sim"]
    bsz = next(x.shape[0] for x in inputs if hasattr(x, "shape"))
    dp = next((s for s, nm in zip(smesh.shape, smesh.names) if nm == "dp"), 1)
    shapes = [list(x.shape) for x in inputs if hasattr(x, "shape")]
    mb_shapes = [[bsz // m] + s[1:] if s and s[0] == bsz else s for s in shapes]
    local = [[bsz // dp] + s[1:] if s and s[0] == bsz else s for s in shapes]

    def row(r):
        ev = r.get("even")
        return {"pp": r["p"], "stage_mesh": list(r["mesh"].shape), "stage_mesh_names": list(r["mesh"].names),
                "n_microbatches": r["m"], "schedule": r["spec"].name, "stages_per_rank": r["v"],
                "step_s": r["step_s"], "bubble": r["bubble"], "peak_mem_bytes": r["peak_mem"],
                "bounds": r["part"].bounds, "proxy_s": r["part"].proxy_s,
                "even_split_step_s": ev["step_s"] if ev else None}
    schedule = {"name": spec.name if S > 1 else "none", "torch_class": spec.torch_class if S > 1 else None,
                "n_microbatches": m, "stages_per_rank": v, "num_stages": S, "pp": p,
                "stage_mesh_shape": list(smesh.shape), "stage_mesh_names": list(smesh.names),
                "layer_prefix": prefix, "clusters": names, "bounds": part.bounds,
                "batch_shapes": shapes, "microbatch_shapes": mb_shapes, "local_batch_shapes": local,
                "step_s": best["step_s"], "pipeline_s": best["pipeline_s"], "exposed_dp_s": best["exposed_dp_s"],
                "bubble_fraction": best["bubble"], "proxy_step_s": part.proxy_s,
                "timeline": pm.timeline(sim), "first_actions": pm.first_events(sim, 10),
                "even_split": None if best["even"] is None else
                {"step_s": best["even"]["step_s"], "bubble": best["even"]["bubble"],
                 "peak_mem_bytes": best["even"]["peak_mem"], "fits": best["even"]["fits"]},
                "candidates": [row(r) for r in top], "n_candidates": n_candidates}
    # whole-step collectives: activation redistributes once per micro-batch, dp comm once per step, p2p
    coll = {}
    for k in range(S):
        cv = costs[part.variants[k]]
        for c in range(part.bounds[k], part.bounds[k + 1]):
            for cls, mult in (("act", m), ("dp", 1)):
                for kind, (cnt, nb) in cv.coll[c][cls].items():
                    d = coll.setdefault(kind, {"count": 0, "bytes": 0})
                    d["count"] += cnt * mult * smesh.size
                    d["bytes"] += nb * mult * smesh.size
    n_x = sum(1 for k in range(S - 1) if best["rank_of"][k] != best["rank_of"][k + 1])
    if n_x:
        d = coll.setdefault("send_recv", {"count": 0, "bytes": 0})
        d["count"] += 2 * m * n_x * smesh.size
        d["bytes"] += int(2 * m * smesh.size * sum(x[0] for k, x in enumerate(best["xfer"])
                                                   if best["rank_of"][k] != best["rank_of"][k + 1]))
    busy = max(sim.busy_s)
    p2p_s = sum(x[2] for x in best["xfer"]) * 2 * m
    rank_state = [sum(best["state"][k] for k in range(S) if best["rank_of"][k] == r) for r in range(p)]
    predicted = {"step_s": best["step_s"], "compute_s": busy, "comm_s": p2p_s + max(best["dp"]),
                 "exposed_comm_s": best["step_s"] - busy, "state_mem_bytes": max(rank_state),
                 "act_peak_bytes": max(best["rank_mem"][r] - rank_state[r] for r in range(p)),
                 "peak_mem_bytes": best["peak_mem"], "collectives": coll, "budget_bytes": budget,
                 "bubble_fraction": best["bubble"]}
    count = {}
    for k in range(S):
        count[part.variants[k]] = count.get(part.variants[k], 0) + 1
    main = ops.plans[max(count, key=count.get)]
    solver = dict(main.solver)
    solver["seconds"] = sum(pl.solver["seconds"] for pl in ops.plans)
    solver["intra_op_variants"] = [c.name for c in costs]
    full_shape = (p,) + tuple(smesh.shape) if "pp" not in getattr(mesh, "names", ()) else tuple(mesh.shape)
    full_names = ("pp",) + tuple(smesh.names) if "pp" not in getattr(mesh, "names", ()) else tuple(mesh.names)
    return Plan(full_shape, full_names, cluster.name, main.nodes, params, predicted, solver,
                [["stages: intra-op plans", times["intra_op_s"]], ["stages: total", times["total_s"]]],
                main.regions, main.coverage,
                {**main.meta, "pipeline": True, "nodes": "the per-op plan of the representative sub-model (one "
                 "block per distinct block) of the stage plan most stages use"}, stages, schedule)
