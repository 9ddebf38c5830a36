"""Op coverage, continued (tests/test_op_coverage.py is at its size bar): ops third-party models use that had no
placement rule, each in a tiny model that plans without replicate_ops and trains equal to one device on a
simulated 2x2 mesh (LocalTensorMode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar

from test_op_coverage import _check_trains

pytest.importorskip("torch.distributed._local_tensor")
pytestmark = pytest.mark.timeout(600)
aten = torch.ops.aten


class WeightNormConv(nn.Module):
    """wav2vec2 / HuBERT's positional convolution: a grouped Conv1d under parametrizations.weight_norm(dim=2),
    whose backward is the fused _weight_norm_interface_backward (no rule before: NoStrategyError)."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        conv = nn.Conv1d(d, d, 8, padding=4, groups=4)
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)

    def forward(self, x, y):
        h = self.inp(x).transpose(1, 2)
        return (self.conv(h)[..., :-1].transpose(1, 2) - y).pow(2).mean()


def test_weight_norm_backward_has_a_rule():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    # v and g pinned to shards of the normed dim (the rule's candidate), the planner choosing the rest
    pins = {
        "conv.parametrizations.weight.original0": ("S2", "R"),
        "conv.parametrizations.weight.original1": ("S2", "R"),
    }
    plan, _, _ = _check_trains(WeightNormConv(), (x, y), force=pins)
    assert not plan.coverage, plan.coverage


class Bags(nn.Module):
    """nn.EmbeddingBag over fixed-size bags (a 2-D input), mean and weighted-sum modes, as recommenders use it."""

    def __init__(self, n=64, d=16):
        super().__init__()
        self.mean, self.sum = nn.EmbeddingBag(n, d, mode="mean"), nn.EmbeddingBag(n, d, mode="sum")
        self.out = nn.Linear(2 * d, 1)

    def forward(self, a, b, w, y):
        z = torch.cat([self.mean(a), self.sum(b, per_sample_weights=w)], 1)
        return nn.functional.binary_cross_entropy_with_logits(self.out(z).squeeze(1), y)


def test_embedding_bag_of_fixed_bags_is_a_lookup_and_a_reduction():
    """aten._embedding_bag and its backward had no rule (NoStrategyError); fixed-size bags are captured as the
    lookup and the sum / mean they compute, which shard (tables by rows or columns, bags by batch)."""
    torch.manual_seed(0)
    a, b = torch.randint(0, 64, (16, 5)), torch.randint(0, 64, (16, 3))
    inputs = (a, b, torch.rand(16, 3), torch.rand(16).round())
    plan, _, _ = _check_trains(Bags(), inputs, force={"mean.weight": ("S0", "R"), "sum.weight": ("S1", "R")})
    assert not plan.coverage, plan.coverage
    # bags given by offsets (their sizes are values) keep the fused op: named, not run wrong
    bag, ids, offsets = nn.EmbeddingBag(64, 16), torch.randint(0, 64, (20,)), torch.tensor([0, 3, 9, 12])
    with pytest.raises(autopar.NoStrategyError, match="aten._embedding_bag.default.*module '<root>'"):
        autopar.plan(bag, (2, 2), (ids, offsets), loss_fn=lambda out: out.sum())


class ImageTokens(nn.Module):
    """Llava's merge: projected image features put at the image tokens' places with masked_scatter."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.proj, self.head = nn.Embedding(vocab, d), nn.Linear(8, d), nn.Linear(d, vocab)

    def forward(self, ids, patches, labels):
        x = self.emb(ids)
        mask = (ids == 0).unsqueeze(-1)  # token 0 stands for an image patch
        x = x.masked_scatter(mask, self.proj(patches))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_masked_scatter_is_a_gather_by_the_masks_count():
    """aten.masked_scatter and its backward had no rule (NoStrategyError naming them in Llava); captured as a
    cumulative count, an index_select and a where: same values, static shapes."""
    torch.manual_seed(0)
    ids = torch.randint(1, 32, (8, 12))
    ids[:, 2:6] = 0  # 4 image tokens a row
    inputs = (ids, torch.randn(8, 4, 8), torch.randint(0, 32, (8, 12)))
    plan, _, _ = _check_trains(ImageTokens(), inputs, force={"emb.weight": ("S0", "R"), "proj.weight": ("S0", "R")})
    assert not plan.coverage, plan.coverage
