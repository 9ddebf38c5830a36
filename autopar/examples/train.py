"""Train a model zoo model with autopar on a real process group, next to the same model on one device.

    torchrun --standalone --nproc-per-node 4 -m autopar.examples.train --model llama-tiny --mesh 2x2 --steps 20

Every rank builds the same model (same seed) and draws the same synthetic batches; `autopar.parallelize` plans
the model for the mesh and each rank runs its shard of every step. Rank 0 also trains a single-device copy and
prints both losses per step, then the largest parameter difference and whether the collectives of the first
step equal the plan's list. `--shard` picks what is planned: `auto` (the cost model alone; tiny models on CPU
stay replicated because a collective costs more than the compute it saves), `fsdp`, `tp` or `fsdp+tp` (the
parameters pinned FSDP-like on the first mesh dim and/or Megatron-like on the last; the planner places the rest).

Checkpoint and resume (autopar/examples/checkpoint.py, torch.distributed.checkpoint):

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 -m autopar.examples.train --steps 20 \
        --checkpoint-dir ckpt --checkpoint-every 5 --resume

writes the model, the optimizer, the step counter and the random generator states (the graph program's, torch's)
after every 5th step (and the last); `--resume` starts from the last complete checkpoint in the directory (from step 1 when there is
none), so a job that torchrun restarts after a failure continues where its last checkpoint left it. The batch of
step i is a function of i alone (the data position is the step counter), so the resumed steps compute the losses
of an uninterrupted run. Each step logs one line, `step i loss x ...`, steps counted from 1; a restarted attempt
logs again the steps after its checkpoint that the failed attempt had already logged (those lines are superseded).
The single-device reference replays the steps before the checkpoint, so it stays an uninterrupted run.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.examples import checkpoint


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 4 or 2x2 (product = world size)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument(
        "--data-batches",
        type=int,
        default=2,
        help="synthetic batches cycled through (a small pool the model can fit, so the loss falls)",
    )
    ap.add_argument("--shard", default="fsdp+tp", choices=["auto", "fsdp", "tp", "fsdp+tp"])
    ap.add_argument("--cluster", default=None, help="cost model cluster (default cpu-gloo on CPU, h100 on CUDA)")
    ap.add_argument("--memory-budget", type=float, default=None, help="bytes per rank")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--no-reference", action="store_true", help="skip the single-device model")
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (optimizer state to checkpoint)")
    ap.add_argument("--checkpoint-dir", default=None, help="write DCP checkpoints into this directory")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="a checkpoint after every K-th step (0: only after the last step)",
    )
    ap.add_argument("--resume", action="store_true", help="start from the last complete checkpoint, if any")
    ap.add_argument(
        "--kill-after-step",
        type=int,
        default=None,
        help="(for the restart test) after this step, on torchrun's first attempt only, one rank SIGKILLs itself",
    )
    ap.add_argument("--kill-rank", type=int, default=None, help="the rank --kill-after-step kills (default: the last)")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        ap.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 0 or args.kill_after_step is not None and args.kill_after_step < 1:
        ap.error("--checkpoint-every must be >= 0 and --kill-after-step >= 1")
    return args


def batch(args, step: int):
    """The global batch of step `step` (from 1): a function of the step alone, so resuming at step i needs no
    data loader state beyond i."""
    from autopar.models import example_inputs

    return example_inputs(args.model, batch=args.batch, seq=args.seq, seed=1000 + (step - 1) % args.data_batches)


def sgd_step(model, opt, x):
    loss = model(*x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def rng_state(pm) -> dict:
    """The random state a step draws from: the graph program's generator (the same on every rank) and torch's."""
    return {"program_rng": pm.program.rng().get_state(), "torch_rng": torch.get_rng_state()}


def resume(args, pm, opt, rank: int) -> int:
    """With --resume: load the last complete checkpoint (model, optimizer, step, random state); its step or 0."""
    if not args.resume:
        return 0
    extra = rng_state(pm)
    start = checkpoint.resume(args.checkpoint_dir, pm, opt, extra)
    if start:
        pm.program.rng().set_state(extra["program_rng"])
        torch.set_rng_state(extra["torch_rng"])
    if rank == 0:
        print(
            f"resumed from {checkpoint.path(args.checkpoint_dir, start)}: model, optimizer, step counter, random "
            f"state; continuing at step {start + 1}"
            if start
            else f"no complete checkpoint in {args.checkpoint_dir}: starting at step 1",
            flush=True,
        )
    return start


def kill_if_asked(args, step: int, rank: int, world: int) -> None:
    """The restart test's failure: after `step`, on the first attempt only (torchrun counts restarts in
    TORCHELASTIC_RESTART_COUNT), every rank meets once (so all have logged the step), then one rank SIGKILLs
    itself, as a crashed node would die: no exception, no cleanup."""
    if args.kill_after_step != step or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    dist.barrier()
    if rank == (world - 1 if args.kill_rank is None else args.kill_rank):
        print(f"rank {rank}: SIGKILL after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_ATTEMPT = re.compile(r"torchrun attempt (\d+)")
_RESUMED = re.compile(r"^resumed from \S+: .*continuing at step (\d+)")
_STEP = re.compile(r"^step (\d+) loss (\S+)")
_KILLED = re.compile(r"^rank (\d+): SIGKILL after step (\d+)")


def read_log(text: str) -> list[dict]:
    """The attempts in a torchrun job's output (rank 0's lines, every attempt, in order): per attempt its number,
    the step it started at, the (step, loss) lines it logged and the step after which a rank was killed."""
    attempts = []
    for line in text.splitlines():
        line = line.strip()
        if (m := _ATTEMPT.search(line)) and line.startswith("planned + parallelized"):
            attempts.append({"attempt": int(m.group(1)), "start": 1, "steps": [], "killed": None})
        elif not attempts:
            continue
        elif m := _RESUMED.match(line):
            attempts[-1]["start"] = int(m.group(1))
        elif m := _STEP.match(line):
            attempts[-1]["steps"].append((int(m.group(1)), float(m.group(2))))
        elif m := _KILLED.match(line):
            attempts[-1]["killed"] = int(m.group(2))
    return attempts


def committed(attempts: list[dict]) -> list[tuple[int, float, int]]:
    """The committed log: (step, loss, attempt) of every step whose result the job kept. An attempt's steps up to
    the checkpoint the next attempt resumed from are committed; its later ones were lost with it (the next
    attempt runs them again) and are superseded; the last attempt's steps are all committed. A job that lost
    no step and ran none twice commits steps 1..N once each."""
    out = []
    for i, a in enumerate(attempts):
        upto = attempts[i + 1]["start"] - 1 if i + 1 < len(attempts) else float("inf")
        out += [(s, loss, a["attempt"]) for s, loss in a["steps"] if s <= upto]
    return out


def init_process_group(backend: str, timeout: timedelta) -> None:
    """dist.init_process_group from torchrun's environment, with a key prefix per torchrun attempt: the agent
    keeps one TCP store for the job across restarts (TORCHELASTIC_USE_AGENT_STORE), and without a prefix of its
    own a restarted attempt reads the dead attempt's gloo addresses from it ("Gloo connectFullMesh failed ...
    Connection refused", torch 2.13)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"autopar/attempt_{attempt}/", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def _force(args, model, shape) -> dict:
    """The `force=` pins of --shard (autopar.testing's FSDP-like / Megatron-like helpers)."""
    from autopar.testing import fsdp_force, fsdp_tp_force, tp_force

    return {
        "auto": lambda: {},
        "fsdp": lambda: fsdp_force(model, shape),
        "tp": lambda: tp_force(model, shape),
        "fsdp+tp": lambda: fsdp_tp_force(model, shape) if len(shape) == 2 else fsdp_force(model, shape),
    }[args.shard]()


