"""FSDP2 under torch.distributed.pipelining as a cost model: the engine terms of a pipeline partition.

On clusters with NCCL links (the GPU presets) a partition's step and memory are priced as torch's engines run FSDP2
under `torch.distributed.pipelining` (`engine_terms`, `engine_step`): the stage module is gathered in the first
micro-batch's forward (one unit ahead; the first gather shows, slower gathers show their excess) and kept gathered
until the last micro-batch's backward (the schedule sets reshard_after_backward and requires_gradient_sync False
on every backward but the last: torchtitan also passes reshard_after_forward=False under PP); the unsharded
gradients accumulate across micro-batches (in the reduce dtype, fp32 under bf16 mixed precision) and are
reduce-scattered after the last backward, the tail past the rank's last backward showing; then the optimizer step,
memory bound over the rank's shard. The unsharded parameters and accumulated gradients are memory every stage
holds through the step. Multi-stage schedule classes (interleaved, zero-bubble, V: torch's
_PipelineScheduleRuntime) instead issue an UNSHARD of each of the rank's stages (up to 3 active) at the step's start,
so a stage's first forward waits only for its gathers to be done, and a REDUCE_GRAD of the whole stage after its
last backward. With one pipeline rank there is no schedule: FSDP2 reshards after the forward and gathers
again for the backward (the plain FSDP2 timeline of autopar/cost/overlap.py).
"""

from __future__ import annotations

import math

import numpy as np

from autopar.cost.comm import collective_time
from autopar.cost.overlap import Unit, fsdp_timeline, optimizer_step_time
from autopar.pipeline_model import rank_stages, simulate
from autopar.strategies import num_shards
from autopar.strategies.context_parallel import CP_PREFIX
from autopar.strategies.data_parallel import dp_dims


def engine_terms(g, P, where, K: int, mesh, precision, cluster) -> dict:
    """Per cluster (where[node] in 0..K-1) of a stage's per-op plan, what the pipeline runtime's fully_shard over
    the dp* mesh dims does with the parameters stored sharded there (tensor-parallel styles keep their sharding on
    the other dims): one all-gather per cluster (a unit) of its parameters unsharded on dp in the parameter dtype
    (ag; ag_bw the same again for a backward that re-gathers), one reduce-scatter of their gradients in the reduce
    dtype (the fp32 master's where there is one: rs), the bytes a pipelined step keeps (`kept`: those unsharded
    parameters and accumulated gradients, unsharded on the cp* dims too), and the optimizer step's seconds over the
    rank's shard (opt_s)."""
    ag, rs, kept, opt_s = (np.zeros(K) for _ in range(4))
    dp = tuple(dp_dims(mesh.names, mesh.shape))
    # a cp* dim shards parameters too (torchtitan's dp_shard_cp): their gathers there are the per-op plan's
    # redistributes (priced with it), but the unit computes on them unsharded, so the kept bytes count them
    held = dp + tuple(d for d, nm in enumerate(mesh.names) if nm.startswith(CP_PREFIX) and mesh.shape[d] > 1)
    acc = precision.master or precision.grad
    unsharded: dict = {}  # (cluster, dp dims it is sharded on) -> parameter elements unsharded there
    for i in g.params.values():
        c, pl, numel = where[i], P[i].out[0], g.nodes[i].out.numel
        if c is None:
            continue
        opt_s[c] += optimizer_step_time(numel / num_shards(pl, mesh.shape), precision, cluster.device)
        dims = tuple(d for d in dp if pl[d][0] == "S")
        if dims:
            rest = tuple("R" if d in dims else q for d, q in enumerate(pl))
            unsharded[(c, dims)] = unsharded.get((c, dims), 0.0) + numel / num_shards(rest, mesh.shape)
        if any(pl[d][0] == "S" for d in held):
            full = tuple("R" if d in held else q for d, q in enumerate(pl))
            kept[c] += numel / num_shards(full, mesh.shape) * (precision.param + acc)
    for (c, dims), n in unsharded.items():
        link, group = cluster.group_link(tuple(mesh.shape), dims), math.prod(mesh.shape[d] for d in dims)
        ag[c] += collective_time("all_gather", n * precision.param, group, link)
        rs[c] += collective_time("reduce_scatter", n * acc, group, link)
    return {"ag": ag, "ag_bw": ag.copy(), "rs": rs, "kept": kept, "opt_s": opt_s}


