"""Step time of the autopar SPMD program vs the same placements applied by hand, on 4 gloo ranks (CPU).

    python benchmarks/bench_execute.py                      # writes benchmarks/results/execute.{md,csv}

Both sides train the same Llama-style model (same weights, same batches, SGD):
  - autopar: `autopar.parallelize(model, mesh, x, force=...)` with every parameter pinned to Megatron tensor
    parallel placements (w1/w3/wq/wk/wv column-wise, w2/wo row-wise, the rest replicated); the planner chooses the
    activations' placements and the executor runs the captured fw+bw graph with the plan's collectives.
  - by hand: torch's `parallelize_module` with ColwiseParallel / RowwiseParallel on the same projections (the
    rest replicated), eager autograd.
Reported: median step time (fw + bw + optimizer step) over the timed steps, measured on rank 0 between barriers,
each side alternating step by step so both see the same machine load; the losses of both sides are compared.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024, ffn_dim=768, max_seq_len=256)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hand_tp(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i in range(len(model.layers)):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def worker(rank, world, port, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        import copy
        import autopar
        from autopar.backends.verify import tp_force
        from autopar.models import build_model, example_inputs
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model = build_model("llama-tiny", device="cpu", seed=0, **CONFIG)
        batches = [example_inputs("llama-tiny", batch=args.batch, seq=args.seq, seed=s, **CONFIG)
                   for s in range(args.warmup + args.steps)]
        t = time.perf_counter()
        kw = {"cluster": args.cluster} if args.cluster else {}
        pm = autopar.parallelize(model, mesh, batches[0], force=tp_force(model, (world,)), **kw)
        plan_s = time.perf_counter() - t
        hand = hand_tp(copy.deepcopy(model), mesh)
        sides = {"autopar": (pm, torch.optim.SGD(pm.parameters(), lr=args.lr)),
                 "hand": (hand, torch.optim.SGD(hand.parameters(), lr=args.lr))}
        times = {k: [] for k in sides}
        losses = {k: [] for k in sides}
        for i, x in enumerate(batches):
            for k, (m, opt) in sides.items():
                dist.barrier()
                t = time.perf_counter()
                loss = m(*x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.barrier()
                if i >= args.warmup:
                    times[k].append(time.perf_counter() - t)
                losses[k].append(float(loss.detach()))
        if rank == 0:
            res = {"plan_s": plan_s, "times": times, "losses": losses,
                   "collectives": {k: v["count"] for k, v in pm.plan.predicted["collectives"].items()},
                   "params": {k: list(v) for k, v in pm.plan.params.items()}}
            with open(os.path.join(out, "res.json"), "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--cluster", default=None, help="cost model autopar plans with (default: cpu-gloo)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "execute"))
    args = ap.parse_args(argv)
    cmd = "python benchmarks/bench_execute.py " + " ".join(sys.argv[1:] if argv is None else argv)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, port, args, tmp), nprocs=args.world, start_method="spawn")
        with open(os.path.join(tmp, "res.json")) as f:
            res = json.load(f)
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    ratio = med["autopar"] / med["hand"]
    dloss = max(abs(a - b) for a, b in zip(res["losses"]["autopar"], res["losses"]["hand"]))
    rows = [("side", "median_step_s", "min_step_s", "max_step_s", "timed_steps")]
    for k in ("autopar", "hand"):
        v = res["times"][k]
        rows.append((k, f"{med[k]:.4f}", f"{min(v):.4f}", f"{max(v):.4f}", str(len(v))))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w") as f:
        f.write(f"# {cmd}\n")
        for r in rows:
            f.write(",".join(r) + "\n")
        f.write(f"ratio_autopar_over_hand,{ratio:.4f}\n")
    md = [f"# autopar SPMD program vs hand placements (DTensor parallelize_module), {args.world} gloo ranks, CPU",
          "", f"Command: `{cmd}`", "",
          f"Model: llama-tiny with {CONFIG}, batch {args.batch}, seq {args.seq}; SGD lr {args.lr}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per side, alternating, barrier-to-barrier on rank 0.",
          f"Placements: Megatron TP on a 1-D mesh of {args.world} (autopar: every parameter pinned with `force=`; "
          f"hand: ColwiseParallel/RowwiseParallel). Planned collectives per step: {res['collectives']}. "
          f"Planning + parallelize took {res['plan_s']:.1f} s.", "",
          "| side | median step (s) | min (s) | max (s) | timed steps |", "|---|---|---|---|---|"]
    for r in rows[1:]:
        md.append("| " + " | ".join(r) + " |")
    md += ["", f"**ratio autopar / hand = {ratio:.3f}** (bar <= 1.10, goal 1.05); max |loss difference| between "
               f"the two sides over all steps: {dloss:.2e}", "",
           "Per-step times (s): " + json.dumps({k: [round(t, 4) for t in v] for k, v in res["times"].items()})]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
