"""The third-party model zoo: architectures nobody on this project wrote, built small from their own configs with
random weights (no downloads). A plain module, no tests (tests/test_third_party_models.py and
benchmarks/models.py use it; import it with tests/third_party on sys.path).

`ZOO[name]()` returns `(model, args, kwargs, notes)`: the model as its users have it (a transformers model takes
keyword inputs with `labels=` and returns a ModelOutput with `.loss`), the example positional and keyword inputs of
one training step, and `notes`, a dict:
  family   what the entry stands for (the architecture feature it covers)
  dropout  the modules / config values that draw random numbers in train() mode (empty: none)
  mode     "train" (every entry is built in train() mode, as a user trains it)
  loss     how the loss is made: "model" (the model computes it from labels=) or the wrapper that adds it
  changed  config values set away from the library's defaults, and why (only to make the model small)
  check_dtype  (some entries) the dtype the 2x2 check casts the model and its floating inputs to

Sizes: hidden 32-64, 2 layers, vocab 128-256, sequence 16, batch 8 (a 2x2 mesh divides it). Models that return
logits only (torchtitan's, torch.nn's, the hand CNN) are wrapped in `WithLoss`, the loss their trainers compute
outside the model (torchtitan's trainer: cross-entropy of the logits).

torchtitan 0.2.2 debug models left out, because they do not run on CPU here: qwen3 'debugmodel_moe' and llama4
'debugmodel' (their MoE counts tokens per expert with torch.histc on int64: '"histogram_cpu" not implemented for
'Long''), deepseek_v3 'debugmodel' (does not build: no attribute 'moe_impl'), gpt_oss (flex attention, bf16).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, VOCAB, HIDDEN = 8, 16, 256, 64
SMALL = "hidden 64, 2 layers, vocab 256 (defaults are full-size)"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _tokens(seed=1, vocab=VOCAB, batch=BATCH, seq=SEQ):
    return torch.randint(0, vocab, (batch, seq), generator=_gen(seed))


_UNUSED_HEADS = ("classifier", "summary", "qa_", "seq_classif")  # dropout of heads these models do not have


def _dropout_in(model: nn.Module) -> list[str]:
    """What draws random numbers in train() mode: nn.Dropout modules with p > 0 (by class and p), and float
    config fields named *dropout* / *drop_prob* that are > 0 (transformers' attention passes those to sdpa)."""
    found = set()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            found.add(f"{type(m).__name__}(p={m.p:g})")
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            found.add(f"MultiheadAttention(dropout={m.dropout:g})")
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for k, v in sorted(cfg.to_dict().items()) if hasattr(cfg, "to_dict") else ():
            if (
                isinstance(v, float)
                and v > 0
                and ("dropout" in k or "drop_prob" in k or k.endswith("_pdrop"))
                and not k.startswith(_UNUSED_HEADS)
            ):
                found.add(f"config.{k}={v:g}")
    return sorted(found)


def _notes(model, family, loss="model", changed=SMALL, **extra):
    return {
        "family": family,
        "dropout": _dropout_in(model),
        "mode": "train" if model.training else "eval",
        "loss": loss,
        "changed": changed,
        **extra,
    }


def _hf(cls_name, config_name, family, seed=0, kwargs=None, changed=SMALL, **cfg):
    """A transformers model from its config class (random init under `seed`), in train() mode."""
    import transformers

    transformers.logging.set_verbosity_error()  # out-of-vocab default bos/eos ids: unused without generate()
    config = getattr(transformers, config_name)(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    model.train()
    return model, (), kwargs, _notes(model, family, changed=changed)


def _lm(cls_name, config_name, family, changed=SMALL, **cfg):
    """A causal LM: input_ids and labels (the model shifts them)."""
    ids = _tokens(1, cfg.get("vocab_size", VOCAB))
    return _hf(cls_name, config_name, family, kwargs={"input_ids": ids, "labels": ids.clone()}, changed=changed, **cfg)


def _mlm(cls_name, config_name, family, **cfg):
    """A masked LM: input_ids, attention_mask (all ones), labels -100 except at 3 masked positions a row."""
    ids = _tokens(2, cfg.get("vocab_size", VOCAB))
    labels = torch.full_like(ids, -100)
    pos = torch.randint(0, SEQ, (BATCH, 3), generator=_gen(3))
    labels.scatter_(1, pos, ids.gather(1, pos))
    ids = ids.scatter(1, pos, 3)  # token 3 stands for [MASK]
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return _hf(cls_name, config_name, family, kwargs=kw, **cfg)


_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


# ---- decoder LMs (transformers) ----------------------------------------------------------------------------------


def gpt2():
    return _lm(
        "GPT2LMHeadModel",
        "GPT2Config",
        "decoder LM, plain MHA, learned positions, tied head",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
    )


def opt():
    return _lm(
        "OPTForCausalLM",
        "OPTConfig",
        "decoder LM, plain MHA, ReLU MLP, learned offset positions",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=HIDDEN,
    )


def llama():
    return _lm(
        "LlamaForCausalLM", "LlamaConfig", "decoder LM, GQA (4 q / 2 kv heads), RoPE, RMSNorm, SwiGLU", **_LLAMA_LIKE
    )


def qwen2():
    return _lm("Qwen2ForCausalLM", "Qwen2Config", "decoder LM, GQA with q/k/v biases", **_LLAMA_LIKE)


def qwen3():
    return _lm("Qwen3ForCausalLM", "Qwen3Config", "decoder LM, GQA with q/k RMSNorm", head_dim=16, **_LLAMA_LIKE)


def mistral():
    return _lm(
        "MistralForCausalLM",
        "MistralConfig",
        "decoder LM, GQA, sliding-window attention (window 8 < seq 16)",
        changed=SMALL + "; sliding_window=8 so the window is shorter than the sequence",
        sliding_window=8,
        **_LLAMA_LIKE,
    )


def gemma2():
    return _lm(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        "decoder LM, attention and final logit soft-capping, alternating sliding/global layers",
        changed=SMALL + "; sliding_window=8 (< seq 16)",
        head_dim=16,
        sliding_window=8,
        **_LLAMA_LIKE,
    )


def gpt_neox():
    return _lm(
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        "decoder LM, parallel attention/MLP (use_parallel_residual)",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        use_parallel_residual=True,
    )


def phi():
    return _lm(
        "PhiForCausalLM",
        "PhiConfig",
        "decoder LM, parallel attention/MLP block, partial rotary",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )


def gptj():
    return _lm(
        "GPTJForCausalLM",
        "GPTJConfig",
        "decoder LM, parallel attention/MLP block, rotary on 16 dims",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
        rotary_dim=8,
    )


def falcon():
    return _lm(
        "FalconForCausalLM",
        "FalconConfig",
        "decoder LM, parallel attention/MLP, multi-query attention",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        parallel_attn=True,
        multi_query=True,
        max_position_embeddings=64,
    )


def bloom():
    return _lm(
        "BloomForCausalLM",
        "BloomConfig",
        "decoder LM, ALiBi position bias",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        n_layer=2,
        n_head=4,
    )


def gpt_bigcode():
    return _lm(
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        "decoder LM, multi-query attention (1 kv head)",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
        multi_query=True,
    )


def phi3():
    return _lm(
        "Phi3ForCausalLM",
        "Phi3Config",
        "decoder LM, fused qkv and gate/up projections, GQA",
        changed=SMALL + "; pad_token_id=0 (the default 32000 is outside the small vocab)",
        pad_token_id=0,
        **_LLAMA_LIKE,
    )


def stablelm():
    return _lm(
        "StableLmForCausalLM", "StableLmConfig", "decoder LM, LayerNorm, partial rotary (25%), GQA", **_LLAMA_LIKE
    )


def mixtral():
    return _lm(
        "MixtralForCausalLM",
        "MixtralConfig",
        "decoder LM, MoE (4 experts, top-2 routing), GQA",
        changed=SMALL + "; 4 experts; output_router_logits=True so the aux loss is in .loss",
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        **_LLAMA_LIKE,
    )


def olmoe():
    return _lm(
        "OlmoeForCausalLM",
        "OlmoeConfig",
        "decoder LM, MoE (8 experts, top-2, no renormalisation), q/k norm",
        changed=SMALL + "; 8 experts; output_router_logits=True so the aux loss is in .loss",
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        **_LLAMA_LIKE,
    )


def qwen2_moe():
    return _lm(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        "decoder LM, MoE (4 experts top-2 + gated shared expert)",
        changed=SMALL + "; 4 experts",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **_LLAMA_LIKE,
    )


# ---- encoders, encoder-decoders (transformers) -------------------------------------------------------------------

_ENC = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)


def bert():
    return _mlm("BertForMaskedLM", "BertConfig", "encoder masked LM, post-LN, GELU, token types", **_ENC)


def roberta():
    return _mlm(
        "RobertaForMaskedLM",
        "RobertaConfig",
        "encoder masked LM, padding-offset positions",
        **{**_ENC, "max_position_embeddings": 64 + 2},
    )


def distilbert():
    return _mlm(
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        "encoder masked LM, no token types, sinusoid-free",
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=64,
    )


def electra():
    return _mlm(
        "ElectraForMaskedLM",
        "ElectraConfig",
        "encoder masked LM, embedding size != hidden size",
        embedding_size=32,
        **_ENC,
    )


def albert():
    return _mlm(
        "AlbertForMaskedLM",
        "AlbertConfig",
        "encoder masked LM, one layer's weights shared by all layers",
        embedding_size=32,
        **_ENC,
    )


def deberta_v2():
    return _mlm(
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        "encoder masked LM, disentangled relative attention",
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=16,
        **_ENC,
    )


def _seq2seq(cls_name, config_name, family, **cfg):
    src, tgt = _tokens(4), _tokens(5)
    kw = {"input_ids": src, "attention_mask": torch.ones_like(src), "labels": tgt}
    return _hf(cls_name, config_name, family, kwargs=kw, **cfg)


def t5():
    return _seq2seq(
        "T5ForConditionalGeneration",
        "T5Config",
        "encoder-decoder, relative position bias, cross-attention, labels shifted right",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    )


def bart():
    return _seq2seq(
        "BartForConditionalGeneration",
        "BartConfig",
        "encoder-decoder, learned positions, tied embeddings",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )


# ---- vision (transformers) ---------------------------------------------------------------------------------------


def _images(seed, size=32, channels=3, batch=BATCH):
    return torch.randn(batch, channels, size, size, generator=_gen(seed))


def _classify(cls_name, config_name, family, size=32, **cfg):
    kw = {"pixel_values": _images(6, size), "labels": torch.randint(0, 10, (BATCH,), generator=_gen(7))}
    return _hf(
        cls_name,
        config_name,
        family,
        kwargs=kw,
        num_labels=10,
        changed="small image (32x32), 2 layers, 10 labels (defaults are full-size)",
        **cfg,
    )


def vit():
    return _classify(
        "ViTForImageClassification",
        "ViTConfig",
        "vision transformer, patch-embedding conv, CLS token",
        image_size=32,
        patch_size=8,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )


def swin():
    return _classify(
        "SwinForImageClassification",
        "SwinConfig",
        "vision transformer, shifted-window attention, patch merging",
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
    )


def resnet():
    return _classify(
        "ResNetForImageClassification",
        "ResNetConfig",
        "CNN, BatchNorm2d in train mode, ReLU, bottleneck blocks",
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="bottleneck",
    )


def convnext():
    return _classify(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        "CNN, depthwise 7x7 conv, channels-last LayerNorm, layer scale, stochastic depth",
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_stages=2,
    )


def mobilenet_v2():
    model, args, kwargs, notes = _classify(
        "MobileNetV2ForImageClassification",
        "MobileNetV2Config",
        "CNN, inverted residuals, depthwise convs, BatchNorm2d (train), ReLU6",
        depth_multiplier=0.25,
        finegrained_output=False,
        image_size=32,
    )
    # Its float32 training is not reproducible to the 2x2 check's tolerance even on one device (1 vs 2 threads: 4
    # grads and 99 params outside it; the linear bottlenecks' BN bias grads are zero analytically, so max|ref| is
    # noise; benchmarks/results/precision.md), so its 2x2 check runs in float64; the (8, 8) plan keeps float32.
    notes["check_dtype"] = torch.float64
    return model, args, kwargs, notes


def clip():
    import transformers

    text = transformers.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    config = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=32)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config)
    model.train()
    ids = _tokens(8)
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": _images(9), "return_loss": True}
    return (
        model,
        (),
        kw,
        _notes(
            model,
            "contrastive two-tower (text + vision), learned logit scale",
            changed="small towers (hidden 64, 2 layers), 32x32 images; return_loss=True",
        ),
    )


