"""Small conv classifier (no BatchNorm: buffers that mutate in forward are not allowed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CNNConfig:
    in_channels: int = 3
    channels: int = 16
    n_classes: int = 10
    image_size: int = 16
    pool: int = 2

    def __post_init__(self):
        if self.image_size % self.pool:
            raise ValueError(f"image_size={self.image_size} not divisible by pool={self.pool}")


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.channels, 3, padding=1)
        self.conv2 = nn.Conv2d(cfg.channels, cfg.channels, 3, padding=1)
        side = cfg.image_size // cfg.pool
        self.fc = nn.Linear(cfg.channels * side * side, cfg.n_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(images))
        x = F.relu(self.conv2(x))
        x = F.avg_pool2d(x, self.cfg.pool)
        logits = self.fc(x.flatten(1))
        return F.cross_entropy(logits.float(), labels)
