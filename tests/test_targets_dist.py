"""autopar.parallelize(backend="torch", target=TorchTarget(...)): the front door passes the declared data dims to
the planner (autopar/targets.py), so the engines' plan is solved once (the solve pass counted by patching it, on the
mesh's first rank: the other runs its plan) and is the plan target="torch" finds in two solves; one SGD step on 2
gloo ranks gives the single-device loss and gradients. Gloo timeout 60 s per collective, 300 s per launch (tests/_dist.py)."""

from __future__ import annotations

import pytest

import autopar
from _dist import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

MODEL, BATCH, SEQ, LR = "llama-tiny", 8, 64, 0.1
FP32_TOL = 1e-5  # fp32 on both sides; only the order of the reductions differs
GRAD_ATOL = 1e-7  # absolute floor: a mathematically zero gradient is float noise on both sides


def _rank():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    import autopar.passes.solve as solve_pass
    from autopar import models
    import autopar.backends.torch as engines
    from _clusters import GLOO_PER_STEP

    calls, run = [0], solve_pass.run

    def counting(state):
        calls[0] += 1
        return run(state)

    solve_pass.run = counting
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ref, model = models.build_model(MODEL, device="cpu"), models.build_model(MODEL, device="cpu")
    x, y = models.example_inputs(MODEL, batch=BATCH, seq=SEQ)
    out = {}
    for name, target in (("free", "torch"), ("declared", autopar.TorchTarget(("dp",)))):
        calls[0] = 0
        m = model if name == "declared" else models.build_model(MODEL, device="cpu")
        pm = autopar.parallelize(m, mesh, (x, y), backend="torch", target=target, cluster=GLOO_PER_STEP)
        assert pm is m
        out[name] = {"solves": calls[0], "hash": m._autopar_plan.hash(), "note": m._autopar_plan.meta["engine_replan"]}
    xl, yl = engines.local_inputs(model, mesh, x, y)
    with engines.train_context(model):
        loss = model(xl, yl)
        loss.backward()
    lv = loss.detach().clone()
    torch.distributed.all_reduce(lv)
    loss_ref = ref(x, y)
    loss_ref.backward()
    ref_params, off = dict(ref.named_parameters()), []
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        gr = ref_params[n].grad
        diff, top = (g - gr).abs().max().item(), gr.abs().max().item()
        if diff > FP32_TOL * top + GRAD_ATOL:
            off.append(f"{n}: max abs diff {diff:.3e} (largest entry {top:.3e})")
    out.update(grads_off=off, loss_rel=abs(lv.item() / 2 - loss_ref.item()) / abs(loss_ref.item()))
    return out


def test_parallelize_with_declared_data_dims_solves_once_and_trains_like_one_device(tmp_path):
    results = launch(_rank, 2, [], tmp_path)
    # the mesh's first rank solves, the other runs its plan (autopar/across_ranks.py)
    assert [(r["free"]["solves"], r["declared"]["solves"]) for r in results] == [(2, 1), (0, 0)], results
    for r in results:
        assert r["declared"]["hash"] == r["free"]["hash"], r
        assert r["declared"]["note"].startswith("planned for the engines in one solve"), r["declared"]["note"]
        assert not r["grads_off"] and r["loss_rel"] < FP32_TOL, r


def test_the_torch_backend_refuses_another_target_before_planning(monkeypatch):
    import torch.nn as nn

    def refuse(*a, **k):
        raise AssertionError("planned")

    import autopar.api

    monkeypatch.setattr(autopar.api, "plan", refuse)
    with pytest.raises(ValueError, match="target='torch' or an autopar.TorchTarget, got 'graph'"):
        autopar.parallelize(nn.Linear(2, 2), _CpuMesh(), (), backend="torch", target="graph")


class _CpuMesh:
    device_type = "cpu"
