"""The stage search (`plan_pipeline`, what `autopar.plan(..., pipeline=...)` runs) and the Plan it returns.

Search: every (pp degree, stage submesh, micro-batch count) gets intra-op plans of its stage (passes/stages.py
StageOps, cached per submesh and micro-batch shape); every (schedule, stages per rank) on top of it is a
configuration. Configurations are visited in increasing order of a lower bound on the closed form; those whose
bound exceeds `prune_margin` (1.25) x the best simulated step so far are skipped (the closed form tracks the
simulation within a few percent; the margin covers that). Each visited configuration gets the exact stage DP
(autopar/pipeline_model.partition) and is simulated on torch's action order; the fastest that fits memory wins.

The Plan: `stages` (per stage its clusters, parameter FQNs, submesh, modeled time and memory, the p2p transfer to
the next stage), `schedule` (name, micro-batch count and shapes, bubble, timeline, the runner-up candidates and the
even-split baseline), `params` (placements on the stage submesh, from the intra-op plan of the stage that holds each
parameter) and `predicted`.
"""

from __future__ import annotations

import math
import re
import time

import numpy as np
import torch
from torch import nn

from autopar import pipeline_model as pm
from autopar.cost import collective_time
from autopar.mesh import MeshSpec
from autopar.passes.stages import StageOps, evaluate, even_bounds, find_layers, layer_signature, layout_bounds
from autopar.plan import Plan
from autopar.solver import InfeasibleMemoryError

INF = float("inf")


def _finite(x):
    """JSON-safe: the closed form of a hand layout (no DP ran) is None, not NaN."""
    return float(x) if x is not None and math.isfinite(x) else None


def _cluster_names(prefix: str, n_blocks: int) -> list[str]:
    return ["pre"] + [f"{prefix}.{i}" for i in range(n_blocks)] + ["post"]


