"""Float8 linears as a precision choice (passes/float8.py): which GEMMs are converted, their pricing (fp8 peak,
cast and amax passes), the planner's choice, and execution on the graph backend (torch._scaled_mm runs on CPU)
on 2 gloo ranks against a one-device float8 reference written here (torchao's tensorwise recipe)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.models import build_model, example_inputs
from _dist import launch

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    """Two convertible linears (one with a bias: addmm) and a head whose out dim 24 is not a multiple of 16."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 24, bias=False)

    def forward(self, x, y):
        return ((self.head(self.down(torch.relu(self.up(x)))) - y) ** 2).mean()


def _net_inputs(batch=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 32, generator=g), torch.randn(batch, 24, generator=g)


@pytest.fixture(scope="module")
def llama_layer():
    """One Llama-3 8B layer at 16 x 8192 tokens on 8 H100s, planned without and with float8 ("auto")."""
    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=1)
    x = example_inputs("llama3-8b", batch=16, seq=8192, device="meta")
    return m, x, autopar.plan(m, (8,), x, cluster="h100", float8="auto")


def test_float8_halves_the_matmuls_of_a_big_llama_layer_and_prices_the_casts(llama_layer):
    _, _, p = llama_layer
    d, f8 = p.meta["precision_decision"], p.meta["float8"]
    assert d["chosen"].endswith("+ float8 linears"), d
    c = d["candidates"]
    assert c["fp32 + float8 linears"]["step_s"] < c["fp32"]["step_s"]
    # q, k, v, o, w1, w2, w3 converted, three GEMMs each; the output head stays bf16
    assert len(f8["linears"]) == 7 and f8["gemms"] == 21
    assert f8["skipped"] == {"output": "filtered (filter_fqns 'output')"}
    # compute-bound GEMMs at the fp8 peak (1979 vs 989 TFLOP/s): half the time, within the 1-byte operands' traffic
    assert 0.49 < f8["gemm_s"] / f8["unconverted_gemm_s"] < 0.52
    # the casts (amax + scaled cast per operand, memory-bound) are priced and visible: a few percent of the step
    assert 0.1 * f8["gemm_s"] < f8["cast_s"] < f8["gemm_s"]
    saved = f8["unconverted_gemm_s"] - f8["gemm_s"] - f8["cast_s"]
    gain = c["fp32"]["compute_s"] - c["fp32 + float8 linears"]["compute_s"]
    assert gain == pytest.approx(saved, rel=0.05)  # the plan's compute moved by what float8 saved, casts paid
    text = p.summary(timings=False)
    assert "float8 (tensorwise) GEMMs of 7 linears (21 GEMMs)" in text and "output: filtered" in text
    marked = [ln for ln in p.dump().splitlines() if " float8 e" in ln]
    assert len(marked) == 21 and sum("float8 e5m2xe4m3" in ln for ln in marked) == 14  # backward: grad_out in e5m2


