"""What a keyword-input pipeline stage carries besides the running tensor (backends/pipelining/side_values.py) and
what splitting the batch asks of the loss (backends/pipelining/batch_split.py), seen in one process: the probe of
the first micro-batch finds the values made before the blocks that later blocks or the head read, and refuses what
a stage boundary cannot carry. That the sent values give one device's step is test_pipeline_models_dist.py's
(MPNet, mT5 in CASES)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "third_party"))


def _model(name):
    import zoo

    model, args, kwargs, _ = zoo.ZOO[name]()
    zoo.zero_dropout(model)
    return model, args, kwargs


def _probe(name, prefix, outer, rows=2):
    import inspect

    import torch

    from autopar.backends.pipelining.forward_stage import probe

    model, args, kwargs = _model(name)
    call = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    return probe(model, prefix, outer, {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in call.items()})


def test_values_made_before_the_blocks_and_read_later_are_found():
    """MPNet's relative position bias (a trainable embedding outside the blocks, its bias fed to every block) and
    mT5's encoder output (every decoder block cross-attends to it) are side values; Llama's embedding output is
    only the running tensor (its RoPE tables come from no parameter: every stage computes them)."""
    sides = _probe("mpnet", "mpnet.encoder.layer", ["mpnet.embeddings", "mpnet.encoder.relative_attention_bias"])
    assert list(sides["sides"]) == ["mpnet.encoder.relative_attention_bias"], sides["sides"]
    _, leaves = sides["sides"]["mpnet.encoder.relative_attention_bias"]
    assert [tuple(t.shape) for t in leaves] == [(16, 16, 4)]  # (seq, seq, heads) of 2 rows' bias table
    mt5 = _probe("mt5", "decoder.block.0.layer", ["encoder", "decoder.embed_tokens"])
    assert list(mt5["sides"]) == ["encoder"], mt5["sides"]
    assert _probe("llama", "model.layers", ["model.embed_tokens"])["sides"] == {}


def test_a_module_output_read_by_every_block_is_a_side_value():
    """DeBERTa-v2/v3 checkpoints layer-norm their relative position table before the blocks (norm_rel_ebd=
    "layer_norm") and hand it to every block: the LayerNorm's output is the side value. (Read raw, the table is a
    parameter every block reads, which check_plan refuses: the zoo's deberta_v2.)"""
    import zoo

    model, args, kwargs, _ = zoo._mlm(
        "DebertaV2ForMaskedLM", "DebertaV2Config", "DeBERTa-v3 style", relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
        **zoo._ENC,
    )  # fmt: skip
    zoo.ZOO["deberta_v3"] = lambda: (model, args, kwargs, {})
    try:
        seen = _probe("deberta_v3", "deberta.encoder.layer", ["deberta.embeddings", "deberta.encoder.LayerNorm"])
    finally:
        del zoo.ZOO["deberta_v3"]
    assert list(seen["sides"]) == ["deberta.encoder.LayerNorm"], seen["sides"]


def test_block_outputs_read_later_are_side_values():
    """T5's first block computes the relative position bias and hands it to the blocks after it, which hand it
    back as they took it: one side value (`<block>:<index>`), the later blocks' outputs aliases of it (a 4-layer
    T5, its encoder blocks the layer list). Mixtral's router logits leave its blocks through transformers' output
    recorders (forward hooks), not their outputs: a stage standing in for a block would not make them. Refused."""
    import zoo

    zoo.ZOO["t5_4"] = lambda: zoo._seq2seq(
        "T5ForConditionalGeneration", "T5Config", "T5, 4 layers", vocab_size=zoo.VOCAB, d_model=zoo.HIDDEN, d_kv=16,
        d_ff=128, num_layers=4, num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    try:
        t5 = _probe("t5_4", "encoder.block", ["encoder.embed_tokens", "encoder.final_layer_norm", "decoder", "lm_head"])
    finally:
        del zoo.ZOO["t5_4"]
    assert list(t5["sides"]) == ["encoder.block.0:1"], t5["sides"]
    assert t5["aliases"] == {f"encoder.block.{i}:1": "encoder.block.0:1" for i in (1, 2, 3)}, t5["aliases"]
    with pytest.raises(NotImplementedError, match=r"a value made inside block 'model\.layers\.0' is read after it"):
        _probe("mixtral", "model.layers", ["model.embed_tokens", "model.norm", "lm_head"])


def test_a_residual_outside_the_blocks_is_refused():
    """The zoo's checkpointed MLP adds each block's output to its input in the model's forward (h = h + block(h)):
    a stage would hand on the block's output without the residual. Refused, naming the block."""
    with pytest.raises(NotImplementedError, match=r"computes on block 'blocks\.0''s output before the next block"):
        _probe("checkpointed", "blocks", ["emb", "head"])


def test_index_side_values_are_refused():
    """ViT-MAE's embeddings hand the decoder the random masking's restore order (int64): torch's stage runs later
    stages on uninitialized inputs to infer shapes, where those indices are out of range. Refused, naming the
    module, instead of an index error mid-step."""
    from autopar.backends.pipelining import side_values

    seen = _probe("vitmae", "vit.layers", ["vit.embeddings", "vit.layernorm", "decoder"])
    assert list(seen["sides"]) == ["vit.embeddings"]
    with pytest.raises(NotImplementedError, match=r"module 'vit\.embeddings' makes a torch\.int64 tensor"):
        side_values.check(seen["sides"])


def _loss_error(name, m):
    import inspect

    from autopar.backends.pipelining import batch_split

    model, args, kwargs = _model(name)
    call = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    return batch_split.loss_rows_error(model, call, m)


def test_a_loss_coupling_the_rows_is_refused():
    """CLIP's contrastive loss pairs every text with every image of the batch: on a micro-batch of one row it is
    0. Its loss on two rows is no mean of each row's, so a plan splitting the batch is refused before the first
    step; Llama's token-mean cross entropy (weighed by each half's count of targets) splits."""
    why = _loss_error("clip", 8)
    assert why is not None and "CLIPModel's loss on 2 rows" in why and "couples the batch's rows" in why, why
    assert _loss_error("llama", 8) is None
    assert _loss_error("llama", 1) is None  # one micro-batch: the local batch's halves (a dp split) are checked
    assert "output holds an aux_loss" in _loss_error("mixtral", 8)  # its routers' load balancing


def test_a_summed_loss_is_refused():
    """A loss summed over the batch is no mean of its micro-batches' losses (the step weighs each the same): the
    runtime would train on 1/m of its gradient. Refused; the same model with a mean passes."""
    import torch
    import torch.nn.functional as F

    from autopar.backends.pipelining import batch_split

    class Sum(torch.nn.Module):
        def __init__(self, reduction):
            super().__init__()
            self.lin, self.reduction = torch.nn.Linear(4, 3), reduction

        def forward(self, x, y):
            return F.cross_entropy(self.lin(x), y, reduction=self.reduction)

    call = {"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))}
    for reduction, refused in (("sum", True), ("mean", False)):
        model = Sum(reduction)
        why = batch_split.loss_rows_error(model, call, 4)
        assert (why is not None) == refused, (reduction, why)
