"""Planning one published row with its layout forced, cached (benchmarks/published.py's plans): the MeshSpec and
pipeline options of a row, the prediction's summary, a cache keyed on the row, the cluster's figures, torch and
autopar's source, and a runner that plans many rows in parallel processes with a timeout each."""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import re
import signal
import time

import torch

import autopar
from autopar import models
import autopar.testing
from autopar.strategies.pins import overlay_pins
from autopar.testing import fsdp_tp_force

from published_rows import CP_ATTENTION, Row, metric_of

CACHE = os.path.join(os.path.dirname(__file__), "results", ".published_cache")

# ---- planning one row (cached)


def _mesh_and_pipeline(row: Row):
    """The MeshSpec (pp, dp, tp), or (pp, dp, cp[, tp]) where the row shards the sequence, and the pipeline options
    forcing the row's layout: blocks per stage, schedule, stages per rank, micro-batches, recomputation."""
    pp, dp, tp, cp = row.layout
    if cp > 1:
        dims = [(n, s) for n, s in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)) if s > 1 or n != "tp"]
        shape, names = tuple(s for _, s in dims), tuple(n for n, _ in dims)
    else:
        shape, names = (pp, dp, tp), ("pp", "dp", "tp")
    opts = dict(
        layers_per_stage=list(row.layers_per_stage),
        schedules=[row.schedule],
        stages_per_rank=[row.v],
        n_microbatches=list(row.microbatches),
        recompute=row.recompute,
        ac=row.ac,
    )
    return autopar.MeshSpec(shape, names), opts


def _build(row: Row):
    m = models.build_model(row.model, device="meta", dtype=torch.bfloat16, **row.over)
    x = models.example_inputs(row.model, batch=row.batch, seq=row.seq, device="meta", **row.over)
    return m, x


def _summary(plan, wall: float) -> dict:
    pr, sc = plan.predicted, plan.schedule or {}
    out = {
        "step_s": pr["step_s"],
        "compute_s": pr.get("compute_s"),
        "exposed_comm_s": pr.get("exposed_comm_s"),
        "bubble_s": pr.get("bubble_s", 0.0),
        "peak_mem_GiB": pr["peak_mem_bytes"] / 2**30,
        # memory_reserved, what TorchTitan's memory monitor logs (components/metrics.py: reserved_bytes.all.peak)
        "reserved_mem_GiB": pr.get("reserved_mem_bytes", pr["peak_mem_bytes"]) / 2**30,
        "fits": pr["peak_mem_bytes"] <= pr["budget_bytes"],
        "plan_wall_s": wall,
    }
    if plan.stages:
        out["recompute_blocks"] = sum(st["recompute_blocks"] for st in plan.stages)
        out["n_microbatches"] = sc.get("n_microbatches")
        out["schedule"] = sc.get("name")
        out["stage_mesh"] = dict(zip(sc.get("stage_mesh_names", []), sc.get("stage_mesh_shape", [])))
        out["pp"] = sc.get("pp")
        # per pipeline rank: its allocated peak and the allocator's idle bytes there (the most of its stages', as
        # passes/stage_costs.py prices memory_reserved); published.py adds the published program's own terms per rank
        ranks: dict = {}
        for st in plan.stages:
            mem = st["memory"]
            r = ranks.setdefault(st["pp_rank"], [mem["rank_peak_bytes"] / 2**30, 0.0])
            r[1] = max(r[1], mem["allocator_idle_bytes"] / 2**30)
        out["rank_mem_GiB"] = [ranks[r] for r in sorted(ranks)]
    return out


def _code_key() -> str:
    """A hash of the planner's source (autopar/, passes/) less cluster.py's fitted block (a fitted figure is in the
    cluster's repr, which is in the key): plans cached before a cost-model change are planned again."""
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha1()
    walk = [w for pkg in ("autopar", "passes") for w in sorted(os.walk(os.path.join(top, pkg)))]
    for d, _, files in walk:
        for f in sorted(x for x in files if x.endswith(".py")):
            with open(os.path.join(d, f)) as fh:
                text = fh.read()
            if f == "cluster.py":
                text = re.sub(r"# ---- presets fitted.*# ---- end of the fitted presets", "", text, flags=re.S)
            h.update(f.encode() + text.encode())
    return h.hexdigest()[:12]


