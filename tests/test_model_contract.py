"""The model contract at plan level (no process group): keyword inputs, ModelOutput/dict/tuple losses, forward-made
constants with data, data-dependent checks specialized with guards, unused parameters, bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.capture import CaptureError, capture
from autopar.guards import GuardError, check_guards
from autopar.model_io import ModelIO, pick_loss

MESH = (2, 2)


class _Net(nn.Module):
    def __init__(self, ret="tensor"):
        super().__init__()
        self.lin, self.ret = nn.Linear(8, 4), ret

    def forward(self, x, labels=None, scale: float = 1.0, **extra):
        loss = F.cross_entropy(self.lin(x) * scale, labels)
        return {"tensor": lambda: loss, "dict": lambda: {"logits": None, "loss": loss}, "tuple": lambda: (loss, x)}[
            self.ret
        ]()


def _xy():
    torch.manual_seed(0)
    return torch.randn(8, 8), torch.randint(0, 4, (8,))


@pytest.mark.parametrize("ret", ["tensor", "dict", "tuple"])
def test_loss_picked_from_output_kinds(ret):
    x, y = _xy()
    g = capture(_Net(ret), (x,), example_kwargs={"labels": y})
    assert g.io.out_kind == ("tensor" if ret == "tensor" else ret)
    assert len(g.inputs) == 2 and set(g.grads) == {"lin.weight", "lin.bias"}
    wrapped = g.io.wrap_loss(torch.tensor(1.0))
    assert {"tensor": torch.is_tensor, "dict": lambda w: w["loss"] == 1, "tuple": lambda w: w[0] == 1}[ret](wrapped)


def test_kwargs_bind_like_the_model():
    x, y = _xy()
    io = ModelIO.from_example(_Net(), {"x": x, "labels": y, "scale": 2.0})
    assert io.names == ["x", "labels", "scale"] and io.tensor_leaves == [0, 1]
    # positional or keyword, any order: the same call
    assert io.flatten_call((x,), {"scale": 2.0, "labels": y})[2] == 2.0
    with pytest.raises(ValueError, match="'scale' is 3.0 but the plan was captured with 2.0"):
        io.flatten_call((x, y), {"scale": 3.0})
    with pytest.raises(TypeError, match="other arguments than the example inputs the plan was captured with: scale"):
        io.flatten_call((x, y), {})
    with pytest.raises(TypeError, match="'labels' must be a tensor"):
        io.flatten_call((x, [1, 2]), {"scale": 2.0})
    io2 = ModelIO.from_example(_Net(), (x,), {"labels": y, "zz": 1, "aa": 2})  # **extra sorted by name
    assert io2.names == ["x", "labels", "extra['aa']", "extra['zz']"]


def test_bad_arguments_named_before_capture():
    x, y = _xy()
    with pytest.raises(TypeError, match="example_inputs is None"):
        autopar.plan(_Net(), MESH, None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        autopar.plan(lambda x: x, MESH, (x,))
    with pytest.raises(TypeError, match="example_kwargs must be a dict"):
        autopar.plan(_Net(), MESH, (x,), example_kwargs=[y])
    with pytest.raises(TypeError, match="unexpected keyword argument 'lables'"):
        autopar.plan(nn.Linear(8, 4), MESH, (x,), example_kwargs={"lables": y})
    with pytest.raises(TypeError, match="hold no tensor"):
        autopar.plan(_Net(), MESH, ([1.0, 2.0],))
    with pytest.raises(TypeError, match="numpy array"):
        autopar.plan(_Net(), MESH, (x.numpy(),), example_kwargs={"labels": y})
    with pytest.raises(TypeError, match="example_inputs is a dict .* and example_kwargs is given too"):
        autopar.plan(_Net(), MESH, {"x": x}, example_kwargs={"labels": y})

    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, labels=None):
            return {"logits": self.lin(x), "loss": None if labels is None else self.lin(x).sum()}

    with pytest.raises(CaptureError, match="NoLoss returned a dict without a loss .*labels="):
        autopar.plan(NoLoss(), MESH, {"x": x})
    with pytest.raises(TypeError, match="returned str"):
        pick_loss("no", None, "Net")


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.pooler = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y)


def test_unused_parameters_have_no_gradient():
    x, y = _xy()
    p = autopar.plan(_Unused(), MESH, (x, y), cluster="cpu-gloo")
    assert {"pooler.weight", "pooler.bias"} <= set(p.params)  # carried, with a placement
    g = capture(_Unused(), (x, y))
    assert set(g.grads) == {"lin.weight", "lin.bias"} and "pooler.weight" in g.params


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if (x > -10).all():  # a value decides Python: specialized, guarded
            h = h * 2
        n = int(x.shape[0] * (x.abs().max() > 0).item())
        return h[:n].pow(2).mean()


def test_data_dependent_check_is_specialized_with_a_guard():
    x = torch.randn(4, 8)
    g = capture(_Branchy(), (x,))
    assert [gd.expected for gd in g.guards] == [True, True]
    assert all(gd.leaves == [("input", 0)] for gd in g.guards)
    check_guards(g.guards, lambda leaf: x + 1, "test")  # still true: passes
    with pytest.raises(
        GuardError, match="module '<root>'.*gave True on the example inputs; this step's inputs give False"
    ):
        check_guards(g.guards, lambda leaf: x - 100, "test")


def test_data_dependent_check_on_meta_weights_is_refused():
    class OnWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8, device="meta")

        def forward(self, x):
            if self.lin.weight.sum() > 0:
                x = x * 2
            return self.lin(x).sum()

    with pytest.raises(CaptureError, match="depends on param 'lin.weight', which has no real value"):
        capture(OnWeight(), (torch.randn(2, 8),))


class _Splits(nn.Module):
    """jetmoe's router: per-expert counts read with .tolist() and used as split sizes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        counts = torch.tensor([1, 3], device=x.device) + (self.lin(x).sum() * 0).long()  # from the graph
        a, b = self.lin(x).split(counts.tolist())
        return a.sum() + b.pow(2).sum()


