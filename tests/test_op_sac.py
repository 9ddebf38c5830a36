"""torchtitan's selective op activation checkpointing in the stage model (pipeline option ac="op",
passes/stage_metrics.py SAC_SAVED): what a checkpointed block keeps and reruns, against a count by hand."""

from __future__ import annotations

from autopar import models
from autopar.cost import get_cluster
from autopar.mesh import MeshSpec
from autopar.passes.stage_costs import StageOps, find_layers
from autopar.passes.stage_metrics import _sac_saved

from _stage import stage_context

BATCH, SEQ = 4, 64


def test_every_second_matmul_reruns_and_attention_stays():
    saved = [_sac_saved("aten.mm.default", k) for k in range(1, 8)]
    assert saved == [True, False, True, False, True, False, True]  # torchtitan counts from 1, recomputes the evens
    assert _sac_saved("aten._scaled_dot_product_flash_attention.default", 0)
    assert not _sac_saved("aten.mul.Tensor", 0) and not _sac_saved("aten.add.Tensor", 0)


def _block_costs(ac: str):
    over = dict(n_layers=2)
    meta = models.build_model("llama-tiny", device="meta", **over)
    x = models.example_inputs("llama-tiny", batch=BATCH, seq=SEQ, device="meta", **over)
    ctx = stage_context(get_cluster("h100"), n_variants=1, ac=ac)
    ops = StageOps(meta, find_layers(meta), [0], [0, 0], x, MeshSpec((1,), ("dp",)), ctx)
    return meta, ops.costs()[0]


def test_op_sac_keeps_the_block_input_and_the_saved_ops_outputs():
    """A llama block's matmuls run wq, wk, wv, wo, w1, w3, w2: op SAC keeps wq, wv, w1, w2's outputs and the
    attention's (its output and logsumexp) beside the block's input; it reruns the rest."""
    meta, op = _block_costs("op")
    _, blk = _block_costs("block")
    a, f = meta.layers[0].attention, meta.layers[0].feed_forward
    tokens, e = BATCH * SEQ, 4  # fp32
    dim, kv, hidden = a.wq.in_features, a.wv.out_features, f.w1.out_features
    by_hand = tokens * e * (dim + dim + kv + hidden + dim)  # input, wq, wv, w1, w2 outputs
    by_hand += tokens * e * dim + BATCH * a.n_heads * SEQ * 4  # attention output, its fp32 logsumexp
    kept = op.act[1] - op.save[1]
    assert abs(kept - by_hand) <= 0.02 * by_hand, (kept, by_hand)
    assert blk.act[1] - blk.save[1] < kept  # whole-block checkpointing keeps only the input
    assert 0 < op.rtime[1] < blk.rtime[1] == blk.F[1]  # reruns less than the whole forward