CODE_KEY = _code_key()
NOT_RUN = "not run: not planned in the time this session had"


def _cache_path(row: Row, cluster, auto: bool) -> str:
    key = hashlib.sha1(repr((row, repr(cluster), auto, torch.__version__, CODE_KEY)).encode()).hexdigest()[:16]
    return os.path.join(CACHE, key + ".json")


def _store(path: str, out: dict) -> None:
    """Written whole or not at all: parallel jobs and a killed run leave no partial file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)


def megatron_tp_force(m, shape) -> dict:
    """Megatron-LM's parameter layout on a (dp.., tp) stage submesh: column- and row-parallel Linears on tp, the
    token embedding and the output layer vocab-sharded (Shard(0)) on tp, everything Replicate on the data dims."""
    force = autopar.testing.tp_force(m, shape)
    vocab = ("wte.weight", "lm_head.weight")
    for k, p in m.named_parameters():
        if k in vocab and p.shape[0] % shape[-1] == 0:
            force[k] = ("R",) * (len(shape) - 1) + ("S0",)
    return force


def tp_force(row: Row, m, mesh) -> dict | None:
    """The published tensor parallelism on the stage submesh (without it the planner may leave a tp dim unused):
    Megatron column-wise input and row-wise output projections on tp, parameters FSDP-sharded (Shard(0)) over the
    data dims (dp, and cp: torchtitan's dp_shard_cp) where that divides, nested outside tp; the embedding and the
    head Shard(0) (vocab) on tp, as torchtitan shards them. None for a row without tp."""
    shape, names = tuple(mesh.shape[1:]), tuple(mesh.names[1:])
    if row.layout[2] == 1:
        return None
    if row.metric == "megatron_tflops":  # Megatron-LM 2021: DDP over dp (replicated parameters, no ZeRO), and
        force = megatron_tp_force(m, shape)  # its vocab-parallel embedding and output layer on tp
        return force
    data = math.prod(s for s, n in zip(shape, names) if n != "tp")
    two = fsdp_tp_force(m, (data, shape[-1]))
    force = {k: (pl[0],) * (len(shape) - 1) + (pl[1],) for k, pl in two.items()}
    if row.model.startswith("llama3"):  # FSDP moves to the hidden dim where the vocab does not divide (FSDP2 pads)
        vocab = dict(m.named_parameters())["output.weight"].shape[0]
        fsdp = "S0" if vocab % (data * shape[-1]) == 0 else "S1"
        force.update({k: (fsdp,) * (len(shape) - 1) + ("S0",) for k in ("tok_embeddings.weight", "output.weight")})
    return force


_COLUMN = ("c_attn", "c_fc", "wq", "wk", "wv", "w1", "w3")  # column-parallel Linears: output features on tp
_ROW = ("c_proj", "wo", "w2")  # row-parallel Linears: partial sums on tp, reduced into the residual stream
_NORMS = ("ln_1", "ln_2", "ln_f", "attention_norm", "ffn_norm", "norm")
_LINEAR = ("aten.mm.default", "aten.addmm.default")


def tp_pin(row: Row, mesh):
    """The published tensor parallelism's activations (a `pin` on the stage submesh; tp_force fixes only the
    parameters, and with those alone the planner runs the blocks data-parallel over tp, gathering the weights):
    column-parallel outputs feature-sharded (Shard(1) of the 2-D GEMM) on tp, row-parallel outputs Partial (the
    all-reduce, or SP's reduce-scatter, into the stream), the residual stream and the norms Replicate on tp
    (Megatron-LM 2021, no sequence parallelism) or sequence-sharded (Shard(1): TorchTitan's SequenceParallel, and
    Llama 3's TP, which cites Korthikanti et al. 2023's sequence parallelism), the
    step's inputs Replicate on tp; attention and the backward are the planner's. None for a row without tp."""
    if row.layout[2] == 1:
        return None
    tp = list(mesh.names[1:]).index("tp")
    stream = "R" if row.metric == "megatron_tflops" else "S1"

    def pin(n):
        if n.kind == "input":
            return {tp: "R"}
        if n.kind != "op" or n.phase != "fw":
            return None
        leaf, op = n.module.rsplit(".", 1)[-1], str(n.target)
        if op in _LINEAR and leaf in _COLUMN:
            return {tp: "S1"}
        if op == "aten.view.default" and leaf in _COLUMN:  # the column GEMMs' shared input, gathered once
            return {tp: "R"}
        if op in _LINEAR and leaf in _ROW:
            return {tp: "P"}
        if op in _LINEAR and leaf == "output":  # the vocab-parallel head into a vocab-parallel cross entropy
            return {tp: "S1"}
        if leaf in _NORMS or (re.fullmatch(r"(h|layers)\.\d+", n.module) and op == "aten.add.Tensor"):
            return {tp: stream}
        return None

    return pin


def kv_pin(row: Row, mesh):
    """Where a cp row moves K/V over the cp ranks, as its run did (a `pin` on the stage submesh; None without cp):
    Llama 3 all-gathers K and V before GQA repeats them ("much smaller than Q due to GQA", arXiv 2407.21783
    section 3.3.2): repeat_kv's unsqueeze reads them Replicate on cp; TorchTitan's Llama calls SDPA on the repeated
    K/V, so torch's context_parallel moves those: the repeat's copy stays sequence-sharded on cp."""
    names = list(mesh.names[1:])
    cp = [d for d, n in enumerate(names) if n.startswith("cp")]
    if row.layout[3] == 1 or not cp:
        return None
    before = CP_ATTENTION[row.source.split(" Table")[0]] == "allgather"
    op, want = ("aten.unsqueeze.default", "R") if before else ("aten.clone.default", "S1")
    native = row.over.get("gqa") == "native"  # no repeat: SDPA reads K/V at their heads, from their transposes
    kv_heads = models.CONFIGS[row.model].kwargs.get("n_kv_heads")

    def pin(n):
        out = n.outs[0] if n.kind == "op" and n.outs else None
        if out is None or not n.module.endswith("attention"):
            return None
        if native:
            kv = str(n.target) == "aten.transpose.int" and n.phase == "fw" and len(out.shape) == 4
            return {d: want for d in cp} if kv and out.shape[1] == kv_heads else None
        if str(n.target) != op or len(out.shape) != 5:
            return None
        return {d: want for d in cp} if not before or out.shape[3] == 1 else None

    return pin


def layout_pin(row: Row, mesh):
    """tp_pin and kv_pin together (they name different nodes)."""
    return overlay_pins(tp_pin(row, mesh), kv_pin(row, mesh))


def _plan_forced(row: Row, m, x, cluster):
    """The row's published layout planned at autopar's default budget, or where no plan fits it but one fits the
    whole device, at the whole device's memory (the published run ran in it): (plan, the budget used or None).
    TorchTitan's rows without pipeline stages ran one micro-batch (no gradient accumulation): that is planned
    first, the row's other micro-batch counts only where it fits no budget."""
    mesh, opts = _mesh_and_pipeline(row)
    kw = dict(float8=row.float8 or None, force=tp_force(row, m, mesh), pin=layout_pin(row, mesh))
    if row.metric == "titan_tps" and row.layout[0] == 1 and len(row.microbatches) > 1:
        try:
            return _fitting(m, mesh, x, cluster, {**opts, "n_microbatches": [1]}, kw)
        except autopar.InfeasibleMemoryError:
            pass
    return _fitting(m, mesh, x, cluster, opts, kw)


def _fitting(m, mesh, x, cluster, opts, kw):
    try:
        return autopar.plan(m, mesh, x, cluster=cluster, pipeline=opts, **kw), None
    except autopar.InfeasibleMemoryError as e:
        whole = cluster.device.mem_bytes
        if e.smallest_bytes and e.smallest_bytes > whole:
            raise
        try:
            return autopar.plan(m, mesh, x, cluster=cluster, pipeline=opts, memory_budget=whole, **kw), whole
        except autopar.InfeasibleMemoryError:
            raise e from None


def plan_row(row: Row, cluster, auto: bool = False, use_cache: bool = True, cached_only: bool = False) -> dict:
    """The row planned on `cluster` (its forced layout, or pipeline="auto" on its GPU count when `auto`): the
    prediction's summary, or {"error": ...} naming why it could not be planned (or, with cached_only, that no run
    so far planned it)."""
    path = _cache_path(row, cluster, auto)
    if use_cache and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if cached_only:
        return {"error": NOT_RUN}
    m, x = _build(row)
    t = time.perf_counter()
    try:
        if auto:
            plan = autopar.plan(m, (row.gpus,), x, cluster=cluster, pipeline="auto", float8=row.float8 or None)
        else:
            plan, budget = _plan_forced(row, m, x, cluster)
        out = _summary(plan, time.perf_counter() - t)
        out["metric"] = metric_of(row, out["step_s"], m)
        if not auto and budget is not None:
            out["budget"] = f"whole device ({budget / 2**30:.0f} GiB): no plan at autopar's default 90%"
    except Exception as e:  # a row that cannot be planned records why; the run goes on
        out = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", "plan_wall_s": time.perf_counter() - t}
    if use_cache:
        _store(path, out)
    return out


def _walls_path() -> str:
    """Each plan's last wall time, whatever the code: the order of the next run."""
    return os.path.join(CACHE, "walls.json")


def _walls() -> dict:
    if not os.path.exists(_walls_path()):
        return {}
    with open(_walls_path()) as f:
        return json.load(f)


def _wall_key(job) -> str:
    row, cluster, auto = job
    return f"{row.name}|{re.sub(r'x[0-9.]+', '', cluster.name)}|{auto}"  # the same plan after a re-fit


def _job(*job) -> None:
    os.setpgrp()  # its own process group: a timeout kills the planner's worker processes with it
    plan_row(*job)


def run_jobs(jobs: list, n: int, timeout: float) -> None:
    """Plan the uncached (row, cluster, auto) jobs, `n` processes at a time, the longest last time first (a short
    tail), into the cache; a job still running after `timeout` seconds is killed and cached as an error saying so."""
    unique = {_cache_path(*j): j for j in jobs}
    walls = _walls()
    todo = sorted(
        (j for path, j in unique.items() if not os.path.exists(path)), key=lambda j: -walls.get(_wall_key(j), 0)
    )
    ctx, running = multiprocessing.get_context("fork"), {}
    print(f"{len(todo)} plans to run ({len(unique) - len(todo)} cached), {n} at a time", flush=True)
    while todo or running:
        while todo and len(running) < n:
            job = todo.pop(0)
            p = ctx.Process(target=_job, args=job)
            p.start()
            running[p] = (job, time.perf_counter())
        time.sleep(0.2)
        for p, (job, t0) in list(running.items()):
            if p.is_alive() and time.perf_counter() - t0 > timeout:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the plan and the solver workers it forked
                except ProcessLookupError:  # killed before it made its group
                    p.kill()
                p.join()
                msg = f"TimeoutError: not planned within {timeout:.0f} s on this machine (killed)"
                _store(_cache_path(*job), {"error": msg, "plan_wall_s": timeout})
            if not p.is_alive():
                p.join()
                del running[p]
                walls[_wall_key(job)] = time.perf_counter() - t0
                _store(_walls_path(), walls)
                print(f"  done {_wall_key(job)}: {walls[_wall_key(job)]:.1f} s", flush=True)
