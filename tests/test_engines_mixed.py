"""backend="mixed" with graph parts (backends/torch/mixed.py): the engines run what they express, the graph
backend runs the modules they cannot, in the user's own module.

The model is moe-tiny (2 MoE blocks, 4 experts, dense routing) with its experts forced Shard(0) on the data dim
and the experts' batched matmuls pinned expert-sharded: expert parallelism on a data-parallel dim, which neither
FSDP2 (it gathers a parameter before every use) nor a ParallelStyle expresses. The rest is pinned: "dp" (world 2:
every other parameter replicated, gradients averaged by the engines' hook), "fsdp" (world 4: FSDP2 units per
block), "fsdp_tp" (world 4, mesh (dp, tp) = (2, 2): torchtitan's FSDP x tensor-parallel layout, no sequence
parallelism; the plan gathers some attention weights on tp, so those Linears become parts too). Each rank plans
on its own (the ranks must agree), runs 3 SGD steps and compares every gradient with the single-device model's
(max |g - g_ref| / max |g_ref| <= 1e-5) and the loss; the first sample's labels are ignore_index, so the loss
hook's weighting is exercised too. Every step runs under a collective counter: the measured collectives (kind,
mesh dim, bytes) must equal the engines' (engine_collectives) plus each part's own plan, per instance.
"""

from __future__ import annotations

import os

import pytest

from _dist import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL, BATCH, SEQ, STEPS, LR, IGNORED, TOL = "moe-tiny", 8, 16, 3, 0.1, 6, 1e-5


def _pin_and_force(model, case: str):
    """(force, pin): experts Shard(0) on dp with their batched matmuls expert-sharded, every activation outside the
    MoE modules batch-sharded on dp. case "dp": every other parameter replicated; "fsdp": Shard(0) on dp (FSDP2
    units); "fsdp_tp": torchtitan's FSDP x Megatron TP layout (no sequence parallelism) on (dp, tp), the experts
    replicated on tp."""
    from _bench import batch_pin, torchtitan_placements

    n_experts = model.cfg.n_experts
    if case == "fsdp_tp":
        force, outside = torchtitan_placements(model, ("dp", "tp"), "dp", "tp", (BATCH, SEQ), sequence_parallel=False)
        force.update({k: ("S0", "R") for k in force if ".experts." in k})
    else:
        force = {k: ("S0",) for k, _ in model.named_parameters() if case == "fsdp" or ".experts." in k}
        outside = batch_pin([0], (BATCH, SEQ))

    def pin(n):
        if ".moe" not in n.module:
            return outside(n)
        if (
            ".experts" in n.module
            and n.kind == "op"
            and n.phase == "fw"
            and n.outs
            and n.outs[0] is not None
            and len(n.outs[0].shape) == 3
            and n.outs[0].shape[0] == n_experts
        ):
            return {0: "S0"}
        return None

    return force, pin


def _rank(cases):
    return [_run(c) for c in cases]