def test_tolist_is_specialized_like_item():
    """tolist() of a graph tensor failed in C++ ('tolist() shouldn't be called on a tensor with unallocated
    storage'); it is .item() of each element, specialized with guards."""
    g = capture(_Splits(), (torch.randn(4, 8),))
    assert [gd.expected for gd in g.guards] == [1, 3]


class _LayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if torch.rand([]) < 0.1:  # LayerDrop: skip the layer at random
            return x.sum()
        return self.lin(x).sum()


class _MaskSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h[h > 0].sum()


def test_random_branches_and_value_shaped_ops_are_named():
    with pytest.raises(
        CaptureError, match=r"a random draw \(aten.rand.default\) decides Python control flow.*LayerDrop"
    ):
        capture(_LayerDrop(), (torch.randn(2, 8),))
    with pytest.raises(CaptureError, match=r"in module '<root>'.*makes a tensor whose shape depends on tensor values"):
        capture(_MaskSelect(), (torch.randn(2, 8),))


class _AttnThenItem(nn.Module):
    """A check after attention without dropout (dropout_p=0 is deterministic, though the op is tagged seeded)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        q = self.lin(x).view(2, 1, 4, 8)
        h = F.scaled_dot_product_attention(q, q, q)
        return h.sum() * 2 if (h.abs().sum() > 0).item() else h.sum()


def test_check_after_dropout_free_attention_is_specialized():
    g = capture(_AttnThenItem(), (torch.randn(8, 8),))
    assert [gd.expected for gd in g.guards] == [True]


class _Made(nn.Module):
    """Tensors made and moved in forward: from data on the input's device (no dispatch sees it on meta), empty,
    factories on the input's device and on the default device, a mask moved with .to(device=...), a .cpu()."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        c = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)
        e = torch.tensor([], device=x.device)
        m = (torch.arange(4, device=x.device) < 2).to(device=x.device, dtype=x.dtype)
        pos = torch.arange(4, dtype=x.dtype)  # the default (CPU) device
        k = x.abs().sum().cpu()
        # (no view of the empty tensor: DTensor's view strategy never returns on a 0-sized reshape)
        return (torch.cat([self.lin(x * c * m + pos).flatten(), e]) * k).sum()


def test_forward_made_constants_keep_their_data():
    x = torch.randn(4, 4)
    g = capture(_Made(), (x,))
    vals = [v for v in g.constants.values() if v.numel()]
    assert any(torch.equal(v, torch.tensor([1.0, 2.0, 3.0, 4.0])) for v in vals)
    assert all(v.device.type == "cpu" for v in g.constants.values())
    devices = {a for n in g.ops() for a in n.kwargs.values() if isinstance(a, torch.device)}
    assert devices == {torch.device("meta")}  # made on the run device at run time
    from _simulated import simulated
    from autopar.testing import global_value
    from autopar.strategies._torch_adapter import outside_local_tensor_mode

    model = _Made()
    ref = copy.deepcopy(model)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, (x,), pin=lambda n: {0: "S0"} if n.kind == "input" else None)
        loss = pm(x)
        loss.backward()
        with outside_local_tensor_mode():
            r = ref(x)
            r.backward()
        assert abs(global_value(loss).item() - r.item()) <= 1e-6 + 1e-4 * abs(r.item())
        err = (global_value(pm.lin.weight.grad) - ref.lin.weight.grad).abs().max().item()
        assert err <= 1e-6 + 1e-4 * ref.lin.weight.grad.abs().max().item()


