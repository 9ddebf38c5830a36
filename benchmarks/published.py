"""Published large training runs against autopar's cost model (issue 26 parts 1 and 5).

Each row of ../shared/reference/published_runs.md that autopar can express is planned with its published layout
forced through the public API (autopar.plan with a MeshSpec (pp, dp, tp[, cp]) and a `pipeline=dict(...)` hand
layout: blocks per stage, schedule, stages per rank, micro-batches, recomputation), and its predicted step time is
turned into the row's own metric:
  * Megatron-LM (SC21 Table 1): TFLOP/s per GPU by the paper's equation 3, 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    FLOPs per iteration (recomputation included), / step time / GPUs.
  * TorchTitan (arXiv 2410.06511 Tables 1-6): tokens per second per GPU = global batch x seq / step / GPUs.
  * Llama 3 (arXiv 2407.21783 Table 4): TFLOPs per GPU counted as 6 N + 6 l h s FLOPs per token (N: parameters
    without the input embedding, which does no matmul; 6 l h s: causal attention's QK^T and PV, forward and
    backward, half the square; no recomputation), x tokens / step / GPUs. The paper does not print its formula;
    this is the usual model-FLOPs count (PaLM's appendix B with the causal half).
Peak memory predicted vs published (TorchTitan's GiB) where published: the predicted memory_reserved (the
allocated peak + the caching allocator's segments idle there), as TorchTitan's monitor logs max reserved.

Assumptions (each also in the results file):
  * Megatron's GPT shapes are autopar's GPT-2 family (learned positions, 4h MLP, vocab 51,200), untied embeddings
    (Megatron-LM ties them, a copy on the last stage; autopar plans that too, but the fitted set was fixed on the
    untied shapes; the copy's gradient all-reduce is under 0.1% of a step); attention unfused (DeviceSpec
    attention="unfused", as Megatron-LM ran it in 2021); full activation recomputation (recompute="all"); micro-batch
    size 1 on the pipelined rows (Megatron's GPT-3 175B and MT-NLG 530B recipes), and for pp = 1 autopar picks the micro-batch count among
    1, 2, 4, .., 32 per step (not published); interleaved schedule with v = the smallest divisor >= 2 of the blocks per
    rank (v is not published).
  * TorchTitan's H100s are the 95 GiB power-limited part (preset h100-95g); sequence 8192 for Tables 1-4; its
    "batch" is per data-parallel rank, split on the pipelined rows into torchtitan's default micro-batch count of
    the time, the pp degree (build_pipeline_schedule: n_microbatches = pipeline_parallel_degree when the config
    sets none, from before the paper to the January 2025 benchmark commit 9dec370; num_total_stages only from
    torchtitan#781, 2025-01-07; the paper states none): Table 4's rows 16 micro-batches of 2 sequences (1F1B and
    interleaved), Table 6 8 of 1; selective AC is torchtitan's op SAC on every block (recompute="all", ac="op":
    each block keeps its matmul outputs but every second one and its attention outputs, and reruns the rest), full
    AC is recompute="all" (whole blocks); without
    pipeline stages TorchTitan ran no gradient accumulation, but autopar may split the local batch into
    micro-batches (1, 2, 4, .. of it) where one does not fit its memory model (the chosen count is in the row's
    record); Float8 rows plan with float8=True (per-tensor scaled GEMMs, FSDP float8 all-gather);
    torch.compile rows price the fused regions of DeviceSpec fusion="inductor"; AsyncTP rows (B3.8, Table 6) price
    torch's micro-pipelined TP with DeviceSpec async_tp=True (autopar/cost/async_tp.py: TP all-gathers into a
    matmul and reduce-scatters of one run in chunks under it, inside a node).
  * TorchTitan's tp rows compute the head's logits vocab-sharded on tp into a class-sharded cross entropy (its
    loss_parallel: autopar/strategies/vocab_parallel.py prices the row all-reduces and the temporaries); its
    pipelined rows' last stage kept each micro-batch's logits to the step's end (torch.distributed.pipelining's
    output_chunks before return_outputs; fp32 logits for Table 4, before torchtitan e10cb9494, bf16 for Table 6):
    added to the last rank's memory (program_memory_GiB), the reported peak the most of any rank's.
  * Context parallelism (Tables 5-6, Llama 3's 128K row): a (pp, dp, cp[, tp]) mesh, the sequence sharded over
    cp inside the pipeline stages, parameters FSDP-sharded over dp x cp (torchtitan's dp_shard_cp), attention on
    sequence-sharded queries priced by autopar's cp kernel model. Tables 5-6 ran with torch.compile + Float8 and
    full AC (torchtitan's docs/performance.md, January 2025, whose Tables 2 and 6 carry the same figures; the paper
    lists only the AC and the schedule), Table 6 with AsyncTP as well. Table 5: one stage of the 32 blocks, GPipe,
    one micro-batch of one sequence per rank. Table 6: 8 stages of [15, 16 x 6, 15] blocks, 1F1B, 8 micro-batches
    of one sequence.
    Llama 3's 128K row: the same interleaved v = 4 layout as its 8K rows, cp 16 inside the stages, attention on
    all-gathered K/V as the paper describes (DeviceSpec cp_attention="allgather"); TorchTitan's cp rows: ring
    attention as torch's context_parallel runs it (cp_attention="ring": one kernel per ring step on chunk pairs,
    merged in fp32; torch's default rotater, which torchtitan's context_parallel_rotate_method="allgather" also
    names, all-gathers the K/V once instead of passing it around the ring, with the same kernels and merges).
  * Llama 3's H100s are the 80 GB 700 W SXM part (preset h100); interleaved 1F1B (section 3.3.2) with 4 stages
    per rank (not published: the deepest interleaving that keeps one fewer block on the first and the last
    stage, as the paper does, with a block in every virtual stage: [1, 2 x 62, 1]), one sequence per
    micro-batch, recompute=True (blocks checkpointed as memory needs); attention on GQA's 8 K/V heads as they are
    (SDPA enable_gqa, as a GQA-aware kernel runs it: the paper all-gathers K and V, "much smaller than Q due to
    GQA", and its attention keeps them so), where TorchTitan's 2024 Llama repeats them to the 128 query heads first.

  * Tensor parallelism is forced where a row has tp > 1 (published_plan.tp_force, force= on the stage submesh):
    Megatron column-wise / row-wise projections on tp, FSDP Shard(0) over the data dims (dp x cp) nested outside
    it, embedding and head vocab-sharded on tp; without it the planner may leave a tp dim unused (it ran the 70B as
    256-way FSDP). Activation placements stay the planner's choice.

Fit and hold-out, chosen before any fit: the FITTED rows are Megatron rows 1, 3, 5, 7, 9 (1.7B, 7.5B, 39.1B,
145.6B, 529.6B), TorchTitan Table 1-2's selective-AC rows and Llama 3's 8,192-GPU row; every other strict row is
held back. Per GPU kind a few free figures (FREE below) are fitted by least squares of log(predicted/published)
with a weak prior pulling each figure to its preset value (few rows, several figures). A trial does not plan
again: each fitted row is planned once at the preset and once per free figure at a changed value, and the step
time is re-priced as step0 + sum_f (step_f - step0) (1/theta_f - 1/theta0_f) / (1/theta'_f - 1/theta0_f)
(every modeled op or collective time is work / efficiency, so this is exact while the placements and the
roofline's memory-vs-compute side stay the same; the final figures are then checked by planning every row
again with the fitted preset, and those are the numbers reported). The CP rows and the torch.compile rows became
strict rows after that set was fixed (round two): they are held back, and the fitted set was not re-chosen
after seeing any result. Round three (2026-12-06) changed the model, not the sets: the 95 GiB part's attention
figures (torch's flash SDPA as measured, causal kernels slower per FLOP) and one compute figure for its GEMMs and
attention, after round two showed the long-sequence rows optimistic; the held-back cp rows are therefore not blind
to that choice (the findings below say so). Round four (2026-12-07) added the class-sharded loss and the published
program's kept logits (memory), the sets again unchanged.

    python benchmarks/published.py [--only ROW ...] [--fit] [--auto [ROW ...]] [--jobs N] [--cached-only]
        [--timeout S] [--auto-timeout S] [--out benchmarks/results/published]
Plans are cached per (row, cluster figures, torch version, autopar's source) in benchmarks/results/.published_cache/
(ignored by git): a re-run re-plans only what changed; --jobs N plans N at a time (processes); --cached-only
reports what is cached and marks the rest not run. ROW: an id prefix ("A", "B5", "C1") or a word of the row's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys

import torch
from scipy.optimize import minimize

from autopar.cost import get_cluster
from autopar.models import model_args

from published_plan import NOT_RUN, _mesh_and_pipeline, plan_row, run_jobs  # noqa: F401 (tests use these)
from published_rows import CP_ATTENTION, NOTES, ROWS, Row

# ---- clusters and their free figures
# Each free figure is a scale factor on preset fields (1.0: the preset); the fit works in these factors.
FIGURES = {
    "gemm": (("device", "gemm_eff_max"),),
    "attn": (("device", "attn_fwd_eff"), ("device", "attn_bwd_eff")),
    "compute": (("device", "gemm_eff_max"), ("device", "attn_fwd_eff"), ("device", "attn_bwd_eff")),
    "mem": (("device", "mem_eff"),),
    "net": (("inter", "bus_eff"),),
    "nvlink": (("intra", "bus_eff"),),
}
# TorchTitan's power-limited H100s: one "compute" figure for GEMMs and attention alike (a lower TDP lowers the clock
# every tensor-core kernel runs at; the fitted rows, at 8K with attention ~10% of their step, cannot tell a separate
# attention figure from its prior, which left it at the 700 W part's rate while the GEMMs moved).
FREE = {"a100": ("gemm", "mem", "net"), "h100-95g": ("compute", "net"), "h100": ("gemm", "mem")}
# The most each fitted field may reach: the best measured shapes (MAMF table, stas00/ml-engineering: A100 bf16
# 85.9%, H100 SXM 80.1% of peak), FlashAttention-3's 75% on H100 (Shah et al., arXiv 2407.08608), 95% of HBM
# bandwidth, a link's line rate. A fit that ends at a cap says the model misses the run elsewhere.
CAPS = {"gemm_eff_max": 0.86, "attn_fwd_eff": 0.75, "attn_bwd_eff": 0.75, "mem_eff": 0.95, "bus_eff": 1.0}
PROBE = 0.8  # the factor each figure is re-planned at to measure the step's sensitivity to it
PRIOR = 0.05  # weight of log(factor)^2 against a row's log(predicted / published)^2: keeps unfitted figures at 1


def scaled(cluster, factors: dict):
    """`cluster` with each free figure's fields multiplied by its factor (clipped to CAPS)."""
    dev, intra, inter = cluster.device, cluster.intra, cluster.inter
    parts = {"device": {}, "intra": {}, "inter": {}}
    for fig, k in sorted(factors.items()):
        for part, field in FIGURES[fig]:
            base = getattr({"device": dev, "intra": intra, "inter": inter}[part], field)
            parts[part][field] = min(CAPS[field], base * k)
    if not any(parts.values()):
        return cluster
    tag = ",".join(f"{f}x{k:.4g}" for f, k in sorted(factors.items()))
    return dataclasses.replace(
        cluster,
        name=f"{cluster.name}[{tag}]",
        device=dataclasses.replace(dev, **parts["device"]),
        intra=dataclasses.replace(intra, **parts["intra"]),
        inter=dataclasses.replace(inter, **parts["inter"]),
    )