def test_fsdp_float8_all_gather_halves_the_weight_gathers_and_casts_the_shards():
    """torchao's enable_fsdp_float8_all_gather on an FSDP-sharded Llama layer (every parameter forced Shard(0) on 8
    ranks): the 7 converted weights are gathered in e4m3, once in the forward and once in the backward, so the
    gathered bytes drop by exactly 2 x their elements (2 bytes each -> 1); their casts run on the shards."""
    from autopar.collectives import redistribute_time
    from autopar.graph import TensorMeta
    from autopar.passes.float8 import Float8Config

    assert not Float8Config().fsdp_float8_all_gather and not Float8Config().precompute_scale  # torchtitan's defaults
    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=1)
    x = example_inputs("llama3-8b", batch=8, seq=8192, device="meta")
    force = {k: ("S0",) for k, _ in m.named_parameters()}
    plans = {
        name: autopar.plan(m, (8,), x, cluster="h100", force=force, float8=f8)
        for name, f8 in (
            ("plain", True),
            ("fp8 gather", {"fsdp_float8_all_gather": True}),
            ("precomputed", {"fsdp_float8_all_gather": True, "precompute_scale": True}),
        )
    }
    gathers = {k: p.predicted["collectives"]["all_gather"] for k, p in plans.items()}
    converted = [f"{n}.weight" for n in plans["plain"].meta["float8"]["linears"]]
    elems = sum(dict(m.named_parameters())[f].numel() for f in converted)
    assert len(converted) == 7 and gathers["fp8 gather"]["count"] == gathers["plain"]["count"]
    assert gathers["plain"]["bytes"] - gathers["fp8 gather"]["bytes"] == 2 * elems
    f8 = plans["fp8 gather"].meta["float8"]
    assert sorted(w for _, w in f8["weight_casts"]) == sorted(converted) and f8["gathered_high_precision"] == {}
    assert f8["gemm_s"] == pytest.approx(plans["plain"].meta["float8"]["gemm_s"], rel=1e-12)
    assert f8["cast_s"] < plans["plain"].meta["float8"]["cast_s"]  # a shard cast replaces two full-weight casts
    assert plans["fp8 gather"].predicted["step_s"] < plans["plain"].predicted["step_s"]
    # the amax all-reduces: two of one scalar per weight, or precomputed: one of all 7 amaxes per step
    ar = lambda n: redistribute_time(("P",), ("R",), TensorMeta((n,), torch.float32), (8,), autopar.get_cluster("h100"))
    saved = f8["cast_s"] - plans["precomputed"].meta["float8"]["cast_s"]
    assert saved == pytest.approx(14 * ar(1) - ar(7), rel=1e-9) and saved > 0
    # the gathered weights are e4m3 in the plan's graph
    views = [n for n in plans["fp8 gather"].nodes if n["target"] == "t.default" and n["dtype"] == ["float8_e4m3fn"]]
    assert len(views) == 14  # each weight's forward transpose and the backward's transpose of it


def test_few_tokens_per_rank_casts_outweigh_the_gain():
    """At 4096 tokens over 8 ranks the weights' casts cost more than float8 saves: the planner keeps bf16."""
    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=1)
    x = example_inputs("llama3-8b", batch=2, seq=2048, device="meta")
    p = autopar.plan(m, (8,), x, cluster="h100", float8="auto")
    d = p.meta["precision_decision"]
    assert d["chosen"] == "fp32" and "float8" not in p.meta
    assert d["candidates"]["fp32 + float8 linears"]["step_s"] > d["candidates"]["fp32"]["step_s"]


def test_shapes_not_multiples_of_16_and_filtered_linears_stay_high_precision():
    m = Net()
    x = _net_inputs(256)
    p = autopar.plan(m, (2,), x, cluster="h100", float8={"filter_fqns": ["down"]})
    f8 = p.meta["float8"]
    assert f8["linears"] == ["up"] and f8["gemms"] == 2  # up's input is the model input: no grad_input GEMM
    assert f8["skipped"] == {
        "down": "filtered (filter_fqns 'down')",
        "head": "weight [24, 32]: dims not multiples of 16",
    }
    modules = {n["idx"]: n["module"] for n in p.nodes}
    assert {modules[r[0]] for r in f8["nodes"]} == {"up"}
    base = autopar.plan(m, (2,), x, cluster="h100")
    times = lambda q, mod: sorted(n.get("time_s", 0) for n in q.nodes if n["module"] == mod and "mm" in n["name"])
    if base.hash() == p.hash():  # the same placements: the unconverted GEMMs are priced as before
        assert times(p, "head") == times(base, "head") and times(p, "down") == times(base, "down")


def test_float8_needs_a_device_with_float8_matmuls():
    m, x = Net(), _net_inputs(64)
    with pytest.raises(ValueError, match="A100-SXM-80GB.*no float8 matmul peak"):
        autopar.plan(m, (2,), x, cluster="a100", float8=True)
    p = autopar.plan(m, (2,), x, cluster="a100", float8="auto")  # auto: not a candidate, and says why
    row = p.meta["precision_decision"]["candidates"]["fp32 + float8 linears"]
    assert "no float8 matmul peak" in row["infeasible"] and "float8" not in p.meta
    with pytest.raises(ValueError, match="unknown fields"):
        autopar.plan(m, (2,), x, cluster="h100", float8={"filter": ["x"]})
    with pytest.raises(ValueError, match="only 'tensorwise'"):
        autopar.plan(m, (2,), x, cluster="h100", float8={"recipe": "rowwise"})


