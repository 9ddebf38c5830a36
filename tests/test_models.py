import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.models import (
    CONFIGS,
    build_model,
    example_inputs,
    get_config,
    llama_ffn_dim,
    model_args,
    model_names,
    num_params,
)
from autopar.models.moe import MoE

TINY = [n for n in model_names() if n.endswith("-tiny")]


def test_registry():
    names = model_names()
    for required in [
        "mlp-tiny",
        "mlp-heavy",
        "llama-tiny",
        "llama3-debug",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "gpt2-tiny",
        "gpt2-small",
        "moe-tiny",
        "moe-debug",
        "cnn-tiny",
    ]:
        assert required in names
    with pytest.raises(ValueError, match="llama3-8b"):
        get_config("llama3-9b")
    with pytest.raises(ValueError, match="unknown overrides"):
        build_model("llama-tiny", not_a_field=1)
    assert llama_ffn_dim(256) == 768 and model_args("llama3-debug").ffn_dim == 768
    assert model_args("llama3-8b").ffn_dim == llama_ffn_dim(4096, 1024, 1.3) == 14336


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name):
    model = build_model(name, device="cpu", seed=0)
    inputs = example_inputs(name, seed=0)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


def test_deterministic():
    a, b = build_model("llama-tiny", device="cpu", seed=3), build_model("llama-tiny", device="cpu", seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(
        a.layers[0].attention.wq.weight, build_model("llama-tiny", "cpu", seed=4).layers[0].attention.wq.weight
    )
    x1, x2 = example_inputs("llama-tiny", seed=1), example_inputs("llama-tiny", seed=1)
    assert all(torch.equal(u, v) for u, v in zip(x1, x2))
    tokens, labels = example_inputs("gpt2-tiny", batch=3, seq=8)
    assert tokens.shape == labels.shape == (3, 8) and tokens.dtype == torch.long and int(tokens.max()) < 256
    images, labels = example_inputs("cnn-tiny", device="meta")
    assert images.is_meta and images.shape == (8, 3, 16, 16) and labels.shape == (8,)


@pytest.mark.parametrize(
    "name,expected", [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.9e9), ("gpt2-small", 124.44e6)]
)
def test_param_counts(name, expected):
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert abs(num_params(model) - expected) / expected < 0.01


@pytest.mark.parametrize("name", list(CONFIGS))
def test_builds_on_meta(name):
    model = build_model(name, device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert num_params(model) > 0


def test_overrides():
    m = build_model("llama3-8b", n_layers=2)
    assert len(m.layers) == 2 and set(m.layers._modules) == {"0", "1"}
    moe = build_model("moe-debug")
    assert [hasattr(layer, "moe") for layer in moe.layers] == [False] + [True] * 5
    alt = build_model("moe-alt-tiny")
    assert [hasattr(layer, "moe") for layer in alt.layers] == [True, False, True]


@pytest.mark.parametrize("name,emb,out", [("gpt2-tiny", "wte", "lm_head"), ("llama-tiny", "tok_embeddings", "output")])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_tied_embeddings(name, emb, out, device):
    model = build_model(name, device=device, tie_embeddings=True)
    assert getattr(model, out).weight is getattr(model, emb).weight
    untied = build_model(name, device=device, tie_embeddings=False)
    assert num_params(model) == num_params(untied) - untied.get_submodule(out).weight.numel()
    if device == "cpu":
        model(*example_inputs(name)).backward()
        assert getattr(model, emb).weight.grad is getattr(model, out).weight.grad


def _moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop that runs only the top-k selected experts."""
    ex = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.softmax(moe.router(x[t]).float(), dim=-1)
        w, idx = torch.topk(probs, moe.top_k)
        w = w / w.sum()
        for wi, e in zip(w.tolist(), idx.tolist()):
            h = F.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])
            out[t] += wi * (h @ ex.w2[e])
        if moe.shared_experts is not None:
            out[t] += moe.shared_experts(x[t])
    return out


@pytest.mark.parametrize("name", ["moe-tiny", "moe-alt-tiny"])
def test_moe_dense_equals_sparse_reference(name):
    model = build_model(name, device="cpu", seed=0)
    moe = next(layer.moe for layer in model.layers if hasattr(layer, "moe"))
    with torch.no_grad():
        moe.router.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(1))  # decisive routing
    x = torch.randn(2, 8, model.cfg.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense, aux = moe(x)
        ref = _moe_reference(moe, x.reshape(-1, x.shape[-1])).view_as(x)
    torch.testing.assert_close(dense, ref, rtol=1e-5, atol=1e-6)
    assert aux.dim() == 0 and aux >= 0.99  # Switch aux loss is >= 1, with equality only for balanced routing


def test_moe_aux_loss_in_total():
    model = build_model("moe-tiny", device="cpu")
    inputs = example_inputs("moe-tiny")
    logits, aux = model.logits_and_aux(inputs[0])
    ce = F.cross_entropy(logits.flatten(0, 1).float(), inputs[1].flatten(0, 1))
    torch.testing.assert_close(model(*inputs), ce + model.cfg.aux_loss_coef * aux)


def _capture(model, inputs):
    params = dict(model.named_parameters())

    def train_step(params, *inputs):
        loss = functional_call(model, params, inputs)
        return loss, torch.autograd.grad(loss, list(params.values()))

    return make_fx(train_step, tracing_mode="fake")(params, *inputs)


@pytest.mark.parametrize("name", TINY)
def test_make_fx_capture(name):
    model = build_model(name, device="cpu")
    gm = _capture(model, example_inputs(name))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("mm" in t for t in targets) or any("convolution" in t for t in targets)
    assert len(gm.graph.find_nodes(op="output")[0].args[0]) == 1 + len(list(model.parameters()))  # flat: loss, grads


@pytest.mark.parametrize("name", ["llama-tiny", "moe-tiny"])
def test_make_fx_capture_meta_model(name):
    model = build_model(name, device="meta")
    gm = _capture(model, example_inputs(name, device="meta"))
    assert len(gm.graph.find_nodes(op="output")[0].args[0]) == 1 + len(list(model.parameters()))