def row_cluster(row: Row, preset: str | None = None, factors: dict | None = None):
    """The row's GPUs as it ran them: unfused attention (Megatron 2021), torch.compile's fusion; `factors` scale the
    free figures."""
    cl = get_cluster(preset or row.cluster)
    if row.unfused and cl.device.attention != "unfused":
        cl = cl.with_device(attention="unfused")
    if row.compile:
        cl = cl.with_device(fusion="inductor")
    if row.async_tp:
        cl = cl.with_device(async_tp=True)
    cp_attention = CP_ATTENTION[row.source.split(" Table")[0]] if row.layout[3] > 1 else cl.device.cp_attention
    if cl.device.cp_attention != cp_attention:
        cl = cl.with_device(cp_attention=cp_attention)
    return scaled(cl, factors or {})


# ---- the fit: step times re-priced under changed free figures without planning again


def probes(row: Row, preset: str | None = None) -> dict:
    """{figure: step seconds with that figure at PROBE x its value} and "": the preset's step, for `row`'s GPU kind."""
    out = {"": plan_row(row, row_cluster(row, preset))}
    for fig in FREE.get(row.cluster, ()):
        out[fig] = plan_row(row, row_cluster(row, preset, {fig: PROBE}))
    return out


def repriced_step(pr: dict, factors: dict) -> float:
    """The step at `factors`: each figure's share of the step moves as 1 / factor (module docstring)."""
    s0 = pr[""]["step_s"]
    step = s0
    for fig, k in factors.items():
        if fig in pr and "step_s" in pr[fig]:
            step += (pr[fig]["step_s"] - s0) * (1 / k - 1) / (1 / PROBE - 1)
    return step


