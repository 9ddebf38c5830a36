"""SPMD execution on real multi-process groups: gloo world 2 (1-D mesh) and world 4 (2x2 and 1-D 4), and NCCL
when CUDA is present (tests marked `gpu`).

Each launch runs several checks in one process group (a start costs seconds): every rank plans the same model
independently (the ranks agree on the plan hash before any collective), trains 3 SGD steps next to the
single-device model, and compares the loss, the first step's gradients, the final parameters and the
collectives of the first step (kind, mesh dim, bytes) with the plan. Also: DCP save/load of the parallel state
dict, pre-sharded inputs, and a rank holding a different plan (a clear error on every rank, no hang).
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist

from _dist import launch as _launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]


def launch(job: str, world: int, cases, tmp_path, backend: str = "gloo") -> list[dict]:
    """Run `job` on `world` ranks of one `backend` group (tests/_dist.py: 60 s per collective, 300 s per launch,
    a failed or hung rank fails the test naming it); returns each rank's result dict."""
    return _launch(
        JOBS[job], world, [cases, str(tmp_path), "cuda" if backend == "nccl" else "cpu"], tmp_path, backend=backend
    )


def _mesh(shape, device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, tuple(shape), mesh_dim_names=("dp", "tp") if len(shape) == 2 else ("dp",))


def _force(model, shape, constraint):
    from autopar.testing import fsdp_force, fsdp_tp_force, tp_force

    return {
        "none": lambda: {},
        "fsdp": lambda: fsdp_force(model, shape),
        "tp": lambda: tp_force(model, shape),
        "fsdp+tp": lambda: fsdp_tp_force(model, shape),
    }[constraint]()


def job_train(cases, tmp, device):
    """Each case: plan on this rank, train 3 SGD steps beside the single-device model, report the numbers."""
    import autopar
    from autopar.testing import train_and_compare
    from autopar.models import build_model, example_inputs

    out = {"cases": []}
    for name, ov, batch, seq, shape, constraint in cases:
        model = build_model(name, device="cpu", seed=7, **ov)
        x = example_inputs(name, batch=batch, seq=seq, seed=8, **ov)
        mesh = _mesh(shape, device)
        if constraint == "dp-flat":  # data parallel over both dims, gradient buckets on the flattened group
            import autopar.passes.buckets as buckets

            keep, buckets.flatten_chain = buckets.flatten_chain, lambda *a: True
            try:
                pm = autopar.parallelize(
                    model,
                    mesh,
                    x,
                    force={k: ("R", "R") for k, _ in model.named_parameters()},
                    pin=lambda n: _batch_sharded(n, batch),
                )
            finally:
                buckets.flatten_chain = keep
        elif constraint == "dp-aux":  # data parallel, the routers' token means left partial means (Pa)
            pm = autopar.parallelize(
                model, mesh, x, force={k: ("R",) for k, _ in model.named_parameters()}, pin=_router_means
            )
        else:
            pm = autopar.parallelize(model, mesh, x, force=_force(model, shape, constraint))
        xs = tuple(t.to(device) for t in x)
        rep = train_and_compare(pm, copy.deepcopy(model).to(device), xs, steps=3, lr=0.5)
        out["cases"].append(
            {
                "case": [name, shape, constraint],
                "failures": rep.failures[:5],
                "collective_diff": rep.collective_diff,
                "measured": rep.measured,
                "predicted": [list(c) for c in rep.predicted],
                "max_abs": rep.max_abs,
                "losses": rep.losses,
                "hash": pm.plan.hash(),
                "fw_reduces": _fw_reduces(pm.plan),
                "placements": {k: list(v) for k, v in pm.plan.params.items()},
            }
        )
    return out


def _batch_sharded(n, batch):
    """Inputs and forward activations (batch, seq, dim) sharded on the batch over both mesh dims: data parallel
    (a model this small would otherwise rather gather its few tokens and compute replicated)."""
    if n.kind == "input":
        return {0: "S0", 1: "S0"}
    out = n.outs[0] if n.kind == "op" and n.phase == "fw" and n.outs else None
    if out is not None and len(out.shape) == 3 and out.shape[0] == batch:
        return {(0, 0): "S0", (1, 0): "S0"}
    return None


def _router_means(n):
    """Inputs batch-sharded; an MoE router's means over the tokens (expert load, mean probability) partial means."""
    if n.kind == "input":
        return {0: "S0"}
    if n.kind == "op" and n.phase == "fw" and n.module.endswith(".moe") and n.target is torch.ops.aten.mean.dim:
        return {0: "Pa"}
    return None


