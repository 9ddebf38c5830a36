"""Calibrate the `cpu-gloo` cost model on this machine: N gloo ranks on the CPU, as the tests and benchmarks run.

    python benchmarks/cpu_calibrate.py [--world 4]     # ~1 min; writes benchmarks/results/cpu_gloo_calibrated.json

All ranks run at once (OMP_NUM_THREADS=1 each, as bench_execute.py and harness.py run them), so every figure is
what one rank gets while its peers compete for the same cores:
  * matmul FLOP/s per rank (fp32, transformer-shaped matmuls, all ranks busy at once);
  * memory bandwidth per rank (a large copy, all ranks at once);
  * the fixed time of one small eager op (dispatch and launch: what a roofline misses on tiny ops);
  * collectives: all_reduce, all_gather, reduce_scatter and all_to_all over the world at sizes 4 KiB..16 MiB,
    each timed INSIDE a busy program: every rank alternates a ~2 ms matmul and the collective, and the cost of a
    collective is the time of that loop minus the time of the matmuls alone. That is what a collective costs in a
    training step on this machine: with more ranks than cores a collective waits until every peer has been
    scheduled again, which a collective timed alone after a barrier (also recorded, "isolated") does not show;
    alpha (seconds per ring step) and bw (bytes/s) are the least-squares fit of the cost model's own formula
    (autopar/cost/comm.py: time = ring_steps * alpha + bytes_sent / bw) over all kinds and sizes of the busy runs,
    and the link's `kinds` the same fit per collective kind (gloo's algorithms differ by kind: on the reference
    machine one fit for all kinds is off by a median 21%, one per kind by 6%).

    python benchmarks/cpu_calibrate.py --refit FILE    # the fits again from FILE's recorded timings, no run
The JSON is a ClusterSpec (`autopar.plan(..., cluster=PATH)`); its "calibration" key holds the raw timings. The
shipped `cpu-gloo` preset (autopar/cost/cluster.py) carries the figures of one run of this script on the
reference 2-core CI machine.
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
SIZES = [1 << k for k in range(12, 25, 2)]          # 4 KiB .. 16 MiB
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


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


def _worker(rank, world, port, out, quick):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    reps = 3 if quick else 7
    res = {"matmul": [], "copy": [], "coll": [], "op_overhead": []}
    small = torch.randn(256)
    ts = _median_time(lambda: [small.mul(1.5).add_(1.0).view(16, 16).t().sum(0) for _ in range(200)], reps)
    res["op_overhead"].append(statistics.median(ts) / (200 * 5))                 # 5 ops per iteration
    for m, k, n in ((1024, 256, 768), (1024, 768, 256), (512, 512, 512)):       # tokens x dim x ffn shapes
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        ts = _median_time(lambda: [a @ b for _ in range(4)], reps)
        res["matmul"].append(2 * m * k * n * 4 / statistics.median(ts))
    src = torch.randn(1 << 23)                                                   # 32 MiB
    dst = torch.empty_like(src)
    ts = _median_time(lambda: dst.copy_(src), reps)
    res["copy"].append(2 * src.numel() * 4 / statistics.median(ts))
    wa, wb = torch.randn(384, 384), torch.randn(384, 384)

    def work():                                 # ~2 ms of matmul on one rank while its peers run too
        for _ in range(4):
            wa @ wb
    for nbytes in SIZES[: 4 if quick else None]:
        full = torch.randn(nbytes // 4)
        shard = torch.randn(nbytes // 4 // world)
        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
               "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full)}
        for kind in KINDS:
            try:
                ops[kind]()
            except RuntimeError as e:      # gloo builds without reduce_scatter_tensor: recorded, not fitted
                res["coll"].append({"kind": kind, "bytes": nbytes, "error": str(e).splitlines()[0]})
                continue
            ts = _median_time(ops[kind], reps)
            busy = _busy_time(ops[kind], work, reps)
            t = torch.tensor([statistics.median(ts), busy])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res["coll"].append({"kind": kind, "bytes": nbytes, "seconds": float(t[1]), "isolated_s": float(t[0])})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def fit(coll, world, kind=None):
    """Least squares of time = steps * alpha + sent / bw over the measured collectives (alpha, bw >= 0), of one
    `kind` or of all."""
    from autopar.cost.comm import bytes_sent, ring_steps
    rows = [(ring_steps(c["kind"], world), bytes_sent(c["kind"], c["bytes"], world), c["seconds"])
            for c in coll if "seconds" in c and kind in (None, c["kind"])]
    A = np.array([[s, b] for s, b, _ in rows], float)
    y = np.array([t for _, _, t in rows])
    w = 1.0 / y                                        # relative error: small and large messages weigh alike
    (alpha, inv_bw), *_ = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)
    alpha, inv_bw = max(alpha, 1e-7), max(inv_bw, 1e-12)
    pred = A @ np.array([alpha, inv_bw])
    return float(alpha), float(1.0 / inv_bw), float(np.median(np.abs(pred - y) / y))


def link_fit(coll, world):
    """The link of the measured collectives: one fit over all kinds, and one per kind measured (LinkSpec.kinds);
    with the pooled fit's and the per-kind fits' median relative errors."""
    from autopar.cost import collective_time
    from autopar.cost.cluster import LinkSpec
    alpha, bw, err = fit(coll, world)
    kinds = tuple((kind, *fit(coll, world, kind)[:2]) for kind in dict.fromkeys(c["kind"] for c in coll
                                                                               if "seconds" in c))
    link = LinkSpec("gloo-loopback", alpha=alpha, bw=bw, kinds=kinds)
    err_kinds = float(np.median([abs(collective_time(c["kind"], c["bytes"], world, link) / c["seconds"] - 1)
                                 for c in coll if "seconds" in c]))
    return link, err, err_kinds


def refit(path, out):
    """The link fits again from the timings recorded in a calibration JSON (no measurement)."""
    from autopar.cost.cluster import ClusterSpec
    with open(path) as f:
        d = json.load(f)
    cal = d["calibration"]
    link, err, err_kinds = link_fit(cal["collectives"], cal["world"])
    spec = ClusterSpec.from_json(d)
    spec = ClusterSpec(spec.name, spec.device, spec.gpus_per_node, link, link)
    new = spec.to_json()
    new["calibration"] = {**cal, "fit_median_rel_error": err, "fit_per_kind_median_rel_error": err_kinds,
                          "refit_command": "python benchmarks/cpu_calibrate.py " + " ".join(sys.argv[1:])}
    with open(out, "w") as f:
        json.dump(new, f, indent=1)
    _report(link, err, err_kinds, out)


def _report(link, err, err_kinds, out):
    print(f"alpha {link.alpha * 1e6:.0f} us, bw {link.bw / 1e9:.3f} GB/s (median fit error {err:.0%}); per kind "
          f"(median error {err_kinds:.0%}): " + ", ".join(f"{k} {a * 1e6:.0f} us {b / 1e9:.3f} GB/s"
                                                         for k, a, b in link.kinds) + f" -> {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_gloo_calibrated.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--refit", metavar="FILE", help="fit the link again from FILE's recorded timings (no run)")
    args = ap.parse_args()
    if args.refit:
        return refit(args.refit, args.out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = args.out + ".raw"
    mp.start_processes(_worker, args=(args.world, port, raw, args.quick), nprocs=args.world, start_method="spawn")
    with open(raw) as f:
        res = json.load(f)
    os.remove(raw)
    from autopar.cost.cluster import CLUSTERS, ClusterSpec, DeviceSpec
    link, err, err_kinds = link_fit(res["coll"], args.world)
    flops, mem_bw = max(res["matmul"]), max(res["copy"])
    base = CLUSTERS["cpu-gloo"]
    overhead = min(res["op_overhead"])
    dev = DeviceSpec("cpu", {"fp32": flops, "bf16": flops, "fp16": flops}, mem_bw=mem_bw,
                     mem_bytes=base.device.mem_bytes, matmul_eff=1.0, mem_eff=1.0, op_overhead=overhead)
    spec = ClusterSpec("cpu-gloo-calibrated", dev, base.gpus_per_node, link, link)
    d = spec.to_json()
    d["calibration"] = {"command": "python benchmarks/cpu_calibrate.py " + " ".join(sys.argv[1:]),
                        "world": args.world, "cores": os.cpu_count(), "matmul_flops_per_rank": res["matmul"],
                        "copy_bytes_per_s_per_rank": res["copy"], "op_overhead_s": res["op_overhead"], "collectives": res["coll"],
                        "fit_median_rel_error": err, "fit_per_kind_median_rel_error": err_kinds}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(d, f, indent=1)
    print(f"matmul {flops / 1e9:.2f} GFLOP/s per rank, copy {mem_bw / 1e9:.2f} GB/s per rank, "
          f"op overhead {overhead * 1e6:.1f} us")
    _report(link, err, err_kinds, args.out)
    for c in res["coll"]:
        if "seconds" in c:
            print(f"  {c['kind']:>15} {c['bytes']:>9} B  {c['seconds'] * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