def _parallelize(args, dev: str, rank: int, world: int):
    """Plan and parallelize the model on this job's mesh; rank 0 prints the plan. (model, parallel model, mesh)."""
    import autopar
    from autopar.models import build_model, example_inputs
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(int(s) for s in args.mesh.split("x"))
    names = ("dp", "tp") if len(shape) == 2 else ("dp",) if len(shape) == 1 else None
    mesh = init_device_mesh(dev, shape, mesh_dim_names=names)
    model = build_model(args.model, device="cpu", seed=args.seed)
    ex = example_inputs(args.model, batch=args.batch, seq=args.seq, seed=args.seed)
    kw = {"force": _force(args, model, shape)}
    if args.cluster:
        kw["cluster"] = args.cluster
    if args.memory_budget:
        kw["memory_budget"] = args.memory_budget
    t = time.perf_counter()
    pm = autopar.parallelize(model, mesh, ex, **kw)
    plan_s = time.perf_counter() - t
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        print(
            f"\nplanned + parallelized in {plan_s:.2f} s on {world} ranks, mesh {shape}, device {dev}; "
            f"torchrun attempt {attempt}\n"
        )
    return model, pm, mesh


def _verdict(counter, pm, step: int) -> str:
    """The first step's measured collectives against the plan's list."""
    from autopar.backends.counter import compare

    diff = compare(counter.collectives(), pm.plan.collectives())
    if diff:
        return f"COLLECTIVES DIFFER: {diff}"
    return (
        f"collectives of step {step}: {len(counter.collectives())} measured == "
        f"{len(pm.plan.collectives())} predicted (kind, mesh dim, bytes)"
    )


