"""Float8 pipeline plans executed on 4 gloo ranks against a one-device float8 reference.

The parent plans llama-tiny with float8 forced and pipeline stages (pp=2 x tp=2 under a cost model where tensor
parallelism pays, ParallelStyles inside the stages; pp=2 x dp=2, the batch split over dp) and launches one process
per rank. Each rank runs one step with backends/pipelining/runtime.py, whose stages compute the plan's float8 linears
(backends/float8_linear.py), and compares with the model on one device whose same linears run the same math on
plain tensors: every micro-batch (of every dp rank's rows) alone, since each GEMM scales the tensor it reads. The
tp ranks' scales are the whole tensors' (the amax all-reduced over tp), so the one-device reference needs no
per-shard scaling there. Also checked: the stages really ran float8 (the step is 1-10% of the largest gradient off
the fp32 step, far outside the tolerance against the float8 reference), the output head stayed high precision (the
plan's filter), and a converted module that is no nn.Linear is refused naming it.
"""

from __future__ import annotations

import pytest

from _dist import launch

MODEL, LAYERS, BATCH, SEQ = "llama-tiny", 4, 8, 8


def _plans(tmp_path):
    import autopar
    from autopar import models
    from autopar.testing import TP_FRIENDLY

    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta", n_layers=LAYERS)
    cases = []
    fsdp = {n: ("S0",) for n, p in m.named_parameters() if p.shape[0] % 2 == 0}  # FSDP2 gathers the weights
    for names, cluster, f8, force in (
        (("pp", "tp"), TP_FRIENDLY, {"emulate": True}, None),
        (("pp", "dp"), "h100", True, fsdp),
    ):
        pipeline = {"schedules": ["1F1B"], "n_microbatches": [2]}
        mesh = autopar.MeshSpec((2, 2), names)
        plan = autopar.plan(m, mesh, x, cluster=cluster, pipeline=pipeline, float8=f8, force=force)
        path = tmp_path / f"plan_{names[1]}.json"
        plan.save(path)
        cases.append({"path": str(path), "linears": plan.meta["float8"]["linears"]})
    return cases


def _reference(model, linears, pieces):
    """(mean loss, gradients) of `model` on one device with `linears` in float8, each piece of the batch alone."""
    import copy

    from autopar.backends.float8_linear import _forward

    ref = copy.deepcopy(model)
    for f in linears:
        ref.get_submodule(f).forward = _forward(ref.get_submodule(f))
    losses = [ref(x, y) / len(pieces) for x, y in pieces]
    for loss in losses:
        loss.backward()
    return sum(float(v.detach()) for v in losses), {k: p.grad for k, p in ref.named_parameters()}


def _rank_cases(cases):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import Plan, models
    from autopar.backends.pipelining.runtime import PipelineRunner, local_batch

    res = []
    for case in cases:
        plan = Plan.load(case["path"])
        model = models.build_model(MODEL, device="cpu", n_layers=LAYERS, seed=0)
        x, y = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, n_layers=LAYERS, seed=1)
        mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_names))
        dp = mesh.size(1) if "dp" in plan.mesh_names else 1
        m = plan.schedule["n_microbatches"]
        pieces = [(a, b) for xs, ys in zip(x.chunk(dp), y.chunk(dp)) for a, b in zip(xs.chunk(m), ys.chunk(m))]
        ref_loss, ref_grads = _reference(model, case["linears"], pieces)
        fp32 = copy.deepcopy(model)
        fp32(x, y).backward()
        d = mesh.get_local_rank("dp") if dp > 1 else 0
        local_ref, _ = _reference(model, case["linears"], pieces[m * d : m * (d + 1)])  # this dp rank's rows
        runner = PipelineRunner(model, plan, mesh)
        xl, yl = local_batch(plan, (x, y), d)
        loss = runner.step(xl if runner.is_first else None, yl if runner.is_last else None)
        err, off = {}, {}
        fp32_grads = dict(fp32.named_parameters())
        for n, p in runner.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            scale = ref_grads[n].abs().max()
            err[n] = float((g - ref_grads[n]).abs().max() / scale)
            off[n] = float((g - fp32_grads[n].grad).abs().max() / scale)
        res.append(
            {
                "float8": runner.float8,
                "wrappers": runner.wrappers,
                "tp_styles": runner.tp_styles,
                "grad_err": err,
                "fp32_grad_err": off,
                "loss": None if loss is None else float(loss),
                "ref_loss": None if loss is None else local_ref,
                "full_ref_loss": ref_loss,
            }
        )
        dist.barrier()
    return {"rank": dist.get_rank(), "cases": res}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_float8_pipeline_stages_equal_the_one_device_float8_reference(tmp_path):
    cases = _plans(tmp_path)
    for c in cases:  # every block linear, not the output head (torchtitan's filter)
        assert len(c["linears"]) == 7 * LAYERS and not any(f.startswith("output") for f in c["linears"]), c
    results = launch(_rank_cases, 4, [cases], tmp_path)
    for i, c in enumerate(cases):
        held = set()
        for r in results:
            h = r["cases"][i]
            held |= set(h["float8"])
            # 1e-7 to 1e-6 measured; an element's float8 rounding can flip with the summation order (tp's partial
            # sums), one e5m2 step being 25% of it: a margin, still 100x under the float8-vs-fp32 difference
            assert max(h["grad_err"].values()) < 1e-4, (i, h["grad_err"])
            f8 = [n for n in h["grad_err"] if n.rsplit(".", 1)[0] in h["float8"]]
            assert f8 and min(h["fp32_grad_err"][n] for n in f8) > 1e-2, (i, h["fp32_grad_err"])
            if h["loss"] is not None:
                assert h["loss"] == pytest.approx(h["ref_loss"], rel=1e-5), h
        assert held == set(c["linears"]), sorted(set(c["linears"]) - held)
    tp = [st for r in results for st in r["cases"][0]["tp_styles"]]
    assert any("ColwiseParallel" in v for st in tp for v in st.values()), tp  # the tp case ran DTensor operands
    assert all(w.startswith("FSDP") for r in results for w in r["cases"][1]["wrappers"])


