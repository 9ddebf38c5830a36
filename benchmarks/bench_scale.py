"""3-D plans at scale, planned only (no hardware): autopar's own pipeline + intra-op plan beside published layouts,
all costed by the same model (autopar/pipeline_model.py on top of the per-op cost model).

  * Llama-3 405B shape on 16,384 simulated H100 (nodes of 8, NVLink inside, IB between), global batch 2048 x 8192
    (16M tokens, Meta's 405B run); beside Llama 3's published layout TP=8, PP=16, DP=128 (Dubey et al. 2024,
    section 3.3: 126 layers, one fewer layer on the first and the last stage, 16 micro-batches of one sequence per
    DP rank), with 1F1B and with interleaved 1F1B (2 stages per rank; their tuned interleaving is not published in
    enough detail to reproduce exactly).
  * A 530B model (MT-NLG shape: 105 layers, dim 20480, 128 heads, vocab 51200; SwiGLU sized to the GPT MLP's
    parameter count) on 2,240 simulated A100, batch 1920 x 2048; beside the Megatron recipe of the seed chapter
    (TP=8, PP=35, DP=8; 3 layers per stage, micro-batch 1, full activation recomputation).
  * Llama-3 70B on 256 H100, batch 256 x 8192; beside torchtitan's llama3_70b.toml (FSDP=32 x TP=8, no PP,
    local batch 8, activation checkpointing "full").

A published layout is evaluated with its mesh shape, stage split, schedule and micro-batch count fixed; what is not
published (the per-op placement inside a stage) is autopar's optimum for that submesh, so the layout's numbers
are optimistic for it. Modeled step time, peak memory per GPU (90% of 80 GB budget), bubble, and 6*N*tokens
TFLOP/s per GPU (no attention FLOPs) for each. Planning time: wall and CPU seconds (this process + its workers)
of autopar.plan; intra-op plans of different stage submeshes run in 2 forked workers on this 2-core machine, so
on an idle machine wall ~ CPU / 2 for that part.

    python benchmarks/bench_scale.py [--cases 405b 530b 70b] [--out benchmarks/results/scale]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

import autopar
from autopar import models

GiB = 2**30

CASES = {
    "405b": dict(
        model="llama3-405b",
        over={},
        batch=2048,
        seq=8192,
        world=16384,
        cluster="h100",
        layouts=[
            (
                "Llama 3 published (TP=8, PP=16, DP=128), 1F1B",
                (16, 128, 8),
                dict(layers_per_stage=[7] + [8] * 14 + [7], schedules=["1F1B"], n_microbatches=[16]),
            ),
            (
                "Llama 3 published (TP=8, PP=16, DP=128), interleaved v=2",
                (16, 128, 8),
                dict(
                    layers_per_stage=[3] + [4] * 30 + [3],
                    schedules=["Interleaved1F1B"],
                    stages_per_rank=[2],
                    n_microbatches=[16],
                ),
            ),
        ],
    ),
    "530b": dict(
        model="llama3-405b",
        batch=1920,
        seq=2048,
        world=2240,
        cluster="a100",
        over=dict(dim=20480, n_layers=105, n_heads=128, n_kv_heads=128, ffn_dim=54784, vocab_size=51200),
        layouts=[
            (
                "Megatron recipe (TP=8, PP=35, DP=8)",
                (35, 8, 8),
                dict(layers_per_stage=[3] * 35, schedules=["1F1B"], n_microbatches=[240], recompute="all"),
            )
        ],
    ),
    "70b": dict(
        model="llama3-70b",
        over={},
        batch=256,
        seq=8192,
        world=256,
        cluster="h100",
        layouts=[
            (
                "torchtitan llama3_70b.toml (FSDP=32 x TP=8)",
                (1, 32, 8),
                dict(layers_per_stage=[80], schedules=["GPipe"], n_microbatches=[1], recompute="all"),
            )
        ],
    ),
}


def _row(case, label, plan, n_params, tokens, wall, cpu):
    sc, pr = plan.schedule, plan.predicted
    world = 1
    for s in plan.mesh_shape:
        world *= s
    sizes = [sum(1 for c in st["clusters"] if c.startswith(sc["layer_prefix"] + ".")) for st in plan.stages]
    split = f"{sizes[0]},{sizes[1]},...,{sizes[-1]}" if len(sizes) > 3 else ",".join(map(str, sizes))
    return {
        "case": case,
        "layout": label,
        "mesh": "x".join(map(str, plan.mesh_shape)),
        "mesh_names": ",".join(plan.mesh_names),
        "schedule": sc["name"],
        "stages_per_rank": sc["stages_per_rank"],
        "n_microbatches": sc["n_microbatches"],
        "layers_per_stage": split,
        "recompute_blocks": sum(st["recompute_blocks"] for st in plan.stages),
        "step_s": round(pr["step_s"], 4),
        "peak_mem_GiB": round(pr["peak_mem_bytes"] / GiB, 2),
        "bubble": round(sc["bubble_fraction"], 4),
        "fits": pr["peak_mem_bytes"] <= pr["budget_bytes"],
        "tflops_per_gpu_6ND": round(6 * n_params * tokens / pr["step_s"] / world / 1e12, 1),
        "plan_wall_s": round(wall, 2),
        "plan_cpu_s": round(cpu, 2),
    }


def _cpu() -> float:
    """CPU seconds of this process and its (finished) worker processes."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_case(case):
    cfg = CASES[case]
    t = time.perf_counter()
    m = models.build_model(cfg["model"], device="meta", dtype=torch.bfloat16, **cfg["over"])
    x = models.example_inputs(cfg["model"], batch=cfg["batch"], seq=cfg["seq"], device="meta", **cfg["over"])
    build = time.perf_counter() - t
    n_params = sum(p.numel() for p in m.parameters())
    tokens = cfg["batch"] * cfg["seq"]
    rows, plans = [], {}
    t, c = time.perf_counter(), _cpu()
    plan = autopar.plan(m, (cfg["world"],), x, cluster=cfg["cluster"], pipeline="auto")
    rows.append(_row(case, "autopar (pipeline='auto')", plan, n_params, tokens, time.perf_counter() - t, _cpu() - c))
    plans["autopar"] = plan
    for label, shape, opts in cfg["layouts"]:
        t, c = time.perf_counter(), _cpu()
        p = autopar.plan(m, autopar.MeshSpec(shape, ("pp", "dp", "tp")), x, cluster=cfg["cluster"], pipeline=opts)
        rows.append(_row(case, label, p, n_params, tokens, time.perf_counter() - t, _cpu() - c))
        plans[label] = p
    return rows, plans, n_params, build


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scale"))
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    all_rows, md = (
        [],
        [
            "# 3-D plans at scale (plan only, modeled)",
            "",
            f"`python benchmarks/bench_scale.py --cases {' '.join(args.cases)}` "
            f"(torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.1f} at start: "
            f"wall times grow with other jobs on the machine, CPU seconds do not)",
            "",
            __doc__.split("\n\n")[1],
            "",
        ],
    )
    for case in args.cases:
        rows, plans, n_params, build = run_case(case)
        all_rows += rows
        cfg = CASES[case]
        md += [
            f"## {case}: {cfg['model']} {cfg['over'] or ''} ({n_params / 1e9:.1f} B params) on {cfg['world']} "
            f"{cfg['cluster'].upper()}, batch {cfg['batch']} x {cfg['seq']}",
            "",
            "| layout | mesh (pp x dp x tp) | schedule | micro-batches | layers/stage | recomputed blocks | "
            "step s | peak GiB/GPU | bubble | fits | TFLOP/s/GPU (6ND) | plan s (wall / cpu) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            sched = r["schedule"] + (f" (v={r['stages_per_rank']})" if r["stages_per_rank"] > 1 else "")
            md.append(
                f"| {r['layout']} | {r['mesh']} | {sched} | {r['n_microbatches']} | {r['layers_per_stage']} | "
                f"{r['recompute_blocks']} | {r['step_s']:.3f} | {r['peak_mem_GiB']:.1f} | {r['bubble']:.3f} | "
                f"{'yes' if r['fits'] else 'NO'} | {r['tflops_per_gpu_6ND']} | {r['plan_wall_s']} / "
                f"{r['plan_cpu_s']} |"
            )
        md += [
            "",
            f"(model build on meta: {build:.1f} s, not counted; load average now {os.getloadavg()[0]:.1f})",
            "",
            "autopar's plan:",
            "",
            "```",
            plans["autopar"].summary().split("\nmodule placements")[0],
            "```",
            "",
        ]
        for r in rows:
            print(
                f"{case:5s} {r['layout']:48s} {r['mesh']:>12s} {r['schedule']:>22s} m={r['n_microbatches']:<4} "
                f"step {r['step_s']:8.3f} s  peak {r['peak_mem_GiB']:6.1f} GiB  bubble {r['bubble']:.3f}  "
                f"{r['tflops_per_gpu_6ND']:6.1f} TF/GPU  plan {r['plan_wall_s']} s wall / {r['plan_cpu_s']} s cpu",
                flush=True,
            )
    md += [
        "## Reading these numbers",
        "",
        "* Modeled, not measured: roofline compute at 70% of peak, alpha-beta collectives, p2p transfers not "
        "overlapped with compute. Absolute TFLOP/s sit below published measurements (Llama 3 reports about 400 "
        "TFLOP/s per GPU on 16K H100; MT-NLG 113-126 on A100, Narayanan et al. up to 163); what the table "
        "compares is layouts under one model.",
        "* A published layout keeps its mesh, stage split, schedule and micro-batch count; its per-op placement "
        "inside a stage and, unless the recipe states full recomputation, its checkpointed-block count are "
        "autopar's choices for that configuration.",
        "* autopar searched pp x dp x tp (tp within a node), micro-batch counts, the six torch schedules and "
        "stages per rank; `plan.schedule['candidates']` lists the runners-up, `['even_split']` the same "
        "configuration with torchtitan's even layer split.",
        "",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(all_rows[0]))
        w.writeheader()
        w.writerows(all_rows)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {args.out}.md and {args.out}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
