"""Functional capture: in-place ops on temporaries are captured as their functional forms (torch's
functionalization), buffer updates become `Graph.state_updates`, and parameter or input mutations are refused
with the module and op named. Each model here failed capture before (every mutating op was refused)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.capture import CaptureError, capture

pytestmark = pytest.mark.timeout(300)
aten = torch.ops.aten
D = 16


class Head(nn.Module):
    """Wraps a body into a scalar loss: a linear layer in front so that every model has a trainable weight."""

    def __init__(self, body: nn.Module, d: int = D):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.body = body

    def forward(self, x):
        return self.body(self.inp(x)).float().pow(2).mean()


class InplaceTemp(nn.Module):
    def forward(self, x):
        y = x * 2
        y.div_(3.0)  # an MoE router's normalisation
        y.add_(torch.ones_like(y))  # an attention bias added in place
        return y


class AsStrided(nn.Module):
    def forward(self, x):
        y = x.clone()
        y.as_strided_((x.shape[0], D // 2), (D, 2))  # a pooler picking every other feature in place
        return y


class QR(nn.Module):
    def forward(self, x):
        q, r = torch.linalg.qr(x)
        return q + r.sum()


def ops_of(g):
    return {n.target for n in g.ops()}


def mutable(g):
    return [n.name for n in g.ops() if n.target._schema.is_mutable]


@pytest.mark.parametrize(
    "body,expect",
    [
        (nn.RMSNorm(D), {aten.rsqrt.default}),
        (nn.ReLU(inplace=True), {aten.relu.default}),
        (InplaceTemp(), {aten.div.Tensor, aten.add.Tensor}),
        (AsStrided(), {aten.as_strided.default}),
        (nn.Dropout(0.1), {aten.bernoulli.p}),
    ],
)
def test_inplace_ops_capture_as_functional_ops(body, expect):
    g = capture(Head(body), (torch.randn(8, D),))
    assert not mutable(g), mutable(g)
    assert expect <= ops_of(g), sorted(map(str, ops_of(g)))
    assert not g.state_updates


def test_views_stay_views():
    """An in-place op through a view: functionalization reapplies the view on the updated base as a view op."""

    class ViewInplace(nn.Module):
        def forward(self, x):
            y = x.view(x.shape[0], 2, D // 2)
            y.mul_(2.0)
            return x.relu()

    g = capture(Head(ViewInplace()), (torch.randn(8, D),))
    assert not mutable(g)
    assert aten.view.default in ops_of(g) and aten.mul.Tensor in ops_of(g)


@pytest.mark.parametrize("body", [nn.RMSNorm(D), nn.ReLU(inplace=True), InplaceTemp(), nn.Dropout(0.1)])
def test_inplace_models_plan(body):
    plan = autopar.plan(Head(body), (2, 2), (torch.randn(8, D),), allow_replicate=True)
    assert set(plan.params) == {"inp.weight", "inp.bias"} | {f"body.{k}" for k, _ in body.named_parameters()}


def test_qr_captures_and_plans():
    g = capture(Head(QR()), (torch.randn(8, D),))
    assert not mutable(g)
    autopar.plan(Head(QR()), (2,), (torch.randn(8, D),), allow_replicate=True)


@pytest.mark.parametrize("bn,x", [(nn.BatchNorm1d(D), (8, D)), (nn.BatchNorm2d(4), (8, 4, 5, 5))])
def test_batchnorm_train_updates_are_state(bn, x):
    model = nn.Sequential(bn, nn.Flatten(), nn.LazyLinear(3)) if False else _BNNet(bn, x)
    g = capture(model.train(), (torch.randn(x),))
    assert not mutable(g)
    assert set(g.state_updates) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    nbt = g.nodes[g.state_updates["bn.num_batches_tracked"].node]
    assert nbt.target is aten.add.Tensor and nbt.inputs()[0].node == g.buffers["bn.num_batches_tracked"]
    g_eval = capture(model.eval(), (torch.randn(x),))
    assert not g_eval.state_updates and not mutable(g_eval)


class _BNNet(nn.Module):
    def __init__(self, bn, x):
        super().__init__()
        self.bn = bn
        self.fc = nn.Linear(torch.Size(x[1:]).numel(), 3)

    def forward(self, x):
        return self.fc(self.bn(x).flatten(1)).pow(2).mean()


class BumpsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x).sum()


class BumpsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        x.add_(1.0)
        return self.lin(x).sum()


def test_parameter_and_input_mutations_are_refused():
    with pytest.raises(CaptureError, match=r"mutates parameter 'lin\.weight' in place \(in module '<root>', op mul_"):
        capture(BumpsWeight(), (torch.randn(4, D),))
    with pytest.raises(CaptureError, match=r"mutates input 0 in place .*op add_"):
        capture(BumpsInput(), (torch.randn(4, D),))


def test_error_names_the_user_op_not_its_decomposition():
    class Item(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            y = self.lin(x)
            if torch.linalg.matrix_norm(y) > 0:  # a tensor value decides control flow
                return y.sum()
            return y.mean()

    with torch.device("meta"):  # no real weights: the check cannot be specialized on example values
        m = Item()
    with pytest.raises(CaptureError, match=r"module '<root>' \(in __bool__\)"):
        capture(m, (torch.randn(4, D),))


def test_batchnorm_train_is_reductions_and_pointwise():
    """Batch norm and its backward are recorded through torch._decomp's decompositions (no fused batch-norm op),
    so a reduction over a sharded batch is a partial the plan all-reduces."""
    for mode, bn in (
        ("train", nn.BatchNorm2d(4)),
        ("eval", nn.BatchNorm2d(4)),
        ("train", nn.BatchNorm2d(4, track_running_stats=False)),
    ):
        g = capture(getattr(_BNNet(bn, (8, 4, 5, 5)), mode)(), (torch.randn(8, 4, 5, 5),))
        names = {str(t) for t in ops_of(g)}
        assert not any("batch_norm" in s for s in names), (mode, names)
        assert {"aten.sum.dim_IntList", "aten.rsqrt.default"} <= names, (mode, names)


def test_torchtitan_llama3_debugmodel_captures_and_plans():
    """torchtitan's Llama-3 debug model (nn.RMSNorm, whose CPU decomposition adds in place to a temporary)."""
    import dataclasses

    titan = pytest.importorskip("torchtitan.models.llama3")
    args = dataclasses.replace(
        titan.llama3_args["debugmodel"], dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=64
    )
    with torch.device("meta"):
        model = titan.Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))

    class WithLoss(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, x, y):
            return F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

    ids = torch.randint(0, 128, (2, 16))
    g = capture(WithLoss(model), (ids, ids.roll(-1, 1)))
    assert not mutable(g) and not g.state_updates
    plan = autopar.plan(WithLoss(model), (2, 2), (ids, ids.roll(-1, 1)), allow_replicate=True)
    assert "model.layers.0.attention_norm.weight" in plan.params


def test_engines_refuse_batchnorm_on_batch_shards():
    """backend="torch": a BatchNorm in training mode on a batch-sharded plan is not what FSDP/DDP compute, so the
    engines' recognizer names the module (auto then runs the graph backend)."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _clusters import SHAPES
    from autopar.backends.torch.recognize import recognize

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.bn = nn.BatchNorm1d(D)

        def forward(self, x):
            return self.bn(self.lin(x)).pow(2).mean()

    x = (torch.randn(64, D),)
    pin = lambda n: {0: "S0"} if n.kind == "input" else None
    plan = autopar.plan(Net().train(), (2,), x, cluster=SHAPES, pin=pin)
    assert set(plan.meta["state_updates"]) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    low = recognize(plan, Net())
    assert any(part == "module bn" and "running statistics" in why for part, why in low.reasons), low.reasons
    plan_eval = autopar.plan(Net().eval(), (2,), x, cluster=SHAPES, pin=pin)
    assert "state_updates" not in plan_eval.meta
    assert not any(part == "module bn" for part, _ in recognize(plan_eval, Net()).reasons)
