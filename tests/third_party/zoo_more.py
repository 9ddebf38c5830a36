"""More unmodified third-party architectures for the zoo (tests/third_party/zoo.py merges them into ZOO): decoder
LMs with other attention, normalization and MoE variants, encoders, encoder-decoders and vision models, each built
small from its transformers config (random init, train() mode, dropout as the config has it)."""

from __future__ import annotations

from zoo import _LLAMA_LIKE, HIDDEN, VOCAB, _classify, _lm, _mlm, _seq2seq

_SMALL_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


# ---- decoder LMs -------------------------------------------------------------------------------------------------
def gemma():
    return _lm(
        "GemmaForCausalLM",
        "GemmaConfig",
        "decoder LM, GeGLU, (1 + w) RMSNorm, scaled embeddings",
        head_dim=16,
        **_LLAMA_LIKE,
    )


def gemma3():
    return _lm(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        "decoder LM, q/k norm, local (window 8) and global layers with their own RoPE bases",
        head_dim=16,
        sliding_window=8,
        **_LLAMA_LIKE,
    )


def starcoder2():
    return _lm(
        "Starcoder2ForCausalLM", "Starcoder2Config", "decoder LM, GQA, LayerNorm with biases, GELU MLP", **_LLAMA_LIKE
    )


def cohere():
    return _lm(
        "CohereForCausalLM",
        "CohereConfig",
        "decoder LM, parallel attention/MLP, LayerNorm without bias, logit scale",
        **_LLAMA_LIKE,
    )


def olmo2():
    return _lm(
        "Olmo2ForCausalLM", "Olmo2Config", "decoder LM, post-norm blocks, q/k RMSNorm over all heads", **_LLAMA_LIKE
    )


def granite():
    return _lm(
        "GraniteForCausalLM",
        "GraniteConfig",
        "decoder LM, embedding / residual / attention / logit multipliers",
        **_LLAMA_LIKE,
    )


def nemotron():
    return _lm(
        "NemotronForCausalLM",
        "NemotronConfig",
        "decoder LM, squared-ReLU MLP, (1 + w) LayerNorm, partial RoPE",
        **_LLAMA_LIKE,
    )


def persimmon():
    return _lm(
        "PersimmonForCausalLM",
        "PersimmonConfig",
        "decoder LM, fused qkv with q/k LayerNorm, squared ReLU",
        **_SMALL_DECODER,
    )


def codegen():
    return _lm(
        "CodeGenForCausalLM",
        "CodeGenConfig",
        "decoder LM, parallel attention/MLP, fused qkv split in mp_num groups, partial rotary",
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
        rotary_dim=8,
    )


def xglm():
    return _lm(
        "XGLMForCausalLM",
        "XGLMConfig",
        "decoder LM, sinusoidal positions, scaled embeddings",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        ffn_dim=128,
        num_layers=2,
        attention_heads=4,
        max_position_embeddings=64,
    )


def gpt_neo():
    return _lm(
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        "decoder LM, alternating global and local (window 8) attention, unscaled scores",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=8,
        max_position_embeddings=64,
    )


def deepseek_v3():
    return _lm(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        "decoder LM, multi-head latent attention (low-rank q and kv), a dense layer then shared + routed experts",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    )


def qwen3_moe():
    return _lm(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        "decoder LM, q/k RMSNorm, top-2 of 4 experts on every layer",
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        **_LLAMA_LIKE,
    )


# ---- encoders ----------------------------------------------------------------------------------------------------
def mpnet():
    return _mlm("MPNetForMaskedLM", "MPNetConfig", "encoder, relative position bias buckets", **_SMALL_DECODER)


def fnet():
    return _mlm(
        "FNetForMaskedLM",
        "FNetConfig",
        "encoder, token mixing by a 2-D FFT (real part) instead of attention",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )


def modernbert():
    return _mlm(
        "ModernBertForMaskedLM",
        "ModernBertConfig",
        "encoder, RoPE, GeGLU, alternating local/global attention, unpadded attention path",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        **_SMALL_DECODER,
    )


# ---- encoder-decoders --------------------------------------------------------------------------------------------
_SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=HIDDEN,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=64,
)


def mbart():
    return _seq2seq(
        "MBartForConditionalGeneration", "MBartConfig", "encoder-decoder, pre-norm with final LayerNorms", **_SEQ2SEQ
    )


def pegasus():
    return _seq2seq(
        "PegasusForConditionalGeneration", "PegasusConfig", "encoder-decoder, sinusoidal positions", **_SEQ2SEQ
    )


# ---- vision ------------------------------------------------------------------------------------------------------
_VIT_LIKE = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8
)


def dinov2():
    return _classify(
        "Dinov2ForImageClassification",
        "Dinov2Config",
        "vision transformer, layer scale, CLS + mean-patch head",
        **_VIT_LIKE,
    )


def deit():
    return _classify("DeiTForImageClassification", "DeiTConfig", "vision transformer (DeiT)", **_VIT_LIKE)


def beit():
    return _classify(
        "BeitForImageClassification",
        "BeitConfig",
        "vision transformer, relative position bias, layer scale",
        **_VIT_LIKE,
    )


def regnet():
    return _classify(
        "RegNetForImageClassification",
        "RegNetConfig",
        "CNN, grouped convolutions, squeeze-and-excitation, BatchNorm (train)",
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        groups_width=8,
    )


def segformer():
    return _classify(
        "SegformerForImageClassification",
        "SegformerConfig",
        "hierarchical vision transformer, overlapping patch embeddings, spatial-reduction attention, Mix-FFN conv",
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        decoder_hidden_size=32,
    )


# ---- state-space LMs ---------------------------------------------------------------------------------------------
def mamba():
    return _lm(
        "MambaForCausalLM",
        "MambaConfig",
        "selective state-space LM (Mamba): gated depthwise causal conv1d, input-dependent scan (the torch path)",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
    )


MORE = {
    f.__name__: f
    for f in (
        gemma,
        gemma3,
        starcoder2,
        cohere,
        olmo2,
        granite,
        nemotron,
        persimmon,
        codegen,
        xglm,
        gpt_neo,
        deepseek_v3,
        qwen3_moe,
        mpnet,
        fnet,
        modernbert,
        mbart,
        pegasus,
        dinov2,
        deit,
        beit,
        regnet,
        segformer,
        mamba,
    )
}
