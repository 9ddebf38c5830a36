"""Shapes that change and gradient accumulation on the graph backend: what they cost, on gloo ranks (CPU).

    python benchmarks/training_shapes.py              # writes benchmarks/results/training_shapes.md

One training loop on `--world` ranks (1-D mesh "dp"), the model FSDP-like (every parameter Shard(0) on dp where it
divides, `fsdp_force`) with the batch sharded on dp (`batch_pin`), cost model cpu-gloo:
  - the first step of a new input shape (another batch size, another sequence length, eval at another batch size
    under no_grad) plans again (backends/spmd/shapes.py): its time against a step of a cached shape;
  - gradient accumulation: `--micro` micro-steps, all but the last under `pm.no_sync()`: the collectives of each
    micro-step (CollectiveCounter, kind and bytes), against the same micro-batches each reduced (no accumulation), and
    the bytes of unreduced gradients a rank holds in between (unsharded, as FSDP2 without gradient sync).
Times are medians over `--steps` steps, barrier to barrier on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

from ranks import run_ranks  # benchmarks/ranks.py (the script's folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))


def _timed(fn):
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def _run(args, world):
    import autopar
    from autopar.backends.counter import CollectiveCounter
    from torchtitan_plan import batch_pin
    from autopar.testing import fsdp_force
    from autopar.models import build_model, example_inputs
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build_model(args.model, device="cpu", seed=0)
    batch = lambda b, s, seed=0: example_inputs(args.model, batch=b, seq=s, seed=seed)
    b0, s0 = args.batch, args.seq
    t_first, pm = _timed(
        lambda: autopar.parallelize(
            model, mesh, batch(b0, s0), cluster="cpu-gloo", force=fsdp_force(model, (world,)), pin=batch_pin([0])
        )
    )
    opt = torch.optim.SGD(pm.parameters(), lr=0.01)
    res = {
        "model": args.model,
        "world": world,
        "parallelize_s": t_first,
        "sharded": sum(any(p != "R" for p in v) for v in pm.plan.params.values()),
        "params": len(pm.plan.params),
        "shapes": [],
    }

    def train(x):
        loss = pm(*x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def steady(fn):
        return statistics.median(_timed(fn)[0] for _ in range(args.steps))

    _timed(lambda: train(batch(b0, s0)))  # warm-up (first step checks replicas)
    base = steady(lambda: train(batch(b0, s0, 1)))
    res["shapes"].append(
        {
            "what": f"train {b0}x{s0} (the example's shape)",
            "first_s": None,
            "plan_s": None,
            "replan_s": None,
            "steady_s": base,
        }
    )
    for what, b, s, mode in (
        (f"train {b0 // 2}x{s0} (smaller batch)", b0 // 2, s0, "train"),
        (f"train {b0}x{s0 // 2} (shorter sequence)", b0, s0 // 2, "train"),
        (f"eval {b0 + 2}x{s0} under no_grad (forward-only plan)", b0 + 2, s0, "eval"),
    ):
        n0 = len(pm.plan_cache.replans)
        if mode == "eval":
            pm.eval()
            run = lambda seed=2: _no_grad(pm, batch(b, s, seed))
        else:
            run = lambda seed=2: train(batch(b, s, seed))
        first, _ = _timed(run)
        st = steady(lambda: run(3))
        with CollectiveCounter(mesh) as cc:
            run(4)
        rp = pm.plan_cache.replans[n0:]
        res["shapes"].append(
            {
                "what": what,
                "first_s": first,
                "plan_s": sum(r["plan_s"] for r in rp),
                "replan_s": sum(r["total_s"] for r in rp),
                "steady_s": st,
                "collectives": len(cc.collectives()),
            }
        )
        pm.train()
    with CollectiveCounter(mesh) as cc:
        train(batch(b0, s0, 5))
    res["shapes"][0]["collectives"] = len(cc.collectives())
    res["programs"] = len(pm.programs)

    micro = [batch(b0, s0, 10 + k) for k in range(args.micro)]
    res["fsdp"] = _accumulate(pm, micro, mesh)
    # DDP-like: every parameter replicated, every activation batch-sharded: the gradients are all_reduced.
    # batch_pin finds activations by their leading size (batch or batch*seq): a seq whose batch*seq is no weight's
    # size (gpt2-tiny: 64, 192, 256)
    s1 = args.ddp_seq
    ddp = autopar.parallelize(
        model,
        mesh,
        batch(b0, s1),
        cluster="cpu-gloo",
        force={k: ("R",) for k, _ in model.named_parameters()},
        pin=batch_pin([0], (b0, s1)),
    )
    res["ddp"] = _accumulate(ddp, [batch(b0, s1, 10 + k) for k in range(args.micro)], mesh)
    res["ddp"]["shape"] = [b0, s1]
    return res


def _accumulate(pm, micro, mesh, rounds: int = 2) -> dict:
    """Micro-steps under no_sync, the last outside; against each micro-batch reduced; the last of `rounds` (the
    first pays one-time costs)."""
    from autopar.backends.counter import CollectiveCounter

    for _ in range(rounds):
        pm.zero_grad(set_to_none=True)
        res = _accumulate_once(pm, micro, mesh, CollectiveCounter)
    pm.zero_grad(set_to_none=True)
    return res


def _accumulate_once(pm, micro, mesh, CollectiveCounter) -> dict:
    acc = []
    for k, x in enumerate(micro):
        sync = k == len(micro) - 1
        with CollectiveCounter(mesh) as cc:
            if sync:
                t, _ = _timed(lambda: pm(*x).backward())
            else:
                with pm.no_sync():
                    t, _ = _timed(lambda: pm(*x).backward())
        acc.append(
            {
                "micro": k + 1,
                "sync": sync,
                "s": t,
                "collectives": _kinds(cc.collectives()),
                "n": len(cc.collectives()),
                "held_bytes": pm.accumulated_bytes(),
            }
        )
    grads = {n: p.grad.full_tensor().clone() for n, p in pm.named_parameters()}
    pm.zero_grad(set_to_none=True)
    each = []
    for k, x in enumerate(micro):
        with CollectiveCounter(mesh) as cc:
            t, _ = _timed(lambda: pm(*x).backward())
        each.append({"micro": k + 1, "s": t, "collectives": _kinds(cc.collectives()), "n": len(cc.collectives())})
    diff = max(
        ((p.grad.full_tensor() - grads[n]).abs().max() / (1e-6 + 1e-4 * grads[n].abs().max())).item()
        for n, p in pm.named_parameters()
    )
    sharded_grad = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    return dict(acc=acc, each=each, acc_vs_each=diff, sharded_grad_bytes=sharded_grad)


def _no_grad(pm, x):
    with torch.no_grad():
        return pm(*x)


def _kinds(records) -> str:
    c = Counter((k, b) for k, _, b in records)
    return ", ".join(f"{n}x {k} {b:,d} B" for (k, b), n in sorted(c.items())) or "none"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per shape (median)")
    ap.add_argument("--micro", type=int, default=4, help="accumulation micro-steps")
    ap.add_argument("--ddp-seq", type=int, default=20, help="sequence length of the DDP-like accumulation run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "training_shapes.md"))
    args = ap.parse_args(argv)
    cmd = "python benchmarks/training_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    r = run_ranks(_run, args.world, args)
    ms = lambda s: "-" if s is None else f"{1e3 * s:.1f}"
    b0 = args.batch
    md = [
        f"## Shapes that change, gradient accumulation ({r['model']}, {r['world']} gloo ranks, CPU)",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"Machine: {os.cpu_count()} CPU cores shared by the ranks, torch {torch.__version__}. The plan shards "
        f"{r['sharded']} of {r['params']} parameters on dp; parallelize (first plan) took "
        f"{r['parallelize_s']:.2f} s.",
        "",
        "### First step of a new shape",
        "",
        "| call | first step (ms) | of which: planning (ms) | + agreeing, building the program (ms) | cached step "
        "(ms) | first / cached | collectives per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in r["shapes"]:
        ratio = f"{s['first_s'] / s['steady_s']:.0f}x" if s["first_s"] else "-"
        extra = None if s["plan_s"] is None else s["replan_s"] - s["plan_s"]
        md.append(
            f"| {s['what']} | {ms(s['first_s'])} | {ms(s['plan_s'])} | {ms(extra)} | {ms(s['steady_s'])} | "
            f"{ratio} | "
            f"{s.get('collectives', '-')} |"
        )
    md += [
        "",
        f"{r['programs']} programs cached at the end; every later call of a shape seen before runs its "
        "cached program (no planning, no agreement collective). A first step of a new shape is: the ranks "
        "agreeing on it (one all_gather_object), planning, agreeing on the plan hash (one all_reduce), building "
        "the program, then the step.",
        "",
    ]
    for name, what in (
        ("fsdp", f"FSDP-like plan (parameters Shard(0) on dp), batch {b0}x{args.seq}"),
        ("ddp", f"DDP-like plan (parameters replicated, activations batch-sharded), batch {b0}x{args.ddp_seq}"),
    ):
        md += _acc_md(r[name], what, ms)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


def _acc_md(r, what, ms) -> list:
    md = [
        f"### Gradient accumulation, {what}: {len(r['acc'])} micro-steps, all but the last under `pm.no_sync()`",
        "",
        "| micro-step | sync | collectives | count | unreduced gradient bytes held after | time (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for a in r["acc"]:
        md.append(
            f"| {a['micro']} | {'yes' if a['sync'] else 'no_sync'} | {a['collectives']} | {a['n']} | "
            f"{a['held_bytes']:,d} | {ms(a['s'])} |"
        )
    md += [
        "",
        "The same micro-batches each reduced (no accumulation):",
        "",
        "| micro-step | collectives | count | time (ms) |",
        "|---|---|---|---|",
    ]
    for a in r["each"]:
        md.append(f"| {a['micro']} | {a['collectives']} | {a['n']} | {ms(a['s'])} |")
    tot_acc, tot_each = sum(a["n"] for a in r["acc"]), sum(a["n"] for a in r["each"])
    md += [
        "",
        f"Collectives over the {len(r['acc'])} micro-steps: {tot_acc} accumulating vs {tot_each} reducing "
        f"each. The accumulated gradient equals the sum of the reduced ones (largest |diff| / (1e-6 + 1e-4 "
        f"max|ref|) = {r['acc_vs_each']:.3g}). Memory: between micro-steps a rank holds its local gradients as "
        f"the backward makes them, before any reduction: {r['acc'][0]['held_bytes']:,d} B, against "
        f"{r['sharded_grad_bytes']:,d} B for gradients at the parameters' placements (a reduce-scattered "
        f"gradient is held unsharded; a weight gradient the plan computes sharded from gathered activations "
        f"stays sharded and needs no reduction).",
        "",
    ]
    return md


if __name__ == "__main__":
    main()
