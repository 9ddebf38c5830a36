"""The stage memory model's transients (autopar/liveness.py cluster_peaks, autopar/pipeline_model.py transients):
what a cluster's run holds beyond the saved activations the stage model already counts, checked on cases computed
by hand. The loss tail is the large one: for N tokens and a vocabulary of V, the backward of cross_entropy holds
log_softmax's saved fp32 output, nll_loss's fp32 gradient of it and log_softmax's fp32 input gradient at once
(12 N V bytes), 8 N V beyond the saved output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import models
from autopar.capture import capture
from autopar.liveness import cluster_peaks
from autopar.pipeline_model import transients


class _Head(nn.Module):
    def __init__(self, h: int, v: int):
        super().__init__()
        self.out = nn.Linear(h, v, bias=False)

    def forward(self, x, labels):
        return F.cross_entropy(self.out(x).float(), labels)


def _head_graph(n: int, h: int, v: int):
    """The captured bf16 head + loss on n tokens, every node Replicate on a one-device mesh."""
    m = _Head(h, v).to(device="meta", dtype=torch.bfloat16)
    x = torch.empty(n, h, device="meta", dtype=torch.bfloat16)
    labels = torch.empty(n, dtype=torch.long, device="meta")
    g = capture(m, (x, labels))
    return g, [SimpleNamespace(out=(("R",),) * len(nd.outs)) for nd in g.nodes]


def test_loss_tail_peak_is_three_fp32_logits_copies():
    """A bf16 head and its loss, N = 64 tokens, V = 1000: forward peak 2 + 4 + 4 B per logit (bf16 logits, fp32
    upcast, log_softmax output), backward 4 + 4 + 4 (saved output, its gradient, the input gradient): 12 N V, and
    the scalar loss beside it."""
    n, h, v = 64, 32, 1000
    g, P = _head_graph(n, h, v)
    (peak,) = cluster_peaks(g, P, (1,), [0] * len(g.nodes), 1)
    assert peak == pytest.approx(12 * n * v, abs=16)
    # sharded two ways (vocab-parallel logits), every buffer halves
    P2 = [SimpleNamespace(out=(("S1",),) * len(nd.outs)) for nd in g.nodes]
    (half,) = cluster_peaks(g, P2, (2,), [0] * len(g.nodes), 1)
    assert half == pytest.approx(6 * n * v, abs=16)


def test_transients_plain_and_checkpointed_by_hand():
    """Three clusters (pre, one block, post): plain = peak - saved; a checkpointed block's = peak - the input it
    keeps (saved - save); costs without a measured peak keep the block's activations as its only transient."""
    cv = SimpleNamespace(
        act=np.array([1.0, 10.0, 20.0]),
        save=np.array([0.0, 8.0, 0.0]),
        blk=np.array([False, True, False]),
        peak=np.array([1.0, 14.0, 52.0]),
    )
    plain, ckpt = transients(cv)
    assert list(plain) == [0.0, 4.0, 32.0] and list(ckpt) == [0.0, 12.0, 32.0]
    cv.peak = None
    plain, ckpt = transients(cv)
    assert list(plain) == [0.0, 0.0, 0.0] and list(ckpt) == [0.0, 10.0, 0.0]