def _bounds(cluster_name: str, figs) -> list:
    """Factors keep every field at or below its CAPS value and above 0.3 x the preset's."""
    cl = get_cluster(cluster_name)
    out = []
    for fig in figs:
        top = min(CAPS[f] / getattr(getattr(cl, p), f) for p, f in FIGURES[fig])
        out.append((0.3, top))
    return out


def fitted_fields(cluster_name: str, factors: dict) -> str:
    """The fitted fields' values, those at their CAPS marked."""
    cl = scaled(get_cluster(cluster_name), factors)
    out = []
    for fig in factors:
        for part, field in FIGURES[fig]:
            v = getattr(getattr(cl, part), field)
            out.append(f"{part}.{field} = {v:.4g}" + (" (at its cap)" if v >= CAPS[field] - 1e-9 else ""))
    return ", ".join(out)


def fit(rows: list[Row], cluster_name: str) -> dict:
    """Factors of `cluster_name`'s free figures that minimise sum log(pred / pub)^2 over `rows` plus the prior."""
    figs = FREE[cluster_name]
    data = []
    for r in rows:
        pr = probes(r)
        if all("step_s" in v for v in pr.values()):
            data.append((r, pr))
    if not data:
        return {}

    def loss(logk):
        k = dict(zip(figs, map(math.exp, logk)))
        err = sum(
            math.log(r.published * repriced_step(pr, k) / (pr[""]["metric"] * pr[""]["step_s"])) ** 2 for r, pr in data
        )
        return err + PRIOR * sum(x * x for x in logk)

    b = [(math.log(lo), math.log(hi)) for lo, hi in _bounds(cluster_name, figs)]
    res = minimize(loss, [0.0] * len(figs), bounds=b, method="L-BFGS-B")
    return {f: round(math.exp(x), 4) for f, x in zip(figs, res.x)}


