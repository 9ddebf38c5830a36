"""Pipeline plans executed on real gloo process groups equal single-device training.

The parent plans (autopar.plan with a "pp" mesh dim; the schedule is pinned per case, stage cuts and micro-batch
count are the planner's), saves the plans, and launches one process per rank (tests/_dist.py, running
`_rank_cases`). Every rank builds the same model, computes the single-device reference loss and gradients itself,
runs one pipeline step with backends/pipeline.py and compares: loss (fp32, rtol 1e-5) on the ranks holding the last
stage, each local parameter's gradient (rtol 1e-5 of the tensor's scale; FSDP-sharded gradients gathered). Several
cases share one launch per world size (start-up costs seconds); every collective has a 60 s timeout, the launch a
300 s one. Cases: world 2 (pp=2): GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, and
1F1B under a memory budget that makes the planner checkpoint blocks; world 4 (pp=2 x dp=2): GPipe, 1F1B (DDP/FSDP2
per stage as planned), Interleaved1F1B with FSDP-sharded parameters. Each case also feeds a batch of the wrong
shape: every rank must raise PipelineShapeError (none may hang waiting for activations).
"""
from __future__ import annotations

import pytest

from _dist import launch

MODEL, LAYERS, BATCH, SEQ = "llama-tiny", 4, 8, 32


def _plans(tmp_path, world):
    import autopar
    from autopar import models
    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta", n_layers=LAYERS)
    mesh = autopar.MeshSpec((2,), ("pp",)) if world == 2 else autopar.MeshSpec((2, 2), ("pp", "dp"))
    cases = []
    for sched in ("GPipe", "1F1B", "Interleaved1F1B"):
        force = None
        if world == 4 and sched == "Interleaved1F1B":      # exercise FSDP2 inside the stages too
            force = {n: ("S0",) for n, p in m.named_parameters() if p.shape[0] % 2 == 0}
        plan = autopar.plan(m, mesh, x, cluster="h100", force=force, pipeline={"schedules": [sched]})
        cases.append(_case(plan, tmp_path, f"{world}_{sched}", sched))
    if world == 2:          # the zero-bubble family too (split backward; V-shaped stage placement)
        for sched in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
            plan = autopar.plan(m, mesh, x, cluster="h100", pipeline={"schedules": [sched]})
            cases.append(_case(plan, tmp_path, f"2_{sched}", sched))
    if world == 2:          # a memory budget the stages only meet by checkpointing blocks (runtime recompute)
        peak = cases[1]["peak"]
        for f in (0.85, 0.7, 0.55):
            plan = autopar.plan(m, mesh, x, cluster="h100", memory_budget=f * peak, pipeline={"schedules": ["1F1B"]})
            if any(st["recompute_blocks"] for st in plan.stages):
                break
        cases.append(_case(plan, tmp_path, "2_1F1B_recompute", "1F1B"))
    return cases


def _case(plan, tmp_path, name, sched):
    path = tmp_path / f"plan_{name}.json"
    plan.save(path)
    return {"schedule": sched, "path": str(path), "stages": len(plan.stages), "m": plan.schedule["n_microbatches"],
            "bounds": plan.schedule["bounds"], "peak": plan.predicted["peak_mem_bytes"],
            "recompute": [st["recompute_blocks"] for st in plan.stages],
            "params_on_dp": sorted({pl[0] for pl in plan.params.values()})}