def build_pipeline_plan(
    best, top, n_candidates, ops, model, prefix, reps, pos_of, mesh, inputs, cluster, budget, times
) -> Plan:
    p, v, m, spec, smesh = best["p"], best["v"], best["m"], best["spec"], best["mesh"]
    S = p * v
    part = best["part"]
    costs = ops.costs()
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
        plan_k = ops.plans[costs[part.variants[k]].base]
        params[fqn] = list(plan_k.params.get(sub, ["R"] * len(smesh.shape)))
    ranks_per_stage = smesh.size
    numel = {f: p.numel() for f, p in model.named_parameters()}
    stages = []
    for k in range(S):
        a, b = part.bounds[k], part.bounds[k + 1]
        cv = costs[part.variants[k]]
        r = best["rank_of"][k]
        rec = {
            "index": k,
            "pp_rank": r,
            "clusters": names[a:b],
            "params": per_stage_params[k],
            "n_params": sum(numel[f] for f in per_stage_params[k]),
            "graph_ops": int(sum(cv.ops[a:b])),
            "submesh": {
                "shape": list(smesh.shape),
                "names": list(smesh.names),
                "ranks": [r * ranks_per_stage, (r + 1) * ranks_per_stage - 1],
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
                "recompute_transient_bytes": best["transient"][k],
                "rank_peak_bytes": best["rank_mem"][r],
            },
        }
        if k < S - 1:
            nb, link, t = best["xfer"][k]
            rec["send"] = {"bytes": nb, "tensors": int(cv.ntensors[b - 1]), "link": link, "time_s": t}
        stages.append(rec)
    sim = best["sim"]
    bsz = next(x.shape[0] for x in inputs if hasattr(x, "shape"))
    count = {}
    for k in range(S):
        count[costs[part.variants[k]].base] = count.get(costs[part.variants[k]].base, 0) + 1
    main = ops.plans[max(count, key=count.get)]
    inp = next((nd for nd in main.nodes if nd["kind"] == "input"), None)
    batch_pl = inp["placement"]["out"][0] if inp else None
    dp = 1
    for d, (size, nm) in enumerate(zip(smesh.shape, smesh.names)):
        if batch_pl is not None and batch_pl[d] == "S0":
            dp *= size
    shapes = [list(x.shape) for x in inputs if hasattr(x, "shape")]
    mb_shapes = [[bsz // m] + s[1:] if s and s[0] == bsz else s for s in shapes]
    local = [[bsz // dp] + s[1:] if s and s[0] == bsz else s for s in shapes]

    def row(r):
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

    schedule = {
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
        "batch_shapes": shapes,
        "microbatch_shapes": mb_shapes,
        "local_batch_shapes": local,
        "batch_placement": batch_pl,
        "step_s": best["step_s"],
        "pipeline_s": best["pipeline_s"],
        "exposed_dp_s": best["exposed_dp_s"],
        "bubble_fraction": best["bubble"],
        "proxy_step_s": _finite(part.proxy_s),
        "timeline": pm.timeline(sim),
        "first_actions": pm.first_events(sim, 10),
        "even_split": None
        if best["even"] is None
        else {
            "step_s": best["even"]["step_s"],
            "bubble": best["even"]["bubble"],
            "peak_mem_bytes": best["even"]["peak_mem"],
            "fits": best["even"]["fits"],
            "bounds": best["even"]["bounds"],
            "recompute": best["even"]["recompute"],
            "stage_s": [f + b + w for f, b, w in zip(best["even"]["F"], best["even"]["B"], best["even"]["W"])],
        },
        "candidates": [row(r) for r in top],
        "n_candidates": n_candidates,
        "search": {
            k: times[k]
            for k in (
                "configs",
                "pruned",
                "intra_op_keys",
                "pp_degrees",
                "stage_meshes",
                "total_s",
                "intra_op_s",
                "stage_plans_wall_s",
                "search_wall_s",
            )
        },
    }
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
        d["bytes"] += int(
            2
            * m
            * smesh.size
            * sum(x[0] for k, x in enumerate(best["xfer"]) if best["rank_of"][k] != best["rank_of"][k + 1])
        )
    busy = max(sim.busy_s)
    p2p_s = sum(x[2] for x in best["xfer"]) * 2 * m
    rank_state = [sum(best["state"][k] for k in range(S) if best["rank_of"][k] == r) for r in range(p)]
    exposed = best["exposed_dp_s"] + best["exposed_p2p_s"]
    predicted = {
        "step_s": best["step_s"],
        "compute_s": best["step_s"] - exposed,
        "comm_s": p2p_s + max(best["dp"]),
        "exposed_comm_s": exposed,
        "busy_s": busy,
        "bubble_s": best["step_s"] - exposed - busy,
        "state_mem_bytes": max(rank_state),
        "act_peak_bytes": max(best["rank_mem"][r] - rank_state[r] for r in range(p)),
        "peak_mem_bytes": best["peak_mem"],
        "collectives": coll,
        "budget_bytes": budget,
        "bubble_fraction": best["bubble"],
    }
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
            "pipeline": True,
            "nodes": "the per-op plan of the representative sub-model (one "
            "block per distinct block) of the stage plan most stages use",
        },
        stages,
        schedule,
    )


def evaluate_fitted(costs, bounds, r, cluster, budget, recompute=True) -> dict:
    """Evaluate fixed stage bounds (a hand layout, the even split) with, per stage, the intra-op variant and
    checkpointed-block count the search itself would pick for that range (fastest that fits; the leanest when none
    does): the same freedom as the DP, only the cuts are fixed."""
    S, v = r["p"] * r["v"], r["v"]
    cap = budget / v
    fl = _dp_inflight(r["order"], S, r["spec"], v)
    xfer = np.zeros((len(costs), len(costs[0].F) - 1))
    variants, rec = [], []
    for k in range(S):
        a, b = bounds[k], bounds[k + 1]
        if recompute == "all":  # a hand layout that checkpoints every block (Megatron / torchtitan "full")
            j = int(np.argmin([(cv.F[a:b] + cv.B[a:b] + cv.W[a:b] + cv.rtime[a:b]).sum() for cv in costs]))
            variants.append(j)
            rec.append(int(costs[j].blk[a:b].sum()))
            continue
        C, _, R = pm.stage_options(costs, xfer, r["spec"], r["p"], v, r["m"], fl[k], cap, recompute)
        if np.isfinite(C[:, a, b]).any():
            j = int(np.argmin(C[:, a, b]))
            variants.append(j)
            rec.append(int(R[j, a, b]))
        else:  # nothing fits: every block checkpointed, leanest variant
            j = int(np.argmin([cv.state[a:b].sum() + fl[k] * (cv.act[a:b] - cv.save[a:b]).sum() for cv in costs]))
            variants.append(j)
            rec.append(int(costs[j].blk[a:b].sum()) if recompute else 0)
    return evaluate(
        costs, bounds, variants, rec, r["spec"], r["p"], v, r["m"], r["order"], cluster, r["mesh"].size, budget
    ) | {"bounds": bounds, "variants": variants}


def _dp_inflight(order, S, spec, v):
    if v == 1:
        return pm.inflight(order, S, spec.split_backward)
    return [max(1, q) for q in pm.inflight_at_peak(order, S, spec.split_backward)]


def lower_bound(costs, spec, p, v, m) -> float:
    """A lower bound on the closed form for any partition: the bottleneck is at least the average and the largest
    cluster; the additive part at least its value with no transfers (each cluster at its fastest variant)."""
    c = np.min([cv.F + cv.B + cv.W for cv in costs], axis=0)
    S = p * v
    tot = float(c.sum())
    f = tot / v if not spec.split_backward else tot / (p * v)
    return pm.proxy_coef(m, v) * max(tot / S, float(c.max())) + f


def search_config(c, order, ops, cluster, budget, hand=None, tol=1e-3, recompute=True) -> dict:
    """Stage DP (or a hand layout) for one configuration, evaluated by simulation. With several stages per rank
    the DP charges each stage budget/v (scaled while the exact rank peak leaves room or overflows)."""
    p, v, m, spec, smesh = c["p"], c["v"], c["m"], c["spec"], c["mesh"]
    S = p * v
    fl = _dp_inflight(order, S, spec, v)
    link = cluster.link_for((p,) + smesh.shape, 0) if p > 1 else cluster.intra
    base = {**c, "order": order}
    if hand:
        cvs = ops.costs()
        r = evaluate_fitted(cvs, layout_bounds(hand), base, cluster, budget, recompute)
        return {**base, **r, "part": pm.Partition(r["bounds"], r["variants"], float("nan"), r["recompute"])}
    cap, best, tried = budget / v, None, 0
    while tried < (1 if v == 1 else 3):
        tried += 1
        cvs = ops.costs()
        xfer = np.array([[collective_time("send_recv", float(b), 2, link) for b in cv.xbytes] for cv in cvs])
        part = pm.partition(cvs, xfer, spec, p, v, m, fl, cap, tol, bool(recompute))
        if part is None:
            break
        ev = evaluate(
            cvs, part.bounds, part.variants, part.recompute, spec, p, v, m, order, cluster, smesh.size, budget
        )
        if ev["fits"] and (best is None or ev["step_s"] < best["step_s"]):
            best = {**base, **ev, "part": part}
        if ev["fits"] and ev["peak_mem"] > 0.95 * budget or cap >= budget:
            break
        cap = min(budget, cap * (budget / ev["peak_mem"]) * (1.0 if ev["fits"] else 0.9))
    return best or {**base, "fits": False, "step_s": INF, "peak_mem": INF}


# ---- the search ------------------------------------------------------------------------------------------------
_FORKED: tuple = ()  # what forked workers inherit: (model, prefix, reps, pos_of, ctx)


def _one_stage_plan(job):
    model, prefix, reps, pos_of, ctx = _FORKED
    smesh, specs, m = job
    mbi = tuple(torch.empty(sh, dtype=dt, device="meta") if sh is not None else x for sh, dt, x in specs)
    return StageOps(model, prefix, reps, pos_of, mbi, smesh, {**ctx, "drop_state": True, "n_microbatches": m})


def _stage_plans(model, prefix, reps, pos_of, inputs, Bsz, keys, ctx, workers=None) -> dict:
    """StageOps per (stage submesh, micro-batch size). Several keys are planned in forked worker processes (one per
    core, at most 2 unless `workers` says otherwise): each is an independent capture + intra-op solve."""
    import multiprocessing as mp
    import os

    global _FORKED
    jobs = []
    for smesh, mb in keys:
        jobs.append(
            (
                smesh,
                tuple(
                    ((mb,) + tuple(x.shape[1:]), x.dtype, None)
                    if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == Bsz
                    else (None, None, x)
                    for x in inputs
                ),
                Bsz // mb,
            )
        )
    if workers is None:
        workers = min(2, os.cpu_count() or 1) if len(jobs) >= 4 else 1
    _FORKED = (model, prefix, reps, pos_of, ctx)
    try:
        if workers > 1 and "fork" in mp.get_all_start_methods():
            with mp.get_context("fork").Pool(workers) as pool:
                out = pool.map(_one_stage_plan, jobs, chunksize=1)
        else:
            out = [_one_stage_plan(j) for j in jobs]
    finally:
        _FORKED = ()
    return dict(zip(keys, out))


def _search_share(share):
    """Configurations share[0]::share[1] in lower-bound order: DP + simulation each, skipping those whose lower
    bound exceeds margin x the best step found so far (here)."""
    configs, cache, cluster, budget, hand, tol, recompute, margin = _FORKED
    results, best, pruned = [], INF, 0
    for c in configs[share[0] :: share[1]]:
        if c["lb"] > margin * best:
            pruned += 1
            continue
        try:
            order = pm.actions(c["spec"], c["p"], c["m"], c["v"])
        except ValueError:
            continue
        r = search_config(c, order, cache[c["key"]], cluster, budget, hand, tol, recompute)
        if r["fits"]:
            best = min(best, r["step_s"])
        if share[1] > 1:  # travels back to the parent: drop what is cheap to rebuild for the few kept
            r = {k: val for k, val in r.items() if k not in ("sim", "order")}
        results.append(r)
    return results, pruned


def _search(job, workers=None):
    """All configurations, split over forked workers (a worker prunes against its own best, so it evaluates at
    least what one process would)."""
    import multiprocessing as mp
    import os

    global _FORKED
    if workers is None:
        workers = min(2, os.cpu_count() or 1) if len(job[0]) >= 8 else 1
    _FORKED = job
    try:
        if workers > 1 and "fork" in mp.get_all_start_methods():
            with mp.get_context("fork").Pool(workers) as pool:
                parts = pool.map(_search_share, [(w, workers) for w in range(workers)])
        else:
            parts = [_search_share((0, 1))]
    finally:
        _FORKED = ()
    return [r for part, _ in parts for r in part], sum(n for _, n in parts)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _dp_size(mesh: MeshSpec) -> int:
    return math.prod(s for s, nm in zip(mesh.shape, mesh.names) if nm.startswith("dp"))


def candidate_meshes(mesh: MeshSpec, n_clusters: int, cluster, opts) -> list:
    """(pp, stage submesh) pairs: the mesh's own pp dim, or every factorization of a flat rank set into
    pp x dp x tp with tp inside one node."""
    if "pp" in mesh.names:
        k = mesh.names.index("pp")
        rest = [(s, nm) for j, (s, nm) in enumerate(zip(mesh.shape, mesh.names)) if j != k]
        sub = MeshSpec(tuple(s for s, _ in rest), tuple(nm for _, nm in rest)) if rest else MeshSpec((1,), ("dp",))
        return [(mesh.shape[k], sub)]
    world = mesh.size
    out = []
    for p in opts.get("pp") or _divisors(world):
        if world % p or p > n_clusters:
            continue
        for tp in opts.get("tp") or _divisors(world // p):
            if (world // p) % tp or tp > cluster.gpus_per_node:
                continue
            dp = world // p // tp
            shape = [(dp, "dp"), (tp, "tp")]
            shape = [x for x in shape if x[0] > 1] or [(1, "dp")]
            out.append((p, MeshSpec(tuple(s for s, _ in shape), tuple(nm for _, nm in shape))))
    return out


def microbatch_counts(B: int, p: int, dp: int, opts) -> list:
    if opts.get("n_microbatches"):
        ms = [m for m in opts["n_microbatches"] if B % m == 0 and (B // m) % dp == 0]
    else:
        ms = [m for m in _divisors(B) if (B // m) % dp == 0 and (m >= p if p > 1 else m == 1)]
        ms = sorted(ms, key=lambda m: B // m)[: opts.get("max_microbatch_options", 3)]
    return sorted(ms)


def plan_pipeline(
    model,
    mesh,
    example_inputs,
    *,
    cluster,
    precision,
    budget,
    loss_fn=None,
    force=None,
    replicate_ops=(),
    allow_replicate=False,
    time_limit=60.0,
    pipeline="auto",
):
    """Choose pp degree, stage submesh, micro-batch count, schedule, stages per rank, stage boundaries and each
    stage's per-op plan; returns a Plan with `stages` and `schedule` filled (see module docstring).

    pipeline: "auto"/True, or a dict narrowing the search: pp, tp (lists), n_microbatches, schedules,
    stages_per_rank (lists), layers_per_stage (a hand layout: blocks per stage, no DP), max_microbatch_options,
    n_variants (intra-op plans per stage submesh: 1 time-optimal, 2 (default) + FSDP-sharded params, 3-4 +
    memory-budgeted), recompute (checkpointed blocks: True (default) as memory needs, False never, "all": every
    block, for hand layouts), dp_shards_batch (default True),
    prune_margin (1.25), dp_tol (1e-3: relative tolerance of the bottleneck scan; 0 = exact), top (candidates
    kept in the report)."""
    t_start = time.perf_counter()
    opts = dict(pipeline) if isinstance(pipeline, dict) else {}
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("pipeline planning needs a batched first input (the batch dim 0 is split into micro-batches)")
    Bsz = tensors[0].shape[0]
    prefix = find_layers(model)
    blocks = (
        list(model.get_submodule(prefix).values())
        if isinstance(model.get_submodule(prefix), nn.ModuleDict)
        else list(model.get_submodule(prefix))
    )
    sigs = [layer_signature(b) for b in blocks]
    reps = [i for i, s in enumerate(sigs) if s not in sigs[:i]]
    pos_of = [reps.index(sigs.index(s)) for s in sigs]
    n = len(blocks) + 2
    tied = {a for a, _ in model.named_parameters(remove_duplicate=False)} - {a for a, _ in model.named_parameters()}
    ctx = {
        "cluster": cluster,
        "precision": precision,
        "loss_fn": loss_fn,
        "force": dict(force or {}),
        "replicate_ops": [str(o) for o in replicate_ops],
        "allow_replicate": allow_replicate,
        "time_limit": time_limit,
        "n_variants": int(opts.get("n_variants", 2)),
        "dp_shards_batch": bool(opts.get("dp_shards_batch", True)),
        "recompute": opts.get("recompute", True),
    }
    names = [k for k in opts.get("schedules") or pm.SCHEDULES]
    specs = [pm.get_schedule(k) for k in names]
    hand = opts.get("layers_per_stage")
    grid = []
    for p, smesh in candidate_meshes(mesh, n, cluster, opts):
        if tied and p > 1:
            raise ValueError(f"tied parameters {sorted(tied)} cannot be split across pipeline stages")
        grid += [(p, smesh, m) for m in microbatch_counts(Bsz, p, _dp_size(smesh), opts)]
    keys = list(dict.fromkeys((smesh, Bsz // m) for _, smesh, m in grid))
    t_keys = time.perf_counter()
    cache = _stage_plans(model, prefix, reps, pos_of, inputs, Bsz, keys, ctx, opts.get("workers"))
    t_keys = time.perf_counter() - t_keys
    configs = []
    for p, smesh, m in grid:
        key = (smesh, Bsz // m)
        if not cache[key].variants:
            continue
        for spec in specs:
            for v in (opts.get("stages_per_rank") or spec.stages_per_rank) if p > 1 else (1,):
                if (
                    (p == 1 and spec.name != "GPipe")
                    or (v > 1) != spec.multi
                    or p * v > n
                    or (hand and len(hand) != p * v)
                ):
                    continue
                configs.append(
                    {
                        "p": p,
                        "mesh": smesh,
                        "m": m,
                        "spec": spec,
                        "v": v,
                        "key": key,
                        "lb": lower_bound(cache[key].costs(), spec, p, v, m),
                    }
                )
    configs.sort(key=lambda c: c["lb"])
    job = (
        configs,
        cache,
        cluster,
        budget,
        hand,
        float(opts.get("dp_tol", 1e-3)),
        ctx["recompute"],
        float(opts.get("prune_margin", 1.25)),
    )
    t_search = time.perf_counter()
    results, pruned = _search(job, opts.get("workers"))
    t_search = time.perf_counter() - t_search
    t_intra = sum(o.seconds for o in cache.values())
    fitting = [r for r in results if r["fits"]]
    if not fitting:
        low = min((r["peak_mem"] for r in results), default=INF)
        raise InfeasibleMemoryError(
            f"no pipeline plan fits {budget / 1e9:.3f} GB per rank on {mesh}: smallest "
            f"peak found {low / 1e9:.3f} GB over {len(results)} candidates"
        )
    fitting.sort(key=lambda r: (r["step_s"], r["p"] * r["v"], r["m"]))
    top = fitting[: int(opts.get("top", 12))]
    for r in top[:5]:  # the torchtitan-style even layer split of the same configuration, for comparison
        if r.get("order") is None:
            r["order"] = pm.actions(r["spec"], r["p"], r["m"], r["v"])
        S = r["p"] * r["v"]
        r["even"] = (
            evaluate_fitted(cache[r["key"]].costs(), even_bounds(len(blocks), S), r, cluster, budget, ctx["recompute"])
            if S <= len(blocks)
            else None
        )
    t0 = top[0]
    best = top[0] = {
        **t0,
        **evaluate(
            cache[t0["key"]].costs(),
            t0["part"].bounds,
            t0["part"].variants,
            t0["part"].recompute,
            t0["spec"],
            t0["p"],
            t0["v"],
            t0["m"],
            t0["order"],
            cluster,
            t0["mesh"].size,
            budget,
            detail=True,
        ),
    }
    stats = {
        "intra_op_s": t_intra,
        "total_s": time.perf_counter() - t_start,
        "configs": len(configs),
        "stage_plans_wall_s": t_keys,
        "search_wall_s": t_search,
        "pruned": pruned,
        "intra_op_keys": len(cache),
        "pp_degrees": sorted({c["p"] for c in configs}),
        "stage_meshes": sorted(
            {"x".join(map(str, c["mesh"].shape)) + "(" + ",".join(c["mesh"].names) + ")" for c in configs}
        ),
    }
    return build_pipeline_plan(
        best, top, len(results), cache[best["key"]], model, prefix, reps, pos_of, mesh, inputs, cluster, budget, stats
    )
