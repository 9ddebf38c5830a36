"""Calibrate the `cpu-gloo` cost model on this machine: N gloo ranks on the CPU, as the tests and benchmarks run.

    python benchmarks/cpu_calibrate.py [--world 4]     # ~2.5 min; writes benchmarks/results/cpu_gloo_calibrated.json

All ranks run at once (OMP_NUM_THREADS=1 each, as bench_execute.py and harness.py run them), so every figure is
what one rank gets while its peers compete for the same cores:
  * matmul FLOP/s per rank (fp32, transformer-shaped matmuls, all ranks busy at once);
  * memory bandwidth per rank (a large copy, all ranks at once);
  * the fixed time of one small eager op (dispatch and launch: what a roofline misses on tiny ops);
  * eager forward + backward steps of llama3-debug, moe-debug and mlp-heavy at batch 1 and 4 (`step_fit`): the
    device's FLOP rate and per-op cost are the least-squares fit of the cost model's own op times (views at the
    per-op cost only) to them, since the small ops of these models on ranks sharing cores run far below the
    matmul rate (47 against ~90 GFLOP/s on the reference machine);
  * collectives: all_reduce, all_gather, reduce_scatter and all_to_all at 16 B..16 MiB, over the world and over
    the pairs of a (world/2) x 2 mesh (both dims in turn, as a 2-D plan's collectives alternate), each timed
    INSIDE a busy program: every rank alternates ~5 ms of matmul (--work-ms) and the collective, and the cost of a
    collective is the time of that loop minus the time of the matmuls alone. That is what a collective costs in a
    training step on this machine: with more ranks than cores a collective waits until every peer has been
    scheduled again, which a collective timed alone after a barrier (also recorded, "isolated") does not show, and
    the longer the ranks compute in between, the longer it waits (on the reference machine ~25% more after 5 ms
    than after 1.5 ms; a preset fitted at 1.5 ms planned per-layer all_reduces that measured 1.19x DDP).
    The link is the non-negative least-squares fit of the cost model's own formula (autopar/cost/comm.py:
    time = launch + ring_steps * alpha + bytes_sent / bw) over the busy runs, relative error, one fit over all
    kinds and one per kind (gloo runs each kind its own way). Two group sizes separate the fixed cost of a call
    (`launch`) from the cost per ring step: gloo's small collectives cost about one launch each, so a chain of
    two pair all_reduces costs more than one all_reduce over the 4 ranks, which a per-step term alone gets backwards.

    python benchmarks/cpu_calibrate.py --refit FILE [FILE ...]   # the fits again from recorded timings (pooled)
The JSON is a ClusterSpec (`autopar.plan(..., cluster=PATH)`); its "calibration" key holds the raw timings. The
shipped `cpu-gloo` preset (autopar/cost/cluster.py) carries the figures of four runs of this script on the
reference 2-core machine, pooled by --refit (results/cpu_gloo_calibrated.json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
SIZES = [1 << k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB
TINY = [16, 256]  # a loss's (sum, count), a norm's statistics
WORK_MS = 5.0  # compute between two collectives (a block of a small model)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
STEP_MODELS = (("llama3-debug", 64), ("moe-debug", 32), ("mlp-heavy", 64))  # (model, seq), at batch 1 and 4


def _median_time(fn, reps):
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def _busy_time(op, work, reps, k=8):
    """Seconds one collective adds to a program that computes between collectives: k rounds of (work, op) minus k
    rounds of work alone, median over reps; each rank's view, the caller takes the max over ranks."""
    both, alone = [], []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(k):
            work()
            op()
        both.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(k):
            work()
        alone.append(time.perf_counter() - t)
    return max(statistics.median(both) - statistics.median(alone), 0.0) / k


