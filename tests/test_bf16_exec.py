"""A mixed-precision plan (FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), chosen by the planner
with allow_bf16=True: passes/precision.py) runs on the graph backend on 2 gloo ranks: the module keeps fp32 master
parameters, each rank casts its shard to bf16 before the all_gather, the forward and backward compute in bf16, each
gradient is cast to fp32 before its reduce-scatter, and the user's SGD updates the fp32 parameters. The loss,
first-step gradients and final parameters equal a one-device reference doing the same casts (a bf16 copy of fp32
master weights per step) within bf16 rounding; the collectives are the plan's, with their dtypes. The same plan saved
and loaded (Plan.load, the planner patched to raise) gives the same losses and gradients, to the bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from _clusters import SHAPES
from _dist import launch
from autopar.models import build_model, example_inputs

pytestmark = pytest.mark.timeout(300)

NAME, OVERRIDES, BATCH, SEQ = "llama-tiny", {"n_layers": 1}, 2, 32
STEPS, LR = 2, 0.5
# bf16 keeps 8 significant bits: a value rounded once is off by up to 2**-9 relative; the split batch adds and
# rounds in another order than the one-device run, so a few roundings apart (measured: up to 6e-3 of the largest
# gradient entry at most)
RTOL, ATOL_OF_MAX = 3e-2, 2e-2


def _dp_pin(n):
    return {0: "S0"} if n.kind == "input" else None


def _plan_options(model) -> dict:
    """FSDP (every parameter sharded on dp, the batch split on dp) with mixed precision allowed, on a cluster where
    bf16 compute pays: the planner picks bf16 parameters with fp32 gradient reduction."""
    force = {k: ("S0",) for k, _ in model.named_parameters()}
    return dict(cluster=SHAPES, overlap=False, force=force, pin=_dp_pin, allow_bf16=True, time_limit=5)


def _plan():
    model = build_model(NAME, device="meta", **OVERRIDES)
    x = example_inputs(NAME, batch=BATCH, seq=SEQ, device="meta", **OVERRIDES)
    return autopar.plan(model, (2,), x, **_plan_options(model))


def test_the_planner_records_mixed_precision_for_the_executor(tmp_path):
    """The plan says what the executor must do: bf16 parameters at capture, fp32 gradient reduction, and the plan's
    parameter gathers are priced at bf16 bytes, its gradient buckets at fp32."""
    plan = _plan()
    assert plan.meta["precision_decision"]["chosen"] == "bf16 params / fp32 reduce", plan.meta["precision_decision"]
    cap = plan.execution["capture"]
    assert (cap["param_dtype"], cap["reduce_dtype"]) == ("bfloat16", "float32")
    model = build_model(NAME, device="meta", **OVERRIDES)
    numel = {k: p.numel() for k, p in model.named_parameters()}
    param_node = {n["idx"]: n["target"] for n in plan.nodes if n["kind"] == "param"}

    def param_of(i):  # a parameter or a view of one (the head's weight transposed)
        while i not in param_node:
            i = plan.nodes[i]["inputs"][0][0]
        return param_node[i]

    gathers = [
        (param_of(n["inputs"][r["input"]][0]), c)
        for n in plan.nodes
        for r in n.get("redistribute", [])
        if r["class"] == "param"
        for c in r["collectives"]
    ]
    assert gathers and all(c[0] == "all_gather" and c[2] == 2 * numel[f] for f, c in gathers), gathers
    assert plan.buckets and all(b["dtype"] == "torch.float32" for b in plan.buckets)
    bucketed = sum(numel[f] for b in plan.buckets for f in b["params"])
    assert sum(b["bytes"] for b in plan.buckets) == 4 * bucketed
    assert {d for _, _, _, d in _planned_collectives(plan)} >= {"bfloat16", "float32"}
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    assert loaded.hash() == plan.hash() and loaded.execution == plan.execution
    line = next(x for x in plan.summary().splitlines() if x.startswith("precision "))
    assert line.startswith("precision bf16 params / fp32 reduce: predicted step") and "vs fp32" in line, line
    assert line in loaded.summary()


def test_a_saved_bf16_plan_with_a_bad_precision_record_is_refused(tmp_path):
    """Plan.load of a mixed-precision plan re-captures with the recorded dtypes: an unknown dtype, or a plan with no
    reduce dtype anywhere, is a PlanLoadError naming it; a plan whose capture record lacks the reduce dtype but whose
    meta has it still gives the plan's graph."""
    import json

    from autopar.execution import PlanLoadError, capture_for, check_graph

    plan = _plan()
    model = build_model(NAME, device="meta", **OVERRIDES)
    x = example_inputs(NAME, batch=BATCH, seq=SEQ, device="meta", **OVERRIDES)
    plan.save(tmp_path / "plan.json")
    d = json.loads((tmp_path / "plan.json").read_text())

    def edited(change) -> autopar.Plan:
        e = json.loads(json.dumps(d))
        change(e)
        (tmp_path / "edited.json").write_text(json.dumps(e))
        return autopar.Plan.load(tmp_path / "edited.json")

    bad = edited(lambda e: e["execution"]["capture"].update(param_dtype="bfloat17"))
    with pytest.raises(PlanLoadError, match="unknown dtype 'bfloat17'"):
        capture_for(bad, model, x)
    older = edited(lambda e: e["execution"]["capture"].pop("reduce_dtype"))
    check_graph(older, capture_for(older, model, x))
    none = edited(lambda e: (e["execution"]["capture"].pop("reduce_dtype"), e["meta"].pop("mixed_precision")))
    with pytest.raises(PlanLoadError, match="records no gradient reduce dtype"):
        capture_for(none, model, x)