# ---- the report

FITTED_PRESETS = {"a100": "a100-selene", "h100-95g": "h100-95g-titan", "h100": "h100-llama3"}


def _layout(row: Row) -> str:
    pp, dp, tp, cp = row.layout
    s = f"pp{pp} dp{dp} tp{tp}" + (f" cp{cp}" if cp > 1 else "")
    if pp > 1:
        s += f", {row.schedule}" + (f" v={row.v}" if row.v > 1 else "") + f", m={row.microbatches[0]}"
    return s + f", recompute={row.recompute}" + (", float8" if row.float8 else "")


def _set(row: Row) -> str:
    if not row.strict:
        return "not strict"
    return "fitted" if row.fitted else "held back"


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}g}" if isinstance(x, float) else str(x)


def fit_cluster(row: Row, fitted: dict):
    """The row's GPUs at the fit's factors (the fitted preset of cluster.py: tests/test_published.py checks they
    agree), or None where its GPU kind has no fit."""
    return row_cluster(row, None, fitted[row.cluster]) if fitted.get(row.cluster) else None


def plan_jobs(rows: list[Row], fitted: dict, auto_rows: list[Row]) -> list:
    """Every plan the report reads, in the order they run: the fitted figures, pipeline='auto', the presets."""
    at_fit = [(r, fit_cluster(r, fitted), False) for r in rows if fit_cluster(r, fitted) is not None]
    auto = [(r, fit_cluster(r, fitted) or row_cluster(r), True) for r in auto_rows]
    return at_fit, auto, [(r, row_cluster(r), False) for r in rows]


