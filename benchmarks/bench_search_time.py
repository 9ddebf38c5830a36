"""Planning time of the automatic 3-D search (`pipeline="auto"`) on every published configuration of
../shared/reference/published_runs.md (issue 26 part 4: each <= 30 s on this machine).

One configuration per distinct (model shape, GPU kind and count, global batch, sequence length) of the published
tables: A (Megatron-LM's GPT shapes on 32..3072 A100, seq 2048), B (TorchTitan's Llama 3.1 8B / 70B / 405B on H100,
incl. the long-sequence rows of tables 5-6) and C (Llama 3 405B on 8,192 and 16,384 H100). Each is planned from a
flat rank set with `pipeline="auto"` (the search picks pp, the stage submesh dp x tp, micro-batches, schedule and
stages per rank), and the row records wall and CPU seconds (this process and its forked workers), the predicted
step time and the chosen layout. The machine is shared: compare CPU seconds across runs, not wall.

Megatron's GPT shapes are autopar's GPT-2 family (learned positions, 4h MLP, vocab 51,200) with untied
embeddings (as benchmarks/published.py plans them). TorchTitan's H100s are modeled with
the `h100` preset (80 GB), like Llama 3's. The long-sequence rows plan without context parallelism unless the
planner offers it: their layout says what the search found.

    python benchmarks/bench_search_time.py [--only SUBSTR ...] [--out benchmarks/results/search_time]
        [--ref OLD.jsonl]   # adds the reference run's step time and CPU seconds beside each row
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import autopar
from autopar import models
from published_rows import MEGATRON

# (name, model, overrides, GPUs, global batch, seq, cluster); Megatron's global batch as published, TorchTitan's
# local batch x dp (table 5: local batch 1 per FSDP rank; table 6: batch 8), Llama 3's tokens per batch / seq.
_GPT = dict(vocab_size=51200, max_seq_len=2048, tie_embeddings=False)
CONFIGS = [
    (f"A gpt-{b}B {g}xA100", "gpt2-small", dict(_GPT, n_heads=h, dim=d, n_layers=n), g, gb, 2048, "a100")
    for b, h, d, n, _t, _p, g, _d, gb, _tflops in MEGATRON  # Megatron-LM SC21 Table 1 (benchmarks/published_rows.py)
] + [
    ("B llama3-8b 8xH100", "llama3-8b", {}, 8, 16, 8192, "h100"),
    ("B llama3-8b 128xH100", "llama3-8b", {}, 128, 256, 8192, "h100"),
    ("B llama3-70b 256xH100", "llama3-70b", {}, 256, 512, 8192, "h100"),
    ("B llama3-405b 512xH100", "llama3-405b", {}, 512, 128, 8192, "h100"),
    ("B llama3-8b 8xH100 seq32k", "llama3-8b", dict(max_seq_len=32768), 8, 8, 32768, "h100"),
    ("B llama3-8b 8xH100 seq64k", "llama3-8b", dict(max_seq_len=65536), 8, 4, 65536, "h100"),
    ("B llama3-8b 8xH100 seq128k", "llama3-8b", dict(max_seq_len=131072), 8, 2, 131072, "h100"),
    ("B llama3-8b 8xH100 seq256k", "llama3-8b", dict(max_seq_len=262144), 8, 1, 262144, "h100"),
    ("B llama3-405b 512xH100 seq32k", "llama3-405b", dict(max_seq_len=32768), 512, 8, 32768, "h100"),
    ("B llama3-405b 512xH100 seq64k", "llama3-405b", dict(max_seq_len=65536), 512, 8, 65536, "h100"),
    ("B llama3-405b 512xH100 seq128k", "llama3-405b", dict(max_seq_len=131072), 512, 8, 131072, "h100"),
    ("B llama3-405b 512xH100 seq256k", "llama3-405b", dict(max_seq_len=262144), 512, 8, 262144, "h100"),
    ("C llama3-405b 8192xH100", "llama3-405b", {}, 8192, 2048, 8192, "h100"),
    ("C llama3-405b 16384xH100", "llama3-405b", {}, 16384, 2048, 8192, "h100"),
    ("C llama3-405b 16384xH100 seq128k", "llama3-405b", dict(max_seq_len=131072), 16384, 128, 131072, "h100"),
]


def _cpu() -> float:
    """CPU seconds of this process and its finished worker processes."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _layout(plan) -> str:
    sc = plan.schedule
    shape = dict(zip(sc["stage_mesh_names"], sc["stage_mesh_shape"]))
    sizes = [sum(1 for c in st["clusters"] if c.startswith(sc["layer_prefix"] + ".")) for st in plan.stages]
    split = f"{sizes[0]},{sizes[1]},..,{sizes[-1]}" if len(sizes) > 3 else ",".join(map(str, sizes))
    rec = sum(st["recompute_blocks"] for st in plan.stages)
    return (
        f"pp {sc['pp']} x dp {shape.get('dp', 1)} x tp {shape.get('tp', 1)}, {sc['name']} m={sc['n_microbatches']}"
        f" v={sc['stages_per_rank']}, blocks {split}, recompute {rec}"
    )