def _train(args, pm, opt, ref, ref_opt, mesh, start: int, rank: int, world: int, dev: str):
    """Steps start+1..args.steps on the parallel model (and on rank 0 the reference), logging each step and
    checkpointing as asked; (largest |loss diff|, the first step's collective verdict)."""
    from autopar.backends.counter import CollectiveCounter

    worst, verdict = 0.0, ""
    for step in range(start + 1, args.steps + 1):
        x = batch(args, step)
        counter = CollectiveCounter(mesh) if step == start + 1 else None
        t = time.perf_counter()
        if counter is not None:
            with counter:
                loss = sgd_step(pm, opt, x)
        else:
            loss = sgd_step(pm, opt, x)
        ms = (time.perf_counter() - t) * 1e3
        if counter is not None:
            verdict = _verdict(counter, pm, step)
        if rank == 0:
            line = f"step {step} loss {loss.item()!r}"  # repr: the float exactly, to compare runs
            if ref is not None:
                rl = sgd_step(ref, ref_opt, [t.to(dev) for t in x])
                d = abs(loss.item() - rl.item())
                worst = max(worst, d)
                line += f" single-device {rl.item()!r} |diff| {d:.2e}"
            print(line + f" {ms:.1f} ms", flush=True)
        if args.checkpoint_dir and (step == args.steps or args.checkpoint_every and step % args.checkpoint_every == 0):
            where = checkpoint.save(args.checkpoint_dir, step, pm, opt, rng_state(pm))
            if rank == 0:
                print(f"checkpoint {where} (after step {step})", flush=True)
        kill_if_asked(args, step, rank, world)
    return worst, verdict


def main(argv=None) -> int:
    args = parse(argv)
    from autopar.testing import global_value

    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_process_group("nccl" if dev == "cuda" else "gloo", timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        dist.destroy_process_group()
        raise SystemExit(f"--kill-rank {args.kill_rank} is not a rank of this job (world size {world})")
    try:
        model, pm, mesh = _parallelize(args, dev, rank, world)
        ref = copy.deepcopy(model).to(dev) if rank == 0 and not args.no_reference else None
        opt = torch.optim.SGD(pm.parameters(), lr=args.lr, momentum=args.momentum)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr, momentum=args.momentum) if ref is not None else None
        start = resume(args, pm, opt, rank)
        if ref is not None:  # the reference replays the steps before the checkpoint: uninterrupted
            for step in range(1, start + 1):
                sgd_step(ref, ref_opt, [t.to(dev) for t in batch(args, step)])
        worst, verdict = _train(args, pm, opt, ref, ref_opt, mesh, start, rank, world, dev)
        full = {k: global_value(p) for k, p in pm.named_parameters()}  # collective: every rank takes part
        if rank == 0:
            print("\n" + verdict)
            if ref is not None:
                pd = max((full[k].cpu() - p.detach().cpu()).abs().max().item() for k, p in ref.named_parameters())
                print(
                    f"max |loss diff| over steps {start + 1}..{args.steps}: {worst:.3e}; max |param diff| after "
                    f"{args.steps} SGD steps: {pd:.3e}"
                )
        dist.barrier()
        return 0 if not verdict.startswith("COLLECTIVES DIFFER") else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
