"""autopar's plans for torchtitan's Llama-3 debug model vs torchtitan's hand plan (parallelize_llama), lowered to
the torch engines, side by side, with the modeled step time and memory of each and the cost terms that explain
the differences. Writes benchmarks/results/torchtitan_compare.md.

Plans (all on the same (dp, tp) mesh, cluster model, batch, mixed precision allowed = torchtitan's default
bf16 params / fp32 reduce):
  A  autopar's free choice;
  B  torchtitan's hand plan priced in autopar's cost model (benchmarks/torchtitan_plan.py: its parameter placements
     and its activation layout pinned; loss_parallel=False, the variant autopar can express, plus the analytic
     loss_parallel delta);
  C  autopar given torchtitan's parameter placements only (TP on tp, FSDP on dp), activations free.
Each plan is recognized as engine constructs (`recognize`); B's lowering is compared entry by entry with
torchtitan's parallelize_module plan. The engine collectives of each expressible plan are derived
(`engine_collectives`) next to the plan's own prediction.

    python benchmarks/compare_torchtitan.py [--mesh 4x2] [--batch 8] [--seq 2048] [--cluster h100]
    python benchmarks/compare_torchtitan.py --compile   # also: lowered model under torch.compile on CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import provenance

HERE = Path(__file__).resolve().parent


def _plan(m, mesh, x, cluster, **kw):
    import autopar

    t = time.perf_counter()
    p = autopar.plan(m, mesh, x, cluster=cluster, allow_bf16=True, **kw)
    return p, time.perf_counter() - t


def _row(name, p, extra=""):
    q = p.predicted
    cb = q["comm_by_class_s"]
    kinds = ", ".join(f"{k} x{v['count']} {v['bytes'] / 1e6:.1f} MB" for k, v in sorted(q["collectives"].items()))
    return (
        f"| {name} | {q['step_s'] * 1e3:.3f} | {q['compute_s'] * 1e3:.3f} | {q['exposed_comm_s'] * 1e3:.3f} | "
        f"{cb['act'] * 1e3:.3f} / {cb['param'] * 1e3:.3f} / {cb['grad'] * 1e3:.3f} | "
        f"{q['state_mem_bytes'] / 2**20:.1f} | {q['act_peak_bytes'] / 2**20:.1f} | "
        f"{q['peak_mem_bytes'] / 2**20:.1f} | {p.meta.get('precision_decision', {}).get('chosen', '')} | "
        f"{kinds}{extra} |"
    )


def _params_by_module(p, tp):
    import re

    out = {}
    for f, pl in p.params.items():
        key = re.sub(r"\.(\d+)\.", ".*.", f.rsplit(".", 1)[0])
        out.setdefault(key, set()).add(",".join(pl))
    return {k: "/".join(sorted(v)) for k, v in out.items()}


def _why(a, b, la, lb, names) -> list[str]:
    """Cost terms that separate plan a from plan b (both autopar Plans)."""
    qa, qb = a.predicted, b.predicted
    lines = []
    d = (qa["step_s"] - qb["step_s"]) * 1e3
    lines.append(
        f"step time {qa['step_s'] * 1e3:.3f} vs {qb['step_s'] * 1e3:.3f} ms ({d:+.3f} ms): "
        f"compute {(qa['compute_s'] - qb['compute_s']) * 1e3:+.3f} ms, exposed communication "
        f"{(qa['exposed_comm_s'] - qb['exposed_comm_s']) * 1e3:+.3f} ms"
    )
    for cls in ("act", "param", "grad"):
        ta, tb = qa["comm_by_class_s"][cls], qb["comm_by_class_s"][cls]
        if abs(ta - tb) > 1e-9:
            what = {
                "act": "activation redistributes (TP/SP collectives, loss)",
                "param": "parameter gathers (FSDP)",
                "grad": "gradient reductions",
            }[cls]
            lines.append(f"{what}: {ta * 1e3:.3f} vs {tb * 1e3:.3f} ms")
    for kind in sorted(set(qa["collectives"]) | set(qb["collectives"])):
        ca, cb = (
            qa["collectives"].get(kind, {"count": 0, "bytes": 0}),
            qb["collectives"].get(kind, {"count": 0, "bytes": 0}),
        )
        if ca != cb:
            lines.append(
                f"{kind}: {ca['count']} x {ca['bytes'] / 1e6:.1f} MB vs {cb['count']} x {cb['bytes'] / 1e6:.1f} MB"
            )
    lines.append(
        f"memory per rank: state {qa['state_mem_bytes'] / 2**20:.1f} vs {qb['state_mem_bytes'] / 2**20:.1f} "
        f"MiB, activation peak {qa['act_peak_bytes'] / 2**20:.1f} vs {qb['act_peak_bytes'] / 2**20:.1f} MiB"
    )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="4x2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cluster", default="h100")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "torchtitan_compare.md"))
    args = ap.parse_args(argv)
    import torch
    import autopar
    from autopar import models
    from autopar.backends.torch.recognize import recognize
    from autopar.backends.torch.source import _fold
    from autopar.backends.torch.collectives import engine_collectives
    from torchtitan_plan import loss_parallel_delta, torchtitan_placements, torchtitan_styles
    from autopar.cost import get_cluster

    shape = tuple(int(v) for v in args.mesh.split("x"))
    names = ("dp", "tp")
    mesh = autopar.MeshSpec(shape, names)
    m = models.build_model("llama3-debug", device="meta")
    x = models.example_inputs("llama3-debug", batch=args.batch, seq=args.seq, device="meta")
    force, pin = torchtitan_placements(m, names, "dp", "tp", (args.batch, args.seq))
    A, ta = _plan(m, mesh, x, args.cluster)
    B, tb = _plan(m, mesh, x, args.cluster, force=force, pin=pin)
    tp_inputs = lambda n: {0: "S0", 1: "R"} if n.kind == "input" else None
    C, tc = _plan(m, mesh, x, args.cluster, force=force, pin=tp_inputs)
    D, td = _plan(m, mesh, x, args.cluster, pin=tp_inputs)
    plans = {"A": A, "B": B, "C": C, "D": D}
    lows = {k: recognize(p, m) for k, p in plans.items()}
    lp = loss_parallel_delta(B, 1, get_cluster(args.cluster))
    L = [
        "# autopar vs torchtitan's hand plan: Llama-3 debug model (dim 256, 6 layers, 16 heads, vocab 2048)",
        "",
        f"command: `python benchmarks/compare_torchtitan.py --mesh {args.mesh} --batch {args.batch} --seq {args.seq} "
        f"--cluster {args.cluster}{' --compile' if args.compile else ''}`  commit: `{provenance.commit()}`  machine: "
        f"{os.cpu_count()} cores, torch {torch.__version__}",
        "",
        f"Mesh (dp={shape[0]}, tp={shape[1]}), cluster model `{args.cluster}`, global batch {args.batch} x seq "
        f"{args.seq}, fp32 model with mixed precision allowed (bf16 params / fp32 reduce, torchtitan's default). "
        f"Planning times: A {ta:.1f} s, B {tb:.1f} s, C {tc:.1f} s, D {td:.1f} s (each plans fp32 and bf16).",
        "",
        "* **A** autopar's free choice.",
        "* **B** torchtitan's hand plan (`parallelize_llama`: FSDP on dp, colwise wq/wk/wv/w1/w3, rowwise wo/w2, "
        "sequence-parallel norms, vocab-parallel embedding, colwise output) priced in autopar's cost model: "
        "parameter placements and activation layout pinned (benchmarks/torchtitan_plan.py), the rest (attention, "
        "backward) filled in by the solver. autopar has no vocab-sharded cross-entropy rule, so B is torchtitan "
        "with `loss_parallel=False`; the loss_parallel delta is computed analytically below.",
        "* **C** autopar given torchtitan's parameter placements (TP on tp, FSDP on dp) and replicated inputs on "
        "tp, activations free: what autopar does with TP-sharded weights.",
        "* **D** autopar given only the inputs as torchtitan feeds them (batch-sharded on dp, replicated on tp), "
        "everything else free.",
        "",
    ]
    L += [
        "## Parallel styles on tp, side by side",
        "",
        "| module | torchtitan `parallelize_llama` (loss_parallel=False) | autopar lowering of B | "
        "autopar lowering of C | autopar D | autopar A |",
        "|---|---|---|---|---|---|",
    ]
    tt = torchtitan_styles(loss_parallel=False)
    folded = {k: _fold(v.styles, v.block_fqns) for k, v in lows.items()}
    keys = list(dict.fromkeys(list(tt) + [k for v in folded.values() for k in v]))
    params = {k: _params_by_module(p, 1) for k, p in plans.items()}
    for k in keys:
        cell = lambda w: f"`{folded[w][k].code()}`" if k in folded[w] else f"none (params {params[w].get(k, '-')})"
        L.append(f"| {k} | `{tt.get(k, '-')}` | {cell('B')} | {cell('C')} | {cell('D')} | {cell('A')} |")
    same = all(
        folded["B"].get(k) is not None
        and folded["B"][k].code().replace(" ", "").replace(",)", ")") == v.replace(" ", "").replace(",)", ")")
        for k, v in tt.items()
    )
    L += ["", f"B's lowering reproduces torchtitan's plan entry for entry: **{same}**.", ""]
    for k, low in lows.items():
        L.append(f"### Plan {k}: lowering report")
        rep = low.report().splitlines()
        if len(rep) > 24:
            rep = rep[:20] + [f"  ... {len(rep) - 20} more lines"]
        L += ["", "```", *rep, "```", ""]
    L += [
        "## Modeled step time and memory (autopar's cost model)",
        "",
        "| plan | step ms | compute ms | exposed comm ms | comm act / param / grad ms | state MiB | act peak MiB | "
        "peak MiB | precision | collectives (plan) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        _row("A autopar", A),
        _row("B torchtitan (loss_parallel=False)", B),
        _row("C autopar, TP params", C),
        _row("D autopar, torchtitan's inputs", D),
    ]
    L.append(
        f"| B + loss_parallel (analytic) | {(B.predicted['step_s'] + lp['delta_s']) * 1e3:.3f} | | | "
        f"act {lp['delta_s'] * 1e3:+.3f} | | | | | logits gather/reduce-scatter removed "
        f"({lp['removed_s'] * 1e3:.3f} ms), 3 per-token all_reduces added ({lp['added_s'] * 1e3:.3f} ms) |"
    )
    qa, qb, qc = A.predicted, B.predicted, C.predicted
    n_params = sum(p.numel() for p in m.parameters())
    ar = qa["collectives"].get("all_reduce", {"bytes": 0})["bytes"]
    L += [
        "",
        "## Where autopar differs, and why (cost terms)",
        "",
        f"Summary: autopar's choice (A) uses no tensor parallelism here. With {n_params / 1e6:.1f} M parameters the "
        f"data-parallel gradient all-reduce is cheap ({qa['comm_by_class_s']['grad'] * 1e3:.3f} ms for "
        f"{ar / 1e6:.1f} MB, mostly hidden behind compute), while torchtitan's TP+SP (B) moves activations in "
        f"every block ({qb['comm_by_class_s']['act'] * 1e3:.3f} ms of activation collectives, exposed) and FSDP "
        f"gathers parameters ({qb['comm_by_class_s']['param'] * 1e3:.3f} ms). Memory is not binding (A peaks at "
        f"{qa['peak_mem_bytes'] / 2**20:.0f} MiB of {A.predicted['budget_bytes'] / 2**30:.0f} GiB per rank), so "
        f"sharding buys nothing and A's modeled step is {qb['step_s'] / qa['step_s']:.2f}x faster than B's. B "
        f"holds {qa['state_mem_bytes'] / max(qb['state_mem_bytes'], 1):.1f}x less model state per rank "
        f"({qb['state_mem_bytes'] / 2**20:.1f} vs {qa['state_mem_bytes'] / 2**20:.1f} MiB): the plan to pick when "
        f"memory binds. Given torchtitan's parameter placements (C), autopar keeps them but all-gathers the "
        f"TP-sharded weights instead of moving activations ({qc['comm_by_class_s']['act'] * 1e3:.3f} vs "
        f"{qb['comm_by_class_s']['act'] * 1e3:.3f} ms activation collectives, {qc['step_s'] * 1e3:.3f} vs "
        f"{qb['step_s'] * 1e3:.3f} ms step): weights of 256 x 256 are far smaller than 16384-token activations.",
        "",
        "A vs B (autopar's choice vs torchtitan's):",
        "",
    ]
    L += [f"* {s}" for s in _why(A, B, lows["A"], lows["B"], names)]
    L += ["", "C vs B (same parameter placements, autopar chooses the activations):", ""]
    L += [f"* {s}" for s in _why(C, B, lows["C"], lows["B"], names)]
    L += ["", "D vs B (inputs as torchtitan feeds them, everything else autopar's):", ""]
    L += [f"* {s}" for s in _why(D, B, lows["D"], lows["B"], names)]
    L += [
        "",
        "## Collectives: the plan's prediction vs what the engines issue (derived)",
        "",
        "The plan prices one redistribute per consumer edge and per parameter; the engines run one collective per "
        "FSDP unit and one per styled module boundary (`engine_collectives`, checked exactly against measured "
        "runs in tests/test_engines_dist.py).",
        "",
        "| plan | kind | plan count | plan MB | engines count | engines MB |",
        "|---|---|---|---|---|---|",
    ]
    for k, p in plans.items():
        if not lows[k].expressible:
            L.append(f"| {k} | (not expressible by the engines: graph backend) | | | | |")
            continue
        exp, _ = engine_collectives(p, lows[k])
        ek = Counter()
        eb = Counter()
        for kind, _, nb in exp:
            ek[kind] += 1
            eb[kind] += nb
        for kind in sorted(set(ek) | set(p.predicted["collectives"])):
            pc = p.predicted["collectives"].get(kind, {"count": 0, "bytes": 0})
            L.append(f"| {k} | {kind} | {pc['count']} | {pc['bytes'] / 1e6:.2f} | {ek[kind]} | {eb[kind] / 1e6:.2f} |")
    if args.compile:
        L += ["", "## torch.compile of the lowered model (CPU, gloo)", ""] + _compile_runs()
    Path(args.out).write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


# ---- torch.compile check ----------------------------------------------------------------------------------------

COMPILE_CHILD = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
r, w = dist.get_rank(), dist.get_world_size()
from torch.distributed.device_mesh import init_device_mesh
import autopar
from autopar import models
from autopar.backends.torch import local_inputs, train_context
from torchtitan_plan import batch_pin, torchtitan_placements
case = json.loads(sys.argv[1])
shape, names = tuple(case["shape"]), tuple(case["names"])
mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
b, s = case["batch"], case["seq"]
ref = models.build_model("llama3-debug", device="cpu"); m = models.build_model("llama3-debug", device="cpu")
x, y = models.example_inputs("llama3-debug", batch=b, seq=s)
meta = models.build_model("llama3-debug", device="meta")
if case["layout"] == "fsdp":
    kw = dict(force={k: ("S0",) for k, _ in meta.named_parameters()}, pin=batch_pin([0], (b, s)))
else:
    force, pin = torchtitan_placements(meta, names, "dp" if "dp" in names else None, "tp", (b, s))
    kw = dict(force=force, pin=pin)
if case["where"] == "blocks":    # torchtitan's order: TP, then compile each block, then FSDP
    m = autopar.parallelize(m, mesh, (x, y), backend="torch", compile_blocks={"backend": case["backend"]}, **kw)
    cm = m
else:
    m = autopar.parallelize(m, mesh, (x, y), backend="torch", **kw)
    cm = torch.compile(m, backend=case["backend"])
xl, yl = local_inputs(m, mesh, x, y)
t = time.perf_counter()
with train_context(m):
    loss = cm(xl, yl)
    loss.backward()
dt = time.perf_counter() - t
lv = loss.detach().float().clone()
for d, p in enumerate(m._autopar_lowering.input_placements[0]):
    if p == "S0":
        dist.all_reduce(lv, group=mesh.get_group(d)); lv /= mesh.size(d)
lref = ref(x, y).item()
if r == 0:
    print("RESULT", json.dumps({"loss": lv.item(), "ref": lref, "seconds": dt}), flush=True)
dist.barrier(); dist.destroy_process_group()
"""