def _check(results, cases):
    for ci, case in enumerate(cases):
        holders = [r["cases"][ci] for r in results]
        assert sum(1 for h in holders if h["loss_diff"] is not None) >= 1, case
        for h in holders:
            assert h["n_params"] > 0 and h["has_layers"], f"{case['schedule']}: rank holds no block: {h}"
            assert h["max_grad_rel"] <= 1e-5, f"{case['schedule']}: gradient mismatch {h}"
            if h["loss_diff"] is not None:
                assert h["loss_diff"] <= 1e-5 * abs(h["loss_ref"]), f"{case['schedule']}: loss mismatch {h}"
            assert "PipelineShapeError" in h["shape_error"] and "micro-batches" in h["shape_error"], h
        covered = set().union(*(set(h["params"]) for h in holders))
        assert covered == set(results[0]["cases"][ci]["all_params"]), "some parameter was on no stage"


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_equals_single_device(tmp_path, world):
    cases = _plans(tmp_path, world)
    for c in cases:        # the planner placed the cuts itself; every stage holds at least one block
        assert c["stages"] == (2 if c["schedule"] in ("GPipe", "1F1B") else 4), c
    if world == 2:
        assert any(cases[-1]["recompute"]), f"the tight budget did not make the planner checkpoint: {cases[-1]}"
    results = launch(_rank_cases, world, [cases], tmp_path)
    _check(results, cases)
    if world == 4:          # the dp dim really ran data parallel (different rows per dp rank), DDP or FSDP2
        for i, c in enumerate(cases):
            assert {tuple(r["cases"][i]["local_rows"]) for r in results} == {(0, 4), (4, 8)}
            for r in results:     # FSDP2 where the stage plan shards parameters on dp, DDP where it replicates
                h = r["cases"][i]
                assert all(w.startswith(h["want_wrapper"]) for w in h["wrappers"]), (c, h["wrappers"])
        assert cases[2]["params_on_dp"] == ["R", "S0"] or cases[2]["params_on_dp"] == ["S0"], cases[2]
    print("\n" + "\n".join(f"world {world} {c['schedule']}: stages {c['stages']} bounds {c['bounds']} m={c['m']} "
                           f"recompute {c['recompute']} params on dp {c['params_on_dp']} "
                           f"max grad rel diff {max(r['cases'][i]['max_grad_rel'] for r in results):.2e} "
                           f"max loss diff {max(r['cases'][i]['loss_diff'] or 0 for r in results):.2e}"
                           for i, c in enumerate(cases)))


# ---- one rank (tests/_dist.py runs it) -------------------------------------------------------------------------
def _rank_cases(cases):
    """One rank of the launch (tests/_dist.py runs it inside the gloo group): every case, a barrier after each."""
    import copy
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from autopar import Plan, models
    from autopar.backends.pipeline import PipelineRunner, PipelineShapeError, local_batch
    res = []
    for case in cases:
        plan = Plan.load(case["path"])
        model = models.build_model(MODEL, device="cpu", n_layers=LAYERS, seed=0)
        ref = copy.deepcopy(model)
        x, y = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, n_layers=LAYERS, seed=1)
        mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_names))
        dp_rank = mesh.get_local_rank("dp") if "dp" in plan.mesh_names else 0
        runner = PipelineRunner(model, plan, mesh)
        xl, yl = local_batch(plan, (x, y), dp_rank)
        ref(x, y).backward()
        loss_local_ref = ref(xl, yl).item()
        loss = runner.step(xl if runner.is_first else None, yl if runner.is_last else None)
        rel, names = 0.0, []
        gref = dict(ref.named_parameters())
        for n, p in runner.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = gref[n].grad
            rel = max(rel, float((g - want).abs().max() / want.abs().max().clamp_min(1e-30)))
            names.append(n)
        try:
            bad = torch.cat([x, x], 1)
            runner.step(bad if runner.is_first else None, torch.cat([y, y], 1) if runner.is_last else None)
            err = "no error"
        except PipelineShapeError as e:
            err = f"PipelineShapeError: {e}"
        sharded = "dp" in plan.mesh_names and any(plan.params[n][0] != "R" for n in names)
        res.append({"max_grad_rel": rel, "params": names, "n_params": len(names), "wrappers": runner.wrappers,
                    "want_wrapper": "FSDP" if sharded else "DistributedDataParallel",
                    "has_layers": any(".layers." in f".{n}" for n in names),
                    "all_params": [n for n, _ in ref.named_parameters()],
                    "loss_diff": None if loss is None else abs(loss.item() - loss_local_ref),
                    "loss_ref": loss_local_ref, "shape_error": err,
                    "local_rows": [int(xl.data_ptr() - x.data_ptr()) // (x.element_size() * x.shape[1]),
                                   int(xl.data_ptr() - x.data_ptr()) // (x.element_size() * x.shape[1])
                                   + xl.shape[0]]})
        dist.barrier()
    return {"rank": dist.get_rank(), "cases": res}
