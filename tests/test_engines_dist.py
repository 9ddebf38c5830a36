"""Plans lowered to PyTorch's engines (fully_shard / parallelize_module) on real gloo groups equal single-device
training, and issue exactly the collectives derived from the plan.

The parent plans every case (llama-tiny, batch 8, seq 64, cost model tests/_clusters.py SHAPES, so plans take the shapes engines lower; the data-parallel and torchtitan
layouts are pinned with `force`/`pin`, the planner fills in everything else), saves the plans, and launches one
process per rank (tests/_dist.py, running `_rank_cases`); several cases share one launch per world size. Every
rank builds the model and the single-device reference itself (same seed), lowers the plan (`autopar.backends.torch.lower`
on the loaded plan, or autopar.parallelize(backend="torch") planning on the rank), runs 3 SGD steps and compares, each step, every gradient
with the reference's (max |g - g_ref| / max |g_ref| per tensor; fp32 <= 1e-5, bf16 mixed precision <= BF16_TOL)
and the loss (mean of the ranks' local losses). The labels of the first sample are ignore_index (-100), so the
batch shards count different numbers of targets: the engines' loss hook (backends/torch/loss.py) must weigh each
rank's mean by its counted targets for the loss and gradients to equal one device's. Step 0 runs under a collective
counter: the measured collectives (kind, mesh dim, bytes) must equal `engine_collectives(plan, lowering)` exactly.
Gloo timeout 60 s per collective, 300 s per launch; every rank ends with barrier + destroy_process_group.
"""

from __future__ import annotations

import pytest

from _clusters import SHAPES
from _dist import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

MODEL, BATCH, SEQ, STEPS, LR = "llama-tiny", 8, 64, 3, 0.1
IGNORED = 48  # labels of the first sample set to ignore_index: the batch shards count different numbers of
#                   targets, so each rank's mean averaged is not the batch's mean (the loss hook weighs them)
FP32_TOL = 1e-5
# bf16 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) vs fp32 single device, relative gradient error
# per tensor over 3 SGD steps. Measured on this machine: 1.0e-2 (worst tensor, step 2); bf16 has 8 mantissa bits
# (relative rounding 3.9e-3) and the error compounds through 2 blocks forward and backward.
BF16_TOL = 3e-2


