"""Step time of the autopar SPMD program vs the same placements applied by hand, on 4 gloo ranks (CPU).

    python benchmarks/bench_execute.py                      # writes benchmarks/results/execute.{md,csv}

Two configurations, each side training the same model (same weights, same batches, SGD), alternating step by
step so both see the same machine load; step = fw + bw + optimizer step, timed barrier to barrier on rank 0:
  - llama-tp: a Llama-style model with every parameter pinned (`force=`) to Megatron tensor-parallel placements
    (wq/wk/wv/w1/w3 column-wise, wo/w2 row-wise, the rest replicated) vs torch's `parallelize_module` with
    ColwiseParallel / RowwiseParallel on the same projections (eager autograd). autopar's planner chooses the
    activations' placements (and so its collectives) itself; parallelize_module uses Megatron's.
  - llama-tp-h100: the same, planned with the h100 cost model (the activations then follow Megatron-SP: the plan
    has the collectives of hand TP in reduce_scatter + all_gather form), to compare the executors on equal plans.
  - mlp-dtensor: an MLP model planned freely by autopar (cpu-gloo cost model) vs the plan's own parameter
    placements applied by hand: every parameter distributed as a DTensor with them and the unchanged model run
    eagerly (DTensor's own propagation places the activations and inserts its redistributes).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ranks import run_ranks  # benchmarks/ranks.py (the script's folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
_LLAMA = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024, ffn_dim=768, max_seq_len=256)
CONFIGS = {  # name: (model, overrides, batch, seq, cluster autopar plans with)
    "llama-tp": ("llama-tiny", _LLAMA, 8, 128, "cpu-gloo"),
    "llama-tp-h100": ("llama-tiny", _LLAMA, 8, 128, "h100"),
    "mlp-dtensor": ("mlp-heavy", dict(dim=256, hidden=1024, n_layers=2, vocab=512), 8, 128, "cpu-gloo"),
}


def hand_tp(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.layers)):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


class HandDTensor(torch.nn.Module):
    """Parameter placements applied by hand: each parameter distributed with them (DTensor), the unchanged model
    run eagerly under autograd on replicated inputs; DTensor's sharding propagation places the activations."""

    def __init__(self, model, mesh, placements):
        super().__init__()
        from torch.distributed.tensor import distribute_tensor

        self.model, self.mesh = model, mesh
        for fqn, p in list(model.named_parameters()):
            mod = model.get_submodule(fqn.rsplit(".", 1)[0]) if "." in fqn else model
            setattr(
                mod,
                fqn.rsplit(".", 1)[-1],
                torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements[fqn], src_data_rank=None)),
            )

    def forward(self, *inputs):
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

        rep = [Replicate()] * self.mesh.ndim
        loss = self.model(*[distribute_tensor(x, self.mesh, rep, src_data_rank=None) for x in inputs])
        return loss.redistribute(placements=rep).to_local() if isinstance(loss, DTensor) else loss


def _run(args, world):
    """One rank's measurements of every config (benchmarks/ranks.py runs it on each rank)."""
    import autopar
    from autopar.testing import tp_force
    from autopar.models import build_model, example_inputs
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = {}
    for cfg in args.configs:
        name, ov, batch, seq, cluster = CONFIGS[cfg]
        model = build_model(name, device="cpu", seed=0, **ov)
        batches = [example_inputs(name, batch=batch, seq=seq, seed=s, **ov) for s in range(args.warmup + args.steps)]
        tp = cfg.startswith("llama-tp")
        kw = {"force": tp_force(model, (world,))} if tp else {}
        kw["cluster"] = args.cluster or cluster
        t = time.perf_counter()
        pm = autopar.parallelize(model, mesh, batches[0], **kw)
        plan_s = time.perf_counter() - t
        hand = (
            hand_tp(copy.deepcopy(model), mesh)
            if tp
            else HandDTensor(copy.deepcopy(model), mesh, pm.plan.param_placements())
        )
        sides = {
            "autopar": (pm, torch.optim.SGD(pm.parameters(), lr=args.lr)),
            "hand": (hand, torch.optim.SGD(hand.parameters(), lr=args.lr)),
        }
        times = {k: [] for k in sides}
        losses = {k: [] for k in sides}
        for i, x in enumerate(batches):
            for k, (m, opt) in sides.items() if i % 2 == 0 else reversed(sides.items()):
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
        results[cfg] = {
            "plan_s": plan_s,
            "times": times,
            "losses": losses,
            "cluster": kw["cluster"],
            "collectives": {k: v["count"] for k, v in pm.plan.predicted["collectives"].items()},
        }
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=9, help="timed steps per side (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--cluster", default=None, help="cost model autopar plans with (default: per config)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "execute"))
    args = ap.parse_args(argv)
    cmd = "python benchmarks/bench_execute.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = run_ranks(_run, args.world, args)
    csv = [f"# {cmd.strip()}", "config,side,median_step_s,min_step_s,max_step_s,timed_steps,ratio_autopar_over_hand"]
    md = [
        f"# autopar SPMD program vs the same placements by hand, {args.world} gloo ranks, CPU",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"Machine: {os.cpu_count()} CPU cores shared by the {args.world} ranks (OMP_NUM_THREADS=1 each), "
        f"torch {torch.__version__}. {args.warmup} warm-up + {args.steps} timed steps per side.",
        "",
    ]
    for cfg, res in results.items():
        med = {k: statistics.median(v) for k, v in res["times"].items()}
        ratio = med["autopar"] / med["hand"]
        dloss = max(abs(a - b) for a, b in zip(res["losses"]["autopar"], res["losses"]["hand"]))
        name, ov, batch, seq, _ = CONFIGS[cfg]
        md += [
            f"## {cfg}: {name} {ov}, batch {batch}, seq {seq}",
            "",
            f"autopar's plan (cost model `{res['cluster']}`): collectives per step {res['collectives']}; planning "
            f"+ parallelize {res['plan_s']:.1f} s.",
            "",
            "| side | median step (s) | min (s) | max (s) | timed steps |",
            "|---|---|---|---|---|",
        ]
        for k in ("autopar", "hand"):
            v = res["times"][k]
            md.append(f"| {k} | {med[k]:.4f} | {min(v):.4f} | {max(v):.4f} | {len(v)} |")
            csv.append(f"{cfg},{k},{med[k]:.4f},{min(v):.4f},{max(v):.4f},{len(v)},{ratio:.4f}")
        md += [
            "",
            f"**ratio autopar / hand = {ratio:.3f}** (bar <= 1.10, goal 1.05). Max |loss difference| "
            f"between the sides over all steps: {dloss:.2e}.",
            "",
            "Per-step times (s): " + json.dumps({k: [round(t, 4) for t in v] for k, v in res["times"].items()}),
            "",
        ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w") as f:
        f.write("\n".join(csv) + "\n")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