def _hf_cases():
    tr = pytest.importorskip("transformers")
    tr.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16))
    small = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    return {
        "gpt2": lambda: (
            tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=128, n_positions=32)),
            dict(input_ids=ids, labels=ids),
        ),
        "llama": lambda: (
            tr.LlamaForCausalLM(tr.LlamaConfig(**small, num_key_value_heads=2, max_position_embeddings=32)),
            dict(input_ids=ids, labels=ids),
        ),
        "bert": lambda: (
            tr.BertForMaskedLM(tr.BertConfig(**small, max_position_embeddings=32)),
            dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids),
        ),
        "vit": lambda: (
            tr.ViTForImageClassification(
                tr.ViTConfig(
                    hidden_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    intermediate_size=64,
                    image_size=16,
                    patch_size=8,
                    num_labels=3,
                )
            ),
            dict(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.tensor([0, 2])),
        ),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit"])
def test_transformers_models_run_with_no_wrapper(name):
    """*ForCausalLM / *ForMaskedLM / *ForImageClassification with keyword inputs and labels, default cache on:
    plan, then one step on 2 simulated ranks with the batch sharded (forward-made masks, caches and positions made
    on the run device), loss in the model's own ModelOutput, loss and every gradient equal to one device."""
    from _simulated import simulated
    from autopar.testing import global_value
    from autopar.strategies._torch_adapter import outside_local_tensor_mode

    model, kw = _hf_cases()[name]()
    model.eval()  # dropout off: random in-place ops are the functional capture's part, not this test's
    ref = copy.deepcopy(model)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, kw, pin=lambda n: {0: "S0"} if n.kind == "input" else None)
        assert set(pm.plan.params) >= {k for k, _ in model.named_parameters()}
        out = pm(**kw)
        out.loss.backward()
        with outside_local_tensor_mode():
            r = ref(**kw)
            r.loss.backward()
        assert type(out) is type(r) and out.logits is None
        assert abs(global_value(out.loss).item() - r.loss.item()) <= 1e-6 + 1e-4 * abs(r.loss.item())
        named = dict(pm.named_parameters())
        for k, p in ref.named_parameters():
            err = (global_value(named[k].grad) - p.grad).abs().max().item()
            assert err <= 1e-6 + 1e-4 * p.grad.abs().max().item(), k
        assert pm.plan.collectives(), "batch-sharded: the gradients are reduced"


def test_llama_runs_with_its_mask_check_guarded():
    """LlamaForCausalLM with use_cache=False and an attention mask: transformers' mask code asks whether the mask
    is all ones (`.all()` on a tensor): specialized on the example, run on 2 simulated ranks equal to one device,
    and a padded batch (which would take the other path) is refused naming the module and the input."""
    tr = pytest.importorskip("transformers")
    from _simulated import simulated
    from autopar.testing import global_value
    from autopar.strategies._torch_adapter import outside_local_tensor_mode

    tr.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16))
    cfg = tr.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = tr.LlamaForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, kw)
        assert len(pm.program.g.guards) == 1
        out = pm(**kw)
        out.loss.backward()
        with outside_local_tensor_mode():
            r = ref(**kw)
            r.loss.backward()
        assert type(out) is type(r)
        assert abs(global_value(out.loss).item() - r.loss.item()) <= 1e-6 + 1e-4 * abs(r.loss.item())
        named = dict(pm.named_parameters())
        for k, p in ref.named_parameters():
            err = (global_value(named[k].grad) - p.grad).abs().max().item()
            assert err <= 1e-6 + 1e-4 * p.grad.abs().max().item(), k
        padded = dict(kw, attention_mask=torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0))
        with pytest.raises(GuardError, match="module 'model'.*reading input 'attention_mask'.*gave True"):
            pm(**padded)
        with pytest.raises(ValueError, match="'use_cache' is True but the plan was captured with False"):
            pm(**dict(kw, use_cache=True))