def _dp_cases(tmp_path):
    """Data parallel with every parameter replicated, planned freely with a CPU cost model of latency per ring step
    (GLOO_PER_STEP, tests/_clusters.py: no per-call cost, so a tiny bucket chains), a batch of 32 (at 16 the free
    plans gather the head's input for the loss, which FSDP/DDP ranks cannot run: tests/test_engines_plan.py's
    re-planning covers that): on (4,) one bucket; on (2,2) it reduces the gradients in a chain of buckets (dp, then
    tp); the third case is that plan with each
    chain flattened into one bucket over the flattened dp+tp group (the form passes/buckets.py takes for larger
    buckets), so both bucket forms run; the fourth leaves the embedding's gradient out of the buckets; the last
    combines replicated data parallelism with tensor parallelism."""
    import autopar
    from autopar import models
    from _clusters import GLOO_PER_STEP

    m = models.build_model(MODEL, device="meta")
    cases = []
    for name, shape, names, batch in (("dp4", (4,), ("dp",), 32), ("dp2x2_chain", (2, 2), ("dp", "tp"), 32)):
        x = models.example_inputs(MODEL, batch=batch, seq=SEQ, device="meta")
        p = autopar.plan(m, autopar.MeshSpec(shape, names), x, cluster=GLOO_PER_STEP)
        assert p.buckets and all(set(v) == {"R"} for v in p.params.values()), (name, p.buckets, p.params)
        p.save(tmp_path / f"{name}.json")
        cases.append(
            {
                "name": name,
                "shape": list(shape),
                "names": list(names),
                "plan": str(tmp_path / f"{name}.json"),
                "plan_buckets": True,
                "batch": batch,
            }
        )
    assert any(b.get("step", 0) for b in p.buckets), p.buckets  # a chain over dp and tp
    flat, seen = [], set()
    for b in p.buckets:
        if b["chain"] in seen:
            continue
        seen.add(b["chain"])
        steps = [c for c in p.buckets if c["chain"] == b["chain"]]
        flat.append({**b, "mesh_dim": [c["mesh_dim"] for c in steps], "group": 4, "chain": len(flat)})
    p.buckets = flat
    p.save(tmp_path / "dp2x2_flat.json")
    cases.append(
        {
            "name": "dp2x2_flat",
            "shape": [2, 2],
            "names": ["dp", "tp"],
            "plan": str(tmp_path / "dp2x2_flat.json"),
            "plan_buckets": True,
            "batch": 32,
        }
    )
    # as llama3-debug's plan on (2,2) does: the embedding's gradient is not in a bucket (the plan computes it from
    # gathered backward inputs); the engines' partial gradient goes in an extra bucket over dp+tp
    emb = "tok_embeddings.weight"
    p.buckets = [
        {
            **b,
            "params": [f for f in b["params"] if f != emb],
            "bytes": b["bytes"] - (emb in b["params"]) * 4 * m.get_parameter(emb).numel(),
        }
        for b in flat
    ]
    p.save(tmp_path / "dp2x2_extra.json")
    cases.append(
        {
            "name": "dp2x2_extra",
            "shape": [2, 2],
            "names": ["dp", "tp"],
            "plan": str(tmp_path / "dp2x2_extra.json"),
            "batch": 32,
        }
    )
    # data parallel (replicated) over dp x torchtitan's TP+SP over tp: the hook averages the tensor-parallel local
    # gradients over dp in the plan's dp bucket; the norms' gradients (the plan: a chain over dp and tp) are
    # all-reduced by DTensor on tp and by the hook on dp (an extra bucket)
    from _clusters import SHAPES
    from _bench import torchtitan_placements

    force, pin = torchtitan_placements(m, ("dp", "tp"), "dp", "tp", (BATCH, SEQ))
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta")
    p = autopar.plan(
        m,
        autopar.MeshSpec((2, 2), ("dp", "tp")),
        x,
        cluster=SHAPES,
        overlap=False,
        pin=pin,
        force={k: ("R",) + tuple(v[1:]) for k, v in force.items()},
    )
    p.save(tmp_path / "dp_x_tp.json")
    cases.append({"name": "dp_x_tp", "shape": [2, 2], "names": ["dp", "tp"], "plan": str(tmp_path / "dp_x_tp.json")})
    return cases


def _cases(tmp_path, world):
    import autopar
    from autopar import models
    from _bench import batch_pin, torchtitan_placements

    m = models.build_model(MODEL, device="meta")
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta")
    fsdp = {k: ("S0",) for k, _ in m.named_parameters()}
    cases = []

    def add(name, shape, names, **kw):
        p = autopar.plan(m, autopar.MeshSpec(shape, names), x, cluster=SHAPES, overlap=False, **kw)
        path = tmp_path / f"{name}.json"
        p.save(path)
        cases.append({"name": name, "shape": list(shape), "names": list(names), "plan": str(path)})
        return p

    if world == 2:
        cases.append({"name": "fsdp2_api", "shape": [2], "names": ["dp"], "plan": None})  # plans on the ranks
        add("fsdp2_bf16", (2,), ("dp",), force=fsdp, pin=batch_pin([0], (BATCH, SEQ)), allow_bf16=True)
        free = autopar.plan(
            m,
            autopar.MeshSpec((2,), ("dp",)),
            x,
            cluster=SHAPES,
            overlap=False,
            force=fsdp,
            pin=batch_pin([0], (BATCH, SEQ)),
        )
        ac = add(
            "fsdp2_checkpoint",
            (2,),
            ("dp",),
            force=fsdp,
            pin=batch_pin([0], (BATCH, SEQ)),
            memory_budget=0.75 * free.predicted["peak_mem_bytes"],
        )
        assert ac.meta["checkpointing"]["blocks"], ac.meta["checkpointing"]
        force, pin = torchtitan_placements(m, ("tp",), None, "tp", (BATCH, SEQ))
        add("tp_sp", (2,), ("tp",), force=force, pin=pin)
        force, pin = torchtitan_placements(m, ("tp",), None, "tp", (BATCH, SEQ), sequence_parallel=False)
        add("tp_megatron", (2,), ("tp",), force=force, pin=pin)
        force, pin = torchtitan_placements(m, ("tp",), None, "tp", (BATCH, SEQ), loss_parallel=True)
        add("tp_loss_parallel", (2,), ("tp",), force=force, pin=pin)
        cases.append({"name": "auto_fallback", "shape": [2], "names": ["dp"], "plan": None})
        # fsdp2_api's plan, planned here for target="torch" as autopar.parallelize plans it on the ranks, saved, and
        # loaded there with the planner patched to raise: Plan.load runs on the torch backend with no planner call
        spec = autopar.MeshSpec((2,), ("dp",))
        p = autopar.plan(m, spec, x, cluster="cpu-gloo", force=fsdp, pin=batch_pin([0], (BATCH, SEQ)), target="torch")
        p.save(tmp_path / "fsdp2_loaded.json")
        path = str(tmp_path / "fsdp2_loaded.json")
        cases.append({"name": "fsdp2_loaded", "shape": [2], "names": ["dp"], "plan": path, "no_planner": True})
    else:
        add("fsdp4", (4,), ("dp",), force=fsdp, pin=batch_pin([0], (BATCH, SEQ)))
        force, pin = torchtitan_placements(m, ("dp", "tp"), "dp", "tp", (BATCH, SEQ))
        add("fsdp_x_tp", (2, 2), ("dp", "tp"), force=force, pin=pin)
        add(
            "hsdp",
            (2, 2),
            ("rep", "shard"),
            force={k: ("R", "S0") for k, _ in m.named_parameters()},
            pin=batch_pin([0, 1], (BATCH, SEQ)),
        )
        add(
            "fsdp_flat_2d",
            (2, 2),
            ("dp", "cp"),
            force={k: ("S0", "S0") for k, _ in m.named_parameters()},
            pin=batch_pin([0, 1], (BATCH, SEQ)),
        )
    return cases