# TorchTitan's pipelined rows ran torch.distributed.pipelining before step() took `return_outputs` (pytorch#159251,
# late 2025): the last stage appended each micro-batch's output, its vocab-sharded logits, to `output_chunks`, held
# until the next step. Table 4 (the paper's first version, 2024-10-09) ran before torchtitan e10cb9494
# (2024-10-22) moved `.float()` from the model's output to the loss: fp32 logits; Table 6's figures are the January
# 2025 docs' run (torch 1963fc8, torchtitan 9dec370): bf16. autopar's runner passes return_outputs=False.
KEPT_LOGIT_BYTES = {"TorchTitan Table 4": 4, "TorchTitan Table 6": 2}


def program_memory_GiB(row: Row, s: dict) -> float | None:
    """The published program's memory_reserved where it held more than autopar's engines do: the most of any
    pipeline rank's (torchtitan's docs/performance.md: "We take the maximum across all GPUs"), the last rank's with
    m - 1 earlier micro-batches' logits kept (the running one is in its activations). None where nothing is added."""
    nbytes = KEPT_LOGIT_BYTES.get(row.source)
    if not nbytes or not s.get("rank_mem_GiB") or not s.get("n_microbatches"):
        return None
    pp, dp, tp, cp = row.layout
    m = s["n_microbatches"]
    tokens = row.batch // dp // m * row.seq // cp
    logits = tokens * model_args(row.model, **row.over).vocab_size // tp * nbytes / 2**30
    ranks = [peak + idle for peak, idle in s["rank_mem_GiB"]]
    ranks[-1] += (m - 1) * logits
    return max(ranks)


def evaluate(rows: list[Row], fitted: dict, cached_only: bool = False) -> list[dict]:
    """Each row planned at its preset and at the fitted figures."""
    out = []
    for row in rows:
        rec = {"name": row.name, "source": row.source, "set": _set(row), "layout": _layout(row), "gpus": row.gpus}
        rec.update(published=row.published, metric=row.metric, published_mem_GiB=row.mem_gib, preset=row.cluster)
        rec["unmodelled"] = list(row.unmodelled)
        rec["at_preset"] = plan_row(row, row_cluster(row), cached_only=cached_only)
        cl = fit_cluster(row, fitted)
        rec["fitted_cluster"] = FITTED_PRESETS.get(row.cluster) if cl is not None else None
        rec["at_fit"] = plan_row(row, cl, cached_only=cached_only) if cl is not None else None
        for k in ("at_preset", "at_fit"):
            r = rec[k]
            if r and "metric" in r:
                r["ratio"] = r["metric"] / row.published
                program = program_memory_GiB(row, r)
                if program is not None:
                    r["program_mem_GiB"] = program
                if row.mem_gib:
                    r["mem_ratio"] = _mem(r)["mem"] / row.mem_gib
        out.append(rec)
        print(json.dumps({"name": row.name, **{k: rec[k] for k in ("at_preset", "at_fit")}}), flush=True)
    return out