def test_one_device_llama_peak_counts_the_loss_backward():
    """llama-tiny (V = 256) on one device, 4 x 128 tokens, no recomputation: the rank peak is its model state +
    the saved activations + the largest transient, the loss's two fp32 logits-sized gradients (8 N V bytes; a
    block's backward temporaries are smaller at dim 64), which the model without the term left out."""
    over = dict(max_seq_len=128)
    m = models.build_model("llama-tiny", device="meta", **over)
    x = models.example_inputs("llama-tiny", batch=4, seq=128, device="meta", **over)
    opts = dict(layers_per_stage=[2], schedules=["GPipe"], n_microbatches=[1], recompute=None)
    plan = autopar.plan(m, autopar.MeshSpec((1, 1), ("pp", "dp")), x, cluster="h100", pipeline=opts)
    (st,) = plan.stages
    mem = st["memory"]
    n_tokens, vocab = 4 * 128, 256
    assert mem["transient_bytes"] == pytest.approx(8 * n_tokens * vocab, rel=1e-3)
    hand = mem["state_bytes"] + mem["act_bytes_per_microbatch"] + 8 * n_tokens * vocab
    assert mem["rank_peak_bytes"] == pytest.approx(hand, rel=1e-3)
    assert plan.predicted["peak_mem_bytes"] == pytest.approx(hand, rel=1e-3)
    # memory_reserved: that peak + the caching allocator's idle segments of the peaking cluster (the loss)
    assert plan.predicted["reserved_mem_bytes"] == pytest.approx(
        mem["rank_peak_bytes"] + mem["allocator_idle_bytes"], rel=1e-9
    )
    assert mem["allocator_idle_bytes"] > 0


def test_fsdp_kept_bytes_count_the_cp_dims():
    """FSDP over dp x cp (torchtitan's dp_shard_cp): a unit computes on its parameters gathered over both, so the
    kept bytes are the whole unit's, bf16 parameters + fp32 gradients (6 B per element): 1000 elements sharded on
    (dp 2, cp 4) keep 6000 B, not the 1500 of a gather over dp alone; sharded on cp alone, 6000 B, not 0."""
    from autopar.cost import TrainingPrecision, get_cluster
    from autopar.pipeline_engine import engine_terms

    g = SimpleNamespace(params={"w": 0}, nodes=[SimpleNamespace(out=SimpleNamespace(numel=1000))])
    mesh = autopar.MeshSpec((2, 4), ("dp", "cp"))
    prec, cl = TrainingPrecision.mixed_bf16_adam(), get_cluster("h100-95g")
    for pl in (("S0", "S0"), ("R", "S0")):
        P = [SimpleNamespace(out=(pl,))]
        assert engine_terms(g, P, [0], 1, mesh, prec, cl)["kept"][0] == pytest.approx(6000)


def test_idle_cached_bytes_of_the_loss_tail_by_hand():
    """The loss tail's trace in units of NV = 10 MiB (large, 2 MiB-aligned: one segment per request): bf16 logits
    A (2), fp32 upcast B (4), log_softmax C (4); B and A freed; the backward's D (4) takes B's segment, E (4) finds
    no free block that holds it and opens a segment; F (2, the bf16 gradient) reuses A's. Reserved 2+4+4+4 = 14,
    allocated peak 12 (C, D, E): 2 idle, A's segment."""
    from autopar.cost.memory import idle_cached_bytes

    nv = 10 * 2**20
    ev = [("A", 2), ("B", 4), ("C", 4), ("B", None), ("A", None), ("D", 4), ("E", 4)]
    ev += [("D", None), ("C", None), ("F", 2), ("E", None), ("F", None)]
    assert idle_cached_bytes([(k, None if n is None else n * nv) for k, n in ev]) == 2 * nv
    # a freed block is split for a smaller request and merges back: no new segment, nothing idle beyond it
    ev = [("A", 8 * nv), ("A", None), ("B", 3 * nv), ("C", 5 * nv), ("B", None), ("C", None), ("D", 8 * nv)]
    assert idle_cached_bytes(ev) == 0


def test_cluster_idle_of_a_head_is_its_bf16_logits_segment():
    """The head + loss of test_loss_tail_peak_is_three_fp32_logits_copies at N = 2048, V = 4096: bf16 logits
    16 MiB, each fp32 copy 32 MiB. Idle at the peak: the logits' 16 MiB segment, plus what of the small pool's
    one 2 MiB segment the scalars and the weight's 256 KiB gradient leave free."""
    from autopar.liveness import cluster_idle

    n, h, v = 2048, 32, 4096
    g, P = _head_graph(n, h, v)
    (idle,) = cluster_idle(g, P, (1,), [0] * len(g.nodes), 1)
    assert 2 * n * v <= idle <= 2 * n * v + 2 * 2**20
