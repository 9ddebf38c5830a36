"""A saved plan runs on the graph backend with no planner call: Plan.save -> Plan.load -> autopar.parallelize(...,
plan=loaded). The model is captured again (capture is not planning) and must give the plan's graph; everything else
the executor needs comes from the Plan (autopar/execution.py). The planner's entry points are patched to raise while
the loaded plan is built and trained on 2 gloo ranks; the loaded run must equal a freshly planned one (same plan,
same loss and gradients, to the bit) and the single-device model (2 SGD steps), and issue the plan's collectives.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util

import pytest
import torch

import autopar
from _clusters import SHAPES
from _dist import launch
from autopar.execution import PlanLoadError, from_plan
from autopar.models import build_model, example_inputs
from autopar.testing import tp_force

pytestmark = pytest.mark.timeout(300)

LLAMA = ("llama-tiny", {"n_layers": 1}, 2, 32)  # name, overrides, batch, seq


def _tp_plan(name, ov, batch, seq, **kw):
    """A Megatron-like plan of a tiny model on 2 ranks (forced: a cost model would replicate a model this small)."""
    model = build_model(name, **ov)
    x = example_inputs(name, batch=batch, seq=seq, device="meta", **ov)
    force = tp_force(model, (2,))
    return autopar.plan(model, (2,), x, cluster=SHAPES, overlap=False, force=force, time_limit=5, **kw)


def _dp_pin(n):
    return {0: "S0"} if n.kind == "input" else None


def _dp_plan(name, ov, batch, seq):
    """Data parallel (inputs batch-sharded, parameters replicated): the loss's (sum, count) all_reduces are
    coalesced and an MoE's expert loads go to the end of the forward (fw_order)."""
    model = build_model(name, **ov)
    x = example_inputs(name, batch=batch, seq=seq, device="meta", **ov)
    force = {k: ("R",) for k, _ in model.named_parameters()}
    return autopar.plan(
        model, (2,), x, cluster=SHAPES, overlap=False, force=force, pin=_dp_pin, time_limit=5, return_state=True
    )


@pytest.mark.parametrize("case", ["llama-tp", "moe-dp"])
def test_saved_plan_rebuilds_what_the_planner_decided(case, tmp_path):
    """The executor's inputs rebuilt from a saved and loaded Plan equal the planner's own PlanState fields."""
    if case == "llama-tp":
        plan, state = _tp_plan(*LLAMA, return_state=True)
    else:
        plan, state = _dp_plan("moe-tiny", {"n_layers": 1}, 4, 16)
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    assert loaded.hash() == plan.hash()
    ex = from_plan(loaded, state.graph)
    red = lambda r: {k: (tuple(s), tuple(d), tuple(c.to_json() for c in cs)) for k, (s, d, cs) in r.items()}
    assert ex.placement == tuple(state.placement)
    assert red(ex.redistributes) == red(state.redistributes)
    assert ex.shares == (state.shares or {}) and ex.coalesced == (state.coalesced or {})
    assert ex.fw_order == (tuple(state.fw_order) if state.fw_order else None)
    if case == "moe-dp":  # the records this case exists for are really there
        assert ex.coalesced and ex.shares and ex.fw_order


@pytest.mark.parametrize("case", ["llama-tp", "moe-dp"])
def test_typed_records_round_trip_through_json(case, tmp_path):
    """Plan.redistribute_records() / bucket_records(): frozen dataclasses that give back the JSON records they were
    read from, the same from a fresh plan and from its saved and loaded copy."""
    import dataclasses
    import json

    plan = _tp_plan(*LLAMA) if case == "llama-tp" else _dp_plan("moe-tiny", {"n_layers": 1}, 4, 16)[0]
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    reds, buckets = plan.redistribute_records(), plan.bucket_records()
    assert reds and (buckets or case == "llama-tp")
    assert reds == loaded.redistribute_records() and buckets == loaded.bucket_records()
    text = lambda x: json.dumps(x, sort_keys=True)
    assert text([r.to_json() for r in reds]) == text([r for n in plan.nodes for r in n.get("redistribute", [])])
    assert text([b.to_json() for b in buckets]) == text(plan.buckets)
    assert {r.value_class for r in reds} >= {"act", "grad"}
    if case == "moe-dp":  # the optional fields are read too
        assert any(r.shares for r in reds) and any(r.coalesced is not None for r in reds)
        assert any(r.bucket is not None for r in reds)
    with pytest.raises(dataclasses.FrozenInstanceError):
        reds[0].src = ("R",)


def test_loaded_plan_for_another_model_names_the_first_differing_node(tmp_path):
    from _simulated import simulated

    plan = _tp_plan(*LLAMA)
    name, ov, batch, seq = LLAMA
    other = build_model(name, device="cpu", **{**ov, "ffn_dim": 128})
    x = example_inputs(name, batch=batch, seq=seq, **ov)
    with simulated((2,)) as mesh, pytest.raises(PlanLoadError, match=r"differs from the plan's at node \d+"):
        autopar.parallelize(other, mesh, x, plan=plan)