def _stats(recs, key: str, which: str) -> str:
    """Median and worst |ratio - 1| of one set, overall and per GPU kind (the base preset)."""
    out = []
    for pre in [None] + list(dict.fromkeys(r["preset"] for r in recs)):
        sel = [r for r in recs if r["set"] == which and (pre is None or r["preset"] == pre)]
        errs = [abs(r[key]["ratio"] - 1) for r in sel if r.get(key) and "ratio" in r[key]]
        if errs:
            m, w = 100 * statistics.median(errs), 100 * max(errs)
            out.append(f"{pre + ' ' if pre else ''}{len(errs)} rows, median {m:.1f}%, worst {w:.1f}%")
    return f"{which}: " + (
        "; ".join(out[:1]) + (" (" + "; ".join(out[1:]) + ")" if out[1:] else "") if out else "no rows"
    )


def _mem_stats(recs, key: str) -> str:
    errs = [abs(r[key]["mem_ratio"] - 1) for r in recs if r.get(key) and "mem_ratio" in r[key]]
    if not errs:
        return "no rows"
    within = sum(e <= 0.15 for e in errs)
    return f"{len(errs)} rows, median {100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%, {within} within 15%"


def _pair(a: dict, f: dict, key: str, fmt: str) -> str:
    """`key` at the preset / at the fit, "-" where that plan has no number."""
    return " / ".join(format(x[key], fmt) if key in x else "-" for x in (a, f)) if f else format(a.get(key, "-"), fmt)


def _mem(x: dict) -> dict:
    """A plan's summary with "mem": its predicted memory_reserved (older summaries: the allocated peak), with the
    published program's own kept logits where it held them (program_memory_GiB)."""
    v = x.get("program_mem_GiB", x.get("reserved_mem_GiB", x.get("peak_mem_GiB")))
    return x if v is None else {**x, "mem": v}


def _row_line(r) -> str:
    a, f = r["at_preset"], r["at_fit"] or {}
    if "error" in a and "error" in (f or a):
        err = a["error"]
        what = "not run" if err == NOT_RUN else "timed out" if err.startswith("TimeoutError") else "not expressible"
        return f"| {r['name']} | {r['set']} | {r['layout']} | {r['published']} | {what}: {err} |||||||"
    cells = [
        r["name"],
        r["set"] + (" (" + "; ".join(r["unmodelled"]) + ")" if r["unmodelled"] else ""),
        r["layout"],
        _fmt(r["published"], 4),
        _fmt(a.get("metric"), 4),
        f"{a['ratio']:.3f}" if "ratio" in a else "-",
        _fmt(f.get("metric"), 4),
        f"{f['ratio']:.3f}" if "ratio" in f else "-",
        _pair(a, f, "step_s", ".3f"),
        _fmt(r["published_mem_GiB"]),
        _pair(_mem(a), _mem(f), "mem", ".1f"),
        _pair(a, f, "plan_wall_s", ".1f"),
    ]
    return "| " + " | ".join(cells).replace("| - / - |", "| - |") + " |"


def _misses(recs, bar: float = 0.10) -> list[str]:
    """Strict rows more than `bar` off at the fitted figures, with the predicted step's terms."""
    out = []
    for r in recs:
        f = r["at_fit"] or {}
        if r["set"] != "not strict" and "ratio" in f and abs(f["ratio"] - 1) > bar:
            side = "optimistic" if f["ratio"] > 1 else "pessimistic"
            out.append(f"- {r['name']} ({r['set']}): {f['ratio']:.3f}, {side}; step {f['step_s']:.3f} s = {_terms(f)}")
    return out or [f"- none over {100 * bar:.0f}%"]


METRIC_NAMES = {
    "megatron_tflops": "TFLOP/s per GPU (Megatron eq. 3)",
    "titan_tps": "tokens/s per GPU",
    "llama3_tflops": "TFLOPs per GPU (6N + 6lhs per token)",
}