def stage_units(cv, a: int, b: int, recompute: int, regather: bool) -> list[Unit]:
    """Clusters a..b-1 of one intra-op variant's costs (stage_costs.Costs with engine terms) as FSDP2 units: forward
    and backward seconds per micro-batch (the backward with its share of the recomputed blocks), the step's gathers
    and reductions."""
    nb = max(1, int(cv.blk[a:b].sum()))
    return [
        Unit(
            float(cv.F[c]),
            float(cv.B[c] + cv.W[c] + (recompute * cv.rtime[c] / nb if cv.blk[c] else 0.0)),
            float(cv.ag[c]),
            float(cv.rs[c]),
            regather=regather,
            ag_bw=float(cv.ag_bw[c]),
        )
        for c in range(a, b)
    ]


def engine_step(order, rank_of, F, B, W, p2p, units: list, opt_s: list, multi: bool = False) -> dict:
    """The step of a partition as the engines run it (module docstring): units[k] stage k's FSDP2 units,
    opt_s[k] its optimizer step, multi: a multi-stage schedule class (torch's _PipelineScheduleRuntime). Returns
    the simulation, the step, per stage the gathers' and reductions' exposed seconds, and the slowest rank's
    optimizer step."""
    p = len(order)
    if p == 1:  # no schedule: FSDP2 as in a plain step, resharded after the forward
        sim = simulate(order, rank_of, F, B, W, p2p)
        exposed = [fsdp_timeline(us)["exposed_s"] for us in units]
        opt = sum(opt_s)
        return {
            "sim": sim,
            "step_s": sim.step_s + sum(exposed) + opt,
            "first_s": exposed,
            "tail_s": [0.0] * len(F),
            "optimizer_s": opt,
        }
    if multi:  # UNSHARD of the rank's stages at its step's start, REDUCE_GRAD of a stage after its last backward
        first, tail, ready = [0.0] * len(F), [sum(u.rs for u in us) for us in units], [0.0] * len(F)
        for r, stages in enumerate(rank_stages(order)):
            t = 0.0
            for s in stages:  # the rank's stages in the order they first compute
                t += sum(u.ag for u in units[s])
                ready[s] = t
        sim = simulate(order, rank_of, F, B, W, p2p, ready_f=ready)
    else:  # single-stage schedules: FSDP2's own hooks gather unit by unit in the first forward
        first = [fsdp_timeline([Unit(u.fw, 0.0, u.ag, 0.0, regather=False) for u in us])["exposed_s"] for us in units]
        tail = [fsdp_timeline([Unit(0.0, u.bw, 0.0, u.rs, regather=False) for u in us])["exposed_s"] for us in units]
        sim = simulate(order, rank_of, F, B, W, p2p, first_f=first)
    ends, opts = [], []
    for r, last in enumerate(sim.rank_ends):  # a rank's actions run one after another: the last ends last
        mine = [k for k in range(len(F)) if rank_of[k] == r]
        opts.append(sum(opt_s[k] for k in mine))
        ends.append(last + max((tail[k] for k in mine), default=0.0) + opts[-1])
    return {"sim": sim, "step_s": max(ends), "first_s": first, "tail_s": tail, "optimizer_s": max(opts)}


def fsdp_unsharded_bytes(kept: list, p: int) -> float:
    """Bytes of FSDP2's unsharded parameters and gradients one rank holds at its peak; kept: per stage of the rank,
    per cluster (unit) its parameters' unsharded bytes plus their gradients'. Pipelined (p > 1) every unit stays
    gathered and accumulates through the step; with one pipeline rank FSDP2 reshards after each unit, so at most
    two units are unsharded at once (the one computing and the one prefetched)."""
    if p > 1:
        return float(sum(float(np.sum(k)) for k in kept))
    units = sorted((float(u) for k in kept for u in k), reverse=True)
    return sum(units[:2])