@pytest.mark.dist
def test_loaded_plan_runs_on_2_ranks_with_no_planner_call(tmp_path):
    plan = _tp_plan(*LLAMA)
    assert any(p != ["R"] for p in plan.params.values()), "the test needs a sharded plan"
    plan.save(tmp_path / "plan.json")
    ranks = launch(job_loaded, 2, [str(tmp_path / "plan.json")], tmp_path)
    for r in ranks:
        assert r["planner_calls"] == 0
        assert r["loaded_hash"] == r["fresh_hash"] == plan.hash()
        assert not r["loaded_failures"], r["loaded_failures"]
        assert not r["collective_diff"], r["collective_diff"]
        assert r["losses"][0] == r["losses"][1]  # one plan, one program: the same bits
        assert r["grads_equal"], r
        assert "no plan" in r["new_shape_error"] and "(4, 32)" in r["new_shape_error"]


class _Forbidden(AssertionError):
    pass


def _forbid_planning() -> list:
    """Patch every planner entry point to raise; returns what to put back."""
    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise _Forbidden("the planner was called while running a loaded plan")

    passmanager = next(
        importlib.import_module(m)
        for m in ("autopar.passmanager", "autopar.pipeline")
        if importlib.util.find_spec(m) is not None
    )
    kept = [(autopar, "plan"), (autopar.api, "plan"), (autopar.api, "run_passes"), (passmanager, "run_passes")]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in kept]
    for mod, attr in kept:
        setattr(mod, attr, refuse)
    return saved, calls


def _first_step(pm, x) -> tuple[float, dict]:
    """(the loss, every gradient's global value) of one step, gradients cleared after."""
    from autopar.testing import global_value

    loss = pm(*x)
    loss.backward()
    grads = {k: global_value(p.grad).clone() for k, p in pm.named_parameters()}
    pm.zero_grad(set_to_none=True)
    return global_value(loss).item(), grads


def job_loaded(path):
    """On each rank: the loaded plan with the planner forbidden, then the same model planned fresh."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.backends.spmd import NoPlanForShapesError
    from autopar.testing import train_and_compare

    name, ov, batch, seq = LLAMA
    model = build_model(name, device="cpu", seed=3, **ov)
    x = example_inputs(name, batch=batch, seq=seq, seed=4, **ov)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    saved, calls = _forbid_planning()
    try:
        loaded = autopar.parallelize(copy.deepcopy(model), mesh, x, plan=autopar.Plan.load(path))
        loss_loaded, grads_loaded = _first_step(loaded, x)
        rep = train_and_compare(loaded, copy.deepcopy(model), x, steps=2, lr=0.5)
        try:
            loaded(*example_inputs(name, batch=2 * batch, seq=seq, seed=5, **ov))
            new_shape_error = ""
        except NoPlanForShapesError as e:
            new_shape_error = str(e)
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
    fresh = autopar.parallelize(
        copy.deepcopy(model), mesh, x, cluster=SHAPES, force=tp_force(model, (2,)), time_limit=5
    )
    loss_fresh, grads_fresh = _first_step(fresh, x)
    return {
        "planner_calls": len(calls),
        "loaded_hash": loaded.plan.hash(),
        "fresh_hash": fresh.plan.hash(),
        "loaded_failures": rep.failures[:5],
        "collective_diff": rep.collective_diff,
        "losses": [loss_loaded, loss_fresh],
        "grads_equal": sorted(grads_loaded) == sorted(grads_fresh)
        and all(torch.equal(grads_loaded[k], grads_fresh[k]) for k in grads_loaded),
        "new_shape_error": new_shape_error,
    }


def test_backend_given_a_plan_without_its_state_captures_again(tmp_path):
    """The torch backend's fallback hands the graph backend `planned=(plan, None)` for a loaded plan: it runs as a
    loaded plan does (captured again, no planner call), one step equal to the single-device loss."""
    from _simulated import simulated
    from autopar.backends.spmd.module import parallelize as graph_parallelize
    from autopar.testing import global_value

    plan = _tp_plan(*LLAMA)
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    name, ov, batch, seq = LLAMA
    model = build_model(name, device="cpu", seed=3, **ov)
    x = example_inputs(name, batch=batch, seq=seq, seed=4, **ov)
    saved, calls = _forbid_planning()
    try:
        with simulated((2,)) as mesh:
            pm = graph_parallelize(copy.deepcopy(model), mesh, x, planned=(loaded, None))
            loss = global_value(pm(*x))
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
    assert not calls and pm.plan.hash() == plan.hash()
    assert torch.allclose(loss, model(*x), rtol=1e-5, atol=1e-6)
