"""Residual MLP language model: the smallest model that still has embedding, matmul chains and a loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, n_layers: int, vocab: int):
        super().__init__()
        self.dim, self.hidden, self.n_layers, self.vocab = dim, hidden, n_layers, vocab
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(h)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
