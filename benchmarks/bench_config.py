"""What the benchmark runs: the measured CPU configurations and the modeled at-scale ones (one place, so the
harness, the worker processes and the tests agree)."""

from __future__ import annotations

# Measured on this machine: 4 gloo ranks, CPU, fp32, AdamW. key -> zoo model name, config overrides, global batch.
MEASURED = {
    "llama3-debug": dict(
        name="llama3-debug",
        overrides={},
        batch=4,
        seq=64,
        label="torchtitan's Llama-3 debugmodel shape (dim 256, 6 layers, 16 heads, vocab 2048)",
    ),
    "gpt2-smallish": dict(
        name="gpt2-small",
        batch=4,
        seq=64,
        overrides=dict(dim=384, n_layers=4, n_heads=6, vocab_size=8192, max_seq_len=128, tie_embeddings=False),
        label="GPT-2 small-ish (dim 384, 4 layers, 6 heads, vocab 8192, untied)",
    ),
    "moe-debug": dict(
        name="moe-debug",
        overrides={},
        batch=4,
        seq=32,
        label="DeepSeek-V3-like debug MoE (dim 256, 6 layers, 8 experts top-2 + 1 shared, first layer dense)",
    ),
    "mlp-heavy": dict(
        name="mlp-heavy",
        overrides={},
        batch=4,
        seq=64,
        label="MLP-heavy LM (dim 256, hidden 2048, 4 layers, vocab 512)",
    ),
}
MEASURED_MESHES = ("4", "2x2")
WORLD = 4

# Smoke configuration (--quick): the smallest model, one mesh, short runs.
QUICK_MEASURED = {"mlp-tiny": dict(name="mlp-tiny", overrides={}, batch=4, seq=16, label="tiny MLP LM (smoke run)")}
QUICK_MESHES = ("2x2",)

# Modeled at scale (no hardware): bf16 (FSDP2-style mixed precision AdamW), H100 cluster preset, the planner's
# default memory budget (90% of 80 GB). Global batch: one 8192-token sequence per 8 GPUs (Meta's 405B run:
# 2048 x 8192 tokens on 16,384 GPUs), at least 8.
_MOE_SCALED = dict(
    dim=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=16,
    vocab_size=32768,
    n_experts=16,
    top_k=2,
    moe_hidden=1024,
    n_shared_experts=1,
    dense_ffn_dim=8192,
    first_k_dense=1,
    max_seq_len=4096,
)
SCALE = [
    dict(key="llama3-8b", name="llama3-8b", overrides={}, mesh="8", seq=8192),
    dict(key="llama3-8b", name="llama3-8b", overrides={}, mesh="8x8", seq=8192),
    dict(key="llama3-70b", name="llama3-70b", overrides={}, mesh="32x8", seq=8192),
    dict(key="llama3-405b", name="llama3-405b", overrides={}, mesh="64x8", seq=8192),
    dict(key="llama3-405b", name="llama3-405b", overrides={}, mesh="2048x8", seq=8192),
    dict(
        key="moe-debug-scaled",
        name="moe-debug",
        overrides=_MOE_SCALED,
        mesh="8x8",
        seq=4096,
        label="moe-debug scaled up: dim 2048, 16 layers, 16 experts top-2 + 1 shared, vocab 32768",
    ),
]
SCALE_CLUSTER = "h100"
QUICK_SCALE = [dict(key="llama-tiny", name="llama-tiny", overrides={}, mesh="2x2", seq=32)]


def scale_batch(mesh: str) -> int:
    import math

    world = math.prod(int(s) for s in mesh.split("x"))
    return max(8, world // 8)