@pytest.mark.dist
def test_bf16_plan_runs_on_2_ranks_fresh_and_loaded(tmp_path):
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    ranks = launch(job_bf16, 2, [str(tmp_path / "plan.json")], tmp_path)
    for r in ranks:
        assert r["fresh_hash"] == r["loaded_hash"] == plan.hash()
        assert r["planner_calls"] == 0
        assert r["param_dtypes"] == ["float32"], r["param_dtypes"]  # fp32 master parameters, fp32 gradients
        assert not r["failures"], r["failures"]
        assert not r["collective_diff"], r["collective_diff"]
        # each collective in the dtype of the value the plan moves: parameters gathered in bf16, gradients
        # reduce-scattered in fp32, activations in their own dtype
        assert sorted(r["collectives"]) == sorted(map(list, _planned_collectives(plan)))
        assert r["loaded_losses"] == r["fresh_losses"], r  # one plan, one program: the same bits
        assert r["loaded_grads_equal"]
        # the run really is bf16: its loss is not the fp32 model's (a bf16 forward rounds the logits)
        assert abs(r["fresh_losses"][0] - r["fp32_loss"]) > 1e-5, r
    assert ranks[0]["fresh_losses"] == ranks[1]["fresh_losses"]


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_bf16_tensor_parallel_plans_match_the_reference_simulated(mesh_shape):
    """Megatron TP on (2,) and FSDP x TP on (2, 2), bf16 chosen, every rank simulated in one process
    (LocalTensorMode) and run from the plan alone (`planned=(plan, None)`: captured again, the gradient casts
    rewritten in again): within bf16 rounding of the one-device reference, each collective in its value's dtype."""
    from _simulated import simulated
    from autopar.testing import fsdp_tp_force, tp_force

    model = build_model(NAME, device="cpu", seed=3, **OVERRIDES)
    x = example_inputs(NAME, batch=4, seq=SEQ, seed=4, **OVERRIDES)
    force = (tp_force if len(mesh_shape) == 1 else fsdp_tp_force)(model, mesh_shape)
    plan = autopar.plan(model, mesh_shape, x, cluster=SHAPES, overlap=False, force=force, allow_bf16=True, time_limit=5)
    assert plan.meta["precision_decision"]["chosen"] == "bf16 params / fp32 reduce"
    with simulated(mesh_shape) as mesh:
        pm = autopar.parallelize(copy.deepcopy(model), mesh, x, planned=(plan, None))
        run = _train(pm, x, count=True)
    assert not _compare(run, _reference(model, x)), _compare(run, _reference(model, x))
    measured = sorted((r.kind, r.mesh_dim, r.nbytes, r.dtype) for r in run["records"])
    assert measured == sorted(_planned_collectives(plan))


