"""Model zoo: named configs, builders and example inputs.

Every model is static (no data-dependent shapes, no in-place updates of params/buffers) and has
`forward(inputs, labels) -> scalar loss`, so it can be captured with make_fx on fake/meta tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from torch import nn

from autopar.models.cnn import CNN, CNNConfig
from autopar.models.gpt2 import GPT2, GPT2Config
from autopar.models.llama import LlamaConfig, Transformer, llama_ffn_dim
from autopar.models.mlp import MLP
from autopar.models.moe import MoEConfig, MoETransformer

__all__ = [
    "CONFIGS",
    "FAMILIES",
    "ModelConfig",
    "build_model",
    "example_inputs",
    "get_config",
    "model_names",
    "model_args",
    "num_params",
    "MLP",
    "Transformer",
    "LlamaConfig",
    "GPT2",
    "GPT2Config",
    "MoETransformer",
    "MoEConfig",
    "CNN",
    "CNNConfig",
    "llama_ffn_dim",
]

# family -> (model class, config dataclass or None when the class takes kwargs directly)
FAMILIES: dict[str, tuple[Callable[..., nn.Module], type | None]] = {
    "mlp": (MLP, None),
    "llama": (Transformer, LlamaConfig),
    "gpt2": (GPT2, GPT2Config),
    "moe": (MoETransformer, MoEConfig),
    "cnn": (CNN, CNNConfig),
}

# residual-stream output projections get GPT-2 style std / sqrt(2 * n_layers)
_RESIDUAL_OUT = ("wo.weight", "w2.weight", "c_proj.weight", "fc2.weight", "experts.w2")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch: int = 2
    seq: int = 16  # sequence length; for "cnn" the image side (taken from kwargs["image_size"])
    description: str = ""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {sorted(FAMILIES)}")


def _llama3(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size=128256, **kw) -> dict[str, Any]:
    return dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        ffn_dim=ffn_dim,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_seq_len=8192,
        **kw,
    )


CONFIGS: dict[str, ModelConfig] = {
    "mlp-tiny": ModelConfig("mlp", dict(dim=32, hidden=128, n_layers=2, vocab=64), batch=4, seq=16),
    "mlp-heavy": ModelConfig(
        "mlp",
        dict(dim=256, hidden=2048, n_layers=4, vocab=512),
        batch=8,
        seq=128,
        description="MLP-dominated FLOPs, for benchmarks",
    ),
    "llama-tiny": ModelConfig(
        "llama",
        dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=128),
        batch=2,
        seq=32,
    ),
    "llama3-debug": ModelConfig(
        "llama",
        _llama3(256, 6, 16, 16, llama_ffn_dim(256), vocab_size=2048),
        batch=8,
        seq=2048,
        description="torchtitan llama3 debugmodel",
    ),
    "llama3-8b": ModelConfig("llama", _llama3(4096, 32, 32, 8, 14336), batch=8, seq=8192),
    "llama3-70b": ModelConfig("llama", _llama3(8192, 80, 64, 8, 28672), batch=8, seq=8192),
    "llama3-405b": ModelConfig("llama", _llama3(16384, 126, 128, 8, 53248), batch=8, seq=8192),
    "gpt2-tiny": ModelConfig(
        "gpt2", dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32), batch=2, seq=32
    ),
    "gpt2-small": ModelConfig(
        "gpt2", dict(dim=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024), batch=8, seq=1024
    ),
    "moe-tiny": ModelConfig(
        "moe",
        dict(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=256,
            n_experts=4,
            top_k=2,
            moe_hidden=128,
            dense_ffn_dim=128,
            max_seq_len=128,
        ),
        batch=2,
        seq=16,
    ),
    "moe-alt-tiny": ModelConfig(
        "moe",
        dict(
            dim=64,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=256,
            n_experts=4,
            top_k=1,
            moe_hidden=64,
            n_shared_experts=1,
            dense_ffn_dim=128,
            moe_every=2,
            max_seq_len=128,
        ),
        batch=2,
        seq=16,
        description="uneven layers: MoE, dense, MoE",
    ),
    "moe-debug": ModelConfig(
        "moe",
        dict(
            dim=256,
            n_layers=6,
            n_heads=16,
            n_kv_heads=16,
            vocab_size=2048,
            n_experts=8,
            top_k=2,
            moe_hidden=256,
            n_shared_experts=1,
            dense_ffn_dim=1024,
            first_k_dense=1,
            max_seq_len=2048,
        ),
        batch=8,
        seq=2048,
        description="DeepSeek-V3-like debug shape (first layer dense)",
    ),
    "cnn-tiny": ModelConfig("cnn", dict(in_channels=3, channels=16, n_classes=10, image_size=16), batch=8, seq=16),
}


def model_names() -> list[str]:
    return list(CONFIGS)


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(CONFIGS)}")
    return CONFIGS[name]


def model_args(name: str, **overrides) -> Any:
    """The resolved constructor argument: a config dataclass, or a kwargs dict for families without one."""
    mc = get_config(name)
    kwargs = {**mc.kwargs, **overrides}
    cfg_cls = FAMILIES[mc.family][1]
    if cfg_cls is None:
        return kwargs
    known = {f.name for f in fields(cfg_cls)}
    if unknown := set(kwargs) - known:
        raise ValueError(f"unknown overrides {sorted(unknown)} for {name!r}; fields: {sorted(known)}")
    return cfg_cls(**kwargs)


def num_params(model: nn.Module) -> int:
    """Unique parameter elements (tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic init drawn on CPU (same values on every device/dtype): normal(std) for matrices,
    He-normal for convs, std/sqrt(2L) for residual output projections, ones for norm weights, zero biases."""
    gen = torch.Generator().manual_seed(seed)
    cfg = getattr(model, "cfg", model)
    out_std = std / math.sqrt(2 * max(1, getattr(cfg, "n_layers", 1)))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.ndim == 1:
            p.fill_(1.0)
        else:
            s = math.sqrt(2.0 / p[0].numel()) if p.ndim == 4 else out_std if name.endswith(_RESIDUAL_OUT) else std
            p.copy_(torch.randn(p.shape, generator=gen) * s)


def build_model(
    name: str, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> nn.Module:
    """Build a named model. On "meta" nothing is allocated; elsewhere weights are initialized from `seed`."""
    mc = get_config(name)
    model_cls, cfg_cls = FAMILIES[mc.family]
    args = model_args(name, **overrides)
    with torch.device("meta"):
        model = model_cls(**args) if cfg_cls is None else model_cls(args)
    model = model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        model = model.to_empty(device=device)
        init_weights(model, seed)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def example_inputs(
    name: str,
    batch: int | None = None,
    seq: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) int64 in [0, vocab), or (images `dtype`, labels) for "cnn". Deterministic from `seed`.

    `overrides` are the same config overrides given to build_model (they may change vocab/image size).
    For "cnn" `seq` is ignored: the image side is fixed by the classifier's Linear.
    """
    mc = get_config(name)
    args = model_args(name, **overrides)
    b = batch or mc.batch
    gen = torch.Generator().manual_seed(seed)
    if mc.family == "cnn":
        shape, n_labels = (b, args.in_channels, args.image_size, args.image_size), args.n_classes
        if torch.device(device).type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta"), torch.empty(b, dtype=torch.long, device="meta")
        images = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        return images, torch.randint(0, n_labels, (b,), generator=gen).to(device)
    s = seq or mc.seq
    vocab = args["vocab"] if isinstance(args, dict) else args.vocab_size
    if torch.device(device).type == "meta":
        return tuple(torch.empty(b, s, dtype=torch.long, device="meta") for _ in range(2))
    tokens = torch.randint(0, vocab, (b, s + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
