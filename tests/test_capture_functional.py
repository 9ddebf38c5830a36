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


class CheckpointedDropout(nn.Module):
    """Blocks with dropout run under torch.utils.checkpoint (non-reentrant; transformers'
    gradient_checkpointing_enable): the backward runs each block again, with the forward's RNG state restored."""

    def __init__(self, ckpt: bool):
        super().__init__()
        self.ckpt = ckpt
        block = lambda: nn.Sequential(nn.Linear(D, 2 * D), nn.Dropout(0.5), nn.Linear(2 * D, D))
        self.blocks = nn.ModuleList(block() for _ in "ab")

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = x + (checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x))
        return x.pow(2).mean()


def _fsdp_on_2_simulated_ranks(model, x, steps, seed=None):
    """Plan `model` FSDP-pinned on 2 simulated ranks (capture must leave the user's generator as it was), train it
    `steps` steps against a copy on one device (both seeded with `seed` when it is given): the comparison report."""
    import copy
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _simulated import simulated
    from autopar.testing import fsdp_force, train_and_compare

    before = torch.get_rng_state()
    plan, state = autopar.plan(model, (2,), x, cluster="cpu-gloo", force=fsdp_force(model, (2,)), return_state=True)
    assert torch.equal(torch.get_rng_state(), before)
    ref = copy.deepcopy(model)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        if seed is not None:
            torch.manual_seed(seed)
            pm.program.manual_seed(seed)
        return train_and_compare(pm, ref, x, steps=steps, count=False)


def test_checkpointed_blocks_replay_the_forwards_dropout():
    """The recompute ran on the model's own CPU weights (functional_call had restored them: 'Tensor on device cpu
    is not on the expected device meta'); and a recomputed dropout must reuse the forward's mask, not draw again
    (the program would draw a second mask: other gradients, silently). Checked against one device on 2 simulated
    ranks, dropout on."""
    torch.manual_seed(0)
    model, x = CheckpointedDropout(True).train(), (torch.randn(8, D),)
    seeded = lambda g: sum(torch.Tag.nondeterministic_seeded in n.target.tags for n in g.ops())
    assert seeded(capture(model, x)) == seeded(capture(CheckpointedDropout(False).train(), x)) == 2
    # one step: its loss and gradients see both blocks' masks (later steps under LocalTensorMode draw differently
    # from one device with or without checkpointing, a limit of the simulation, not of this)
    rep = _fsdp_on_2_simulated_ranks(model, x, steps=1, seed=7)
    assert rep.ok, rep.failures[:5]


class CheckpointedAttention(nn.Module):
    """Causal SDPA blocks under non-reentrant checkpointing, dropout 0 (the default of Llama-like configs)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in "ab")
        self.out = nn.ModuleList(nn.Linear(D, D) for _ in "ab")

    def block(self, i, x):
        b, s, _ = x.shape
        q, k, v = self.qkv[i](x).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return self.out[i](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for i in range(2):
            x = x + checkpoint(self.block, i, x, use_reentrant=False)
        return x.pow(2).mean()


def test_checkpointed_attention_recomputes_as_its_forward():
    """Capture routes a dropout-free SDPA to the fused attention op; torch.autograd.grad used to hand itself to
    capture's TorchFunctionModes, which ran it with the modes popped, so checkpoint's recompute in the backward
    ran SDPA unfused and its saved tensors mismatched (CheckpointError: saved [B, H, S, S], recomputed
    [B*H, S, S]). Every Llama-like transformers model after gradient_checkpointing_enable() failed so. Now the
    recompute is fused like its forward, and two steps on 2 simulated ranks equal one device."""
    torch.manual_seed(0)
    model, x = CheckpointedAttention().train(), (torch.randn(4, 8, D),)
    fused = [n for n in capture(model, x).ops() if "flash" in str(n.target)]
    assert len(fused) == 4, fused  # each block's forward and backward
    rep = _fsdp_on_2_simulated_ranks(model, x, steps=2)
    assert rep.ok, rep.failures[:5]


def test_transformers_llama_plans_after_gradient_checkpointing_enable():
    """The same through transformers: LlamaForCausalLM (attention dropout 0) after gradient_checkpointing_enable()."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/third_party")
    from zoo import ZOO

    model, _, kwargs, _ = ZOO["llama"]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = autopar.plan(model, autopar.MeshSpec((2,), ("dp",)), example_kwargs=kwargs, cluster="h100")
    fused = [n for n in plan.nodes if "flash_attention" in str(n["target"])]
    assert [n["phase"] for n in fused] == ["fw", "fw", "bw", "bw"], fused  # 2 layers