def test_the_torch_engines_convert_the_float8_nn_linears_and_refuse_other_modules():
    from autopar.backends import torch as torch_backend
    from autopar.backends.torch.recognize import recognize

    m, x = Net(), _net_inputs(256)
    p = autopar.plan(m, (2,), x, cluster="h100", float8=True)
    low = recognize(p, m)
    assert low.float8 == ["down", "up"] and not any(r[0] == "float8" for r in low.reasons), low.reasons
    code = torch_backend.render(p, m)
    assert "convert_float8_linears(model, float8_linears)" in code and "float8_linears = [" in code

    class MyLinear(nn.Module):  # the GEMM of its own weight the planner converts; no nn.Linear
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 32))

        def forward(self, x):
            return x @ self.weight.t()

    m.up = MyLinear()
    p = autopar.plan(m, (2,), x, cluster="h100", float8=True)
    why = dict(recognize(p, m).reasons)["float8"]
    assert "module 'up' (MyLinear)" in why and "['output', 'up']" in why, why


def test_a_forced_pipeline_layout_prices_every_stage_in_float8():
    """The published harness's way: a MeshSpec with a pp dim and a pipeline dict, float8=True."""
    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=4)
    x = example_inputs("llama3-8b", batch=8, seq=8192, device="meta")
    mesh = autopar.MeshSpec((2, 2, 2), ("pp", "dp", "tp"))
    opts = {"n_microbatches": [4], "schedules": ["1F1B"]}
    base = autopar.plan(m, mesh, x, cluster="h100", pipeline=opts)
    p = autopar.plan(m, mesh, x, cluster="h100", pipeline=opts, float8=True)
    assert p.meta["float8"]["filter_fqns"] == ["output"] and "float8" not in base.meta
    busy = lambda q: [st["time"]["F_s"] + st["time"]["B_s"] + st["time"]["W_s"] for st in q.stages]
    # every stage computes less; the last holds the bf16 output head (vocab 128256), so it gains least
    assert all(a < b for a, b in zip(busy(p), busy(base))) and busy(p)[0] < 0.9 * busy(base)[0]
    assert p.predicted["step_s"] < base.predicted["step_s"]
    assert "float8 linears (tensorwise" in p.summary(timings=False)
    with pytest.raises(ValueError, match="not available for pipeline plans"):
        autopar.plan(m, mesh, x, cluster="h100", pipeline=opts, float8="auto")
    # the linears the pipelining runtime converts, named in the model (every block's, from the stage plans' graphs)
    f8 = p.meta["float8"]
    assert len(f8["linears"]) == 7 * 4 and f8["skipped"] == {"output": "filtered (filter_fqns 'output')"}, f8
    assert {f.split(".")[1] for f in f8["linears"]} == {"0", "1", "2", "3"}


# ---- execution: 2 gloo ranks against a one-device reference ------------------------------------------------------


def _q(t, dtype):
    """t quantized tensorwise to `dtype` and back (the scale from its amax), in fp32."""
    top = torch.finfo(dtype).max
    s = top / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * s).clamp(-top, top).to(dtype).float() / s


