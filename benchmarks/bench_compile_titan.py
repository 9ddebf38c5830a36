"""Predicted TorchTitan throughput under torch.compile and float8 (shared/reference/published_runs.md, table B):
Llama 3 8B FSDP 8 / FSDP 128 (Tables 1-2) and 70B FSDP 32 x TP 8 (Table 3), predicted tokens/s/GPU beside the
published figures. The check of autopar/cost/fusion.py's scope and passes/float8.py's TP pricing.

    python benchmarks/bench_compile_titan.py [--table 1 2 3] [--fusion-eff 1.0]

Assumptions (as benchmarks/published.py states them): the h100-95g preset; 8192-token sequences, 2 (Tables 1-2) or
16 (Table 3) per data-parallel rank; blocks recomputed as memory needs (the nearest autopar has to torchtitan's
selective AC; Table 3 ran full AC); every parameter Shard(0) on the FSDP dim. Table 3 forces torchtitan's TP plan:
wq/wk/wv/w1/w3 colwise (weight Shard(0) on tp, their forward GEMM outputs pinned Shard(1) on tp), wo/w2 rowwise
(Shard(1)); unpinned, the planner runs the (32, 8) mesh as 256-way FSDP instead.
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar import models
from autopar.cost import get_cluster

F8 = {"fsdp_float8_all_gather": True, "precompute_scale": True}
# table -> (model, gpus, mesh, per-rank batch, published eager / compile / compile+float8 TPS per GPU)
TABLES = {
    1: ("llama3-8b", 8, ((8,), ("dp",)), 2, (6258, 6674, 9409)),
    2: ("llama3-8b", 128, ((128,), ("dp",)), 2, (5645, 6482, 9319)),
    3: ("llama3-70b", 256, ((32, 8), ("dp", "tp")), 16, (None, None, 897)),
}
COLWISE, ROWWISE = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")


def _tp_force(m) -> dict:
    def place(fqn):
        leaf = fqn.rsplit(".", 2)[-2] if fqn.count(".") >= 1 else fqn
        return ("S0", "S0") if leaf in COLWISE else ("S0", "S1") if leaf in ROWWISE else ("S0", "R")

    return {fqn: place(fqn) for fqn, _ in m.named_parameters()}


def _tp_pin(n):
    colwise = n.kind == "op" and n.phase == "fw" and n.target is torch.ops.aten.mm.default
    return {1: "S1"} if colwise and n.module.rsplit(".", 1)[-1] in COLWISE else None


def run(table: int, fusion_eff: float) -> list[str]:
    name, gpus, (shape, names), per_rank, published = TABLES[table]
    m = models.build_model(name, device="meta", dtype=torch.bfloat16)
    x = models.example_inputs(name, batch=per_rank * shape[0], seq=8192, device="meta")
    tp = len(shape) > 1
    force = _tp_force(m) if tp else {fqn: ("S0",) for fqn, _ in m.named_parameters()}
    base = get_cluster("h100-95g")
    compiled = base.with_device(fusion="inductor", fusion_eff=fusion_eff)
    lines = []
    for label, cl, f8, pub in zip(
        ("eager", "compile", "compile+float8"), (base, compiled, compiled), (None, None, F8), published
    ):
        if pub is None:
            continue
        p = autopar.plan(
            m, autopar.MeshSpec(shape, names), x, cluster=cl, force=force, float8=f8, pin=_tp_pin if tp else None
        )
        tps = per_rank * shape[0] * 8192 / gpus / p.predicted["step_s"]
        lines.append(
            f"Table {table} {name} {gpus} GPUs {label}: predicted {tps:,.0f} published {pub:,} ({tps / pub:.3f}x)"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=int, nargs="+", default=[1, 2, 3], choices=sorted(TABLES))
    ap.add_argument("--fusion-eff", type=float, default=1.0)
    args = ap.parse_args(argv)
    for t in args.table:
        for line in run(t, args.fusion_eff):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