def _check(results, cases):
    for ci, case in enumerate(cases):
        tol = BF16_TOL if "bf16" in case["name"] else FP32_TOL
        h0 = results[0]["cases"][ci]
        print(
            f"{case['name']:<18} grad rel err per step (worst rank) "
            f"{[max(r['cases'][ci]['grad_rel'][s] for r in results) for s in range(STEPS)]}  loss rel "
            f"{max(max(r['cases'][ci]['loss_rel']) for r in results):.1e}  collectives "
            f"{h0.get('n_collectives', '-')} match={h0.get('collectives_match', '-')}\n"
            f"{'':<18} plan predicts {h0.get('plan_kinds')}\n{'':<18} measured      {h0.get('measured_kinds')}"
        )
        for rank, res in enumerate(results):
            h = res["cases"][ci]
            assert h["name"] == case["name"]
            assert h["backend"] == ("graph" if case["name"] == "auto_fallback" else "torch"), h
            assert max(h["grad_rel"]) <= tol, f"{case['name']} rank {rank}: gradients differ {h['grad_rel']}"
            assert max(h["loss_rel"]) <= tol, f"{case['name']} rank {rank}: loss differs {h['loss_rel']}"
            if case["name"] == "auto_fallback":
                assert "backend: graph" in h["dump"] and "-> graph  parameter layers.0.fc2.weight" in h["dump"]
                continue
            assert h["collectives_match"], f"{case['name']} rank {rank}: {h['collectives_diff']}"
            assert h["n_collectives"] > 0
            if case.get("plan_buckets"):  # exactly the plan's gradient buckets (kind, mesh dims, bytes)
                assert h["buckets_match"], f"{case['name']} rank {rank}: {h['buckets_diff']}"


def _plan_run_check(tmp_path, world):
    cases = _cases(tmp_path, world)
    results = launch(_rank_cases, world, [cases], tmp_path)
    _check(results, cases)
    return cases, results


def test_world2_fsdp2_bf16_checkpointing_tp_sp_fallback(tmp_path):
    cases, results = _plan_run_check(tmp_path, 2)
    by = {c["name"]: results[0]["cases"][i] for i, c in enumerate(cases)}
    assert by["fsdp2_bf16"]["mixed_precision"] and max(by["fsdp2_bf16"]["grad_rel"]) > FP32_TOL  # really bf16
    assert by["fsdp2_checkpoint"]["checkpointed"] == ["layers.0", "layers.1"]
    assert by["fsdp2_checkpoint"]["fw_calls"] == 2 * STEPS and by["fsdp2_api"]["fw_calls"] == STEPS
    # the saved torch-target plan, loaded and run with the planner patched to raise, is the plan the ranks made
    assert by["fsdp2_loaded"]["plan_hash"] == by["fsdp2_api"]["plan_hash"], (by["fsdp2_loaded"], by["fsdp2_api"])
    assert (
        "SequenceParallel" in by["tp_sp"]["code"] and "RowwiseParallel(output_layouts=Shard(1))" in by["tp_sp"]["code"]
    )
    # torchtitan's default loss: the logits vocab-sharded into torch's loss_parallel (its all_reduces as counted)
    assert "loss_parallel = True" in by["tp_loss_parallel"]["code"], by["tp_loss_parallel"]["code"]


