"""Predicted vs published peak memory per GPU of TorchTitan's runs (arXiv 2410.06511, Tables 1-4; the rows of
/work/shared/reference/published_runs.md section B that publish memory and autopar can express), planned only, with
each published layout forced through the public API (pipeline= fixes the mesh, stage split, schedule, micro-batches
and recomputation; force= the FSDP x TP storage of every parameter on the stage submesh, as torchtitan shards
them: FSDP on dim 0 over dp, attention and MLP projections column-/row-wise on tp, the embedding and the head on
their vocabulary dim).

    python benchmarks/memory_check.py [--out benchmarks/results/memory_check.md]

Assumptions (not in the paper): sequence 8192 (torchtitan's configs); bf16 mixed precision with fp32 master,
gradient reduction and AdamW states (Float8 and torch.compile are not modelled: their rows are planned in bf16
eager); micro-batches as torchtitan defaulted then (pipeline_parallel_microbatches unset: one per pp rank, so 16 of
2 sequences for 1F1B and interleaved alike; benchmarks/published.py says why); layers per stage as even as 126
allows, one fewer on the first and last; "selective AC" is not expressible (op-level selective recomputation): those
rows give the two bounds, no recomputation and full. The published figure is torch.cuda.max_memory_reserved
(torchtitan's memory monitor) on the 95 GiB H100 (the h100-95g preset). Tokens/s/GPU are printed beside them for
reference only: the T3/T4 rows ran torch.compile + Float8, planned here in bf16 eager (benchmarks/published.py is
the step-time harness).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import autopar
from autopar import models
from autopar.testing import fsdp_tp_force

GiB = 2**30
SEQ = 8192
NUMEL: dict = {}  # parameter FQN -> elements, of the model planned last


NOTES = """What the prediction counts: model state at the storage placements (bf16 parameters, fp32 master,
gradients, AdamW states, sharded FSDP x TP), the saved activations of the micro-batches in flight (torch's action
order), the largest transient of a cluster's run beyond its saved activations (autopar/liveness.py cluster_peaks:
a recomputed block's activations and its backward's gradients, the loss's bf16 logits, fp32 upcast and
log_softmax output, then its two fp32 gradients), and FSDP2's unsharded buffers (autopar/pipeline_engine.py:
pipelined, every unit's bf16 parameters and fp32 accumulated gradients kept through the step; with one pipeline
rank the two largest units). The published figure is memory_reserved: plan.predicted["reserved_mem_bytes"] adds the
caching allocator's idle segments at the peak (autopar/cost/memory.py idle_cached_bytes over the peaking cluster's
buffers); the table's predicted column is the allocated peak. Not counted: fragmentation across clusters, NCCL's
and the pipeline's communication buffers, and Float8's casts (T3/T4)."""


def _layout(layers, schedule, m, recompute, v=1):
    out = dict(layers_per_stage=layers, schedules=[schedule], n_microbatches=[m], recompute=recompute)
    return out | ({"stages_per_rank": [v]} if v > 1 else {})


# (label, model, global batch, mesh (pp, dp, tp), pipeline layout, published GiB, published tokens/s/GPU)
ROWS = [
    (
        "T1 8B FSDP 8, selective AC (bound: none)",
        "llama3-8b",
        16,
        (1, 8, 1),
        _layout([32], "GPipe", 1, None),
        81.9,
        6258,
    ),
    (
        "T1 8B FSDP 8, selective AC (bound: full)",
        "llama3-8b",
        16,
        (1, 8, 1),
        _layout([32], "GPipe", 1, "all"),
        81.9,
        6258,
    ),
    ("T3 70B FSDP 32 x TP 8, full AC", "llama3-70b", 512, (1, 32, 8), _layout([80], "GPipe", 1, "all"), 70.3, 897),
    (
        "T4 405B FSDP 4 x TP 8 x PP 16, 1F1B, full AC",
        "llama3-405b",
        128,
        (16, 4, 8),
        _layout([7] + [8] * 14 + [7], "1F1B", 16, "all"),
        78.0,
        100,
    ),
    (
        "T4 405B FSDP 4 x TP 8 x PP 16, interleaved 1F1B (v=2), full AC",
        "llama3-405b",
        128,
        (16, 4, 8),
        _layout([3] + [4] * 30 + [3], "Interleaved1F1B", 16, "all", v=2),
        80.3,
        130,
    ),
]


def plan_row(name, batch, mesh, layout):
    m = models.build_model(name, device="meta", dtype=torch.bfloat16)
    NUMEL.update({k: p.numel() for k, p in m.named_parameters()})
    x = models.example_inputs(name, batch=batch, seq=SEQ, device="meta")
    force = fsdp_tp_force(m, mesh[1:])
    if mesh[2] > 1:  # torchtitan: the embedding row-wise and the head column-wise on tp, both dim 0 (vocab)
        force.update({k: ("S0", "S0") for k in ("tok_embeddings.weight", "output.weight")})
    spec = autopar.MeshSpec(mesh, ("pp", "dp", "tp"))
    return autopar.plan(m, spec, x, cluster="h100-95g", force=force, memory_budget=1e15, pipeline=layout)


def breakdown(plan) -> dict:
    """GiB of the peak rank's terms (summed over its stages): model state, in-flight activations (the rank's
    stages at their in-flight counts: an upper bound for interleaved schedules, whose peak the schedule decides),
    the largest transient (a recompute, the loss tail), and FSDP2's unsharded buffers (the rest of the rank's peak)."""
    ranks: dict = {}
    for st in plan.stages:
        ranks.setdefault(st["pp_rank"], []).append(st)
    r, sts = max(ranks.items(), key=lambda kv: kv[1][0]["memory"]["rank_peak_bytes"])
    peak = sts[0]["memory"]["rank_peak_bytes"]
    state = sum(st["memory"]["state_bytes"] for st in sts)
    transient = max(st["memory"]["transient_bytes"] for st in sts)
    fsdp = fsdp_bytes(plan, sts)
    return {
        "rank": r,
        "state": state / GiB,
        "act": (peak - state - transient - fsdp) / GiB,
        "transient": transient / GiB,
        "kept": fsdp / GiB,
        "peak": plan.predicted["peak_mem_bytes"] / GiB,
    }


def fsdp_bytes(plan, stages) -> float:
    """FSDP2's unsharded parameters (bf16) and accumulated gradients (fp32) of the stages' parameters stored sharded
    on dp, at their tp sharding: all of them pipelined, the two largest blocks with one pipeline rank."""
    shape = dict(zip(plan.mesh_names, plan.mesh_shape))
    per_block: dict = {}
    for st in stages:
        for f in st["params"]:
            pl = plan.params[f]
            if pl[0][0] != "S":
                continue
            tp = shape["tp"] if pl[1][0] == "S" else 1
            key = f.split(".")[1] if f.startswith("layers.") else f
            per_block[key] = per_block.get(key, 0.0) + NUMEL[f] * 6 / tp
    units = sorted(per_block.values(), reverse=True)
    return sum(units) if shape["pp"] > 1 else sum(units[:2])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_check.md"))
    args = ap.parse_args(argv)
    md = [
        "# Peak memory per GPU: predicted vs TorchTitan's published (plan only)",
        "",
        "`python benchmarks/memory_check.py`",
        "",
        __doc__.split("\n\n")[0].replace("\n", " "),
        "",
        __doc__.split("\n\n")[2].replace("\n", " "),
        "",
        "| row | peak pp rank | state GiB | activations GiB | transient GiB | FSDP2 kept GiB | predicted GiB | "
        "published GiB | predicted / published | tokens/s/GPU predicted (published) | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, name, batch, mesh, layout, published, tps in ROWS:
        t = time.perf_counter()
        plan = plan_row(name, batch, mesh, layout)
        b = breakdown(plan)
        pred_tps = batch * SEQ / plan.predicted["step_s"] / math.prod(mesh)
        row = (
            f"| {label} | {b['rank']} | {b['state']:.1f} | {b['act']:.1f} | {b['transient']:.1f} | {b['kept']:.1f} | "
            f"{b['peak']:.1f} | {published} | {b['peak'] / published:.2f} | {pred_tps:.0f} ({tps}) | "
            f"{time.perf_counter() - t:.1f} |"
        )
        print(row, flush=True)
        md.append(row)
    md += ["", NOTES.replace("\n", " ")]
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
