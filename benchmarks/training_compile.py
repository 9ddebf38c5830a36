"""Eager vs compiled graph backend (`autopar.parallelize(..., compile=True)`: Inductor on each rank's local segments
between the collectives, backends/spmd/compiled.py), 2 gloo ranks on CPU.

    python benchmarks/training_compile.py            # writes benchmarks/results/training_compile.md

Per model: both programs from the same plan and weights; the first step of each (the compiled one compiles then)
is timed on its own; then `--steps` training steps (SGD; step = zero_grad + forward + backward + optimizer step,
barrier to barrier on rank 0), eager and compiled alternating step by step so both see the same machine load; the
ratio is eager median / compiled median. Before timing, both run 3 steps from the same seed (dropout masks from
the program's generator): the losses and the first step's gradients are compared (max relative difference), and
the collectives of one step are counted on each (kind, mesh dim, bytes) and compared with each other and the plan.
  - mlp-dp / mlp-tp: 8 pre-norm residual MLP blocks at width 32, ~300 small ops a step (Python dispatch
    dominates), planned with tests/_clusters.py SHAPES: mlp-dp with the batch on the mesh (data parallel: the
    program is 2 long local segments and the gradient buckets), mlp-tp with the Megatron MLP pinned (column-wise
    up, row-wise down: collectives inside every block cut the program into short segments).
  - gpt2-defaults: transformers GPT2LMHeadModel with its default config except the size (dropout 0.1 on
    embeddings, attention and residuals), batch on the mesh (data parallel, gradient all_reduce buckets).
"""

from __future__ import annotations

import argparse
import copy
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
ROOT = os.path.dirname(HERE)
SEED = 1234


def _mlp_model(tp: bool):
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, vocab=128, d=32, layers=8):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, ids, labels):
            h = self.emb(ids)
            for b in self.blocks:
                h = b(h)
            return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
    if not tp:
        from torchtitan_plan import batch_pin

        return model, x, {}, dict(pin=batch_pin([0]))
    force = {
        f"blocks.{i}.{k}": pl
        for i in range(8)
        for k, pl in (("up.weight", ("S0",)), ("up.bias", ("S0",)), ("down.weight", ("S1",)))
    }
    return model, x, {}, dict(force=force)


def _gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    from torchtitan_plan import batch_pin

    logging.set_verbosity_error()
    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)).train()
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(3))
    return model, (), dict(input_ids=ids, labels=ids), dict(pin=batch_pin([0]))


MODELS = {"mlp-dp": lambda: _mlp_model(False), "mlp-tp": lambda: _mlp_model(True), "gpt2-defaults": _gpt2_model}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out