def test_world4_fsdp2_fsdp_x_tp_hsdp_flat(tmp_path):
    _plan_run_check(tmp_path, 4)


def test_world4_replicated_data_parallel_issues_the_plans_buckets(tmp_path):
    """Free plans (_dp_cases) that replicate every parameter lower to data parallelism whose gradient hook issues
    exactly the plan's buckets (one all_reduce per bucket step, on the planned group, of the planned bytes);
    loss and gradients equal one device, 3 SGD steps."""
    cases = _dp_cases(tmp_path)
    results = launch(_rank_cases, 4, [cases], tmp_path)
    _check(results, cases)
    by = {c["name"]: results[0]["cases"][i] for i, c in enumerate(cases)}
    assert "reduce_grads_in_buckets(" in by["dp4"]["code"] and "[('dp', 'tp')]" in by["dp2x2_flat"]["code"]
    assert "[('dp',), ('tp',)]" in by["dp2x2_chain"]["code"]
    assert "not a plan bucket" in by["dp2x2_extra"]["code"] and by["dp2x2_extra"]["n_collectives"] == 3
    assert all("weigh_mean_loss(model" in h["code"] and h["mean_loss"]["ignore_index"] == -100 for h in by.values())
    assert "SequenceParallel" in by["dp_x_tp"]["code"] and "plan bucket 0" in by["dp_x_tp"]["code"]


# ---- one rank (tests/_dist.py runs it) -----------------------------------------------------------------------


