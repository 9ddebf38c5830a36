"""The prediction is a pure function of the Plan (autopar/predict.py `predict`): recomputed from a saved and loaded
plan's records alone (node times, placements, redistributes with their collectives, buckets, the `pricing` record
with the cluster's figures), it equals the fresh plan's, and it follows those records when they change."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import autopar
from _bench import torchtitan_placements
from _clusters import SHAPES
from autopar import models as M
from autopar.collectives import link_of
from autopar.cost import collective_time
from autopar.cost.cluster import ClusterSpec
from autopar.plan import Plan
from autopar.predict import predict
from autopar.testing import fsdp_force

pytestmark = pytest.mark.timeout(300)


def _tp_recompute_overlap():
    """TP + sequence parallel (shared gathers), checkpointed blocks (a budget under the free plan's peak), overlap."""
    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=4, device="meta")
    force, pin = torchtitan_placements(m, ("tp",), None, "tp", tuple(x[0].shape))
    kw = dict(cluster="h100", force=force, pin=pin, overlap=True, time_limit=30)
    free = autopar.plan(m, (2,), x, **kw)
    return autopar.plan(m, (2,), x, memory_budget=0.8 * free.predicted["peak_mem_bytes"], **kw)


def _moe_dp():
    """Data parallel MoE: the loss's (sum, count) all_reduces coalesced, expert loads moved to the forward's end."""
    m = M.build_model("moe-tiny", n_layers=1, device="meta")
    x = M.example_inputs("moe-tiny", batch=4, seq=16, n_layers=1, device="meta")
    force = {k: ("R",) for k, _ in m.named_parameters()}
    pin = lambda n: {0: "S0"} if n.kind == "input" else None
    return autopar.plan(m, (2,), x, cluster=SHAPES, force=force, pin=pin, time_limit=30)


def _bf16_2x2():
    """FSDP2-style bf16 mixed precision chosen on a 2x2 mesh, parameters sharded on dp."""
    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=8, device="meta")
    force = fsdp_force(m, (2, 2))
    return autopar.plan(m, (2, 2), x, cluster=SHAPES, force=force, allow_bf16=True, time_limit=30)


CASES = {"tp-recompute-overlap": _tp_recompute_overlap, "moe-dp": _moe_dp, "bf16-2x2": _bf16_2x2}


@pytest.fixture(scope="module")
def plans():
    return {k: f() for k, f in CASES.items()}


def _loaded(plan, tmp_path) -> Plan:
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    loaded.predicted = {}  # what predict returns cannot come from the saved prediction
    return loaded


@pytest.mark.parametrize("case", sorted(CASES))
def test_loaded_plan_predicts_what_the_fresh_plan_did(plans, case, tmp_path):
    plan = plans[case]
    if case == "tp-recompute-overlap":  # the records this case exists for are really there
        assert plan.pricing["recompute"] and plan.pricing["overlap"] and plan.predicted["recompute_s"] > 0
        assert any("shares" in r for n in plan.nodes for r in n["redistribute"])
    if case == "moe-dp":
        assert any("coalesced" in r for n in plan.nodes for r in n["redistribute"]) and plan.buckets
    if case == "bf16-2x2":
        assert plan.meta["mixed_precision"]["param_dtype"] == "bfloat16" and plan.predicted["comm_s"] > 0
    assert predict(_loaded(plan, tmp_path)) == plan.predicted
    assert predict(plan) == plan.predicted


def test_prediction_follows_the_records(plans, tmp_path):
    """Another cluster in the pricing record re-prices every collective (every link twice as slow: twice the comm);
    a node's recorded time is its compute."""
    plan = plans["bf16-2x2"]
    base = predict(plan)
    assert base["comm_s"] > 0
    slow = _loaded(plan, tmp_path)
    spec = ClusterSpec.from_json(slow.pricing["cluster"])
    slower = lambda k: (k[0], 2 * k[1], k[2] / 2, 2 * k[3])  # (kind, alpha, bw, launch)
    half = lambda link: dataclasses.replace(
        link, alpha=2 * link.alpha, bw=link.bw / 2, launch=2 * link.launch, kinds=tuple(map(slower, link.kinds))
    )
    slow.pricing["cluster"] = dataclasses.replace(spec, intra=half(spec.intra), inter=half(spec.inter)).to_json()
    got = predict(slow)
    assert got["compute_s"] == base["compute_s"] and got["comm_s"] == pytest.approx(2 * base["comm_s"], rel=1e-9)
    assert got["collectives"] == base["collectives"] and got["peak_mem_bytes"] == base["peak_mem_bytes"]
    longer = copy.deepcopy(plan)
    op = max((n for n in longer.nodes if n["kind"] == "op"), key=lambda n: n["time_s"])
    op["time_s"] += 1e-3
    assert predict(longer)["compute_s"] == pytest.approx(base["compute_s"] + 1e-3, rel=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_recorded_redistribute_times_are_their_collectives_on_the_cluster(plans, case):
    """Each redistribute's recorded seconds (the planner's redistribute_time) are its recorded collectives priced
    on the plan's cluster, as predict prices them; shared and coalesced ones cost nothing of their own."""
    plan = plans[case]
    cluster, shape = ClusterSpec.from_json(plan.pricing["cluster"]), plan.mesh_shape
    dim = lambda d: tuple(d) if isinstance(d, list) else d
    checked = 0
    for n in plan.nodes:
        for r in n["redistribute"]:
            if "bucket" in r:
                continue
            t = sum(collective_time(c[0], c[2], c[3], link_of(cluster, shape, dim(c[1]))) for c in r["collectives"])
            if "shares" in r or "coalesced" in r:
                assert r["time_s"] == 0.0 and not r["collectives"], (n["name"], r)
            else:
                assert t == pytest.approx(r["time_s"], rel=1e-12, abs=1e-18), (n["name"], r)
                checked += bool(r["collectives"])
    assert checked > 0


def test_cluster_spec_round_trips_through_the_plan(plans):
    plan = plans["moe-dp"]
    assert ClusterSpec.from_json(plan.pricing["cluster"]) == SHAPES


def test_predict_refuses_what_it_cannot_price(plans):
    old = copy.deepcopy(plans["moe-dp"])
    old.pricing = {}
    with pytest.raises(ValueError, match="no pricing record"):
        predict(old)
    staged = copy.deepcopy(plans["moe-dp"])
    staged.stages = [{"index": 0}]
    with pytest.raises(ValueError, match="pipeline plan"):
        predict(staged)
