"""The memory lower bound (autopar/feasibility.py): fails fast with what would fit, never above a real plan's peak;
and the fully replicated plan's summary says why."""

import json
import time

import pytest
import torch

import autopar
from autopar import feasibility
from autopar import models as M
from autopar.passes import PASSES
from autopar.passmanager import PlanState, run_passes
from autopar.passes import checkpointing


def _model(name, batch, seq, dtype=torch.float32, **over):
    return M.build_model(name, dtype=dtype, device="meta", **over), M.example_inputs(
        name, batch=batch, seq=seq, device="meta", **over
    )


def test_infeasible_70b_fails_in_seconds_naming_fixes():
    """llama3-70b (bf16, AdamW: 16 B per parameter) on 8 H100s: 141 GB of model state per rank at best, over the
    72 GB budget. It fails before any candidate or solve, with the bound's parts and the changes that fit."""
    model, x = _model("llama3-70b", 1, 512, dtype=torch.bfloat16, n_layers=80)
    t = time.perf_counter()
    with pytest.raises(autopar.InfeasibleMemoryError) as info:
        autopar.plan(model, (8,), x, cluster="h100")
    seconds = time.perf_counter() - t
    msg, fixes = str(info.value), info.value.fixes
    assert seconds < 60, seconds  # capture and the bound only (no candidates, costs or solve)
    assert "smallest achievable peak is at least" in msg and "72.000 GB" in msg
    assert "model state 141.107 GB" in msg and "checkpointing of all 80 blocks" in msg
    ranks = next(f for f in fixes if f.startswith("more ranks"))
    assert ">= 16 ranks" in ranks or ">= 17 ranks" in ranks, ranks  # 16 B x 70.55 B / 72 GB = 15.7 ranks of state
    assert "still over" not in ranks
    assert any(f.startswith("a pp dim: pp=2") for f in fixes), fixes
    assert any(f.startswith("bf16 optimizer states") for f in fixes), fixes
    assert not any("allow_checkpointing=True" in f for f in fixes)  # already on: no such fix


def test_fixes_follow_the_options():
    """With checkpointing off and an fp32 model, checkpointing and bf16 activations are offered, each with its
    computed peak; a budget met by checkpointing alone lists it among the fixes that fit."""
    model, x = _model("llama3-debug", 16, 256, n_layers=2)
    free = autopar.plan(model, (2,), x, cluster="cpu-gloo", allow_checkpointing=False)
    peak = free.predicted["peak_mem_bytes"]
    with pytest.raises(autopar.InfeasibleMemoryError) as info:
        autopar.plan(model, (2,), x, cluster="cpu-gloo", allow_checkpointing=False, memory_budget=peak / 8)
    fixes = info.value.fixes
    assert any("allow_checkpointing=True" in f for f in fixes), fixes
    assert any("allow_bf16=True" in f for f in fixes), fixes
    assert str(info.value).count("\n  - ") == len(fixes)


@pytest.mark.parametrize(
    "name,mesh,batch,seq,budget_frac",
    [
        ("llama3-debug", (4,), 8, 64, None),
        ("llama-tiny", (4,), 4, 32, 0.5),  # memory-bound: parameters sharded
        ("gpt2-tiny", (4,), 4, 32, None),
        ("moe-tiny", (2,), 4, 32, None),
    ],
)
def test_bound_is_below_the_planned_peak(name, mesh, batch, seq, budget_frac):
    """On planned models the bound (computed from the same state the planner ran on) is at most the plan's
    predicted state, activation peak and total; under a tight budget too (sharding, checkpointing)."""
    model, x = _model(name, batch, seq, n_layers=2)
    kw = dict(cluster="h100", allow_replicate=True)
    if budget_frac:
        free = autopar.plan(model, mesh, x, **kw)
        kw["memory_budget"] = budget_frac * free.predicted["peak_mem_bytes"]
    p, state = autopar.plan(model, mesh, x, return_state=True, **kw)
    b = feasibility.memory_bound(state)
    assert b.state_bytes <= p.predicted["state_mem_bytes"] * (1 + 1e-12)
    assert b.act_bytes <= p.predicted["act_peak_bytes"] * (1 + 1e-12)
    assert 0 < b.total <= p.predicted["peak_mem_bytes"] * (1 + 1e-12)
    if budget_frac:
        assert p.meta["checkpointing"]["blocks"] or any(v != ["R"] * len(mesh) for v in p.params.values())