def _seeded(pm, x, kw, steps=3, call=None):
    """`steps` SGD steps from SEED (through `call`, default pm): the losses and the first step's gradients (names
    without torch.compile's `_orig_mod.`)."""
    from autopar.testing import global_value

    pm.program.manual_seed(SEED)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    losses, grads = [], None
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss((pm if call is None else call)(*x, **kw))
        loss.backward()
        losses.append(global_value(loss).item())
        if s == 0:
            grads = {k: global_value(p.grad) for k, p in pm.named_parameters()}  # pm's own names
        opt.step()
    return losses, grads


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _rank(rank, world, port, names, steps, warmup, backend, out_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    import autopar
    from autopar.backends.counter import CollectiveCounter, compare
    from autopar.backends.spmd.compiled import summary
    from torch.distributed.device_mesh import init_device_mesh
    from _clusters import SHAPES

    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for name in names:
        model, x, kw, plan_kw = MODELS[name]()
        t0 = time.perf_counter()
        planned = autopar.plan(
            model, mesh, x, example_kwargs=kw or None, cluster=SHAPES, overlap=False, return_state=True, **plan_kw
        )
        t_plan = time.perf_counter() - t0
        make = lambda **c: autopar.parallelize(
            copy.deepcopy(model), mesh, x, example_kwargs=kw or None, planned=planned, **c
        )
        eager, comp = make(), make(compile=backend)
        row = {
            "model": name,
            "plan_s": t_plan,
            "backend": backend,
            "sharded": sorted(k for k, v in eager.plan.params.items() if any(p != "R" for p in v)),
        }
        first = {}
        for side, pm in (("eager", eager), ("compiled", comp)):
            dist.barrier()
            t0 = time.perf_counter()
            with CollectiveCounter(mesh) as cc:
                _loss(pm(*x, **kw)).backward()
            dist.barrier()
            first[side] = time.perf_counter() - t0
            row[f"collectives {side}"] = sorted(map(tuple, cc.collectives()))
            row[f"plan diff {side}"] = compare(cc.collectives(), pm.plan.collectives())
            pm.zero_grad(set_to_none=True)
        row["first_step_s"] = first
        row["same collectives"] = row["collectives eager"] == row["collectives compiled"]
        row["n collectives"] = len(row["collectives compiled"])
        for side in ("eager", "compiled"):
            row.pop(f"collectives {side}")
        prog = comp.program
        row["segments"] = {"fw": summary(prog.fw_segments), "bw": summary(prog.bw_segments)}
        row["ops"] = len(prog.fw) + len(prog.bw)
        row["compile_s"] = row["segments"]["fw"]["compile_s"] + row["segments"]["bw"]["compile_s"]
        row["random ops"] = sum(it.mode == "random" for it in prog.fw)
        le, ge = _seeded(eager, x, kw)
        lc, gc = _seeded(comp, x, kw)
        # torch.compile of a third copy (Dynamo runs the program as one opaque call): the eager numbers
        t0 = time.perf_counter()
        third = make()
        lt, gt = _seeded(third, x, kw, call=torch.compile(third))
        row["torch.compile(pm)"] = {
            "s": time.perf_counter() - t0,
            "loss max rel": max(abs(a - b) / abs(b) for a, b in zip(lt, le)),
            "grad max rel": max(_rel(gt[k], ge[k]) for k in ge),
        }
        row["losses eager"], row["losses compiled"] = le, lc
        row["loss max rel"] = max(abs(a - b) / abs(b) for a, b in zip(lc, le))
        row["grad max rel"] = max(_rel(gc[k], ge[k]) for k in ge)
        times = {"eager": [], "compiled": []}
        opts = {s: torch.optim.SGD(pm.parameters(), lr=0.01) for s, pm in (("eager", eager), ("compiled", comp))}
        for i in range(warmup + steps):
            for side, pm in (("eager", eager), ("compiled", comp)):
                dist.barrier()
                t0 = time.perf_counter()
                opts[side].zero_grad(set_to_none=True)
                _loss(pm(*x, **kw)).backward()
                opts[side].step()
                dist.barrier()
                if i >= warmup:
                    times[side].append(time.perf_counter() - t0)
        row["step_ms"] = {s: 1e3 * statistics.median(v) for s, v in times.items()}
        row["step_ms_min"] = {s: 1e3 * min(v) for s, v in times.items()}
        row["ratio"] = row["step_ms"]["eager"] / row["step_ms"]["compiled"]
        rows.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _table(rows, cmd, world) -> str:
    lines = [
        f"# Eager vs compiled graph backend ({world} gloo ranks, CPU)",
        "",
        f"`{cmd}` (backends/spmd/compiled.py; one run, eager and compiled steps alternating; median of the timed "
        f"steps; compile s: the time the segments took to compile in the compiled program's first step, "
        f"with an empty Inductor cache; load average at the end: {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores).",
        "",
        "| model | ops/step | compiled ops (segments) fw / bw | eager ms/step | compiled ms/step | eager/compiled "
        "| compile s | collectives/step (same as eager, = plan) | loss, grad max rel diff | torch.compile(pm): "
        "loss, grad max rel diff from eager (s for 3 steps) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sg = r["segments"]
        seg = " / ".join(f"{sg[p]['compiled_ops']} ({sg[p]['compiled']})" for p in ("fw", "bw"))
        same = "yes" if r["same collectives"] and not r["plan diff compiled"] else "NO"
        tc = r["torch.compile(pm)"]
        lines.append(
            f"| {r['model']} | {r['ops']} | {seg} | {r['step_ms']['eager']:.1f} | "
            f"{r['step_ms']['compiled']:.1f} | **{r['ratio']:.2f}x** | {r['compile_s']:.1f} | "
            f"{r['n collectives']} ({same}) | {r['loss max rel']:.1e}, {r['grad max rel']:.1e} | "
            f"{tc['loss max rel']:.1e}, {tc['grad max rel']:.1e} ({tc['s']:.1f}) |"
        )
    lines += [
        "",
        "Details (JSON per model: sharded parameters, losses of 3 seeded steps on each side, dropout "
        "ops drawn outside the compiled segments; torch.compile(pm): 3 seeded steps through "
        "`torch.compile(pm)` of the eager program (Dynamo treats the step as one call), its time and its "
        "losses' max relative difference from the same steps without it):",
        "",
        "```",
    ]
    keys = (
        "model",
        "backend",
        "sharded",
        "losses eager",
        "losses compiled",
        "random ops",
        "step_ms_min",
        "plan_s",
        "first_step_s",
        "segments",
        "torch.compile(pm)",
    )
    lines += [json.dumps({k: r[k] for k in keys}) for r in rows]
    lines.append("```")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "training_compile.md"))
    a = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp()
    res = os.path.join(tmp, "rows.json")
    # a fresh Inductor cache: the compile time is a first run's (a warm cache hits most segments)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "inductor"))
    mp.spawn(_rank, args=(a.world, port, a.models, a.steps, a.warmup, a.backend, res), nprocs=a.world)
    rows = json.load(open(res))
    cmd = "python benchmarks/training_compile.py" + (
        "" if argv is None and len(sys.argv) == 1 else " " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    text = _table(rows, cmd, a.world)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
