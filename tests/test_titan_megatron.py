"""torchtitan's Llama-3 (grouped-query attention: F.scaled_dot_product_attention(..., enable_gqa=True)) plans the
Megatron layout on the tp dim, and its fused GQA attention runs head-sharded with one device's numbers.

The cause of wk/wv coming out S1 (row-wise) on the 8B shape: capture sent SDPA with enable_gqa=True to its math
decomposition, whose bmm flattens (batch, heads) into one dim; with the batch on dp, DTensor's view rule cannot keep
the heads sharded on tp through that flatten, so head-parallel attention had no candidate at all, and the plans
compared (wk/wv S0 or S1) both gathered q/k/v on tp and ran attention on the query sequence, a 0.01% near-tie.
Capture now records the fused attention op with K/V at their own head count (GQA-aware kernels take them so),
whose rule shards the heads of Q and of K/V together.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from _clusters import SHAPES
from _simulated import simulated
from autopar.testing import train_and_compare

llama3 = pytest.importorskip("torchtitan.models.llama3")
pytest.importorskip("torch.distributed._local_tensor")

pytestmark = pytest.mark.timeout(300)
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
COLUMN, ROW = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")


class TitanLoss(nn.Module):
    """The trainer's loss: cross-entropy of the fp32 logits over all tokens (benchmarks/bench_titan_plan.py)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        return F.cross_entropy(self.model(tokens).flatten(0, 1).float(), labels.flatten(0, 1))


def tp_layout(params: dict) -> dict:
    """{weight leaf name: set of its placements on the tp dim} over the blocks."""
    out = {}
    for fqn, pl in params.items():
        if ".layers." in fqn:
            out.setdefault(fqn.split(".")[-2], set()).add(pl[1])
    return out


def test_titan_llama3_8b_shape_plans_megatron_on_tp():
    """The 8B dims (dim 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256; 2 layers), bf16 on meta, (8, 8)
    h100 mesh: every block's wq/wk/wv/w1/w3 is S0 on tp and wo/w2 S1, the attention op computes with its heads
    sharded on tp, and no q/k/v is gathered on tp before it."""
    args = dataclasses.replace(llama3.llama3_args["8B"], n_layers=2)
    assert args.n_kv_heads < args.n_heads  # GQA: the case the math path lost
    with torch.device("meta"):
        model = TitanLoss(llama3.Transformer(args).to(torch.bfloat16))
    tok = torch.randint(0, args.vocab_size, (8, 2048), device="meta")
    t = time.perf_counter()
    plan, state = autopar.plan(
        model, autopar.MeshSpec((8, 8), ("dp", "tp")), (tok, tok.clone()), cluster="h100", return_state=True
    )
    print(f"plan 2 layers: {time.perf_counter() - t:.1f} s, step {plan.predicted['step_s'] * 1e3:.3f} ms")
    tp = tp_layout(plan.params)
    assert {n: tp[n] for n in COLUMN + ROW} == {**{n: {"S0"} for n in COLUMN}, **{n: {"S1"} for n in ROW}}, tp
    g = state.graph
    attn = [n for n in g.nodes if n.target is SDPA]
    assert len(attn) == args.n_layers, "GQA attention is captured as the fused op"
    assert not any(n.target is torch.ops.aten.bmm.default for n in g.nodes if n.module.endswith("inner_attention"))
    for n in attn:
        pl = state.placement[n.idx]
        assert pl.out[0] == ("S0", "S1") and all(p == ("S0", "S1") for p in pl.ins), (n.name, pl)
        for j in range(3):  # q, k, v arrive head-sharded: nothing gathered on tp
            assert (n.idx, j) not in state.redistributes, (n.name, j, state.redistributes[(n.idx, j)])


def _small_gqa():
    args = dataclasses.replace(
        llama3.llama3_args["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        max_seq_len=16,
        multiple_of=32,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = llama3.Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return TitanLoss(model), args


def test_titan_gqa_fused_attention_head_sharded_matches_single_device():
    """The capture change on values: a small GQA torchtitan Llama-3 (4 heads, 2 kv heads) with its attention
    weights pinned Megatron-style on tp (the kv heads split 1 per tp rank, grouped by the fused kernel), 2x2
    simulated mesh: loss and every gradient of two steps, and the parameters after them, equal one device's."""
    model, args = _small_gqa()
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, args.vocab_size, (4, 16), generator=g)
    x = (tok, tok.roll(-1, 1))
    force = {}
    for fqn, p in model.named_parameters():
        leaf = fqn.split(".")[-2] if ".layers." in fqn else None
        if leaf in COLUMN or leaf in ROW:
            force[fqn] = ("R", "S0" if leaf in COLUMN else "S1")
    meta_x = tuple(t.to("meta") for t in x)
    with torch.device("meta"):
        meta_model = copy.deepcopy(model).to("meta")
    plan, state = autopar.plan(meta_model, (2, 2), meta_x, cluster=SHAPES, force=force, return_state=True)
    attn = [n for n in state.graph.nodes if n.target is SDPA]
    assert attn and all(state.placement[n.idx].out[0][1] == "S1" for n in attn)  # heads on tp
    ref = copy.deepcopy(model)
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        sharded = [f for f, p in pm.named_parameters() if any(str(q).startswith("S(") for q in p.placements)]
        assert len(sharded) >= 4 * args.n_layers, sharded
        rep = train_and_compare(pm, ref, x, steps=2, lr=0.1, rtol=1e-4, atol=1e-6, all_grads=True)
    assert not rep.failures, "\n".join(rep.failures[:10])
    assert all(math.isfinite(a) for a, _ in rep.losses)
    assert len(rep.measured) > 0 and not rep.collective_diff, rep.collective_diff


def test_enable_gqa_captures_one_fused_op_on_the_kv_heads():
    """SDPA(enable_gqa=True) is the fused attention op taking K and V at their own head count (no repeat copy that
    attention would save at the query heads), forward and backward, and autopar's Llama with gqa="native" computes
    what its explicit repeat computes."""
    from autopar import models
    from autopar.capture import capture

    with torch.device("meta"):
        m = models.build_model("llama-tiny", n_layers=1, gqa="native")
    g = capture(m, models.example_inputs("llama-tiny", batch=2, seq=16, device="meta"), None)
    fw = [n for n in g.nodes if n.target is SDPA]
    bw = [n for n in g.nodes if n.kind == "op" and str(n.target).endswith("flash_attention_for_cpu_backward.default")]
    heads, kv = m.cfg.n_heads, m.cfg.n_kv_heads
    assert kv < heads and len(fw) == 1 and len(bw) == 1
    assert [g.meta(r).shape[1] for r in fw[0].inputs()] == [heads, kv, kv]
    assert [o.shape[1] for o in bw[0].outs] == [heads, kv, kv]
    assert not any(n.kind == "op" and str(n.target) == "aten.clone.default" for n in g.nodes if "attention" in n.module)
    rep = models.build_model("llama-tiny", n_layers=1, device="cpu")
    nat = models.build_model("llama-tiny", n_layers=1, gqa="native", device="cpu")
    nat.load_state_dict(rep.state_dict())
    x = models.example_inputs("llama-tiny", batch=2, seq=16, device="cpu")
    a, b = rep(*x), nat(*x)
    a.backward(), b.backward()
    assert torch.allclose(a, b, atol=1e-6)
    for (name, p), q in zip(rep.named_parameters(), nat.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), name