def test_counted_outputs_are_placed_by_every_candidate():
    """The bound counts an op's outputs unless its strategies may leave one unplaced; check that against the
    candidates pass on a model: every counted tensor output has a placement in every candidate."""
    model, x = _model("llama3-debug", 8, 64, n_layers=2)
    _, state = autopar.plan(model, (2, 2), x, cluster="cpu-gloo", return_state=True)
    counted = 0
    for n in state.graph.ops():
        if feasibility._may_leave_unplaced(n.target):
            continue
        for o, m in enumerate(n.outs):
            if m is not None:
                counted += 1
                assert all(s.out[o] is not None for s in state.strategies[n.idx]), (n.name, o)
    assert counted > 100


def test_blocks_are_the_checkpointing_pass_blocks():
    model, x = _model("llama3-debug", 8, 64, n_layers=3)
    io = autopar.model_io.ModelIO.from_example(model, x, None)
    graph = autopar.capture.capture(model, io, None)
    state = PlanState(graph, autopar.mesh.as_mesh_spec((2,)), autopar.cost.get_cluster("cpu-gloo"), None, 1e9, {})
    run_passes(state, PASSES[:2])
    assert feasibility.block_members(state) == checkpointing._blocks(state)
    assert [b for b, _ in feasibility.block_members(state)] == ["layers.0", "layers.1", "layers.2"]


def test_solver_infeasible_gets_the_fixes():
    """A budget the bound passes but the planner cannot meet (the checkpointing pass's floors, or the solve's
    liveness check) still says what would fit, from the planner's own smallest figure."""
    model, x = _model("llama3-debug", 8, 128, n_layers=2)
    free, state = autopar.plan(model, (2,), x, cluster="cpu-gloo", return_state=True)
    budget = 1.01 * feasibility.memory_bound(state).total  # the bound passes; the planner's floors do not
    assert budget < free.predicted["peak_mem_bytes"]
    with pytest.raises(autopar.InfeasibleMemoryError) as info:
        autopar.plan(model, (2,), x, cluster="cpu-gloo", memory_budget=budget)
    err = info.value
    assert "at least" not in str(err).splitlines()[0]  # the planner's message, not the bound's
    assert err.smallest_bytes is not None and err.smallest_bytes > budget
    assert err.fixes and err.fixes[0].startswith("more ranks") and "what would fit:" in str(err)


def test_replicated_plan_says_why():
    """The calibrated cpu-gloo cluster replicates a tiny model (milliseconds per gloo collective against
    microseconds of compute): the summary names the link's figures and the costliest op's saving against its
    collectives, from Plan.meta (a saved and loaded plan says the same)."""
    model, x = _model("llama-tiny", 2, 16, n_layers=2)
    p = autopar.plan(model, (2, 2), x, cluster="cpu-gloo")
    assert feasibility.is_replicated(p) and not p.predicted["collectives"]
    why = p.meta["replicated_why"]
    assert [d["dim"] for d in why["dims"]] == ["dp", "tp"]
    for d in why["dims"]:
        op = d["op"]
        assert d["alpha_s"] == pytest.approx(1.27e-3) and d["launch_s"] == pytest.approx(1.48e-3)
        assert op["op"].startswith("aten.") and 0 < op["sharded_s"] < op["replicated_s"]
        assert op["comm_s"] > op["replicated_s"] - op["sharded_s"]  # why it stays replicated
    text = p.summary(timings=False)
    assert "why replicated: on this cluster sharding costs more in collectives than it saves in compute" in text
    assert "dp (2 ranks, gloo-loopback: all_gather 1270 us per ring step + 1480 us per call, 0.68 GB/s)" in text
    assert "collectives per step: none" in text
    loaded = autopar.Plan(**json.loads(json.dumps(p.to_json())))
    assert loaded.summary(timings=False) == text


def test_sharded_plan_has_no_replicated_why():
    """On H100 links the planner splits the batch of a larger step (the loss is all-reduced): no why-replicated."""
    model, x = _model("llama3-debug", 8, 64, n_layers=2)
    p = autopar.plan(model, (4,), x, cluster="h100")
    assert not feasibility.is_replicated(p)
    assert "replicated_why" not in p.meta and "why replicated" not in p.summary()
