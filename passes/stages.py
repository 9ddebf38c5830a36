"""Pass: pipeline stages (Alpa-style inter-op pass). `run(request)` chooses the pp degree, stage submesh,
micro-batch count, schedule, stages per rank, stage boundaries and each stage's per-op plan, and returns the Plan
with `stages` and `schedule` filled.

The request (StagesRequest) is what autopar.plan was given for a pipeline plan. The parts: per-cluster costs of a
stage's intra-op plans (passes/stage_costs.py: StageOps, the legal cuts, the evaluation of a partition), the search
over configurations (passes/stage_search.py), the schedule model and the stage DP (autopar/pipeline_model.py), the
Plan's stage records (passes/stage_plan.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar import pipeline_model as pm
from .stage_search import (
    INF,
    candidate_meshes,
    dp_size,
    evaluate_fitted,
    forked,
    forked_map,
    head_counts,
    lower_bound,
    microbatch_counts,
    search,
    spend_room,
    stage_plans,
    state_bound,
    workers_for,
)
from autopar.model_io import ModelIO
from autopar.plan import Plan
from autopar.solver import InfeasibleMemoryError

from .stage_costs import evaluate, even_bounds, find_layers, layer_signature
from .stage_estimate import estimate, representatives
from .stage_plan import build_pipeline_plan


@dataclass(frozen=True)
class StagesRequest:
    """A pipeline plan's inputs. inputs: the step's positional example inputs (the first is batched on dim 0);
    options: "auto"/True, or a dict narrowing the search: pp, tp (lists), n_microbatches, schedules,
    stages_per_rank (lists), layers_per_stage (a hand layout: blocks per stage, no DP), max_microbatch_options,
    n_variants (intra-op plans per stage submesh: 1 time-optimal, 2 (default) + FSDP-sharded params, 3-4 +
    memory-budgeted), recompute (checkpointed blocks: True (default) as memory needs, False never, "all": every
    block, for hand layouts), ac (what checkpointing a block means: "block" (default) reruns its forward, "op"
    torchtitan's selective op SAC: its matmul outputs but every second one and its attention outputs stay saved),
    dp_shards_batch (default True), prune_margin (1.25), dp_tol (1e-3: relative tolerance
    of the bottleneck scan; 0 = exact), top (candidates kept in the report), workers, exact_keys (0: with more
    (submesh, micro-batch) keys than this, one per family is solved and the rest estimated, passes/stage_estimate.py;
    a family's keys differ only in dp size and micro-batch, so even a few keys (C3: eight, one family of 405B cp
    stages) are mostly estimated), estimate_margin (0.05: an estimated key is solved exactly when its estimate is
    within this of the best exact step)."""

    model: nn.Module
    mesh: object
    inputs: tuple
    cluster: object
    precision: object
    budget: float
    loss_fn: object = None
    force: dict = field(default_factory=dict)
    replicate_ops: tuple = ()
    allow_replicate: bool = False
    time_limit: float = 60.0
    options: object = "auto"
    float8: dict | None = None  # the float8 option every stage's plan is priced with (passes/float8.py)
    pin: object = None  # plan(pin=) on the stage submesh's dims, called on each stage's representative nodes
    kwargs: dict | None = None  # keyword inputs (a transformers model's input_ids=, labels=): bound with `inputs`


def _blocks(model):
    """The model's layer list: its prefix, the blocks, the representative block of each distinct block signature
    (in order of first appearance) and each block's representative position."""
    prefix = find_layers(model)
    layers = model.get_submodule(prefix)
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    sigs = [layer_signature(b) for b in blocks]
    reps = [i for i, s in enumerate(sigs) if s not in sigs[:i]]
    pos_of = [reps.index(sigs.index(s)) for s in sigs]
    return prefix, blocks, reps, pos_of


