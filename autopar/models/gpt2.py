"""GPT-2 with HuggingFace/nanoGPT module names (wte, wpe, h.N.attn.c_attn, ..., ln_f, lm_head)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPT2Config:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50257
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # c_attn's output features as Megatron-LM lays them out, [heads, (q, k, v), head_dim], instead of GPT-2's
    # [(q, k, v), heads, head_dim]: the same model up to a permutation of c_attn's rows, on which a
    # column-parallel c_attn hands each tp rank whole heads (no regrouping before attention)
    qkv_per_head: bool = False

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, qkv_per_head: bool = False):
        super().__init__()
        self.n_heads, self.head_dim, self.qkv_per_head = n_heads, dim // n_heads, qkv_per_head
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        if self.qkv_per_head:
            qkv = self.c_attn(x).view(bs, seqlen, self.n_heads, 3 * self.head_dim)
            q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))
        else:
            q, k, v = self.c_attn(x).split(dim, dim=-1)
            q, k, v = (t.view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(bs, seqlen, dim))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.dim, cfg.n_heads, cfg.qkv_per_head)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        if seqlen > self.cfg.max_seq_len:
            raise ValueError(f"seq {seqlen} > max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(seqlen, device=tokens.device)
        h = self.wte(tokens) + self.wpe(pos)
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