def report(recs, fitted: dict, argv: list[str], auto_rows) -> list[str]:
    head = (
        "| row | set | layout (forced) | published | predicted (preset) | ratio | predicted (fitted) | ratio | "
        "step s (preset / fitted) | published GiB | predicted reserved GiB (preset / fitted) | plan s |"
    )
    lines = [
        "# Published large runs against autopar's cost model",
        "",
        f"`python benchmarks/published.py {' '.join(argv)}` (torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()}). Rows: ../shared/reference/published_runs.md; each row's published "
        "layout forced through autopar.plan (MeshSpec + pipeline=dict(...)); ratio = predicted / published in the "
        "row's own metric (> 1: the model is optimistic).",
        "",
        "## Assumptions and method",
        "",
        __doc__.split("\n\n", 1)[1].split("\n    python")[0],
        "",
        "## Accuracy (|predicted / published - 1| on throughput)",
        "",
        "At the presets as they are (`" + "`, `".join(sorted({r["preset"] for r in recs})) + "`):",
        "",
        f"- {_stats(recs, 'at_preset', 'fitted')}",
        f"- {_stats(recs, 'at_preset', 'held back')}",
        f"- {_stats(recs, 'at_preset', 'not strict')}",
        f"- memory: {_mem_stats(recs, 'at_preset')}",
        "",
        "With the fitted figures (factors on the preset: "
        + "; ".join(f"{c}: {k} -> {fitted_fields(c, k)}" for c, k in sorted(fitted.items()) if k)
        + "):",
        "",
        f"- {_stats(recs, 'at_fit', 'fitted')}",
        f"- {_stats(recs, 'at_fit', 'held back')}",
        f"- {_stats(recs, 'at_fit', 'not strict')}",
        f"- memory: {_mem_stats(recs, 'at_fit')}",
        "",
    ]
    for src in dict.fromkeys(r["source"].split(" Table")[0] for r in recs):
        group = [r for r in recs if r["source"].startswith(src)]
        lines += [f"## {src}: {METRIC_NAMES[group[0]['metric']]}", "", head, "|" + "---|" * 12]
        lines += [_row_line(r) for r in group] + [""]
    lines += ["## Rows more than 10% off at the fitted figures (the predicted step's terms)", ""] + _misses(recs)
    bad = [r for r in recs if "error" in r["at_preset"] and "error" in (r["at_fit"] or r["at_preset"])]
    lines += ["", "## Not planned (the exact error)", ""]
    lines += [f"- {r['name']} ({r['layout']}): `{r['at_preset']['error']}`" for r in bad] or ["- none"]
    lines += ["", "## Findings of this run (hand-written, 2026-12-07)", ""] + [f"- {n}" for n in NOTES]
    lines += [""] + (auto_rows or [])
    return lines


def _terms(s: dict) -> str:
    parts = [f"{k.replace('_s', '')} {s[k]:.3f}" for k in ("compute_s", "exposed_comm_s", "bubble_s") if s.get(k)]
    if "recompute_blocks" in s:
        parts.append(f"recomputed blocks {s['recompute_blocks']}")
    if "pp" in s:
        mesh = " x ".join(f"{k} {v}" for k, v in s["stage_mesh"].items())
        parts.append(f"pp {s['pp']} x {mesh}, {s['schedule']} m={s['n_microbatches']}")
    return ", ".join(parts)