def _tied_in_blocks(model, prefix: str) -> set:
    """The aliases of tied parameters that a block holds (one tensor in several layers, ALBERT's shared blocks):
    those keep pp = 1. A tensor tied only outside the blocks (the input embedding and the output head) is held by
    the first and the last stage, its gradients all-reduced between the two (Megatron's embedding group), priced in
    passes/stage_metrics.py and run by backends/pipelining/runtime.py."""
    every = {a: id(p) for a, p in model.named_parameters(remove_duplicate=False)}
    shared = {i for i in every.values() if list(every.values()).count(i) > 1}
    return {a for a, i in every.items() if i in shared and a.startswith(prefix + ".")}


def _meshes(model, mesh, n: int, cluster, opts, tied, seq=None) -> list:
    """The (pp, stage submesh) candidates. A model whose blocks hold tied parameters (one tensor used by two layers,
    `_tied_in_blocks`) plans without pipeline stages: the pipeline runtime keeps each block on one stage. seq: the
    step's sequence length (cp candidates where it is long); a model that declares no attention heads gets none
    (a cp dim splits attention's sequence)."""
    if tied and "pp" in mesh.names and mesh.shape[mesh.names.index("pp")] > 1:
        raise ValueError(
            f"tied parameters {sorted(tied)} cannot be split across pipeline stages: plan {type(model).__name__} "
            f"without a pp mesh dim (pipeline='auto' on a flat rank set then keeps pp = 1), or untie them"
        )
    heads = head_counts(model)
    out = candidate_meshes(mesh, n, cluster, opts, heads, 1 if tied else None, seq if heads else None)
    if not out:
        why = f"; tied parameters {sorted(tied)} keep pp = 1" if tied else ""
        raise ValueError(
            f"no (pp, dp, tp) layout of {mesh} for {type(model).__name__}: pp must divide the ranks and be at most "
            f"{n} (its layer clusters), tp must divide the ranks, the node's {cluster.gpus_per_node} GPUs and "
            f"the head counts {sorted(head_counts(model))}{why}; options pp={opts.get('pp')} tp={opts.get('tp')}"
        )
    return out


def _configs(grid, cache, Bsz: int, specs, opts, hand, n: int) -> list:
    """Every (pp, stage submesh, micro-batches, schedule, stages per rank) whose stage has intra-op plans, in
    increasing order of its lower bound."""
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
                        "mem_lb": state_bound(cache[key].costs(), p),
                    }
                )
    configs.sort(key=lambda c: c["lb"])
    return configs