class _F8Linear(torch.autograd.Function):
    """torchao's tensorwise Float8Linear math: x, W in e4m3, grad_out in e5m2, every GEMM operand scaled alone."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        out = _q(x, torch.float8_e4m3fn) @ _q(w.t(), torch.float8_e4m3fn)
        return out if b is None else out + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gi = _q(g, torch.float8_e5m2) @ _q(w, torch.float8_e4m3fn)
        gw = _q(g.t(), torch.float8_e5m2) @ _q(x, torch.float8_e4m3fn)
        return gi, gw, (g.sum(0) if ctx.needs_input_grad[2] else None)


def _reference(model, x, y):
    """(loss, grads) of `model` with up/down in float8 on one device (head stays fp32)."""
    ref = copy.deepcopy(model)
    for name in ("up", "down"):
        lin = getattr(ref, name)
        lin.forward = lambda t, lin=lin: _F8Linear.apply(t, lin.weight, lin.bias)
    loss = ref(x, y)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in ref.named_parameters()}


def job_float8_dp(fsdp=False, backend="graph"):
    """Rank job: the float8 plan data-parallel on 2 ranks (batch sharded), one step: parameters replicated, or with
    fsdp the converted weights sharded and gathered as float8 is priced (fsdp_float8_all_gather; executed as
    high-precision gathers, the same numerics: the gathered weight's scale is the whole weight's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Net()
    x, y = _net_inputs()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    force = {k: ("S0",) if fsdp and k in ("up.weight", "down.weight") else ("R",) for k, _ in model.named_parameters()}
    opts = dict(
        cluster="h100",
        float8={"fsdp_float8_all_gather": True} if fsdp else True,
        force=force,
        pin=lambda n: {0: "S0"} if n.kind == "input" else None,
    )
    if backend == "graph":
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x, y), **opts)
        loss, plan = pm(x, y), pm.plan
    else:  # the user's module parallelized in place by the engines; each rank feeds its half of the batch
        plan = autopar.plan(model, (2,), (x, y), target="torch", **opts)
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (x, y), backend="torch", plan=plan, cluster="h100")
        half = slice(dist.get_rank() * 1024, (dist.get_rank() + 1) * 1024)
        loss = pm(x[half], y[half])
    loss.backward()
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
    grads = {k: full(p.grad) for k, p in pm.named_parameters()}
    # the reference: each rank's half of the batch in float8 on one device (per-rank scales), averaged
    halves = [_reference(model, x[i * 1024 : (i + 1) * 1024], y[i * 1024 : (i + 1) * 1024]) for i in range(2)]
    ref_loss = (halves[0][0] + halves[1][0]) / 2
    fp32 = copy.deepcopy(model)
    fp32_loss = fp32(x, y)
    fp32_loss.backward()
    out = {
        "rank": dist.get_rank(),
        "gemms": plan.meta["float8"]["gemms"],
        "weight_casts": len(plan.meta["float8"]["weight_casts"]),
        "sharded_gemms": sum(
            any(p != ["R"] for p in n["placement"]["ins"])
            for n in plan.nodes
            if n["idx"] in {r[0] for r in plan.meta["float8"]["nodes"]}
        ),
        "loss": float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss),
        # the graph backend returns the batch's loss, the engines this rank's half's
        "ref_loss": float(ref_loss if backend == "graph" else halves[dist.get_rank()][0]),
        "converted": sorted(pm._autopar_lowering.float8) if backend == "torch" else None,
        "fp32_loss": float(fp32_loss),
        "grad_err": {},
        "fp32_grad_err": {},
    }
    for k, g in grads.items():
        ref_g = (halves[0][1][k] + halves[1][1][k]) / 2
        out["grad_err"][k] = float((g - ref_g).abs().max() / ref_g.abs().max())
        out["fp32_grad_err"][k] = float((g - dict(fp32.named_parameters())[k].grad).abs().max() / ref_g.abs().max())
    return out


def test_a_saved_plan_gathering_weights_in_float8_runs_on_a_fresh_capture(tmp_path):
    """The float8 pass retypes the views between a weight FSDP gathers in float8 and its GEMMs (e4m3: priced at one
    byte an element); a saved plan's fresh capture (autopar/execution.py: Plan.load, and every rank but the mesh's
    first under parallelize) repeats it, so the graphs agree node for node and dtype for dtype."""
    from autopar.execution import finished

    model, (x, y) = Net(), _net_inputs()
    force = {k: ("S0",) if k in ("up.weight", "down.weight") else ("R",) for k, _ in model.named_parameters()}
    plan, state = autopar.plan(
        model,
        (2,),
        (x, y),
        cluster="h100",
        float8={"fsdp_float8_all_gather": True},
        force=force,
        pin=lambda n: {0: "S0"} if n.kind == "input" else None,
        return_state=True,
    )
    views = plan.meta["float8"]["gathered_views"]
    assert views and all(state.graph.nodes[v].outs[0].dtype == torch.float8_e4m3fn for v in views)
    plan.save(tmp_path / "plan.json")
    ex = finished(model, (x, y), plan=autopar.Plan.load(tmp_path / "plan.json"))
    assert [n.outs for n in ex.graph.nodes] == [n.outs for n in state.graph.nodes]
    assert ex.placement == tuple(state.placement)


