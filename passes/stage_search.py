"""The stage search's configurations (what passes/stages.py `run` visits): per (pp degree, stage submesh,
micro-batch count) the intra-op plans of its stage (passes/stage_costs.py StageOps, cached per submesh and
micro-batch shape, `stage_plans`); every (schedule, stages per rank) on top of it is a configuration.
Configurations are visited in increasing order of a lower bound on the closed form (`lower_bound`); those whose
bound exceeds `prune_margin` (1.25) x the best simulated step so far are skipped (the closed form tracks the
simulation within a few percent; the margin covers that). Each visited configuration gets the exact stage DP
(autopar/pipeline_model.partition) and is simulated on torch's action order (`search_config`, `search`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from autopar import pipeline_model as pm
from autopar.cost import collective_time
from autopar.mesh import MeshSpec

from .stage_costs import StageOps, evaluate, layout_bounds, stage_transient

INF = float("inf")


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
            j = _fastest_fitting_all_checkpointed(costs, a, b, fl[k], cap)
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


def _fastest_fitting_all_checkpointed(costs, a: int, b: int, inflight: int, cap: float) -> int:
    """The variant for clusters a:b with every block checkpointed: the fastest whose memory (state, each in-flight
    micro-batch's block inputs, the largest transient: a block's recompute, the loss) fits `cap`, else the leanest."""
    t = [(cv.F[a:b] + cv.B[a:b] + cv.W[a:b] + cv.rtime[a:b]).sum() for cv in costs]
    mem = [
        cv.state[a:b].sum() + inflight * (cv.act[a:b] - cv.save[a:b]).sum() + stage_transient(cv, a, b, 1)
        for cv in costs
    ]
    fit = [j for j in range(len(costs)) if mem[j] <= cap]
    return min(fit, key=lambda j: t[j]) if fit else int(np.argmin(mem))


def _hand_fitting(costs, bounds, base, cluster, budget, recompute) -> dict:
    """evaluate_fitted, its per-stage choices made again under a scaled cap while the exact rank peak overflows
    `budget` (the per-stage options leave out FSDP's unsharded units with one pipeline rank, which the simulation
    counts) or leaves room that fewer checkpointed blocks could use (with v stages per rank each stage is first
    charged budget / v, though their peaks do not coincide): the cap is scaled by the room, then bisected between
    the largest that fits and the smallest that overflows; recompute=True checkpoints as memory needs, and the
    fastest layout that fits wins, its ranks' remaining room then spent stage by stage (spend_room). The DP scales
    its cap the same way for v > 1."""
    r = evaluate_fitted(costs, bounds, base, cluster, budget, recompute)
    if recompute is not True:
        return r
    best, lo, hi, cap = (
        (r if r["fits"] else None),
        (budget if r["fits"] else 0.0),
        (None if r["fits"] else budget),
        budget,
    )
    for _ in range(6):
        if r["fits"] and not any(r["recompute"]):
            break
        room = 0.98 * budget / r["peak_mem"] if r["peak_mem"] > 0 else 1.0
        nxt = min(cap * room, base["v"] * budget) if hi is None else (lo + hi) / 2
        if hi is not None and hi - lo < 0.02 * budget or abs(nxt - cap) < 0.01 * budget:
            break
        cap = nxt
        r = evaluate_fitted(costs, bounds, base, cluster, cap, recompute)
        r["fits"] = r["peak_mem"] <= budget
        if r["fits"]:
            lo = max(lo, cap)
            best = r if best is None or r["step_s"] < best["step_s"] else best
        else:
            hi = cap if hi is None else min(hi, cap)
    return spend_room(costs, best, base, cluster, budget) if best else r


def _rank_mem_fn(costs, bounds, variants, order, rank_of, split: bool, rec):
    """mem(q): rank q's peak as evaluate counts it before FSDP's unsharded units (its stages' state, the peak of
    their saved activations over its action order, their largest transient) for the checkpointed-block counts in
    `rec` (read at each call, so the caller may change it)."""
    S = len(bounds) - 1
    parts = [(costs[variants[k]], bounds[k], bounds[k + 1]) for k in range(S)]
    nb = [max(1, int(cv.blk[a:b].sum())) for cv, a, b in parts]
    full = [float(cv.act[a:b].sum()) for cv, a, b in parts]
    save = [float(cv.save[a:b].sum()) / nb[k] for k, (cv, a, b) in enumerate(parts)]
    state = [float(cv.state[a:b].sum()) for cv, a, b in parts]
    trans = [(stage_transient(cv, a, b, 0), stage_transient(cv, a, b, 1)) for cv, a, b in parts]
    mine = [[k for k in range(S) if rank_of[k] == q] for q in range(len(order))]
    live: dict = {}  # rank -> its in-flight rows (pm.live_rows), built on first use

    def mem(q: int) -> float:
        if q not in live:
            live[q] = pm.live_rows(order[q], mine[q], split)
        act = np.array([full[k] - rec[k] * save[k] for k in mine[q]])
        peak = max(0.0, float((live[q] @ act).max())) if len(live[q]) else 0.0
        return sum(state[k] for k in mine[q]) + peak + max((trans[k][rec[k] > 0] for k in mine[q]), default=0.0)

    return mem


def spend_room(costs, r: dict, base: dict, cluster, budget: float, quick: bool = False) -> dict:
    """A fitting plan `r` (bounds, variants, recompute per stage) with each rank's memory left under `budget` spent
    on fewer checkpointed blocks, stage by stage: a uniform per-stage cap leaves most of it unused where one block
    more or less per stage moves the rank's peak by many GB. Each rank's peak is its own (its stages' activations
    over its action order, FSDP's unsharded units), so each rank picks its stages' counts alone: where they allow
    few combinations, every one (from none to all of each stage's blocks: a block checkpointed more on one stage
    may free two on another), the most recompute seconds saved whose peak fits; else one block fewer at a time,
    the stage saving the most seconds per byte of peak added (on an interleaved schedule a later stage of the rank
    holds fewer micro-batches at its peak), while the peak fits. The result is evaluated again and kept only where
    it fits and is faster."""
    rec = list(r.get("recompute") or [])
    if not r.get("fits") or not any(rec):
        return r
    bounds, variants, order, spec = r["bounds"], r["variants"], base["order"], base["spec"]
    p, v, m, rank_of = base["p"], base["v"], base["m"], pm.stage_ranks(spec, base["p"], base["v"])
    mem = _rank_mem_fn(costs, bounds, variants, order, rank_of, spec.split_backward, rec)
    gain, nblk = [], []
    for k in range(len(rec)):
        cv, a, b = costs[variants[k]], bounds[k], bounds[k + 1]
        nblk.append(int(cv.blk[a:b].sum()))
        gain.append(m * float(cv.rtime[a:b].sum()) / max(1, nblk[-1]))
    for q in range(p):
        mine = [k for k in range(len(rec)) if rank_of[k] == q and nblk[k] > 0]
        room = budget - (r["rank_mem"][q] - mem(q))  # less FSDP's unsharded units: they do not depend on rec
        if math.prod(nblk[k] + 1 for k in mine) <= 729:
            _rank_exhaustive(rec, mine, [nblk[k] for k in mine], gain, lambda: mem(q), room)
        else:
            _rank_greedy(rec, mine, gain, mem, q, room)
    if rec == list(r["recompute"]):
        return r
    ev = evaluate(costs, bounds, variants, rec, spec, p, v, m, order, cluster, base["mesh"].size, budget, quick=quick)
    if not ev["fits"] or ev["step_s"] >= r["step_s"]:
        return r
    return {**r, **ev, "bounds": bounds, "variants": variants}


def _rank_greedy(rec, mine, gain, mem, q, room) -> None:
    """One block fewer at a time on rank q's stages `mine`: the one saving the most seconds per byte of peak added,
    while mem(q) <= room."""
    cur = mem(q)
    while True:
        best, best_score, best_mem = None, -1.0, cur
        for k in (k for k in mine if rec[k] > 0):
            rec[k] -= 1
            new = mem(q)
            rec[k] += 1
            score = gain[k] / max(new - cur, 1.0)
            if new <= room and score > best_score:
                best, best_score, best_mem = k, score, new
        if best is None:
            return
        rec[best] -= 1
        cur = best_mem


def _rank_exhaustive(rec, mine, tops, gain, mem, room) -> None:
    """Every count from 0 to tops[i] on one rank's stages `mine` (few): the most seconds saved over the counts in
    `rec` with the rank's mem() <= room, the lower peak on a tie (the counts in `rec` fit: saving 0)."""
    now = [rec[k] for k in mine]
    best, key = now, (0.0, -mem())
    for c in itertools.product(*(range(t + 1) for t in tops)):
        saved = sum(gain[k] * (was - x) for k, was, x in zip(mine, now, c))
        if saved < key[0]:
            continue
        for k, x in zip(mine, c):
            rec[k] = x
        used = mem()
        if used <= room and (saved, -used) > key:
            best, key = list(c), (saved, -used)
    for k, x in zip(mine, best):
        rec[k] = x


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


def state_bound(costs, p: int) -> float:
    """A lower bound on any partition's per-rank peak: every cluster's state at its leanest variant, averaged over
    the p ranks (the fullest rank holds at least the mean; activations only add). A configuration whose bound
    exceeds the budget cannot fit, so the search skips it without a DP (a 1T model on few stages: most of them)."""
    return float(np.min([cv.state for cv in costs], axis=0).sum()) / p


def search_config(c, order, ops, cluster, budget, hand=None, tol=1e-3, recompute=True, tries=3, above=INF) -> dict:
    """Stage DP (or a hand layout) for one configuration, evaluated by simulation. With several stages per rank
    the DP charges each stage budget/v (scaled, up to `tries` DPs, while the exact rank peak leaves room or
    overflows), and what the ranks' peaks leave is then spent per stage (spend_room). A DP whose closed form
    exceeds `above` (the prune margin x the best step so far) is not simulated: the lower bound that ordered the
    configurations is a bound on this closed form, so the partition's own value prunes by the same rule, only
    tighter; with cap < budget a later DP may still improve (a larger cap only widens the DP's choices), so only a
    DP at the full budget ends the configuration. Returns {"pruned": True} when it was cut so before any
    simulation."""
    p, v, m, spec, smesh = c["p"], c["v"], c["m"], c["spec"], c["mesh"]
    S = p * v
    fl = _dp_inflight(order, S, spec, v)
    link = cluster.link_for((p,) + smesh.shape, 0) if p > 1 else cluster.intra
    base = {**c, "order": order}
    if hand:
        cvs = ops.costs()
        r = _hand_fitting(cvs, layout_bounds(hand), base, cluster, budget, recompute)
        return {**base, **r, "part": pm.Partition(r["bounds"], r["variants"], float("nan"), r["recompute"])}
    cap, best, tried = budget / v, None, 0
    while tried < (1 if v == 1 else tries):
        tried += 1
        cvs = ops.costs()
        xfer = np.array([[collective_time("send_recv", float(b), 2, link) for b in cv.xbytes] for cv in cvs])
        part = pm.partition(cvs, xfer, spec, p, v, m, fl, cap, tol, bool(recompute))
        if part is None:
            break
        if part.proxy_s > above and (v == 1 or cap >= budget):
            if best is None:
                return {"pruned": True}
            break
        ev = evaluate(
            cvs,
            part.bounds,
            part.variants,
            part.recompute,
            spec,
            p,
            v,
            m,
            order,
            cluster,
            smesh.size,
            budget,
            quick=True,
        )
        if ev["fits"] and (best is None or ev["step_s"] < best["step_s"]):
            best = {**base, **ev, "part": part}
        if ev["fits"] and ev["peak_mem"] > 0.95 * budget or cap >= budget:
            break
        cap = min(budget, cap * (budget / ev["peak_mem"]) * (1.0 if ev["fits"] else 0.9))
    # One stage has one partition: the DP's per-stage memory bound must not rule it out where the exact rank peak
    # fits (a long sequence near the budget, as TorchTitan's 8B at 256K tokens on cp 8)
    if best is None and p * v == 1:
        cvs = ops.costs()
        r = _hand_fitting(cvs, [0, len(cvs[0].F)], base, cluster, budget, recompute)
        if r["fits"]:
            return {**base, **r, "part": pm.Partition(r["bounds"], r["variants"], float("nan"), r["recompute"])}
    if best is None:
        return {**base, "fits": False, "step_s": INF, "peak_mem": INF}
    if v > 1 and recompute is True:  # the DP charged each stage budget / v: the ranks' room is spent per stage
        part = best["part"]
        r = spend_room(cvs, {**best, "bounds": part.bounds, "variants": part.variants}, base, cluster, budget, True)
        best = {**r, "part": pm.Partition(part.bounds, part.variants, part.proxy_s, r["recompute"])}
        best.pop("bounds"), best.pop("variants")
    return best


# ---- the search ------------------------------------------------------------------------------------------------
_FORKED: tuple = ()  # what forked workers inherit (forked_map's `shared`)


def workers_for(n_jobs: int, at_least: int, workers=None) -> int:
    """Forked workers for n_jobs jobs: `workers` if given, else one per core (at most 2) from `at_least` jobs on;
    1 where the platform cannot fork."""
    import multiprocessing as mp
    import os

    if "fork" not in mp.get_all_start_methods():
        return 1
    if workers is None:
        return min(2, os.cpu_count() or 1) if n_jobs >= at_least else 1
    return workers


def forked_map(fn, items, shared, workers: int) -> list:
    """[fn(x) for x in items] over `workers` forked processes, which inherit `shared` (read with `forked()`)
    instead of receiving it pickled (models, action orders and intra-op plans are large); here when workers <= 1."""
    import multiprocessing as mp

    global _FORKED
    _FORKED = shared
    try:
        if workers > 1:
            with mp.get_context("fork").Pool(workers) as pool:
                return pool.map(fn, items, chunksize=1)
        return [fn(x) for x in items]
    finally:
        _FORKED = ()


def forked() -> tuple:
    """The `shared` of the forked_map running (in a worker: the one it was forked with)."""
    return _FORKED


def _one_stage_plan(job):
    model, prefix, reps, pos_of, ctx = forked()
    smesh, specs, m = job
    # a batched input: its real first rows where the example is real (capture specializes data-dependent checks,
    # an attention mask's `.all()`, on real values), else an empty meta tensor of the micro-batch's shape
    mbi = tuple(x if sh is None or x is not None else torch.empty(sh, dtype=dt, device="meta") for sh, dt, x in specs)
    return StageOps(model, prefix, reps, pos_of, mbi, smesh, {**ctx, "drop_state": True, "n_microbatches": m})


def stage_plans(model, prefix, reps, pos_of, inputs, Bsz, keys, ctx, workers=None) -> dict:
    """StageOps per (stage submesh, micro-batch size). Several keys are planned in forked worker processes (one per
    core, at most 2 unless `workers` says otherwise): each is an independent capture + intra-op solve."""
    jobs = []
    for smesh, mb in keys:
        jobs.append(
            (
                smesh,
                tuple(
                    ((mb,) + tuple(x.shape[1:]), x.dtype, None if x.is_meta else x[:mb].clone())
                    if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == Bsz
                    else (None, None, x)
                    for x in inputs
                ),
                Bsz // mb,
            )
        )
    shared = (model, prefix, reps, pos_of, ctx)
    return dict(zip(keys, forked_map(_one_stage_plan, jobs, shared, workers_for(len(jobs), 4, workers))))


def _search_share(share):
    """Configurations share[0]::share[1] in lower-bound order: DP + simulation each, skipping those whose lower
    bound exceeds margin x the best step found so far (here)."""
    configs, cache, cluster, budget, hand, tol, recompute, margin, best = forked()
    results, pruned, orders = [], 0, {}
    for c in configs[share[0] :: share[1]]:
        if c["lb"] > margin * best or c.get("mem_lb", 0.0) > budget:
            pruned += 1
            continue
        sched = (c["spec"].name, c["p"], c["m"], c["v"])  # configurations on other submeshes share the order
        if sched not in orders:
            try:
                orders[sched] = pm.actions(c["spec"], c["p"], c["m"], c["v"])
            except ValueError:
                orders[sched] = None
        order = orders[sched]
        if order is None:
            continue
        ops, above = cache[c["key"]], margin * best
        if getattr(ops, "exact", True):
            r = search_config(c, order, ops, cluster, budget, hand, tol, recompute, above=above)
        else:  # estimated costs only rank keys for an exact solve: a coarser DP (2% bottleneck scan, one cap)
            r = search_config(c, order, ops, cluster, budget, hand, max(tol, 0.02), recompute, 1, above)
        if r.get("pruned"):
            pruned += 1
            continue
        if r["fits"]:
            best = min(best, r["step_s"])
        if share[1] > 1:  # travels back to the parent: drop what is cheap to rebuild for the few kept
            r = {k: val for k, val in r.items() if k not in ("sim", "order")}
        results.append(r)
    return results, pruned


def search(job, workers=None):
    """All configurations, split over forked workers (a worker prunes against its own best, so it evaluates at
    least what one process would). job: (configs, key -> StageOps, cluster, budget, hand layout, dp_tol, recompute,
    prune margin, the best step already found elsewhere (pruning starts from it))."""
    workers = workers_for(len(job[0]), 8, workers)
    parts = forked_map(_search_share, [(w, workers) for w in range(workers)], job, workers)
    return [r for part, _ in parts for r in part], sum(n for _, n in parts)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def dp_size(mesh: MeshSpec) -> int:
    return math.prod(s for s, nm in zip(mesh.shape, mesh.names) if nm.startswith("dp"))


_HEADS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
_KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


def head_counts(model) -> set:
    """Every attention head count the model's modules (or their config) declare: query and KV heads, as the
    Llama/GPT-2 families, torchtitan and transformers name them. A tensor-parallel degree must divide each."""
    out = set()
    for mod in model.modules():
        for obj in (mod, getattr(mod, "config", None), getattr(mod, "cfg", None)):
            for name in _HEADS + _KV_HEADS:
                val = getattr(obj, name, None) if obj is not None else None
                if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                    out.add(val)
    return out


def tp_degrees(world: int, per_stage: int, cluster, heads: set, asked=None) -> list:
    """Tensor-parallel degrees of a stage submesh of `per_stage` of `world` ranks: dividing it, at most a node,
    dividing the node's GPU count when the ranks span several nodes (a tp group of consecutive ranks then never
    crosses a node), and dividing every head count (no head split or replicated across tp ranks); `asked` (the
    tp option) narrows them."""
    g = cluster.gpus_per_node
    ok = [t for t in range(1, min(g, per_stage) + 1) if all(h % t == 0 for h in heads)]
    return [t for t in asked or ok if t in ok and per_stage % t == 0 and (g % t == 0 or world <= g)]


# Context parallelism pays where one sequence is long: a cp rank all-gathers K and V (2 x seq x kv_dim per
# attention) while its attention work grows with (seq / cp) x seq, so the compute that hides the gather per
# gathered byte scales with the per-rank sequence. Llama 3 (cp 16 at 131072) and torchtitan (cp 2-8 at 65536-262144)
# keep >= 8192 tokens per cp rank; below that the GEMMs go skinny and the gather is exposed. Degrees are powers of
# 2 up to 16 (Llama 3's largest), so a long sequence adds at most 4 cp degrees per (pp, tp).
CP_MIN_TOKENS = 8192
CP_MAX = 16


def cp_degrees(seq: int | None, per_stage: int, asked=None) -> list:
    """Context-parallel degrees of a stage submesh of `per_stage` ranks for sequences of `seq` tokens: 1, and the
    powers of 2 up to CP_MAX dividing both the sequence and the ranks that keep >= CP_MIN_TOKENS per rank; `asked`
    (the cp option) narrows them. None (no sequence, or a model without attention): [1]."""
    ok = [1]
    c = 2
    while seq and c <= min(CP_MAX, per_stage) and seq % c == 0 and seq // c >= CP_MIN_TOKENS:
        ok += [c] if per_stage % c == 0 else []
        c *= 2
    return [c for c in asked or ok if c in ok]


def candidate_meshes(mesh: MeshSpec, n_clusters: int, cluster, opts, heads=frozenset(), max_pp=None, seq=None) -> list:
    """(pp, stage submesh) pairs: the mesh's own pp dim, or every factorization of a flat rank set into
    pp x dp x cp x tp with tp a valid degree (tp_degrees), cp a valid degree for a `seq`-token sequence
    (cp_degrees: only long sequences get cp > 1) and pp <= max_pp (1 for a model with tied parameters). Stage
    submesh dims are named ("dp", "cp", "tp") as forced layouts name them, size-1 dims left out."""
    if "pp" in mesh.names:
        k = mesh.names.index("pp")
        rest = [(s, nm) for j, (s, nm) in enumerate(zip(mesh.shape, mesh.names)) if j != k]
        sub = MeshSpec(tuple(s for s, _ in rest), tuple(nm for _, nm in rest)) if rest else MeshSpec((1,), ("dp",))
        return [(mesh.shape[k], sub)]
    world = mesh.size
    out = []
    for p in opts.get("pp") or _divisors(world):
        if world % p or p > n_clusters or (max_pp is not None and p > max_pp):
            continue
        for tp in tp_degrees(world, world // p, cluster, heads, opts.get("tp")):
            for cp in cp_degrees(seq, world // p // tp, opts.get("cp")):
                dp = world // p // tp // cp
                shape = [x for x in [(dp, "dp"), (cp, "cp"), (tp, "tp")] if x[0] > 1] or [(1, "dp")]
                out.append((p, MeshSpec(tuple(s for s, _ in shape), tuple(nm for _, nm in shape))))
    return out


def microbatch_counts(B: int, p: int, dp: int, opts) -> list:
    if opts.get("n_microbatches"):
        ms = [m for m in opts["n_microbatches"] if B % m == 0 and (B // m) % dp == 0]
    else:
        ms = [m for m in _divisors(B) if (B // m) % dp == 0 and (m >= p if p > 1 else m == 1)]
        ms = sorted(ms, key=lambda m: B // m)[: opts.get("max_microbatch_options", 3)]
    return sorted(ms)
