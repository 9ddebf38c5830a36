"""A hand pipeline layout with recompute=True checkpoints as memory needs and finds a plan under the budget where
one exists (the per-stage choice leaves out FSDP's unsharded units, which the simulated peak counts;
passes/stage_search.py _hand_fitting picks again under a smaller cap)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import models

TINY = dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=4096, max_seq_len=1024)


def _plan(recompute, budget=None):
    m = models.build_model("llama3-8b", device="meta", dtype=torch.bfloat16, **TINY)
    x = models.example_inputs("llama3-8b", batch=8, seq=1024, device="meta", **TINY)
    opts = dict(layers_per_stage=[4], schedules=["GPipe"], n_microbatches=[1], recompute=recompute)
    return autopar.plan(m, autopar.MeshSpec((1, 8, 1), ("pp", "dp", "tp")), x, cluster="h100", pipeline=opts,
                        memory_budget=budget)  # fmt: skip


def test_torchtitan_8b_fsdp8_selective_layout_fits_its_budget():
    """TorchTitan Table 1's 8B on 8 H100 (95 GiB), FSDP 8, local batch 2 x 8192, blocks checkpointed as memory
    needs: the first per-stage choice overflows 90% of 95 GiB by FSDP's unsharded units; picked again it fits."""
    m = models.build_model("llama3-8b", device="meta", dtype=torch.bfloat16)
    x = models.example_inputs("llama3-8b", batch=16, seq=8192, device="meta")
    opts = dict(layers_per_stage=[32], schedules=["GPipe"], n_microbatches=[1, 2], recompute=True)
    plan = autopar.plan(m, autopar.MeshSpec((1, 8, 1), ("pp", "dp", "tp")), x, cluster="h100-95g", pipeline=opts)
    pr = plan.predicted
    assert pr["peak_mem_bytes"] <= pr["budget_bytes"]
    assert 0 < sum(st["recompute_blocks"] for st in plan.stages) < 32  # as memory needs: some, not all


def test_hand_layout_under_any_peak_is_refused():
    with pytest.raises(autopar.InfeasibleMemoryError, match="no pipeline plan fits"):
        _plan(True, 1e6)


def test_interleaved_hand_layout_spends_each_ranks_room_per_stage(monkeypatch):
    """Interleaved1F1B, 4 ranks x 4 stages of 1 block, budget 0.65x the plan's peak without checkpointing: the
    uniform cap search checkpoints nearly every block (one block fewer on every stage overflows); spending each rank's
    room stage by stage (passes/stage_search.py spend_room) checkpoints fewer, still under the budget, faster."""
    tiny = {**TINY, "n_layers": 16}
    m = models.build_model("llama3-8b", device="meta", dtype=torch.bfloat16, **tiny)
    x = models.example_inputs("llama3-8b", batch=8, seq=1024, device="meta", **tiny)
    mesh = autopar.MeshSpec((4, 1, 1), ("pp", "dp", "tp"))

    def plan(recompute, budget=None):
        opts = dict(layers_per_stage=[1] * 16, schedules=["Interleaved1F1B"], stages_per_rank=[4],
                    n_microbatches=[4], recompute=recompute, workers=1)  # fmt: skip
        return autopar.plan(m, mesh, x, cluster="h100", pipeline=opts, memory_budget=budget)

    budget = 0.65 * plan(False).predicted["peak_mem_bytes"]
    after = plan(True, budget)
    with monkeypatch.context() as mp:
        mp.setattr("autopar.passes.stage_search.spend_room", lambda costs, r, *a, **k: r)
        before = plan(True, budget)
    blocks = lambda p: sum(st["recompute_blocks"] for st in p.stages)
    assert 0 < blocks(after) < blocks(before)
    assert after.predicted["peak_mem_bytes"] <= budget
    assert after.predicted["step_s"] < before.predicted["step_s"]
    # the stage records are those of the refined partition: its rank peaks, and a middle stage's backward and saved
    # bytes follow its own count (one block each: checkpointed, it recomputes and keeps less)
    assert max(st["memory"]["rank_peak_bytes"] for st in after.stages) == after.predicted["peak_mem_bytes"]
    mid = {st["recompute_blocks"]: st for st in after.stages[1:-1]}
    assert set(mid) == {0, 1}
    assert mid[1]["time"]["B_s"] > mid[0]["time"]["B_s"]
    assert mid[1]["memory"]["act_bytes_per_microbatch"] < mid[0]["memory"]["act_bytes_per_microbatch"]


def test_rank_choice_fits_the_room_and_saves_what_it_can():
    """One rank's stages, bytes added per block un-checkpointed differing by stage (later stages hold fewer
    micro-batches at the peak): the exhaustive choice checkpoints stage 0's block again where that frees three
    cheaper ones; the greedy one (for many combinations) takes the cheap blocks first and stays within the room."""
    from autopar.passes.stage_search import _rank_exhaustive, _rank_greedy

    per_block, gain, mine, tops = [4.0, 1.5, 1.5, 1.5], [1.0] * 4, [0, 1, 2, 3], [2, 1, 1, 1]

    def mem(rec):
        return sum((t - r) * w for t, r, w in zip(tops, rec, per_block))

    rec = [1, 1, 1, 1]  # 4 bytes used of 4.5
    _rank_exhaustive(rec, mine, tops, gain, lambda: mem(rec), 4.5)
    assert rec == [2, 0, 0, 0]
    rec = [2, 1, 1, 1]
    _rank_greedy(rec, mine, gain, lambda q: mem(rec), 0, 5.0)
    assert rec == [2, 0, 0, 0]