@pytest.mark.dist
@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("backend", ["graph", "torch"])
def test_float8_plan_runs_on_two_gloo_ranks_as_the_per_rank_float8_reference(tmp_path, fsdp, backend):
    """The graph backend (its float8 GEMMs, backends/spmd/float8.py) and the torch engines (FSDP2 or replicated
    parameters with the plan's gradient hooks, the linears converted: backends/float8_linear.py)."""
    for r in launch(job_float8_dp, 2, [fsdp, backend], tmp_path):
        assert r["converted"] in (None, ["down", "up"]), r["converted"]
        assert r["gemms"] == 5 and r["sharded_gemms"] == 5  # every float8 GEMM reads this rank's batch shard
        assert r["weight_casts"] == (2 if fsdp else 0)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6)
        # the graph's fp32 ops round differently from eager autograd in the last bit, which can move an element
        # across a float8 rounding boundary (one e5m2 step is 25%): a few 1e-4 of the largest gradient at most
        assert max(r["grad_err"].values()) < 1e-3, r["grad_err"]
        # and it is float8, not fp32: 3-11% of the largest gradient off the fp32 step (30x the tolerance above)
        assert 1e-5 < abs(r["loss"] / r["fp32_loss"] - 1) < 0.05
        assert min(r["fp32_grad_err"][k] for k in ("up.weight", "down.weight")) > 1e-2, r["fp32_grad_err"]
        assert max(r["fp32_grad_err"].values()) < 0.3


class TPMlp(nn.Module):
    """w1 (colwise) -> relu -> w2 (rowwise) -> sum: the input needs no gradient, so 5 GEMMs (w1 has no grad_input)."""

    def __init__(self, d=1024, h=4096):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x))).sum()


def test_tensor_parallel_float8_all_reduces_each_operand_amax_over_the_tp_group(monkeypatch):
    """torchao's Float8ColwiseParallel / Float8RowwiseParallel: every operand cast of a GEMM whose weight is
    sharded on a mesh dim takes the amax of a DTensor, one fp32 scalar all-reduce over that dim. By hand: forward
    w1 (x, W1) and w2 (h, W2): 4 casts; w2's grad_input (grad_out, W2): 2; w2's grad_weight (h; grad_out's cast is
    shared): 1; w1's grad_weight (grad_h, x): 2; so 9 all-reduces."""
    from autopar.collectives import redistribute_time
    from autopar.graph import TensorMeta
    from autopar.passes import float8 as f8

    x = torch.randn(4096, 1024, device="meta")
    tp = {"w1.weight": ("S0",), "w2.weight": ("S1",)}

    def cast_s(force):
        p = autopar.plan(TPMlp(), (2,), (x,), cluster="h100", force=force, float8=True)
        assert p.meta["float8"]["gemms"] == 5
        return p.meta["float8"]["cast_s"]

    with_amax = cast_s(tp)
    monkeypatch.setattr(f8, "_tp_amax_time", lambda *a: 0.0)
    without = cast_s(tp)
    ar = redistribute_time(("P",), ("R",), TensorMeta((1,), torch.float32), (2,), autopar.get_cluster("h100"))
    assert ar > 0
    assert with_amax - without == pytest.approx(9 * ar, rel=1e-9)


def test_compile_casts_an_activation_read_by_several_float8_linears_once():
    """wq, wk, wv read one norm output and w1, w3 another: in the forward and again in the backward's weight-gradient
    GEMMs, so 6 of a layer's activation casts repeat one (REPEAT). Compiled, Inductor's CSE computes each once,
    so the compiled cast seconds are below eager's by at least those 6 full casts (amax read, cast read, 1-byte
    write of a (tokens / 8) x 4096 bf16 activation each; compile's fused amaxes save more on top)."""
    from autopar.passes import float8 as f8

    m = build_model("llama3-8b", dtype=torch.bfloat16, n_layers=1)
    x = example_inputs("llama3-8b", batch=8, seq=2048, device="meta")
    force = {k: ("S0",) for k, _ in m.named_parameters()}
    cl = autopar.get_cluster("h100").with_device(fusion="inductor")
    p = autopar.plan(m, (8,), x, cluster=cl, force=force, float8=True)
    rows = p.meta["float8"]["nodes"]
    assert sum(r[3:5].count(f8.REPEAT) for r in rows) == 6
    eager = autopar.plan(m, (8,), x, cluster="h100", force=force, float8=True).meta["float8"]["cast_s"]
    compiled = p.meta["float8"]["cast_s"]
    # every repeated cast is of a (tokens / 8) x 4096 bf16 activation, priced in full eager and not at all compiled
    dev = cl.device
    one = 8 * 2048 // 8 * 4096 * (2 * 2 + 1) / (dev.mem_bw * dev.mem_eff) + 2 * dev.op_overhead
    assert compiled < eager - 6 * one * 0.99