def _fw_reduces(plan) -> list:
    """The forward's activation all_reduces: (node, input, src, its collectives, the all_reduce carrying it)."""
    return [
        [n["name"], r["input"], r["src"], r["collectives"], r.get("coalesced")]
        for n in plan.nodes
        if n["phase"] == "fw"
        for r in n.get("redistribute", [])
        if r["class"] == "act" and (r["collectives"] or "coalesced" in r)
    ]


@contextlib.contextmanager
def _planner_refused(refuse: bool):
    """autopar.plan raises inside the block (on the ranks that must not plan)."""
    import autopar.api

    def refused(*a, **k):
        raise AssertionError("this rank planned")

    real = autopar.api.plan
    if refuse:
        autopar.api.plan = refused
    try:
        yield
    finally:
        autopar.api.plan = real


def job_extras(cases, tmp, device):
    """DCP round trip of the parallel state dict, pre-sharded inputs, then a rank with a different plan."""
    import torch.distributed.checkpoint as dcp
    import autopar
    from autopar.backends.spmd.comm import PlanMismatchError
    from autopar.backends.spmd.module import local_batch
    from autopar.testing import global_value
    from autopar.models import build_model, example_inputs

    name, ov, batch, seq, shape, constraint = cases[0]
    mesh = _mesh(shape, device)
    model = build_model(name, device="cpu", seed=1, **ov)
    x = example_inputs(name, batch=batch, seq=seq, seed=2, **ov)
    force = _force(model, shape, constraint)
    pm = autopar.parallelize(model, mesh, x, force=force)
    loss = pm(*x)
    loss.backward()
    torch.optim.SGD(pm.parameters(), lr=0.5).step()
    ckpt = os.path.join(tmp, "ckpt")
    dcp.save(pm.state_dict(), checkpoint_id=ckpt)
    other = autopar.parallelize(build_model(name, device="cpu", seed=99, **ov), mesh, x, force=force)
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    other.load_state_dict(sd)
    dcp_diff = max(
        (global_value(a) - global_value(b)).abs().max().item() for a, b in zip(pm.parameters(), other.parameters())
    )
    # pre-sharded inputs: the DTensors of `shard_inputs` and the global tensors give the same loss
    sharded = pm.shard_inputs(*x)
    same_loss = torch.equal(pm(*sharded).detach(), pm(*x).detach())
    local_shapes = [list(t.shape) for t in local_batch(pm, *x)]
    in_pl = [n["placement"]["out"][0] for n in pm.plan.nodes if n["kind"] == "input"]
    # one rank plans for the mesh (autopar/across_ranks.py): rank 1, called with other options and with no planner
    # at all, runs rank 0's plan
    alt = dict(force)
    if dist.get_rank() == 1:
        k = next(iter(alt))
        alt[k] = tuple("R" for _ in shape)
    with _planner_refused(dist.get_rank() == 1):
        pm1 = autopar.parallelize(model, mesh, x, force=alt)
        pm1(*(t[: t.shape[0] // 2] for t in x))  # new shapes: re-planned on rank 0 alone too
        once = [pm1.plan.hash(), len(pm1.programs)]
    # ranks handed different finished plans: refused on every rank before any step
    try:
        autopar.parallelize(model, mesh, x, planned=autopar.plan(model, mesh, x, force=alt, return_state=True))
        mismatch = "no error"
    except PlanMismatchError as e:
        mismatch = str(e)
    # planning that fails (here a forced placement the mesh's first rank cannot take) or a capture that differs on
    # another rank (rank 1's batch is another size): every rank raises at once, none waits in a collective for it
    failed = {}
    for case in ("plan", "capture"):
        bad = dict(force)
        if case == "plan" and dist.get_rank() == 0:
            bad[next(iter(bad))] = tuple("S7" for _ in shape)
        xs = x if case == "plan" or dist.get_rank() == 0 else tuple(t[: t.shape[0] // 2] for t in x)
        try:
            autopar.parallelize(model, mesh, xs, force=bad)
            failed[case] = "no error"
        except (ValueError, autopar.PlanningFailedError) as e:
            failed[case] = f"{type(e).__name__}: {e}"
    # gradient buckets: the flat buffer is filled again when nothing else holds it (autograd copies the gradients
    # into .grad); gradients accumulate over steps without zero_grad
    dp = autopar.parallelize(
        model,
        mesh,
        x,
        force={k: tuple("R" for _ in shape) for k, _ in model.named_parameters()},
        pin=lambda n: {0: "S0"} if n.kind == "input" else None,
    )  # the batch on dim 0
    params = list(dp.parameters())

    def grads():
        loss = dp(*x)
        loss.backward()
        bufs = {b.untyped_storage().data_ptr() for b in dp.program.flat_bufs.values()}
        return [global_value(p.grad).clone() for p in params], bufs

    g1, b1 = grads()
    for p in params:
        p.grad = None
    g2, b2 = grads()
    g3, _ = grads()  # no zero_grad: accumulated (a new buffer if .grad still holds it)
    ref = build_model(name, device="cpu", seed=1, **ov)  # one device, at dp's weights
    names = [k for k, _ in dp.named_parameters()]
    with torch.no_grad():
        for k, p in zip(names, params):
            ref.get_parameter(k).copy_(global_value(p))
    ref(*x).backward()
    bucket = {
        "buffers": len(b1),
        "reused": b1 == b2,
        "same": all(torch.equal(a, b) for a, b in zip(g1, g2)),
        "accum_err": max((c - 2 * a).abs().max().item() for a, c in zip(g1, g3)),
        "ref_err": max((a - ref.get_parameter(k).grad).abs().max().item() for k, a in zip(names, g1)),
        "in_place": len(dp.program.write_at),
        "copied": sum(map(len, dp.program.copy_at.values())),
    }
    # attach_optimizer: fused AdamW's per-parameter step counts become replicated DTensors after the first step;
    # the training it does is the same to the bit
    runs = {}
    for attach in (False, True):
        m = autopar.parallelize(build_model(name, device="cpu", seed=1, **ov), mesh, x, force=force)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        if attach:
            m.attach_optimizer(opt)
        for _ in range(3):
            m(*x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[attach] = (
            [global_value(p).clone() for p in m.parameters()],
            sorted({type(st["step"]).__name__ for st in opt.state.values()}),
        )
    attached = {
        "diff": max((a - b).abs().max().item() for a, b in zip(runs[False][0], runs[True][0])),
        "plain_steps": runs[False][1],
        "attached_steps": runs[True][1],
    }
    out = {
        "dcp_diff": dcp_diff,
        "same_loss": same_loss,
        "local_shapes": local_shapes,
        "input_placements": in_pl,
        "mismatch": mismatch,
        "failed": failed,
        "plan_hashes": [pm.plan.hash(), *once],
        "bucket": bucket,
        "attached": attached,
    }
    out.update(job_train(cases[1:], tmp, device))  # and train the other cases in the same group
    return out


JOBS = {"train": job_train, "extras": job_extras}

LLAMA = dict(dim=8, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16, ffn_dim=12)  # GQA
GPT2 = dict(dim=8, n_layers=1, n_heads=2, vocab_size=16, max_seq_len=8)  # tied embeddings
MOE = dict(
    dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=16, n_experts=4, top_k=2, moe_hidden=4, dense_ffn_dim=8
)
MLP_DP = dict(dim=64, hidden=256, n_layers=1, vocab=32)


def _check_train(results, n_cases):
    for res in results:
        assert len(res["cases"]) == n_cases
    for i in range(n_cases):
        cases = [res["cases"][i] for res in results]
        assert len({c["hash"] for c in cases}) == 1, "ranks planned differently"
        for r, c in enumerate(cases):
            assert not c["failures"], (r, c["case"], c["failures"])
            assert not c["collective_diff"], (r, c["case"], c["collective_diff"])
            assert sorted(map(repr, c["measured"])) == sorted(map(repr, c["predicted"]))
    return [[c for c in res["cases"]] for res in results]


def test_world4_gloo_2x2_and_1d(tmp_path):
    cases = [
        ("llama-tiny", LLAMA, 2, 4, (2, 2), "fsdp"),  # its plan has an all_to_all
        ("gpt2-tiny", GPT2, 2, 4, (2, 2), "fsdp+tp"),
        ("moe-tiny", MOE, 2, 4, (4,), "fsdp"),
        ("llama-tiny", LLAMA, 4, 4, (2, 2), "dp-flat"),
        ("moe-tiny", {**MOE, "n_layers": 3}, 4, 4, (4,), "dp-aux"),
    ]
    results = launch("train", 4, cases, tmp_path)
    per_rank = _check_train(results, len(cases))
    # the exact aux loss over a split batch: every layer's expert load and mean probability (partial means) and the
    # loss's sum and count (partial sums) reach Replicate in ONE all_reduce at the end of the forward
    red = per_rank[0][4]["fw_reduces"]
    lead = [r for r in red if r[3]]
    assert len(lead) == 1 and lead[0][3][0][0] == "all_reduce", red
    assert len(red) == 2 * 3 + 2 and {tuple(r[2]) for r in red} == {("P",), ("Pa",)}, red
    assert all(r[4] is None or isinstance(r[4], str) or r[0] == lead[0][0] for r in red), red
    flat = [c for c in per_rank[0][3]["measured"] if c[0] == "all_reduce" and c[1] == [0, 1]]
    assert flat and len(flat) == sum(1 for c in per_rank[0][3]["predicted"] if c[1] == [0, 1]), per_rank[0][3]
    kinds = {c[0] for case in per_rank[0] for c in case["measured"]}
    assert {"all_gather", "reduce_scatter", "all_to_all"} <= kinds, kinds  # a real all_to_all on gloo
    assert any(c[1] == 1 for case in per_rank[0] for c in case["measured"]), "no collective on the tp sub-group"
    assert all(abs(a - b) <= 1e-6 + 1e-5 * abs(b) for case in per_rank[0] for a, b in case["losses"])


def test_world2_gloo_train_dcp_sharded_inputs_and_plan_mismatch(tmp_path):
    cases = [("mlp-tiny", MLP_DP, 32, 32, (2,), "fsdp"), ("llama-tiny", LLAMA, 2, 4, (2,), "tp")]
    results = launch("extras", 2, cases, tmp_path)
    _check_train(results, 1)
    for res in results:
        b = res["bucket"]
        assert b["buffers"] == 1 and b["reused"] and b["same"], b
        assert b["accum_err"] <= 1e-6 and b["ref_err"] <= 1e-5, b
        # gradients made in their bucket slice (out=: the biases' sums here) or copied there, all 7 bucketed
        assert b["in_place"] >= 1 and b["in_place"] + b["copied"] == 7, b
        assert res["dcp_diff"] == 0.0
        assert res["same_loss"]
        a = res["attached"]
        assert a["diff"] == 0.0 and a["plain_steps"] == ["Tensor"] and a["attached_steps"] == ["DTensor"], a
        assert (
            "ranks hold different plans" in res["mismatch"]
            and "ranks [0]" in res["mismatch"]
            and "ranks [1]" in res["mismatch"]
        ), res["mismatch"]
    # rank 1 planned nothing (its planner raised) and ran rank 0's plan, not the one its own options give
    assert results[0]["plan_hashes"][1] == results[1]["plan_hashes"][1] == results[0]["plan_hashes"][0], results
    assert results[0]["plan_hashes"][2] == results[1]["plan_hashes"][2] == 2, results  # and at the new shapes
    # planning failed on rank 0: rank 0 raises its own error, rank 1 says so instead of waiting for it
    fail0, fail1 = results[0]["failed"], results[1]["failed"]
    assert fail0["plan"].startswith("ValueError") and "forced on parameter" in fail0["plan"], fail0
    assert fail1["plan"].startswith("PlanningFailedError") and "rank 0" in fail1["plan"], fail1
    assert "forced on parameter" in fail1["plan"], fail1  # rank 0's reason, on rank 1
    # rank 1 captured another graph than rank 0 planned: its own error names the difference, rank 0 names rank 1
    assert fail1["capture"].startswith("PlanLoadError") and "differs from the plan's" in fail1["capture"], fail1
    assert fail0["capture"].startswith("PlanningFailedError") and "ranks [1]" in fail0["capture"], fail0
    # inputs the plan shards arrive as this rank's slice (batch 32 over 2 ranks) without communication
    pl, shapes = results[0]["input_placements"], results[0]["local_shapes"]
    for p, s in zip(pl, shapes):
        assert s[0] == (16 if p == ["S0"] else 32), (pl, shapes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_nccl_same_checks(tmp_path):
    world = min(torch.cuda.device_count(), 2)
    shape = (world,)
    cases = [
        ("llama-tiny", LLAMA, 2, 4, shape, "tp"),
        ("gpt2-tiny", GPT2, 2, 4, shape, "fsdp"),
        ("moe-tiny", MOE, 2, 4, shape, "fsdp"),
    ]
    _check_train(launch("train", world, cases, tmp_path, backend="nccl"), len(cases))