def _compile_runs() -> list[str]:
    cases = [
        {"layout": "fsdp", "shape": [2], "names": ["dp"], "backend": "inductor", "where": "model"},
        {"layout": "tp", "shape": [2], "names": ["tp"], "backend": "inductor", "where": "model"},
        {"layout": "tp", "shape": [2, 2], "names": ["dp", "tp"], "backend": "inductor", "where": "blocks"},
        {"layout": "tp", "shape": [2, 2], "names": ["dp", "tp"], "backend": "inductor", "where": "model"},
    ]
    for c in cases:
        c.update(batch=4, seq=256)
    out = [
        "| lowered plan | mesh | torch.compile backend | compile + one step s | loss | single-device loss | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        world = 1
        for v in c["shape"]:
            world *= v
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        procs = []
        for r in range(world):
            env = dict(
                os.environ,
                OMP_NUM_THREADS="1",
                RANK=str(r),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", COMPILE_CHILD, json.dumps(c)],
                    cwd=HERE,  # the child imports torchtitan_plan from benchmarks/ (sys.path[0] of -c)
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=1500)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append("TIMEOUT")
        res = next((json.loads(line[7:]) for line in logs[0].splitlines() if line.startswith("RESULT ")), None)
        layout = (
            "FSDP2 (fully_shard per block)"
            if c["layout"] == "fsdp"
            else "torchtitan TP+SP" + (" x FSDP2" if "dp" in c["names"] else "")
        )
        mesh = " x ".join(f"{n}={s}" for n, s in zip(c["names"], c["shape"]))
        layout += " (blocks compiled before FSDP)" if c["where"] == "blocks" else " (whole model compiled)"
        if res is None:
            err = next((ln.strip() for ln in reversed(logs[0].splitlines()) if "Error" in ln), "no result")
            out.append(f"| {layout} | {mesh} | {c['backend']} | | | | FAILED: `{err[:200]}` |")
        else:
            ok = abs(res["loss"] - res["ref"]) <= 1e-5 * abs(res["ref"])
            out.append(
                f"| {layout} | {mesh} | {c['backend']} | {res['seconds']:.1f} | {res['loss']:.6f} | "
                f"{res['ref']:.6f} | {'same loss' if ok else 'DIFFERENT'} |"
            )
    out.append("")
    out.append(
        f"llama3-debug shape, batch {cases[0]['batch']} x seq {cases[0]['seq']} (CPU); 'same loss' = the mean of "
        f"the ranks' local losses equals the single-device loss to 1e-5 relative."
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
