"""Llama-3 style decoder with torchtitan's module names (tok_embeddings, layers.N.attention.wq, ...).

Kept trace-friendly: RoPE is real-valued (rotate-half) and its cos/sin are computed inside forward from
torch.arange on the input's device, so the model has no buffers and works unchanged on meta/fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None
    vocab_size: int = 2048
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # "repeat": K/V repeated to the query heads before SDPA (torchtitan's Llama of 2024); "native": SDPA on the KV
    # heads (enable_gqa), as GQA-aware kernels run it: attention keeps, and context parallelism gathers, K/V at
    # n_kv_heads
    gqa: str = "repeat"

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"bad head config: dim={self.dim} n_heads={self.n_heads} n_kv_heads={self.n_kv_heads}")
        if self.gqa not in ("repeat", "native"):
            raise ValueError(f"gqa must be 'repeat' or 'native', got {self.gqa!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def llama_ffn_dim(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """torchtitan/Meta rule: hidden = 4*dim -> 2/3 of it -> optional multiplier -> round up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, head_dim) cos/sin tables for rotate-half RoPE, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, Dh); cos/sin: (S, Dh)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, S, Hkv, Dh) -> (B, S, Hkv * n_rep, Dh) with expand+reshape (static shapes)."""
    if n_rep == 1:
        return x
    bs, slen, n_kv, hd = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, gqa: str = "repeat"):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.gqa = n_heads, n_kv_heads, gqa
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        native = self.gqa == "native" and n_rep > 1
        if not native:
            xk, xv = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=native)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: LlamaConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.gqa)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, cfg) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Re-establish tying; also needed after `to_empty`, which allocates tied params separately."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = rope_cos_sin(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


Llama = Transformer