def test_a_float8_linear_that_is_no_nn_linear_is_refused_naming_it():
    import torch
    from torch import nn

    import autopar
    from autopar import models
    from autopar.backends import float8_linear as float8

    class MyLinear(nn.Module):  # a GEMM on its own weight, priced in float8, not an nn.Linear
        def __init__(self, lin):
            super().__init__()
            self.weight = lin.weight

        def forward(self, x):
            return x @ self.weight.t()

    m = models.build_model(MODEL, device="cpu", n_layers=LAYERS)
    m.layers[0].attention.wq = MyLinear(m.layers[0].attention.wq)
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, n_layers=LAYERS)
    plan = autopar.plan(m, autopar.MeshSpec((2,), ("pp",)), x, cluster="h100", float8=True)
    assert "layers.0.attention.wq" in plan.meta["float8"]["linears"]
    with pytest.raises(NotImplementedError, match=r"module 'layers.0.attention.wq' \(MyLinear\).*\['output', 'wq'\]"):
        float8.check(m, plan, torch.device("cpu"))
    del plan.meta["float8"]["linears"]
    with pytest.raises(NotImplementedError, match="does not name them"):
        float8.check(m, plan, torch.device("cpu"))


def test_transformers_conv1d_runs_the_float8_gemm_of_its_transposed_weight():
    """GPT-2's linears (transformers' Conv1D: x @ W + b, W stored (in, out)) convert like an nn.Linear holding W^T:
    the same forward and gradients, float8 (off the fp32 ones by a few %)."""
    import copy

    import torch
    from transformers.pytorch_utils import Conv1D

    from autopar.backends import float8_linear

    torch.manual_seed(0)
    conv = Conv1D(48, 64)
    torch.nn.init.normal_(conv.bias)
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    fp32 = copy.deepcopy(conv)
    assert float8_linear.convert(torch.nn.ModuleDict({"c": conv, "l": lin}), ["c", "l"]) == ["c", "l"]
    x = torch.randn(4, 16, 64)
    outs = [m(x) for m in (conv, lin, fp32)]
    for o in outs:
        o.square().sum().backward()
    assert torch.equal(outs[0], outs[1]) and torch.equal(conv.weight.grad.t(), lin.weight.grad)
    err = (outs[0] - outs[2]).abs().max() / outs[2].abs().max()
    assert 1e-3 < err < 0.1, err


def test_a_converted_linear_output_can_be_modified_in_place():
    """OLMo clamps its q/k/v projections in place (clip_qkv): the float8 output must be an ordinary tensor, not a
    view made inside the custom autograd Function (which autograd forbids modifying in place)."""
    import torch

    from autopar.backends import float8_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    float8_linear.convert(torch.nn.ModuleDict({"q": lin}), ["q"])
    x = torch.randn(2, 8, 64, requires_grad=True)
    out = lin(x)
    out.clamp_(min=-0.5, max=0.5)
    out.sum().backward()
    assert out.shape == (2, 8, 32) and out.abs().max() <= 0.5 and x.grad.abs().max() > 0
