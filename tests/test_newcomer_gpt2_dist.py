"""The newcomer path (issue 23's must-show): a transformers GPT2LMHeadModel with its default config values except
its size (dropout 0.1 on embeddings, attention and residuals; use_cache on), in train() mode, goes through
`autopar.parallelize(model, mesh, example_kwargs=dict(input_ids=ids, labels=ids))` on 4 gloo ranks (2x2 mesh) and
trains 3 AdamW steps with no wrapper. Seeded like one device (`torch.manual_seed(s)` there,
`pm.program.manual_seed(s)` here), the program draws the dropout masks one device draws: each random op draws the
global tensor from the program's generator in the graph's order, which is eager's order (attention's dropout
inside F.scaled_dot_product_attention is recorded as its math decomposition's bernoulli, drawn at the same point).
So the losses of 3 steps, the first step's gradients and the parameters after 3 steps equal one device
(|diff| <= 1e-6 + 1e-4 max|ref|), with the default cpu-gloo cost model and with tests/_clusters.py SHAPES (on which
sharding pays: something sharded, collectives counted equal to the plan's). The same seed twice gives the same
losses to the bit. The README's quickstart is autopar/examples/hf_gpt2.py, run here with torchrun as written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import launch

pytestmark = [pytest.mark.dist]
pytest.importorskip("transformers")

SEED, STEPS = 1234, 3
ROOT = Path(__file__).resolve().parents[1]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(7)
    # the defaults except the size: resid/embd/attn_pdrop 0.1, use_cache True
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)).train()


def _train(model, batch, seed_fn, opt_params):
    """3 AdamW steps: the losses, the first step's gradients, the parameters after (full tensors)."""
    from autopar.testing import global_value

    seed_fn(SEED)
    # eps=1e-6: Adam's division by sqrt(v) + eps turns ~1e-9 float32 rounding differences of a near-zero gradient
    # entry into update differences lr * dg / eps (see tests/test_model_contract_dist.py)
    opt = torch.optim.AdamW(opt_params, lr=1e-3, eps=1e-6)
    losses, grads = [], None
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        losses.append(global_value(loss).item())
        if s == 0:
            grads = {k: global_value(p.grad) for k, p in model.named_parameters()}
        opt.step()
    return losses, grads, {k: global_value(p.detach()) for k, p in model.named_parameters()}


def _worst(got, ref) -> tuple[float, str]:
    """max |a - b| / (1e-6 + 1e-4 max|b|) over losses, gradients and parameters (<= 1 passes), and where."""
    worst, where = 0.0, ""
    pairs = [(f"loss {s}", torch.tensor(a), torch.tensor(b)) for s, (a, b) in enumerate(zip(got[0], ref[0]))]
    pairs += [(f"grad {k}", got[1][k], ref[1][k]) for k in ref[1]]
    pairs += [(f"param {k}", got[2][k], ref[2][k]) for k in ref[2]]
    for what, a, b in pairs:
        a, b = a.double(), b.double()
        w = ((a - b).abs().max() / (1e-6 + 1e-4 * b.abs().max())).item()
        if w > worst:
            worst, where = w, what
    return worst, where