class DeadDropout(nn.Module):
    """A dropout on a branch the loss does not read (CANINE's final character encoder under a sequence
    classifier), drawn by eager before the dropout the loss does read."""

    def __init__(self):
        super().__init__()
        self.fc, self.unused, self.drop = nn.Linear(D, D), nn.Linear(D, D), nn.Dropout(0.5)

    def forward(self, x):
        h = self.fc(x)
        self.drop(self.unused(h))  # dead: dropped from the graph, but one device draws its mask
        return self.drop(h).pow(2).mean()


def test_dropped_random_ops_still_advance_the_generator():
    """The dead branch's draw left the graph, so the live dropout drew the dead one's place in the stream (another
    mask than one device's: CANINE's loss was 2e-3 off); the live node now draws past it first."""
    torch.manual_seed(0)
    model, x = DeadDropout().train(), (torch.randn(8, D),)
    rep = _fsdp_on_2_simulated_ranks(model, x, steps=1, seed=7)
    assert rep.ok, rep.failures[:5]


class CopyIntoStrided(nn.Module):
    """A copy into a buffer laid out column-major, then a view legal on that layout only (Longformer's chunked
    attention does this in the backward of its slice assignments)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        buf = x.new_zeros(6, 8).t()  # (8, 6), strides (1, 8)
        buf.copy_(self.lin(x) * 2)
        return buf.t().view(48).pow(2).mean()


def test_copy_into_a_strided_buffer_keeps_its_layout():
    """copy(dst, src) was recorded as clone(src) in src's layout, so the view failed on meta ('view size is not
    compatible with input tensor's size and stride'); the value is made in dst's layout and trains as one device."""
    torch.manual_seed(0)
    model, x = CopyIntoStrided(), (torch.randn(8, 6),)
    rep = _fsdp_on_2_simulated_ranks(model, x, steps=2)
    assert rep.ok, rep.failures[:5]


def test_reentrant_checkpoint_is_refused_naming_its_module():
    """use_reentrant=True: its forward runs the block under no_grad (capture's module hooks failed there with
    "'NoneType' object has no attribute '_sequence_nr'") and its backward calls .backward() itself, which
    torch.autograd.grad refuses; the error says so and names the module."""
    from torch.utils.checkpoint import checkpoint

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(D, D), nn.ReLU())

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=True).pow(2).mean()

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.blk = nn.Linear(D, D), Outer()

        def forward(self, x):
            return self.blk(self.inp(x))

    with pytest.raises(CaptureError, match=r"use_reentrant=True\) in module 'blk'.*pass use_reentrant=False"):
        capture(Root(), (torch.randn(4, D),))


class ChannelsLastConvDropout(nn.Module):
    """DPT's neck: tokens reshaped NHWC and permuted to NCHW (a channels-last view), a conv, dropout on its output."""

    def __init__(self):
        super().__init__()
        self.proj, self.conv, self.drop = nn.Linear(D, D), nn.Conv2d(D, 8, 3, padding=1), nn.Dropout(0.5)

    def forward(self, x):  # x: (batch, 4 * 4 tokens, D)
        h = self.proj(x).view(x.shape[0], 4, 4, D).permute(0, 3, 1, 2)
        return self.drop(self.conv(h)).pow(2).mean()


def test_conv_output_layout_is_the_devices_for_its_dropout():
    """The meta convolution is always contiguous, the CPU / CUDA kernels' output channels-last for a channels-last
    input: dropout's mask, drawn in its buffer's memory order, was another mask than one device's."""
    torch.manual_seed(0)
    model, x = ChannelsLastConvDropout().train(), (torch.randn(8, 16, D),)
    rep = _fsdp_on_2_simulated_ranks(model, x, steps=1, seed=7)
    assert rep.ok, rep.failures[:5]