def _ranked(results, cache, n_blocks: int, mesh, cluster, budget, opts, recompute):
    """The fitting results, fastest first (the report's `top`), the first five with their even layer split; the
    best one evaluated in detail. Raises InfeasibleMemoryError when none fits."""
    fitting = [r for r in results if r["fits"]]
    if not fitting:
        low = min((r["peak_mem"] for r in results), default=INF)
        raise InfeasibleMemoryError(
            f"no pipeline plan fits {budget / 1e9:.3f} GB per rank on {mesh}: smallest "
            f"peak found {low / 1e9:.3f} GB over {len(results)} candidates"
        )
    fitting.sort(key=lambda r: (r["step_s"], r["p"] * r["v"], r["m"]))
    top = fitting[: int(opts.get("top", 12))]
    for r in top[:5]:
        if r.get("order") is None:
            r["order"] = pm.actions(r["spec"], r["p"], r["m"], r["v"])
    evens = _evens(top[:5], cache, n_blocks, cluster, budget, recompute, opts.get("workers"))
    for r, even in zip(top[:5], evens):
        r["even"] = even
    t0 = top[0]
    top[0] = {
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
    return top


def _even_split(i: int) -> dict | None:
    """The torchtitan-style even layer split of configuration i of _evens, for comparison (its summary: the
    simulation stays behind)."""
    top, cache, n_blocks, cluster, budget, recompute = forked()
    r = top[i]
    S = r["p"] * r["v"]
    if S > n_blocks:
        return None
    costs = cache[r["key"]].costs()
    even = evaluate_fitted(costs, even_bounds(n_blocks, S), r, cluster, budget, recompute)
    if even is not None and recompute is True and r["v"] > 1:  # as the DP's result has it (search_config)
        even = spend_room(costs, even, r, cluster, budget)
    return None if even is None else {k: v for k, v in even.items() if k != "sim"}


def _evens(top, cache, n_blocks, cluster, budget, recompute, workers=None) -> list:
    """_even_split of each configuration in `top`, over two forked workers where there are several."""
    shared = (top, cache, n_blocks, cluster, budget, recompute)
    return forked_map(_even_split, range(len(top)), shared, workers_for(len(top), 2, workers))


def _context(request: "StagesRequest", opts: dict) -> dict:
    """What every stage's intra-op plan is planned with."""
    return {
        "cluster": request.cluster,
        "precision": request.precision,
        "loss_fn": request.loss_fn,
        "force": dict(request.force or {}),
        "replicate_ops": [str(o) for o in request.replicate_ops],
        "allow_replicate": request.allow_replicate,
        "time_limit": request.time_limit,
        "n_variants": int(opts.get("n_variants", 2)),
        "dp_shards_batch": bool(opts.get("dp_shards_batch", True)),
        "recompute": opts.get("recompute", True),
        "ac": opts.get("ac", "block"),
        "float8": request.float8,
        "pin": request.pin,
    }


def _search_stats(configs, cache, pruned, t_start, t_keys, t_search, n_keys, rounds) -> dict:
    return {
        "intra_op_s": sum(o.seconds for o in cache.values()),
        "total_s": time.perf_counter() - t_start,
        "configs": len(configs),
        "stage_plans_wall_s": t_keys,
        "search_wall_s": t_search,
        "pruned": pruned,
        "intra_op_keys": len(cache),
        "estimated_keys": n_keys - len(cache),
        "refine_rounds": rounds,
        "pp_degrees": sorted({c["p"] for c in configs}),
        "stage_meshes": sorted(
            {"x".join(map(str, c["mesh"].shape)) + "(" + ",".join(c["mesh"].names) + ")" for c in configs}
        ),
    }


def _priced(keys, cache, cluster) -> dict:
    """Every key's intra-op costs: the solved ones, the others estimated from their family (stage_estimate.py)."""
    out = {}
    for k in keys:
        out[k] = cache[k] if k in cache else estimate(k, cache, cluster)
    return {k: v for k, v in out.items() if v is not None}


def _to_solve(results, cache, batch: int, margin: float) -> list:
    """Keys still estimated whose best estimated configuration is within `margin` of beating every exact one
    (estimated step < best exact step x (1 + margin)), best first (at most `batch`); with no exact configuration
    that fits, the best estimated ones."""
    exact = min((r["step_s"] for r in results if r["fits"] and r["key"] in cache), default=INF)
    todo = []
    for r in sorted((r for r in results if r["fits"] and r["key"] not in cache), key=lambda r: r["step_s"]):
        if r["step_s"] >= exact * (1 + margin) or len(todo) == batch:
            break
        if r["key"] not in todo:
            todo.append(r["key"])
    return todo


def _refine(results, configs, cache, solve_keys, job_rest, workers, margin):
    """Solve exactly, a batch at a time, the estimated keys that look better than the best exact configuration
    (within `margin`, the estimate_margin option), and search their configurations again on exact costs, until none
    does. Returns (results on exact costs only, pruned count, rounds)."""
    pruned, rounds, batch = 0, 0, 2
    while True:
        todo = _to_solve(results, cache, batch, margin)
        if not todo and not any(r["fits"] for r in results if r["key"] in cache):
            # nothing exact fits: the estimates may be wrong on memory, so every key left is solved before failing
            todo = list(dict.fromkeys(c["key"] for c in configs if c["key"] not in cache))
        if not todo:
            break
        rounds += 1
        cache.update(solve_keys(todo))
        fresh = [c for c in configs if c["key"] in todo and cache[c["key"]].variants]
        for c in fresh:
            c["lb"] = lower_bound(cache[c["key"]].costs(), c["spec"], c["p"], c["v"], c["m"])
            c["mem_lb"] = state_bound(cache[c["key"]].costs(), c["p"])
        fresh.sort(key=lambda c: c["lb"])
        exact = min((r["step_s"] for r in results if r["fits"] and r["key"] in cache), default=INF)
        res, pr = search((fresh, cache, *job_rest, exact), workers)
        results = [r for r in results if r["key"] not in todo] + res
        pruned += pr
    return [r for r in results if r["key"] in cache], pruned, rounds


def run(request: StagesRequest) -> Plan:
    """The stage search (see the module docstring and StagesRequest); the fastest configuration that fits memory."""
    t_start = time.perf_counter()
    model, mesh, cluster, budget = request.model, request.mesh, request.cluster, request.budget
    opts = dict(request.options) if isinstance(request.options, dict) else {}
    io = None
    if request.kwargs or isinstance(request.inputs, dict):  # the bound call's leaves, rebuilt per micro-batch
        io = ModelIO.from_example(model, request.inputs, request.kwargs)
        inputs = tuple(io.leaves)
    else:
        inputs = tuple(request.inputs) if isinstance(request.inputs, (tuple, list)) else (request.inputs,)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("pipeline planning needs a batched first input (the batch dim 0 is split into micro-batches)")
    Bsz = tensors[0].shape[0]
    prefix, blocks, reps, pos_of = _blocks(model)
    n = len(blocks) + 2
    tied = _tied_in_blocks(model, prefix)
    ctx = {**_context(request, opts), "io": io}
    specs = [pm.get_schedule(k) for k in opts.get("schedules") or pm.SCHEDULES]
    hand = opts.get("layers_per_stage")
    grid = []
    seq = tensors[0].shape[1] if tensors[0].dim() >= 2 else None
    for p, smesh in _meshes(model, mesh, n, cluster, opts, tied, seq):
        grid += [(p, smesh, m) for m in microbatch_counts(Bsz, p, dp_size(smesh), opts)]
    keys = list(dict.fromkeys((smesh, Bsz // m) for _, smesh, m in grid))
    t_keys = time.perf_counter()
    workers = opts.get("workers")
    # two keys already split over the two cores (stage_plans alone forks from four)
    solve_keys = lambda ks: stage_plans(
        model, prefix, reps, pos_of, inputs, Bsz, ks, ctx, workers if workers is not None or len(ks) < 2 else 2
    )
    # up to `exact_keys` keys every one is solved; beyond, one per family and the rest estimated (refined below)
    first = keys if len(keys) <= int(opts.get("exact_keys", 0)) else representatives(keys)
    cache = solve_keys(first)
    priced = _priced(keys, cache, cluster)
    t_keys = time.perf_counter() - t_keys
    configs = _configs(grid, priced, Bsz, specs, opts, hand, n)
    rest = (cluster, budget, hand, float(opts.get("dp_tol", 1e-3)), ctx["recompute"])
    rest += (float(opts.get("prune_margin", 1.25)),)
    t_search = time.perf_counter()
    results, pruned = search((configs, priced, *rest, INF), workers)
    margin = float(opts.get("estimate_margin", 0.05))
    results, more, rounds = _refine(results, configs, cache, solve_keys, rest, workers, margin)
    t_search = time.perf_counter() - t_search
    top = _ranked(results, cache, len(blocks), mesh, cluster, budget, opts, ctx["recompute"])
    best = top[0]
    stats = _search_stats(configs, cache, pruned + more, t_start, t_keys, t_search, len(keys), rounds)
    plan = build_pipeline_plan(
        best, top, len(results), cache[best["key"]], model, prefix, reps, pos_of, mesh, inputs, cluster, budget, stats
    )
    if io is not None:  # the runtime feeds the first stage positionally: it checks this (backends/pipelining)
        plan.meta["keyword_inputs"] = [n for n, x in zip(io.names, io.leaves) if isinstance(x, torch.Tensor)]
    return plan