# ---- models that return logits: the trainer's loss around them ---------------------------------------------------


class WithLoss(nn.Module):
    """`model(x)` and the trainer's cross-entropy on its logits (what torchtitan's trainer and a plain PyTorch
    training loop compute outside the model)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _titan(module, args_name, flavor, family, **overrides):
    import importlib

    mod = importlib.import_module(f"torchtitan.models.{module}")
    args = getattr(mod, args_name)[flavor]
    if hasattr(args, "moe_args") and args.moe_args is not None:
        overrides["moe_args"] = dataclasses.replace(
            args.moe_args, use_grouped_mm=False, num_experts=4, top_k=min(args.moe_args.top_k, 2)
        )
    args = dataclasses.replace(args, **overrides)
    cls = {
        "llama3": "Transformer",
        "qwen3": "Qwen3Model",
        "gpt_oss": "GptOssModel",
        "llama4": "Transformer",
        "deepseek_v3": "DeepSeekV3Model",
    }[module]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = getattr(mod, cls)(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.train()
    ids = _tokens(10, args.vocab_size)
    wrapped = WithLoss(model)
    return (
        wrapped,
        (ids, ids.roll(-1, 1)),
        {},
        _notes(
            wrapped,
            family,
            loss="WithLoss: cross-entropy of the logits (torchtitan's trainer)",
            changed=f"torchtitan {module} '{flavor}' with {overrides}: " + "smaller than the debug model; "
            "MoE: 4 experts, no grouped_mm (a CPU has none)" * ("moe_args" in overrides),
        ),
    )


_TITAN_SMALL = dict(dim=HIDDEN, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=64)


def titan_llama3():
    return _titan(
        "llama3",
        "llama3_args",
        "debugmodel",
        "torchtitan Llama-3 (nn.RMSNorm, GQA off, RoPE complex)",
        multiple_of=32,
        **_TITAN_SMALL,
    )


def titan_qwen3():
    return _titan(
        "qwen3",
        "qwen3_args",
        "debugmodel",
        "torchtitan Qwen3 (GQA, q/k norm, tied embeddings)",
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        **_TITAN_SMALL,
    )


# ---- torch.nn ----------------------------------------------------------------------------------------------------


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer as its tutorial uses it: embeddings, the transformer (default dropout 0.1), a vocab head."""

    def __init__(self, vocab=VOCAB, d=HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(
            d_model=d, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=128, batch_first=True
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.transformer(self.emb(src), self.emb(tgt), tgt_mask=mask, tgt_is_causal=True))


class Seq2SeqLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, src, tgt, labels):
        return F.cross_entropy(self.model(src, tgt).flatten(0, 1), labels.flatten())


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder (norm_first, GELU, default dropout 0.1) over embeddings, mean-pooled, a classifier."""

    def __init__(self, vocab=VOCAB, d=HIDDEN, classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, 4, dim_feedforward=128, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.encoder(self.emb(x)).mean(1))


def nn_transformer():
    torch.manual_seed(0)
    model = Seq2SeqLoss(Seq2SeqTransformer()).train()
    return (
        model,
        (_tokens(11), _tokens(12), _tokens(13)),
        {},
        _notes(
            model,
            "torch.nn.Transformer encoder-decoder (default dropout 0.1), causal target mask",
            loss="Seq2SeqLoss: cross-entropy of the logits",
            changed="d_model 64, 2+2 layers, ffn 128",
        ),
    )


def nn_transformer_encoder():
    torch.manual_seed(0)
    model = WithLoss(EncoderClassifier()).train()
    return (
        model,
        (_tokens(14), torch.randint(0, 10, (BATCH,), generator=_gen(15))),
        {},
        _notes(
            model,
            "torch.nn.TransformerEncoder, pre-LN, GELU, default dropout 0.1",
            loss="WithLoss: cross-entropy",
            changed="d_model 64, 2 layers, ffn 128",
        ),
    )


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, written out (torchvision does not load on this CPU build)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += idt
        return self.relu(out)


class TinyResNet(nn.Module):
    """torchvision-style ResNet-10-ish: stem conv + BN + ReLU(inplace) + maxpool, two BasicBlocks, avgpool, fc."""

    def __init__(self, classes=10, width=16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_resnet():
    torch.manual_seed(0)
    model = WithLoss(TinyResNet()).train()
    return (
        model,
        (_images(16), torch.randint(0, 10, (BATCH,), generator=_gen(17))),
        {},
        _notes(
            model,
            "hand-built torchvision-style ResNet: BatchNorm2d (train), ReLU(inplace=True), in-place residual add_",
            loss="WithLoss: cross-entropy",
            changed="width 16, 2 blocks, 32x32 images",
        ),
    )


ZOO = {
    f.__name__: f
    for f in (
        gpt2,
        opt,
        llama,
        qwen2,
        qwen3,
        mistral,
        gemma2,
        gpt_neox,
        phi,
        gptj,
        falcon,
        bloom,
        gpt_bigcode,
        phi3,
        stablelm,
        mixtral,
        olmoe,
        qwen2_moe,
        bert,
        roberta,
        distilbert,
        electra,
        albert,
        deberta_v2,
        t5,
        bart,
        vit,
        swin,
        resnet,
        convnext,
        mobilenet_v2,
        clip,
        titan_llama3,
        titan_qwen3,
        nn_transformer,
        nn_transformer_encoder,
        torchvision_resnet,
    )
}
from zoo_more import MORE  # noqa: E402 (it builds on the helpers above)
from zoo_more2 import MORE2  # noqa: E402
from zoo_more3 import MORE3  # noqa: E402
from zoo_more4 import MORE4  # noqa: E402

ZOO.update(MORE)
ZOO.update(MORE2)
ZOO.update(MORE3)
ZOO.update(MORE4)


def preload():
    """Import the libraries the builders use, running no tensor op (forked.py forks the ranks after this): every
    transformers class named in this file, and torchtitan's model packages."""
    import importlib
    import inspect
    import re
    import sys
    import transformers

    transformers.logging.set_verbosity_error()
    source = inspect.getsource(sys.modules[__name__]) + inspect.getsource(sys.modules["zoo_more"])
    source += inspect.getsource(sys.modules["zoo_more2"]) + inspect.getsource(sys.modules["zoo_more3"])
    source += inspect.getsource(sys.modules["zoo_more4"])
    for cls in set(re.findall(r'"([A-Z]\w+(?:For\w+|Model|Config))"', source)):
        getattr(transformers, cls, None)
    try:
        for m in ("llama3", "qwen3"):
            importlib.import_module(f"torchtitan.models.{m}")
    except Exception:  # e.g. triton missing (the test extra has it): those entries fail at their build
        pass


def loss_of(out) -> torch.Tensor:
    """The loss of one call, as a user reads it: `.loss` of a ModelOutput, else the tensor itself."""
    return out.loss if hasattr(out, "loss") else out


def zero_dropout(model: nn.Module) -> list[str]:
    """Turn every random draw of `model` off in place (nn.Dropout p=0, attention dropout floats 0), keeping
    train() mode (BatchNorm keeps its batch statistics); returns what was turned off."""
    off = _dropout_in(model)
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
        for k, v in list(vars(m).items()):
            if isinstance(v, float) and ("dropout" in k or "drop_prob" in k) and not isinstance(m, nn.Dropout):
                setattr(m, k, 0.0)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        for k, v in cfg.to_dict().items():
            if isinstance(v, float) and ("dropout" in k or "drop_prob" in k or k.endswith("_pdrop")):
                try:
                    setattr(cfg, k, 0.0)
                except Exception:  # a sub-config's field, read through its own module attribute
                    pass
    return off