def _run(case):
    import warnings

    warnings.filterwarnings("ignore")
    from collections import Counter
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar import models
    from autopar.backends.torch import local_inputs, train_context
    from autopar.backends.counter import CollectiveCounter
    from autopar.backends.torch.collectives import engine_collectives
    from autopar.backends.spmd.program import ExecutionError

    world = dist.get_world_size()
    shape, names = ((2, 2), ("dp", "tp")) if case == "fsdp_tp" else ((world,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    def build():
        m = models.build_model(MODEL, device="cpu")
        m.cfg.aux_loss_coef = 0.0
        return m

    ref, model = build(), build()
    x, y = models.example_inputs(MODEL, batch=BATCH, seq=SEQ)
    y[0, :IGNORED] = -100
    force, pin = _pin_and_force(model, case)
    import inspect
    import autopar.api

    planner, callers = autopar.api.plan, []

    def recording_plan(*a, **k):  # who plans: the front door only, never a backend
        callers.append(os.path.relpath(inspect.stack()[1].filename, ROOT))
        return planner(*a, **k)

    autopar.api.plan = recording_plan
    try:
        out_model = autopar.parallelize(model, mesh, (x, y), backend="mixed", force=force, pin=pin)
    finally:
        autopar.api.plan = planner
    low, plan = model._autopar_lowering, model._autopar_plan
    res = {
        "case": case,
        "same_module": out_model is model,
        "dump": model.autopar_dump,
        "code": low.code(),
        "parts": sorted(low.parts),
        "units": [u.fqn for u in low.units],
        "grad_rel": [],
        "loss_rel": [],
        "match": [],
        "diff": [],
        "kinds": None,
        "planned_by": callers,
    }
    xl, yl = local_inputs(model, mesh, x, y)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters())
    expected, _ = engine_collectives(plan, low)
    for _ in range(STEPS):
        loss_ref = ref(x, y)
        loss_ref.backward()
        with CollectiveCounter(mesh) as cc:
            with train_context(model):
                loss = model(xl, yl)
                loss.backward()
        a, b = Counter(cc.collectives()), Counter(expected)
        res["match"].append(a == b)
        res["diff"].append(f"measured-only {sorted((a - b).items())} expected-only {sorted((b - a).items())}")
        res["kinds"] = {k: [v["count"], v["bytes"]] for k, v in sorted(cc.summary().items())}
        worst = 0.0
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            gr = ref_params[n].grad
            worst = max(worst, ((g - gr).abs().max() / gr.abs().max().clamp_min(1e-12)).item())
        res["grad_rel"].append(worst)
        lv = loss.detach().clone()  # each rank's weighted mean: their average over dp is the loss
        dist.all_reduce(lv, group=mesh.get_group(0))
        res["loss_rel"].append(abs(lv.item() / shape[0] - loss_ref.item()) / abs(loss_ref.item()))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    experts = model.layers[0].moe.experts
    try:  # the whole batch instead of this rank's shard: a clear error, not a wrong answer
        experts(torch.zeros(BATCH * SEQ, model.cfg.dim), torch.zeros(BATCH * SEQ, model.cfg.n_experts))
        res["error"] = None
    except ExecutionError as e:
        res["error"] = str(e)
    return res


MOE_PARTS = ["layers.0.moe.experts", "layers.0.moe.router", "layers.1.moe.experts", "layers.1.moe.router"]
EXPERTS = {"layers.0.moe.experts", "layers.1.moe.experts"}  # forced expert parallel: always parts; the routers
# are free and become parts only where the plan gathers over dp in them (it depends on the cost model)


def _check(results, k):
    h = results[0][k]
    case = h["case"]
    print(h["dump"].split("autopar plan")[0])
    print(
        case, "grad rel", [max(r[k]["grad_rel"][s] for r in results) for s in range(STEPS)], "collectives", h["kinds"]
    )
    for rank, res in enumerate(results):
        r = res[k]
        assert r["same_module"], "backend auto with parts returns the user's own module"
        assert EXPERTS <= set(r["parts"]), r["parts"]
        assert max(r["grad_rel"]) <= TOL, f"{case} rank {rank}: gradients differ {r['grad_rel']}"
        assert max(r["loss_rel"]) <= TOL, f"{case} rank {rank}: loss differs {r['loss_rel']}"
        assert all(r["match"]), f"{case} rank {rank}: {r['diff']}"
        assert r["error"] and "module 'layers.0.moe.experts'" in r["error"] and "batch shard" in r["error"], r["error"]
    assert "all_to_all" in h["kinds"] and "all_gather" in h["kinds"], h["kinds"]  # expert parallelism ran
    # the whole model and the parts (the experts' instances share one plan) planned by the front door, no backend
    by = h["planned_by"]
    assert by.count(os.path.join("autopar", "parallel.py")) >= 2 and set(by) <= {
        "autopar/parallel.py",
        "autopar/api.py",
    }, by
    dump = h["dump"]
    assert dump.startswith("backend: torch + graph parts")
    assert "-> graph  layers.0.moe.experts, layers.1.moe.experts: the plan's placements on" in dump
    assert "is used sharded on dp by" in dump  # why the experts went to the graph backend
    assert "the engines issue" in dump and "the graph parts run their own plans" in dump  # vs the plan's own
    assert "part_params = [" in h["code"] and "'layers.0.moe.experts.w1'" in h["code"]
    if case == "dp":
        assert set(r["parts"]) <= set(MOE_PARTS) and h["units"] == [] and "-> torch  gradient hook" in dump
    else:
        assert h["units"] == ["layers.0", "layers.1", ""], h["units"]
        assert "fully_shard(layers.0" in dump
    if case == "fsdp_tp":  # tensor parallelism by parallelize_module on the rest
        assert "mesh dims: dp: FSDP shard, tp: tensor parallel" in dump and "ColwiseParallel" in dump


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_world2_data_parallel_with_expert_parallel_parts(tmp_path):
    _check(launch(_rank, 2, [["dp"]], tmp_path), 0)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_world4_fsdp_and_fsdp_x_tp_with_expert_parallel_parts(tmp_path):
    results = launch(_rank, 4, [["fsdp", "fsdp_tp"]], tmp_path)
    _check(results, 0)
    _check(results, 1)


def test_part_capture_and_plan_pin_the_boundary():
    """A module captured as a part (output="activation"): its backward starts from the output's incoming
    gradient (a ones_like node the executor replaces) and its floating inputs' gradients are outputs; planned with
    the boundary pinned batch-sharded, every boundary value is at Shard(0)."""
    import torch
    import autopar
    from autopar.capture import capture
    from autopar.models.llama import FeedForward
    from autopar.backends.torch.mixed import _boundary_pins

    ff = FeedForward(32, 64)
    x = torch.zeros(8, 16, 32)
    g = capture(ff, (x,), output="activation")
    assert g.activation and list(g.input_grads) == [0] and g.meta(g.input_grads[0]).shape == (8, 16, 32)
    seeds = [n for n in g.ops() if n.phase == "bw" and n.target is torch.ops.aten.ones_like.default]
    assert [s.inputs() for s in seeds] == [[g.loss]]
    pins = _boundary_pins(g, ("S0", "R"))
    plan, state = autopar.plan(
        ff,
        autopar.MeshSpec((2, 2), ("dp", "tp")),
        (x,),
        cluster="cpu-gloo",
        output="activation",
        pin=lambda n: pins.get(n.name),
        return_state=True,
    )
    P = state.placement
    assert P[g.inputs[0]].out[0] == ("S0", "R") and P[g.loss.node].out[g.loss.out] == ("S0", "R")
    r = g.input_grads[0]
    assert P[r.node].out[r.out] == ("S0", "R")
    assert not any(k[1] == "loss" for k in state.redistributes)  # a part's output is not reduced like a loss
    with pytest.raises(ValueError, match="plans a part of a model"):
        autopar.plan(ff, (2,), (x,), output="activation", loss_fn=lambda o: o.sum())


def test_reasons_name_the_module_a_part_would_hold():
    from autopar.backends.torch.mixed import reason_module

    assert (
        reason_module(
            "parameter layers.0.moe.experts.w1",
            "is used sharded on dp by %1:bmm.default in module 'layers.0.moe.experts' (input 1 ['S2'])",
        )
        == "layers.0.moe.experts"
    )
    # a parameter read outside its block: the part must hold both (here: the root, so no part)
    assert (
        reason_module(
            "parameter layers.0.fc2.weight", "is used outside its FSDP unit 'layers.0' by %9:mm in module '<root>'; ..."
        )
        == ""
    )
    assert reason_module("parameter a.b.w", "is the same tensor as c.w; ...") is None  # tied: whole model
    assert reason_module("op %5:mm.default", "in module 'layers.1.router' redistributes input 0") == "layers.1.router"
    assert reason_module("mesh dim tp", "a second tensor-parallel dim") is None
    assert reason_module("mixed precision", "...") is None


def test_part_program_matches_one_device_on_simulated_ranks():
    """The executor running a part (Program.forward / backward_part) on LocalTensorMode ranks: each rank's output
    and input gradient are its batch shard of the single-device ones, parameter gradients (global view, summed over
    the batch) equal the single device's, and the collectives are the part's plan's."""
    import torch
    import autopar
    from _simulated import simulated
    from torch.distributed import _local_tensor as lt
    from autopar.capture import capture
    from autopar.models.llama import FeedForward
    from autopar.backends.counter import CollectiveCounter
    from autopar.backends.torch.mixed import _boundary_pins
    from autopar.backends.spmd.module import _distribute
    from autopar.backends.spmd.program import Program
    from autopar.strategies._torch_adapter import outside_local_tensor_mode

    torch.manual_seed(0)
    ff = FeedForward(16, 32)
    x, gout = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    xr = x.clone().requires_grad_(True)
    ref = ff(xr)
    ref.backward(gout)
    pins = _boundary_pins(capture(ff, (x,), output="activation"), ("S0",))
    plan, state = autopar.plan(
        ff,
        (2,),
        (x,),
        cluster="cpu-gloo",
        output="activation",
        return_state=True,
        force={"w1.weight": ("S0",), "w2.weight": ("S1",)},
        pin=lambda n: pins.get(n.name),
    )
    with simulated((2,)) as mesh:
        prog = Program(state, plan, mesh, torch.device("cpu"), (x,))
        params = {
            f: _distribute(p, mesh, prog.param_placement(f), torch.device("cpu")) for f, p in ff.named_parameters()
        }
        piece = lambda t: lt.LocalTensor({r: t.chunk(2)[r].clone() for r in range(2)})
        with CollectiveCounter(mesh) as cc:
            out, env = prog.forward(params, [piece(x)], {}, keep=True)
            grads, in_grads = prog.backward_part(env, piece(gout))
        with outside_local_tensor_mode():
            for r in range(2):
                assert torch.allclose(out._local_tensors[r], ref.detach().chunk(2)[r], atol=1e-5)
                assert torch.allclose(in_grads[0]._local_tensors[r], xr.grad.chunk(2)[r], atol=1e-5)
        for f, p in ff.named_parameters():
            full = grads[f].full_tensor()
            full = lt.LocalTensor.reconcile(full) if isinstance(full, lt.LocalTensor) else full
            with outside_local_tensor_mode():
                assert torch.allclose(full, p.grad, atol=1e-5), f
    expected = sorted((k, d, b) for k, d, b in plan.collectives())
    assert expected and sorted(cc.collectives()) == expected


def test_which_modules_can_run_as_parts():
    """A part takes and returns tensors cut into the batch shards on dim 0 (each rank's piece of the global view):
    Llama's feed-forward can; its attention cannot (the rotary cos/sin are the same on every rank); a ModuleList
    never runs; the leaky model's blocks cannot (the root reads their weights), so its plan falls back whole, and the
    refusal names the module, the parameter and the op that reads it."""
    import autopar
    from autopar import models
    from autopar.backends.torch.recognize import recognize
    from autopar.backends.torch.mixed import _calls, _runs_alone, choose_parts

    m = models.build_model("llama-tiny", device="cpu")
    x = models.example_inputs("llama-tiny", batch=4, seq=16)
    plan = autopar.plan(m, autopar.MeshSpec((2,), ("dp",)), x, cluster="cpu-gloo")
    fqns = ["layers.0.feed_forward", "layers.0.attention", "layers"]
    glob, local = _calls(m, x, fqns), _calls(m, x, fqns, 2, [0, 1])
    why = {f: _runs_alone(plan, f, glob[f], local[f], 2) for f in fqns}
    assert why["layers.0.feed_forward"] is None
    assert (
        "its argument 1" in why["layers.0.attention"] and "not cut into the 2 batch shards" in why["layers.0.attention"]
    )
    assert why["layers"] == "it does not run in the forward"
    from test_engines_dist import _leaky_model

    leaky = _leaky_model("cpu")
    xs = (x[0] % 64, x[1] % 64)

    def batch(n):  # FSDP-like: the inputs and every (batch, seq, dim) activation batch-sharded
        o = n.outs[0] if n.kind in ("input", "op") and n.outs else None
        return {0: "S0"} if n.kind == "input" or (o is not None and len(o.shape) == 3 and o.shape[0] == 4) else None

    p = autopar.plan(
        leaky,
        autopar.MeshSpec((2,), ("dp",)),
        xs,
        cluster="cpu-gloo",
        force={k: ("S0",) for k, _ in leaky.named_parameters()},
        pin=batch,
    )
    low = recognize(p, leaky, units=["layers.0", "layers.1"])
    parts, msg = choose_parts(p, low, leaky, xs, recognize)
    assert parts is None and "can run as a part" in msg and "is read by" in msg and "'<root>'" in msg, msg