def _groups(world):
    """(group size, this rank's groups) of each layout timed: the world ([None]); then, for an even world, the
    pairs of a (world // 2) x 2 mesh, this rank's pair along dim 1 and its pair along dim 0, every pair running at
    once, the two in turn: a 2-D plan's collectives alternate mesh dims, and a collective that follows one on the
    other dim waits for peers that were just busy elsewhere (on the reference machine a pair repeating on one dim
    takes ~2 ms for 16 B, the alternation ~3 ms each). A row's time is per collective."""
    out = [(world, [None])]
    if world >= 4 and world % 2 == 0:
        rank, mine = dist.get_rank(), []
        for pairs in ([[r, r + 1] for r in range(0, world, 2)], [[r, r + world // 2] for r in range(world // 2)]):
            for p in pairs:  # every rank creates every group, in the same order
                pg = dist.new_group(p)
                if rank in p:
                    mine.append(pg)
        out.append((2, mine))
    return out


def _worker(rank, world, port, out, quick, work_ms=WORK_MS):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    reps = 3 if quick else 7
    res = {"matmul": [], "copy": [], "coll": [], "op_overhead": []}
    small = torch.randn(256)
    ts = _median_time(lambda: [small.mul(1.5).add_(1.0).view(16, 16).t().sum(0) for _ in range(200)], reps)
    res["op_overhead"].append(statistics.median(ts) / (200 * 5))  # 5 ops per iteration
    for m, k, n in ((1024, 256, 768), (1024, 768, 256), (512, 512, 512)):  # tokens x dim x ffn shapes
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        ts = _median_time(lambda: [a @ b for _ in range(4)], reps)
        res["matmul"].append(2 * m * k * n * 4 / statistics.median(ts))
    src = torch.randn(1 << 23)  # 32 MiB
    dst = torch.empty_like(src)
    ts = _median_time(lambda: dst.copy_(src), reps)
    res["copy"].append(2 * src.numel() * 4 / statistics.median(ts))
    wa, wb = torch.randn(256, 256), torch.randn(256, 256)
    one = torch.tensor([statistics.median(_median_time(lambda: wa @ wb, 3 * reps))])
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    rounds = max(1, round(work_ms / 1e3 / float(one)))

    def work():  # ~work_ms of matmul on one rank while its peers run too
        for _ in range(rounds):
            wa @ wb

    for g, groups in _groups(world):
        for nbytes in (TINY + SIZES)[: 6 if quick else None]:
            full = torch.randn(nbytes // 4)
            shard = torch.randn(nbytes // 4 // g)
            call = {
                "all_reduce": lambda pg: dist.all_reduce(full, group=pg),
                "all_gather": lambda pg: dist.all_gather_into_tensor(full, shard, group=pg),
                "reduce_scatter": lambda pg: dist.reduce_scatter_tensor(shard, full, group=pg),
                "all_to_all": lambda pg: dist.all_to_all_single(torch.empty_like(full), full, group=pg),
            }
            ops = {k: (lambda f=f: [f(pg) for pg in groups]) for k, f in call.items()}
            for kind in KINDS:
                row = {"kind": kind, "bytes": nbytes, "group": g}
                try:
                    ops[kind]()
                except RuntimeError as e:  # gloo builds without reduce_scatter_tensor: recorded, not fitted
                    res["coll"].append({**row, "error": str(e).splitlines()[0]})
                    continue
                ts = _median_time(ops[kind], reps)
                busy = _busy_time(ops[kind], work, reps)
                t = torch.tensor([statistics.median(ts), busy]) / len(groups)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res["coll"].append({**row, "seconds": float(t[1]), "isolated_s": float(t[0])})
    res["steps"] = [] if quick else _time_steps(reps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def _time_steps(reps):
    """Seconds of one eager forward + backward of each STEP_MODELS model at batch 1 and 4, every rank at once (the
    max over ranks of each rank's median)."""
    from autopar import models

    out = []
    for name, seq in STEP_MODELS:
        for batch in (1, 4):
            model = models.build_model(name, device="cpu", seed=0)
            x = models.example_inputs(name, batch=batch, seq=seq, device="cpu", seed=0)
            for _ in range(2):
                model(*x).backward()
            t = torch.tensor([statistics.median(_median_time(lambda: model(*x).backward(), reps + 1))])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append({"model": name, "batch": batch, "seq": seq, "seconds": float(t)})
    return out


def step_fit(steps, dev):
    """The device whose roofline matches measured eager steps: each step's captured graph (mesh (1,)) split into op
    count, memory-bound and FLOP-bound seconds at `dev`'s raw rates (views cost no traffic: autopar.cost.is_view),
    and time = ops * op_overhead + mem + flop / s_flop fitted by non-negative least squares (relative error), the
    copy bandwidth kept (op count and a small op's traffic are too alike to tell apart). The raw matmul rate comes
    from large matmuls; a training step's reach less of it, and each op's fixed cost counts about twice with two
    ranks per core. (device, median relative error); `dev` and None without steps."""
    if not steps:
        return dev, None
    from scipy.optimize import nnls
    import autopar
    from autopar import models
    from autopar.cost import is_view
    from autopar.cost.cluster import ClusterSpec, DeviceSpec, LinkSpec
    from autopar.cost import global_flops

    raw = ClusterSpec("raw", dev, 1, LinkSpec("l", 1e-6, 1e9), LinkSpec("l", 1e-6, 1e9))
    rows, y = [], []
    for st in steps:
        x = models.example_inputs(st["model"], batch=st["batch"], seq=st["seq"], device="meta")
        _, state = autopar.plan(models.build_model(st["model"], device="meta"), (1,), x, cluster=raw, return_state=True)
        g, fc, row = state.graph, {}, [0.0, 0.0, 0.0]
        for n in g.nodes:
            if n.kind != "op":
                continue
            row[0] += 1
            if is_view(n.target):
                continue
            dtype = next((o.dtype for o in n.outs if o is not None and o.dtype.is_floating_point), torch.float32)
            tf = global_flops(g, n, fc) / dev.flops_for(dtype)
            nbytes = sum(o.nbytes for o in n.outs if o is not None) + sum(g.meta(r).nbytes for r in n.inputs())
            tm = nbytes / dev.mem_bw
            row[1 if tm > tf else 2] += max(tm, tf)
        rows.append(row)
        y.append(st["seconds"])
    A, y = np.array(rows), np.array(y)
    (c, s_flop), _ = nnls(A[:, [0, 2]] / y[:, None], 1 - A[:, 1] / y)
    err = float(np.median(np.abs((A[:, 0] * c + A[:, 1] + A[:, 2] * s_flop) / y - 1)))
    f = dev.flops_for(torch.float32) / max(s_flop, 1e-9)
    return DeviceSpec(
        "cpu",
        {"fp32": f, "bf16": f, "fp16": f},
        mem_bw=dev.mem_bw,
        mem_bytes=dev.mem_bytes,
        matmul_eff=1.0,
        mem_eff=1.0,
        op_overhead=float(c),
    ), err


def fit(coll, world, kind=None):
    """Non-negative least squares of time = launch + steps * alpha + sent / bw (autopar/cost/comm.py) over the
    measured collectives of one `kind` or of all, each over its own group (`world` where a record has none);
    relative error, so small and large messages weigh alike. (launch, alpha, bw, median relative error)."""
    from scipy.optimize import nnls
    from autopar.cost.comm import bytes_sent, ring_steps

    rows = [c for c in coll if "seconds" in c and kind in (None, c["kind"])]
    n = [c.get("group", world) for c in rows]
    A = np.array([[1.0, ring_steps(c["kind"], k), bytes_sent(c["kind"], c["bytes"], k)] for c, k in zip(rows, n)])
    y = np.array([c["seconds"] for c in rows])
    w = 1.0 / y
    x, _ = nnls(A * w[:, None], y * w)
    x[2] = max(x[2], 1e-12)
    return float(x[0]), float(x[1]), float(1.0 / x[2]), float(np.median(np.abs(A @ x - y) / y))


def link_fit(coll, world):
    """The link of the measured collectives: one fit over all kinds, and one per kind measured (LinkSpec.kinds);
    with the pooled fit's and the per-kind fits' median relative errors."""
    from autopar.cost import collective_time
    from autopar.cost.cluster import LinkSpec

    launch, alpha, bw, err = fit(coll, world)
    kinds = []
    for kind in dict.fromkeys(c["kind"] for c in coll if "seconds" in c):
        c0, a, b, _ = fit(coll, world, kind)
        kinds.append((kind, a, b, c0))
    link = LinkSpec("gloo-loopback", alpha=alpha, bw=bw, kinds=tuple(kinds), launch=launch)
    err_kinds = float(
        np.median(
            [
                abs(collective_time(c["kind"], c["bytes"], c.get("group", world), link) / c["seconds"] - 1)
                for c in coll
                if "seconds" in c
            ]
        )
    )
    return link, err, err_kinds


def refit(paths, out):
    """The link fits again from the timings recorded in one or more calibration JSONs (no measurement): several
    runs of the same machine pooled, each collective and size a row per run, weigh alike; the device's figures
    are the median over the runs of each run's (`_device`), the world the first file's."""
    from autopar.cost.cluster import ClusterSpec

    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    cal = runs[0]["calibration"]
    coll = [c for d in runs for c in d["calibration"]["collectives"]]
    link, err, err_kinds = link_fit(coll, cal["world"])
    spec = ClusterSpec.from_json(runs[0])
    dev = spec.device
    steps = [st for d in runs for st in d["calibration"].get("steps", [])]
    if all("matmul_flops_per_rank" in d["calibration"] for d in runs):
        dev = _device(
            [max(d["calibration"]["matmul_flops_per_rank"]) for d in runs],
            [max(d["calibration"]["copy_bytes_per_s_per_rank"]) for d in runs],
            [min(d["calibration"]["op_overhead_s"]) for d in runs],
        )
    dev, step_err = step_fit(steps, dev)
    spec = ClusterSpec(spec.name, dev, spec.gpus_per_node, link, link)
    new = spec.to_json()
    new["calibration"] = {
        **cal,
        "runs": len(runs),
        "collectives": coll,
        "steps": steps,
        "step_fit_median_rel_error": step_err,
        "fit_median_rel_error": err,
        "fit_per_kind_median_rel_error": err_kinds,
        "refit_command": "python benchmarks/cpu_calibrate.py " + " ".join(sys.argv[1:]),
    }
    with open(out, "w") as f:
        json.dump(new, f, indent=1)
    _report(link, err, err_kinds, out)


def _device(flops, copy, overhead):
    """The CPU DeviceSpec of one or more runs' figures (the median of each): matmul FLOP/s and copy bytes/s per
    rank, the fixed time of one eager op."""
    from autopar.cost.cluster import CLUSTERS, DeviceSpec

    f = statistics.median(flops)
    return DeviceSpec(
        "cpu",
        {"fp32": f, "bf16": f, "fp16": f},
        mem_bw=statistics.median(copy),
        mem_bytes=CLUSTERS["cpu-gloo"].device.mem_bytes,
        matmul_eff=1.0,
        mem_eff=1.0,
        op_overhead=statistics.median(overhead),
    )


def _report(link, err, err_kinds, out):
    print(
        f"launch {link.launch * 1e6:.0f} us, alpha {link.alpha * 1e6:.0f} us, bw {link.bw / 1e9:.3f} GB/s "
        f"(median fit error {err:.0%}); per kind (median error {err_kinds:.0%}): "
        + ", ".join(f"{k} {c * 1e6:.0f} + {a * 1e6:.0f}/step us {b / 1e9:.3f} GB/s" for k, a, b, c in link.kinds)
        + f" -> {out}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_gloo_calibrated.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work-ms", type=float, default=WORK_MS, help="compute between two timed collectives")
    ap.add_argument(
        "--refit",
        metavar="FILE",
        nargs="+",
        help="fit the link again from the timings recorded in FILE(s), pooled (no run)",
    )
    args = ap.parse_args()
    if args.refit:
        return refit(args.refit, args.out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = args.out + ".raw"
    mp.start_processes(
        _worker, args=(args.world, port, raw, args.quick, args.work_ms), nprocs=args.world, start_method="spawn"
    )
    with open(raw) as f:
        res = json.load(f)
    os.remove(raw)
    from autopar.cost.cluster import CLUSTERS, ClusterSpec

    link, err, err_kinds = link_fit(res["coll"], args.world)
    dev, step_err = step_fit(res["steps"], _device([max(res["matmul"])], [max(res["copy"])], [min(res["op_overhead"])]))
    flops, mem_bw, overhead = dev.flops_for(torch.float32), dev.mem_bw, dev.op_overhead
    spec = ClusterSpec("cpu-gloo-calibrated", dev, CLUSTERS["cpu-gloo"].gpus_per_node, link, link)
    d = spec.to_json()
    d["calibration"] = {
        "command": "python benchmarks/cpu_calibrate.py " + " ".join(sys.argv[1:]),
        "world": args.world,
        "cores": os.cpu_count(),
        "matmul_flops_per_rank": res["matmul"],
        "copy_bytes_per_s_per_rank": res["copy"],
        "op_overhead_s": res["op_overhead"],
        "collectives": res["coll"],
        "steps": res["steps"],
        "step_fit_median_rel_error": step_err,
        "fit_median_rel_error": err,
        "fit_per_kind_median_rel_error": err_kinds,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(d, f, indent=1)
    print(
        f"device (fitted to the eager steps, median error {step_err}): {flops / 1e9:.2f} GFLOP/s per rank, "
        f"{mem_bw / 1e9:.2f} GB/s per rank, op overhead {overhead * 1e6:.1f} us"
    )
    _report(link, err, err_kinds, args.out)
    for c in res["coll"]:
        if "seconds" in c:
            print(f"  {c['kind']:>15} {c['bytes']:>9} B  {c['seconds'] * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
