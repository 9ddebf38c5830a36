"""torch.compile pricing (autopar/cost/fusion.py, DeviceSpec fusion="inductor"): a fused chain of memory-bound ops
reads its inputs once and writes only what leaves it, against a hand count on RMSNorm + SwiGLU; eager unchanged."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost import fusion, get_cluster
from autopar.models import build_model, example_inputs

T, D, H = 8 * 2048, 1024, 4096  # tokens, model dim, SwiGLU hidden dim


class Block(nn.Module):
    """RMSNorm (pow, mean, add, rsqrt, mul, mul) -> w1, w3 -> silu(a) * b -> w2 -> sum, all fp32."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))
        self.w1, self.w3 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return self.w2(F.silu(self.w1(y)) * self.w3(y)).sum()


def _forward(fusion_kind):
    x = torch.randn(8, 2048, D, device="meta")
    cl = get_cluster("h100").with_device(fusion=fusion_kind)
    return autopar.plan(Block(), (1,), (x,), cluster=cl, backward=False)


def test_rmsnorm_and_swiglu_fuse_into_one_read_and_one_write_per_region():
    p, eager = _forward("inductor"), _forward("eager")
    dev = get_cluster("h100").device
    mm = lambda q: sum(n["time_s"] for n in q.nodes if n["target"] == "mm.default")
    assert mm(p) == mm(eager)  # the GEMMs are library kernels either way
    # by hand, 4-byte elements: RMSNorm reads x and w, writes y; SwiGLU reads w1's and w3's outputs, writes their
    # product; the loss sum reads w2's output and writes the scalar
    fused = 4 * ((T * D + D + T * D) + (T * H + T * H + T * H) + (T * D + 1))
    assert p.predicted["compute_s"] == pytest.approx(mm(p) + fused / (dev.mem_bw * dev.mem_eff), rel=1e-9)
    # eager: each of the 9 memory-bound ops reads its inputs and writes its output
    rms = 2 * T * D + (T * D + T) + 2 * T + 2 * T + (T * D + T + T * D) + (T * D + D + T * D)
    eager_bytes = 4 * (rms + (2 * T * H) + (3 * T * H) + (T * D + 1))
    assert eager.predicted["compute_s"] == pytest.approx(mm(eager) + eager_bytes / (dev.mem_bw * dev.mem_eff), rel=1e-9)


def test_fused_reads_and_writes_of_a_training_step():
    """The forward's y is saved for the backward (written); the norm's inner values are not; every gradient is an
    output of the step (written)."""
    from autopar.capture import capture

    g = capture(Block(), (torch.randn(2, 16, D, device="meta"),))
    io = fusion.fused_io(g)
    name = lambda i: str(g.nodes[i].target)
    by_name = {}
    for i, o in io.skip_writes:
        by_name.setdefault(name(i), 0)
        by_name[name(i)] += 1
    assert "aten.mean.dim" in by_name and "aten.rsqrt.default" in by_name
    grads = {r.node for r in g.grads.values()}
    assert not any(i in grads for i, _ in io.skip_writes)
    # nothing a GEMM reads is skipped, nor any GEMM's own read or write
    gemm = {n.idx for n in g.ops() if n.target == torch.ops.aten.mm.default}
    assert not any(i in gemm for i, _ in io.skip_reads | io.skip_writes)


def test_compile_lowers_a_llama_step_and_eager_is_the_default():
    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=1)
    x = example_inputs("llama3-8b", batch=2, seq=4096, device="meta")
    base = autopar.plan(m, (8,), x, cluster="h100")
    same = autopar.plan(m, (8,), x, cluster=get_cluster("h100").with_device(fusion="eager"))
    comp = autopar.plan(m, (8,), x, cluster=get_cluster("h100").with_device(fusion="inductor"))
    assert get_cluster("h100").device.fusion == "eager" and get_cluster("cpu-gloo").device.fusion == "eager"
    assert same.predicted["step_s"] == base.predicted["step_s"] and same.hash() == base.hash()
    assert comp.predicted["compute_s"] < 0.97 * base.predicted["compute_s"]


def test_float8_casts_fuse_their_amax_under_compile():
    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=1)
    x = example_inputs("llama3-8b", batch=16, seq=8192, device="meta")
    f8 = lambda cl: autopar.plan(m, (8,), x, cluster=cl, float8=True).meta["float8"]
    eager, comp = f8(get_cluster("h100")), f8(get_cluster("h100").with_device(fusion="inductor"))
    assert comp["gemm_s"] == pytest.approx(eager["gemm_s"], rel=1e-9)
    # the casts of norm outputs and pointwise gradients lose their separate amax read (2 bytes of 5 per element)
    assert 0.55 * eager["cast_s"] < comp["cast_s"] < 0.9 * eager["cast_s"]


def test_unknown_fusion_names_the_device():
    x = torch.randn(2, 16, D, device="meta")
    with pytest.raises(ValueError, match="H100-SXM.*fusion must be one of"):
        autopar.plan(Block(), (1,), (x,), cluster=get_cluster("h100").with_device(fusion="xla"))


def test_the_batch_formula_refuses_a_fused_device():
    from autopar.symbolic import batch_formula

    m, x = Block(), (torch.randn(2, 16, D, device="meta"),)
    _, st = autopar.plan(m, (1,), x, cluster=get_cluster("h100").with_device(fusion="inductor"), return_state=True)
    with pytest.raises(ValueError, match="H100-SXM.*fusion='inductor'"):
        batch_formula(st, m, x)


def test_fusion_eff_scales_the_skipped_bytes_between_eager_and_fully_fused():
    """DeviceSpec.fusion_eff: 0 saves nothing (eager's compute), 1 the full fused count, 0.5 halfway (linear)."""
    x = torch.randn(8, 2048, D, device="meta")
    cl = get_cluster("h100").with_device(fusion="inductor")
    step = {
        e: autopar.plan(Block(), (1,), (x,), cluster=cl.with_device(fusion_eff=e), backward=False).predicted[
            "compute_s"
        ]
        for e in (0.0, 0.5, 1.0)
    }
    assert step[0.0] == pytest.approx(_forward("eager").predicted["compute_s"], rel=1e-12)
    assert step[0.5] == pytest.approx((step[0.0] + step[1.0]) / 2, rel=1e-9) and step[1.0] < step[0.0]


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return torch.relu(x * self.w)


class TwoLayers(nn.Module):
    """Two ModuleList layers of pointwise ops, then a sum outside them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scale(), Scale()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_inductor_compiles_each_layer_on_its_own_and_inductor_graph_the_whole_model():
    """By hand, 4-byte elements, N = T * D: eager moves 9N + 2D + 1 (per layer mul N + D + N, relu 2N; sum N + 1);
    "inductor" (torchtitan's per-block compile) 5N + 2D + 1 (each layer reads its input and weight and writes its
    output once: layer 0's result crosses into layer 1, layer 1's into the eager sum); "inductor-graph" N + 2D + 1."""
    x = torch.randn(8, 2048, D, device="meta")
    dev = get_cluster("h100").device
    compute = {
        f: autopar.plan(
            TwoLayers(), (1,), (x,), cluster=get_cluster("h100").with_device(fusion=f), backward=False
        ).predicted["compute_s"]
        for f in ("eager", "inductor", "inductor-graph")
    }
    bw = dev.mem_bw * dev.mem_eff
    assert compute["eager"] - compute["inductor"] == pytest.approx(4 * 4 * T * D / bw, rel=1e-9)
    assert compute["inductor"] - compute["inductor-graph"] == pytest.approx(4 * 4 * T * D / bw, rel=1e-9)
