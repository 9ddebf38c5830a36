"""Mixture-of-experts decoder (Llama attention + top-k routed SwiGLU experts), computed densely.

Every expert runs on every token and the outputs are weighted by a dense (T, E) gate matrix that is zero
outside each token's top-k experts. That is mathematically equal to sparse dispatch but has only static
shapes (no nonzero / masks / all-to-all), so it traces and shards like any other dense model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.llama import Attention, FeedForward, RMSNorm, rope_cos_sin


@dataclass
class MoEConfig:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None
    vocab_size: int = 2048
    n_experts: int = 8
    top_k: int = 2
    moe_hidden: int = 256
    n_shared_experts: int = 0
    dense_ffn_dim: int = 1024
    moe_every: int = 1
    first_k_dense: int = 0
    aux_loss_coef: float = 0.01
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"bad head config: dim={self.dim} n_heads={self.n_heads} n_kv_heads={self.n_kv_heads}")
        if not 1 <= self.top_k <= self.n_experts or self.moe_every < 1:
            raise ValueError(
                f"bad moe config: top_k={self.top_k} n_experts={self.n_experts} moe_every={self.moe_every}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense and (layer_id - self.first_k_dense) % self.moe_every == 0


class Experts(nn.Module):
    """E SwiGLU experts as batched weights: w1/w3 (E, dim, hidden), w2 (E, hidden, dim)."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x: (T, dim), gate: (T, E) -> sum_e gate[:, e] * expert_e(x): (T, dim)."""
        h = F.silu(torch.einsum("td,edh->eth", x, self.w1)) * torch.einsum("td,edh->eth", x, self.w3)
        out = torch.einsum("eth,ehd->etd", h, self.w2)
        return torch.einsum("etd,te->td", out, gate.to(out.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.moe_hidden)
        self.shared_experts = (
            FeedForward(cfg.dim, cfg.moe_hidden * cfg.n_shared_experts) if cfg.n_shared_experts > 0 else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (T, dim) -> (router probs (T, E) fp32, top-k weights (T, k), top-k indices (T, k))."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        return probs, w / w.sum(dim=-1, keepdim=True), idx

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, seqlen, dim = x.shape
        xt = x.reshape(bs * seqlen, dim)
        probs, w, idx = self.route(xt)
        gate = torch.zeros_like(probs).scatter(1, idx, w)
        out = self.experts(xt, gate)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xt)
        mask = torch.zeros_like(probs).scatter(1, idx, torch.ones_like(w))
        load, mean_probs = self.token_means(mask, probs)
        aux = self.n_experts * (load / self.top_k * mean_probs).sum()
        return out.view(bs, seqlen, dim), aux

    def token_means(self, mask: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router statistics of the aux loss, each expert's share of the routed tokens and its mean probability:
        means over every token of the batch. A plan written by hand that splits the batch replaces this with means
        over the global batch (benchmarks/hand_plans.py); autopar needs nothing: it plans the model as written."""
        return mask.mean(0), probs.mean(0)


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: MoEConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.dense_ffn_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        if self.is_moe:
            out, aux = self.moe(self.ffn_norm(h))
            return h + out, aux
        return h + self.feed_forward(self.ffn_norm(h)), None


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(i, cfg) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def logits_and_aux(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.tok_embeddings(tokens)
        cos, sin = rope_cos_sin(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device, h.dtype)
        aux_total = None
        for layer in self.layers:
            h, aux = layer(h, cos, sin)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        return self.output(self.norm(h)), aux_total

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = self.logits_and_aux(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        if aux is not None and self.cfg.aux_loss_coef:
            loss = loss + self.cfg.aux_loss_coef * aux
        return loss