def _leaky_model(device):
    """mlp blocks whose root also reads layers[0].fc2.weight (a parameter used outside its module)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, h):
            return h + self.fc2(F.gelu(self.fc1(h)))

    class Leaky(nn.Module):
        def __init__(self, d=32, vocab=64):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Block(d) for _ in range(2))
            self.out = nn.Linear(d, vocab)

        def forward(self, x, y):
            h = self.embed(x)
            for blk in self.layers:
                h = blk(h)
            h = h + F.linear(F.gelu(h @ self.layers[0].fc1.weight.t()), self.layers[0].fc2.weight)
            return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    return Leaky().to(device)


def _grad(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run_case(case, rank, world):
    import torch
    import torch.distributed as dist
    from collections import Counter
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar import models
    import autopar.backends.torch as engines
    from autopar.backends.counter import CollectiveCounter
    from autopar.backends.torch.collectives import engine_collectives
    from _bench import batch_pin

    mesh = init_device_mesh("cpu", tuple(case["shape"]), mesh_dim_names=tuple(case["names"]))
    out = {"name": case["name"]}
    if case["name"] == "auto_fallback":
        ref, model = _leaky_model("cpu"), _leaky_model("cpu")
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen)
        pm = autopar.parallelize(
            model,
            mesh,
            (x, y),
            backend="auto",
            units=["layers.0", "layers.1"],
            force={k: ("S0",) for k, _ in model.named_parameters()},
            pin=batch_pin([0], (8, 16)),
        )
        out.update(backend="graph" if not isinstance(pm, type(ref)) else "torch", dump=pm.autopar_dump)

        def step():
            loss = pm(x, y)
            loss.backward()
            return loss

        params = dict(pm.named_parameters())
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
    else:
        ref = models.build_model(MODEL, device="cpu")
        model = models.build_model(MODEL, device="cpu")
        x, y = models.example_inputs(MODEL, batch=case.get("batch", BATCH), seq=SEQ)
        y[0, :IGNORED] = -100  # ignored labels on the first batch shard only (cross_entropy's ignore_index)
        if case["plan"] is None:
            force = {k: ("S0",) for k, _ in model.named_parameters()}
            out_model = autopar.parallelize(
                model, mesh, (x, y), backend="torch", force=force, pin=batch_pin([0], (BATCH, SEQ))
            )
            assert out_model is model and "backend: torch" in model.autopar_dump  # the user's own module
            plan = model._autopar_plan
        else:
            plan = autopar.Plan.load(case["plan"])
            engines.lower(model, plan, mesh)
        out["plan_hash"] = plan.hash()
        low = model._autopar_lowering
        out.update(
            backend="torch",
            code=low.code(),
            mixed_precision=low.mixed_precision,
            checkpointed=low.checkpoint,
            fw_calls=0,
        )
        counter = lambda *a: out.__setitem__("fw_calls", out["fw_calls"] + 1)
        model.layers[0].attention.register_forward_pre_hook(counter)  # 2 calls per step when recomputed
        xl, yl = engines.local_inputs(model, mesh, x, y)

        def step():
            with engines.train_context(model):
                loss = model(xl, yl)
                loss.backward()
            return loss

        params = dict(model.named_parameters())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters())
    grad_rel, loss_rel = [], []
    for s in range(STEPS):
        loss_ref = ref(x, y)
        loss_ref.backward()
        if s == 0 and case["name"] != "auto_fallback":  # one whole step (fw, bw, optimizer) counted
            with CollectiveCounter(mesh) as cc:
                loss = step()
                opt.step()
            exp, notes = engine_collectives(plan, low)
            a, b = Counter(cc.collectives()), Counter(exp)
            fmt = lambda d: {k: [v["count"], v["bytes"]] for k, v in sorted(d.items())}
            out.update(plan_kinds=fmt(plan.predicted["collectives"]), measured_kinds=fmt(cc.summary()))
            out.update(
                collectives_match=a == b,
                n_collectives=sum(a.values()),
                notes=notes[:5],
                collectives_diff=f"measured-only {sorted((a - b).items())} expected-only {sorted((b - a).items())}",
            )
            pb = Counter(
                (bk["kind"], tuple(bk["mesh_dim"]) if isinstance(bk["mesh_dim"], list) else bk["mesh_dim"], bk["bytes"])
                for bk in plan.buckets
            )
            if low.mean_loss:  # the loss hook's all_reduce is not a gradient bucket
                dims = tuple(low.replicate_dims + low.shard_dims)
                a = a - Counter([("all_reduce", dims[0] if len(dims) == 1 else dims, low.mean_loss["nbytes"])])
            out.update(
                buckets_match=a == pb,
                buckets_diff=f"measured-only {sorted((a - pb).items())} plan-only {sorted((pb - a).items())}",
                mean_loss=low.mean_loss,
            )
        else:
            loss = step()
            opt.step()
        worst = 0.0
        for n, p in params.items():
            g, gr = _grad(p.grad).float(), ref_params[n].grad
            worst = max(worst, ((g - gr).abs().max() / gr.abs().max().clamp_min(1e-12)).item())
        grad_rel.append(worst)
        lv = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().float().clone()
        if case["name"] != "auto_fallback":
            group = [mesh.get_group(d) for d, pl in enumerate(low.input_placements[0]) if pl == "S0"]
            for g in group:
                dist.all_reduce(lv, group=g)
                lv /= dist.get_world_size(g)
        loss_rel.append(abs(lv.item() - loss_ref.item()) / abs(loss_ref.item()))
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    out.update(grad_rel=grad_rel, loss_rel=loss_rel)
    return out


def _rank_cases(cases):
    """One rank of the launch (tests/_dist.py runs it inside the gloo group): every case, in order."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    return {
        "cases": [
            _run_without_planner(c) if c.get("no_planner") else _run_case(c, dist.get_rank(), dist.get_world_size())
            for c in cases
        ]
    }


def _run_without_planner(case):
    """The case with autopar.plan and the pass manager patched to raise: lowering and training never plan."""
    import torch.distributed as dist
    import autopar
    import autopar.api

    def refuse(*args, **kwargs):
        raise AssertionError("the torch backend called the planner on a loaded plan")

    saved = autopar.plan, autopar.api.plan, autopar.api.run_passes
    autopar.plan = autopar.api.plan = autopar.api.run_passes = refuse
    try:
        return _run_case(case, dist.get_rank(), dist.get_world_size())
    finally:
        autopar.plan, autopar.api.plan, autopar.api.run_passes = saved