def test_bf16_gradient_accumulation_reduces_fp32_once_simulated():
    """no_sync micro-steps of a bf16 plan accumulate the fp32-cast local gradients with no gradient collective; the
    synced micro-step reduces the sum once, in fp32: twice the one-device bf16 gradient of the batch."""
    from _simulated import simulated
    from autopar.backends.counter import CollectiveCounter
    from autopar.testing import global_value

    model = build_model(NAME, device="cpu", seed=3, **OVERRIDES)
    x = example_inputs(NAME, batch=BATCH, seq=SEQ, seed=4, **OVERRIDES)
    plan = _plan()
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(copy.deepcopy(model), mesh, x, planned=(plan, None))
        with CollectiveCounter(mesh) as quiet, pm.no_sync():
            pm(*x).backward()
        with CollectiveCounter(mesh) as synced:
            pm(*x).backward()
        grads = {k: global_value(p.grad) for k, p in pm.named_parameters()}
    measured = lambda cc: sorted((r.kind, r.mesh_dim, r.nbytes, r.dtype) for r in cc.records)
    assert measured(quiet) == sorted(_planned_collectives(plan, gradients=False))
    assert measured(synced) == sorted(_planned_collectives(plan))
    assert pm.accumulated_bytes() == 0
    ref = _reference(model, x)["grads"]
    doubled = {"losses": [], "grads": grads, "params": {}}
    assert not _compare(doubled, {"losses": [], "grads": {k: 2 * g for k, g in ref.items()}, "params": {}})


def job_bf16(path):
    """On each rank: the plan planned fresh and trained, then loaded with the planner forbidden and trained; both
    against the one-device bf16 reference."""
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model(NAME, device="cpu", seed=3, **OVERRIDES)
    x = example_inputs(NAME, batch=BATCH, seq=SEQ, seed=4, **OVERRIDES)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ref = _reference(model, x)
    fresh = autopar.parallelize(copy.deepcopy(model), mesh, x, **_plan_options(model))
    fresh_run = _train(fresh, x, count=True)
    saved, calls = _forbid_planning()
    try:
        loaded = autopar.parallelize(copy.deepcopy(model), mesh, x, plan=autopar.Plan.load(path))
        loaded_run = _train(loaded, x, count=False)
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
    records = fresh_run["records"]
    from autopar.backends.counter import compare

    return {
        "fresh_hash": fresh.plan.hash(),
        "loaded_hash": loaded.plan.hash(),
        "planner_calls": len(calls),
        "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in fresh.parameters()}),
        "failures": _compare(fresh_run, ref) + _compare(loaded_run, ref),
        "collective_diff": compare(records, fresh.plan.collectives()),
        "collectives": [[r.kind, r.mesh_dim, r.nbytes, r.dtype] for r in records],
        "fresh_losses": fresh_run["losses"],
        "loaded_losses": loaded_run["losses"],
        "loaded_grads_equal": all(torch.equal(fresh_run["grads"][k], loaded_run["grads"][k]) for k in ref["grads"]),
        "fp32_loss": model(*x).item(),
    }