def plan_quality(recs, rows: list[Row], fitted: dict, cached_only: bool = False) -> list[str]:
    """autopar's own layout (pipeline="auto") beside each published layout, on the same GPUs, batch and cluster."""
    lines = [
        "## Plan quality: autopar's own layout (pipeline='auto') vs the published one, same GPUs and batch",
        "",
        "| row | published layout step s | autopar step s | autopar / published | published terms | autopar terms "
        "| plan s |",
        "|---|---|---|---|---|---|---|",
    ]
    by_name, walls, failed = {r["name"]: r for r in recs}, [], 0
    for row in rows:
        rec = by_name[row.name]
        pub = rec["at_fit"] or rec["at_preset"]
        auto = plan_row(row, fit_cluster(row, fitted) or row_cluster(row), auto=True, cached_only=cached_only)
        walls.append(auto.get("plan_wall_s") if "error" not in auto or auto["error"].startswith("Timeout") else None)
        failed += "error" in auto and not auto["error"].startswith(("Timeout", NOT_RUN))
        if "error" in auto or "error" in pub:
            wall = f"{auto['plan_wall_s']:.1f}" if "plan_wall_s" in auto else "-"
            lines.append(f"| {row.name} | - | - | - | {pub.get('error', '')} | {auto.get('error', '')} | {wall} |")
            continue
        lines.append(
            f"| {row.name} | {pub['step_s']:.3f} | {auto['step_s']:.3f} | {auto['step_s'] / pub['step_s']:.3f} | "
            f"{_terms(pub)} | {_terms(auto)} | {auto['plan_wall_s']:.1f} |"
        )
    walls = [w for w in walls if w is not None]
    if walls:
        over = sum(w > 30 for w in walls)
        lines[1:1] = [f"pipeline='auto' planning time: {len(walls)} configurations, median {statistics.median(walls):.1f} s, "
                      f"longest {max(walls):.1f} s, {over} over the issue's 30 s (killed ones count at their limit); "
                      f"{failed} more found no plan (the error in the table).", ""]  # fmt: skip
    return lines + [""]


def _matches(row: Row, s: str) -> bool:
    """--only: a row id prefix ("A", "B5", "C1") or a word of the name ("405b", "interleaved")."""
    if re.fullmatch(r"[ABC][0-9.]*", s):
        return row.name.split()[0].startswith(s)
    return s.lower() in row.name.lower()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="rows whose name contains one of these")
    ap.add_argument("--fit", action="store_true", help="fit the free figures on the fitted rows (FREE, per GPU kind)")
    ap.add_argument("--auto", nargs="*", help="also plan pipeline='auto' for the rows containing these (all: '')")
    ap.add_argument("--cached-only", action="store_true", help="plan nothing: report what earlier runs cached")
    ap.add_argument("--jobs", type=int, default=1, help="plans run at a time (processes)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before a forced layout's plan is killed")
    ap.add_argument("--auto-timeout", type=float, default=300, help="the same for pipeline='auto'")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "published"))
    args = ap.parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    rows = [r for r in ROWS if not args.only or any(_matches(r, s) for s in args.only)]
    auto_rows = []
    if args.auto is not None:
        auto_rows = [r for r in rows if any(_matches(r, s) for s in args.auto or [""])]
    fitted = {}
    fit_path = args.out + "_fit.json"
    if args.fit:
        sets = {
            c: [r for r in rows if r.cluster == c and r.fitted and r.strict] for c in sorted({r.cluster for r in rows})
        }
        if not args.cached_only:
            probe = [(r, row_cluster(r, None, {f: PROBE} if f else None), False) for c in sets for r in sets[c]
                     for f in ("",) + FREE.get(c, ())]  # fmt: skip
            run_jobs(probe, args.jobs, args.timeout)
        for c, fit_rows in sets.items():
            fitted[c] = fit(fit_rows, c)
            print(f"fit {c}: {fitted[c]}", flush=True)
        with open(fit_path, "w") as f:
            json.dump(fitted, f, indent=1)
    elif os.path.exists(fit_path):
        with open(fit_path) as f:
            fitted = json.load(f)
    if not args.cached_only:
        at_fit, auto, at_preset = plan_jobs(rows, fitted, auto_rows)
        # pipeline='auto' one at a time: its planning time is a measured figure (the search forks its own workers)
        for jobs, n, limit in (
            (at_fit, args.jobs, args.timeout),
            (auto, 1, args.auto_timeout),
            (at_preset, args.jobs, args.timeout),
        ):
            run_jobs(jobs, n, limit)
    recs = evaluate(rows, fitted, cached_only=True)
    auto = plan_quality(recs, auto_rows, fitted, cached_only=True) if auto_rows else []
    with open(args.out + ".jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(report(recs, fitted, argv, auto)) + "\n")
    print(f"wrote {args.out}.md, {args.out}.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