def run_one(cfg) -> dict:
    name, model, over, world, batch, seq, cluster = cfg
    m = models.build_model(model, device="meta", dtype=torch.bfloat16, **over)
    x = models.example_inputs(model, batch=batch, seq=seq, device="meta", **over)
    row = {"name": name, "gpus": world, "batch": batch, "seq": seq, "cluster": cluster}
    t, c = time.perf_counter(), _cpu()
    try:
        plan = autopar.plan(m, (world,), x, cluster=cluster, pipeline="auto")
    except Exception as e:  # a configuration that cannot be planned is a row saying why
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        plan = None
    row.update(wall_s=round(time.perf_counter() - t, 2), cpu_s=round(_cpu() - c, 2))
    if plan is not None:
        s = plan.schedule["search"]
        row.update(
            step_s=round(plan.predicted["step_s"], 5),
            peak_mem_GiB=round(plan.predicted["peak_mem_bytes"] / 2**30, 2),
            layout=_layout(plan),
            configs=s["configs"],
            pruned=s["pruned"],
            intra_op_keys=s["intra_op_keys"],
            estimated_keys=s.get("estimated_keys", 0),
            refine_rounds=s.get("refine_rounds", 0),
            stage_plans_wall_s=round(s["stage_plans_wall_s"], 2),
            search_wall_s=round(s["search_wall_s"], 2),
        )
    return row


def _table(rows, ref) -> list[str]:
    head = (
        "| configuration | wall s | CPU s | predicted step s | peak GiB | layout | configs / pruned / intra-op plans |"
    )
    if ref:
        head += " reference step s | reference CPU s |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["name"], f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}"]
        if "error" in r:
            cells += ["-", "-", r["error"], "-"]
        else:
            cells += [
                f"{r['step_s']:.4f}",
                f"{r['peak_mem_GiB']:.1f}",
                r["layout"],
                f"{r['configs']} / {r['pruned']} / {r['intra_op_keys']}",
            ]
        if ref:
            o = ref.get(r["name"], {})
            cells += [f"{o['step_s']:.4f}" if "step_s" in o else "-", f"{o['cpu_s']:.1f}" if "cpu_s" in o else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="run only the configurations whose name contains one of these")
    ap.add_argument("--out", default="benchmarks/results/search_time", help="writes OUT.jsonl and OUT.md")
    ap.add_argument("--ref", help="an earlier run's OUT.jsonl, shown beside each row")
    args = ap.parse_args(argv)
    cfgs = [c for c in CONFIGS if not args.only or any(s in c[0] for s in args.only)]
    ref = {}
    if args.ref:
        with open(args.ref) as f:
            ref = {r["name"]: r for r in map(json.loads, f)}
    rows = []
    with open(args.out + ".jsonl", "w") as f:
        for cfg in cfgs:
            rows.append(run_one(cfg))
            print(json.dumps(rows[-1]), flush=True)
            f.write(json.dumps(rows[-1]) + "\n")
            f.flush()
    worst = max((r["wall_s"] for r in rows), default=0.0)
    lines = [
        "# pipeline='auto' planning time on the published configurations",
        "",
        f"`python benchmarks/bench_search_time.py{' --ref ' + args.ref if args.ref else ''}` (wall and CPU seconds "
        "of autopar.plan, its forked workers included; this 2-core machine is shared, so CPU seconds are the "
        f"figure to compare). Slowest wall: {worst:.1f} s.",
        "",
        *_table(rows, ref),
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