def job_newcomer(_):
    sys.path.insert(0, os.path.dirname(__file__))
    from _clusters import SHAPES
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.backends.counter import CollectiveCounter, compare
    from _bench import batch_pin

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(3))
    batch = dict(input_ids=ids, labels=ids)
    ref_model = _gpt2()
    ref = _train(ref_model, batch, torch.manual_seed, ref_model.parameters())
    out = {"worst": {}, "kind": type(ref_model(**batch)).__name__}
    # on this tiny model even SHAPES keeps everything replicated: the shapes case pins the Megatron MLP on tp and
    # the batch on dp (as tests/test_model_contract_dist.py does), so sharded weights, batch-sharded masks and
    # their collectives run on the dropout path too
    force = {
        f"transformer.h.{i}.mlp.{k}.weight": pl
        for i in range(2)
        for k, pl in (("c_fc", ("R", "S1")), ("c_proj", ("R", "S0")))
    }
    for name, kw in (("cpu-gloo", {}), ("shapes", dict(cluster=SHAPES, force=force, pin=batch_pin([0])))):
        model = _gpt2()
        pm = autopar.parallelize(model, mesh, example_kwargs=batch, **kw)  # as a user writes it
        out[f"kind {name}"] = type(pm(**batch)).__name__
        with CollectiveCounter(mesh) as cc:  # one counted step (outside the seeded run: its draws are its own)
            pm(**batch).loss.backward()
        out[f"collectives {name}"] = len(cc.collectives())
        out[f"collective_diff {name}"] = compare(cc.collectives(), pm.plan.collectives())
        pm.zero_grad(set_to_none=True)
        got = _train(pm, batch, pm.program.manual_seed, pm.parameters())
        out["worst"][name] = _worst(got, ref)
        out[f"losses {name}"] = got[0]
        pl = pm.plan
        out[f"sharded {name}"] = [n for n, v in pl.params.items() if any(x != "R" for x in v)] + [
            f"input {i}" for i in pm.program.g.inputs if any(x != "R" for x in pm.program.P[i].out[0])
        ]
        out[f"masks {name}"] = [
            n["placement"]["out"][0]
            for n in pl.nodes
            if n["kind"] == "op" and n["name"].split(":")[-1].split(".")[0] in ("bernoulli", "native_dropout")
        ]
        if name == "shapes":  # the same seed again: the same losses, to the bit
            pm2 = autopar.parallelize(_gpt2(), mesh, example_kwargs=batch, **kw)
            out["again"] = _train(pm2, batch, pm2.program.manual_seed, pm2.parameters())[0]
    out["ref_losses"] = ref[0]
    return out


@pytest.mark.timeout(600)
def test_gpt2_defaults_dropout_equals_one_device_4_ranks(tmp_path):
    res = launch(job_newcomer, 4, [0], tmp_path, timeout=540)
    print(res[0])
    for r, out in enumerate(res):
        for name in ("cpu-gloo", "shapes"):
            w, where = out["worst"][name]
            assert w <= 1.0, (r, name, w, where, out[f"losses {name}"], out["ref_losses"])
            assert out[f"kind {name}"] == out["kind"] == "CausalLMOutputWithCrossAttentions"
            assert out[f"collectives {name}"] > 0 and out[f"collective_diff {name}"] == "", out[
                f"collective_diff {name}"
            ]
            # embeddings, 2 x (attention, attention output, MLP output): 7 masks drawn by the program
            assert len(out[f"masks {name}"]) == 7, out[f"masks {name}"]
        assert out["sharded shapes"], "the SHAPES plan shards nothing"
        assert any(any(p != "R" for p in pl) for pl in out["masks shapes"]), out["masks shapes"]
        assert out["losses shapes"][0] != out["losses shapes"][1]  # the masks (and weights) change per step
        assert out["again"] == out["losses shapes"], (out["again"], out["losses shapes"])
    assert all(out["losses shapes"] == res[0]["losses shapes"] for out in res)


@pytest.mark.timeout(420)
def test_quickstart_example_runs_with_torchrun(tmp_path):
    """The README's quickstart as written: torchrun -m autopar.examples.hf_gpt2 prints 3 losses per rank, the
    ranks agree, and they are one device's (the same model, torch.manual_seed(0) before training)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "autopar.examples.hf_gpt2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # four ranks share one stdout pipe: a rank's line can land after another process's unterminated output, so the
    # records are found anywhere in the text, not at line starts
    lines = [
        ["rank", r, "step", s, "loss", v]
        for r, s, v in re.findall(r"rank (\d+) step (\d+) loss ([-+0-9.eE]+\d)", proc.stdout)
    ]
    losses = {}  # step -> the losses the ranks printed
    for ln in lines:
        losses.setdefault(int(ln[3]), set()).add(ln[5])
    assert sorted({int(ln[1]) for ln in lines}) == [0, 1, 2, 3] and len(lines) == 12, (lines, proc.stdout[-3000:])
    assert sorted(losses) == [0, 1, 2] and all(len(v) == 1 for v in losses.values()), lines
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)).train()
    ids = torch.randint(0, 128, (8, 64))
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        got = float(next(iter(losses[step])))
        assert abs(got - loss.item()) <= 1e-6 + 1e-4 * abs(loss.item()), (step, got, loss.item())