def _planned_collectives(plan, gradients: bool = True) -> list[tuple]:
    """The plan's collectives of one step as (kind, mesh dim, bytes, dtype): the dtype of the value each one moves
    (an op input: its producer's output; "opt": a gradient, cast to the reduce dtype; "loss": the loss).
    gradients=False: without the gradient reductions (buckets and "opt" redistributes), as under no_sync."""
    reduce_dtype = plan.execution["capture"]["reduce_dtype"]
    out = [(b["kind"], b["mesh_dim"], b["bytes"], b["dtype"].replace("torch.", "")) for b in plan.buckets]
    out = out if gradients else []
    for n in plan.nodes:
        for r in n.get("redistribute", []):
            if "bucket" in r or (r["input"] == "opt" and not gradients):
                continue
            if isinstance(r["input"], int):
                src, o = n["inputs"][r["input"]]
                dtype = plan.nodes[src]["dtype"][o]
            else:
                dtype = {"opt": reduce_dtype, "loss": n["dtype"][0]}[r["input"]]
            out += [(c[0], c[1], c[2], dtype) for c in r["collectives"]]
    return out


def _train(pm, x, count: bool) -> dict:
    """STEPS steps of torch.optim.SGD on the parallel module: the losses, the first step's gradients and the final
    parameters as global values, and the first step's collectives (count=True)."""
    from autopar.backends.counter import CollectiveCounter
    from autopar.testing import global_value

    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    out = {"losses": [], "records": []}
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        counter = CollectiveCounter(pm.program.mesh) if count and s == 0 else None
        if counter is not None:
            with counter:
                loss = pm(*x)
                loss.backward()
            out["records"] = [r for r in counter.records if r.group_size != 1]
        else:
            loss = pm(*x)
            loss.backward()
        out["losses"].append(global_value(loss).item())
        if s == 0:
            out["grads"] = {k: global_value(p.grad).clone() for k, p in pm.named_parameters()}
        opt.step()
    out["params"] = {k: global_value(p).clone() for k, p in pm.named_parameters()}
    return out


def _reference(model, x) -> dict:
    """One device, the same casts: per step a bf16 copy of the fp32 master parameters (buffers as they are) computes
    the loss and gradients, the gradients are cast to fp32 and SGD updates the fp32 masters."""
    master = copy.deepcopy(model)
    out = {"losses": []}
    for s in range(STEPS):
        work = copy.deepcopy(master)
        with torch.no_grad():
            for p in work.parameters():
                p.data = p.data.to(torch.bfloat16)
        loss = work(*x)
        loss.backward()
        grads = {k: p.grad.float() for k, p in work.named_parameters()}
        out["losses"].append(loss.item())
        if s == 0:
            out["grads"] = grads
        with torch.no_grad():
            for k, p in master.named_parameters():
                p -= LR * grads[k]
    out["params"] = {k: p.detach().clone() for k, p in master.named_parameters()}
    return out


def _compare(run: dict, ref: dict) -> list[str]:
    """What differs from the reference by more than bf16 rounding (RTOL, with an absolute floor of ATOL_OF_MAX of
    the tensor's largest entry, for the entries near zero)."""
    bad = []
    close = lambda a, b: torch.allclose(a, b, rtol=RTOL, atol=ATOL_OF_MAX * b.abs().max().item() + 1e-6)
    for s, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        if not close(torch.tensor(a), torch.tensor(b)):
            bad.append(f"step {s} loss {a} vs {b}")
    for what in ("grads", "params"):
        for k, b in ref[what].items():
            a = run[what][k]
            if a.dtype != torch.float32 or not close(a, b):
                diff, top = (a.float() - b).abs().max().item(), b.abs().max().item()
                bad.append(f"{what} {k}: {a.dtype}, max abs diff {diff:.3e} (largest entry {top:.3e})")
    return bad


def _forbid_planning() -> tuple[list, list]:
    """Patch the planner's entry points to raise; returns (what to put back, the calls made)."""
    from autopar import api, passmanager

    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise AssertionError("the planner was called while running a loaded plan")

    kept = [(autopar, "plan"), (api, "plan"), (api, "run_passes"), (passmanager, "run_passes")]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in kept]
    for mod, attr in kept:
        setattr(mod, attr, refuse)
    return saved, calls
