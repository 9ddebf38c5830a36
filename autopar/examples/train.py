"""Train a model zoo model with autopar on a real process group, next to the same model on one device.

    torchrun --standalone --nproc-per-node 4 -m autopar.examples.train --model llama-tiny --mesh 2x2 --steps 20

Every rank builds the same model (same seed) and draws the same synthetic batches; `autopar.parallelize` plans
the model for the mesh and each rank runs its shard of every step. Rank 0 also trains a single-device copy and
prints both losses per step, then the largest parameter difference and whether the collectives of the first
step equal the plan's list. `--shard` picks what is planned: `auto` (the cost model alone; tiny models on CPU
stay replicated because a collective costs more than the compute it saves), `fsdp`, `tp` or `fsdp+tp` (the
parameters pinned FSDP-like on the first mesh dim and/or Megatron-like on the last; the planner places the rest).
"""
from __future__ import annotations

import argparse
import copy
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 4 or 2x2 (product = world size)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--data-batches", type=int, default=2,
                    help="synthetic batches cycled through (a small pool the model can fit, so the loss falls)")
    ap.add_argument("--shard", default="fsdp+tp", choices=["auto", "fsdp", "tp", "fsdp+tp"])
    ap.add_argument("--cluster", default=None, help="cost model cluster (default cpu-gloo on CPU, h100 on CUDA)")
    ap.add_argument("--memory-budget", type=float, default=None, help="bytes per rank")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--no-reference", action="store_true", help="skip the single-device model")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import autopar
    from autopar.backends.comm import CommCounter, compare
    from autopar.backends.verify import fsdp_force, fsdp_tp_force, global_value, tp_force
    from autopar.models import build_model, example_inputs
    from torch.distributed.device_mesh import init_device_mesh

    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        shape = tuple(int(s) for s in args.mesh.split("x"))
        names = ("dp", "tp") if len(shape) == 2 else ("dp",) if len(shape) == 1 else None
        mesh = init_device_mesh(dev, shape, mesh_dim_names=names)
        model = build_model(args.model, device="cpu", seed=args.seed)
        ex = example_inputs(args.model, batch=args.batch, seq=args.seq, seed=args.seed)
        force = {"auto": lambda: {}, "fsdp": lambda: fsdp_force(model, shape),
                 "tp": lambda: tp_force(model, shape),
                 "fsdp+tp": lambda: fsdp_tp_force(model, shape) if len(shape) == 2 else fsdp_force(model, shape)
                 }[args.shard]()
        kw = {"force": force}
        if args.cluster:
            kw["cluster"] = args.cluster
        if args.memory_budget:
            kw["memory_budget"] = args.memory_budget
        t = time.perf_counter()
        pm = autopar.parallelize(model, mesh, ex, **kw)
        plan_s = time.perf_counter() - t
        ref = None
        if rank == 0:
            print(pm.plan.summary(), flush=True)
            print(f"\nplanned + parallelized in {plan_s:.2f} s on {world} ranks, mesh {shape}, device {dev}\n")
            if not args.no_reference:
                ref = copy.deepcopy(model).to(dev)
        opt = torch.optim.SGD(pm.parameters(), lr=args.lr)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr) if ref is not None else None
        worst = 0.0
        verdict = ""
        if rank == 0:
            print(f"{'step':>4} {'autopar loss':>14} {'single-device':>14} {'|diff|':>10} {'step ms':>9}")
        for step in range(args.steps):
            x = example_inputs(args.model, batch=args.batch, seq=args.seq, seed=1000 + step % args.data_batches)
            counter = CommCounter(mesh) if step == 0 else None
            t = time.perf_counter()
            if counter is not None:
                with counter:
                    loss = pm(*x)
                    loss.backward()
            else:
                loss = pm(*x)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ms = (time.perf_counter() - t) * 1e3
            if counter is not None:
                diff = compare(counter.records, pm.plan.collectives())
                verdict = (f"collectives of step 0: {len(counter.records)} measured == {len(pm.plan.collectives())} "
                           f"predicted (kind, mesh dim, bytes)") if not diff else f"COLLECTIVES DIFFER: {diff}"
            if rank == 0:
                line = f"{step:>4} {loss.item():>14.6f}"
                if ref is not None:
                    rl = ref(*[t.to(dev) for t in x])
                    rl.backward()
                    ref_opt.step()
                    ref_opt.zero_grad(set_to_none=True)
                    d = abs(loss.item() - rl.item())
                    worst = max(worst, d)
                    line += f" {rl.item():>14.6f} {d:>10.2e}"
                print(line + f" {ms:>9.1f}", flush=True)
        full = {k: global_value(p) for k, p in pm.named_parameters()}   # collective: every rank takes part
        if rank == 0:
            print("\n" + verdict)
            if ref is not None:
                pd = max((full[k].cpu() - p.detach().cpu()).abs().max().item() for k, p in ref.named_parameters())
                print(f"max |loss diff| over {args.steps} steps: {worst:.3e}; max |param diff| after {args.steps} "
                      f"SGD steps: {pd:.3e}")
        dist.barrier()
        return 0 if not verdict.startswith("COLLECTIVES DIFFER") else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
