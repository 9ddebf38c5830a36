"""Compiled training steps on the graph backend, 2 gloo ranks, a tiny transformer-like model with dropout 0.1 and
a Megatron MLP pinned on the 1-D mesh under tests/_clusters.py SHAPES (weights sharded, activations all-reduced).

One launch checks:
  - `parallelize(..., compile="aot_eager")`: each rank's local segments between the collectives run through
    torch.compile (backends/spmd/compiled.py); with the same seed as one device (`torch.manual_seed` there,
    `pm.program.manual_seed` here) the losses of 2 SGD steps, every gradient of the first and the parameters after
    equal one device's (|diff| <= 1e-6 + 1e-4 max|ref|) and the eager program's to 1e-5 relative; the collectives
    of a step (kind, mesh dim, bytes) are the eager program's and the plan's; dropout masks are drawn outside the
    compiled regions (random instructions are never in a segment).
  - `torch.compile(pm)` of the eager program runs (Dynamo treats the program as one opaque call) with one
    device's losses, gradients and parameters and the plan's collectives (the "eager" side of the comparison).
Both programs run one plan (planned once, `planned=`).
The test uses backend "aot_eager" (Dynamo + AOTAutograd, no C++ compile: Inductor on 2 CPU cores costs seconds a
segment); benchmarks/training_compile.py measures Inductor.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import launch

pytestmark = [pytest.mark.dist]
SEED = 1234


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Tiny(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())


def _steps(model, x, seed_fn, steps=2):
    """SGD steps: losses, the first step's gradients and the parameters after, as full tensors."""
    from autopar.testing import global_value

    seed_fn(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], None
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*x)
        loss.backward()
        losses.append(global_value(loss).item())
        if s == 0:
            grads = {_name(k): global_value(p.grad) for k, p in model.named_parameters()}
        opt.step()
    return losses, grads, {_name(k): global_value(p.detach()) for k, p in model.named_parameters()}


def _name(fqn: str) -> str:
    return fqn.removeprefix("_orig_mod.")  # torch.compile's wrapper module


def _worst(got, ref, rtol=1e-4, atol=1e-6):
    """max |a - b| / (atol + rtol max|b|) over losses, gradients and parameters (<= 1 passes), and where."""
    pairs = [(f"loss {s}", torch.tensor(a), torch.tensor(b)) for s, (a, b) in enumerate(zip(got[0], ref[0]))]
    pairs += [(f"grad {k}", got[1][k], ref[1][k]) for k in ref[1]] + [
        (f"param {k}", got[2][k], ref[2][k]) for k in ref[2]
    ]
    worst = max(
        (((a.double() - b.double()).abs().max() / (atol + rtol * b.double().abs().max())).item(), what)
        for what, a, b in pairs
    )
    return list(worst)


def job():
    sys.path.insert(0, os.path.dirname(__file__))
    from _clusters import SHAPES
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.backends.counter import CollectiveCounter, compare
    from autopar.backends.spmd.compiled import summary

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Tiny().train()
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
    force = {
        f"blocks.{i}.{k}": pl
        for i in range(2)
        for k, pl in (("up.weight", ("S0",)), ("up.bias", ("S0",)), ("down.weight", ("S1",)))
    }
    ref = _steps(copy.deepcopy(model), x, torch.manual_seed)
    planned = autopar.plan(model, mesh, x, cluster=SHAPES, force=force, overlap=False, return_state=True)
    out = {}
    # the eager program under torch.compile(pm) (one opaque call for Dynamo), and the compiled program
    eager = autopar.parallelize(copy.deepcopy(model), mesh, x, planned=planned)
    compiled = autopar.parallelize(copy.deepcopy(model), mesh, x, planned=planned, compile="aot_eager")
    for name, pm, call in (("eager", eager, torch.compile(eager)), ("compiled", compiled, compiled)):
        t0 = time.perf_counter()
        with CollectiveCounter(mesh) as cc:  # the first step: compiles, counted
            call(*x).backward()
        out[f"first step s {name}"] = time.perf_counter() - t0
        out[f"collectives {name}"] = sorted(map(list, cc.collectives()))
        out[f"collective_diff {name}"] = compare(cc.collectives(), pm.plan.collectives())
        pm.zero_grad(set_to_none=True)
        out[name] = got = _steps(call, x, pm.program.manual_seed)
        out[f"worst {name}"] = _worst(got, ref)
        out[f"sharded {name}"] = sorted(k for k, v in pm.plan.params.items() if any(p != "R" for p in v))
    prog = compiled.program
    out["segments"] = {"fw": summary(prog.fw_segments), "bw": summary(prog.bw_segments)}
    seg_ops = {id(it) for s in prog.fw_segments + prog.bw_segments for it in s.instrs}
    out["random in a segment"] = [it.name for it in prog.fw + prog.bw if it.mode == "random" and id(it) in seg_ops]
    out["random ops"] = sum(it.mode == "random" for it in prog.fw)
    out["worst compiled vs eager"] = _worst(out.pop("compiled"), out.pop("eager"), rtol=1e-5, atol=1e-7)
    try:
        autopar.parallelize(model, mesh, x, planned=planned, compile="inductr")
        out["bad backend"] = "no error"
    except ValueError as e:
        out["bad backend"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_compiled_program_equals_eager_and_one_device(tmp_path):
    res = launch(job, 2, [], tmp_path, timeout=240)
    print(res[0])
    for out in res:
        assert out["sharded compiled"] and out["sharded compiled"] == out["sharded eager"]
        assert out["collectives compiled"] and out["collective_diff compiled"] == "", out["collective_diff compiled"]
        assert out["collectives compiled"] == out["collectives eager"]
        assert any(k == "all_reduce" for k, _, _ in out["collectives compiled"])
        for name in ("eager", "compiled"):  # eager: torch.compile(pm) of the eager program
            assert out[f"worst {name}"][0] <= 1.0, (name, out[f"worst {name}"])
        assert out["worst compiled vs eager"][0] <= 1.0, out["worst compiled vs eager"]
        seg = out["segments"]
        assert seg["fw"]["compiled"] > 0 and seg["bw"]["compiled"] > 0, seg
        assert out["random ops"] == 2 and out["random in a segment"] == [], out
        assert "'inductr'" in out["bad backend"] and "inductor" in out["bad backend"], out["bad backend"]
