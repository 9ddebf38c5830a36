"""The benchmark's hand plans compute what one device computes: on 4 gloo ranks (meshes 4 and 2x2), one forward and
backward of each hand source (benchmarks/hand_plans.py: DDP, FSDP2, Megatron-style TP, FSDP2 x TP) gives every
parameter one device's gradient of the mean loss, with labels that ignore_index leaves uneven over the batch shards.
The loss is normalized as torchtitan 0.2.2's train_step does (summed over the global count of valid labels); the
control, DDP on each rank's plain mean loss, gives another gradient, so the check can tell them apart."""

from __future__ import annotations

import os
import sys

from _dist import launch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
MODEL = "llama-tiny"
TOL = 1e-5


def test_world4_hand_plans_give_one_devices_gradients(tmp_path):
    res = launch(
        _rank_hand_grads,
        4,
        [BENCH, [["4", "ddp"], ["4", "fsdp2"], ["2x2", "tp"], ["2x2", "fsdp2_tp"], ["2x2", "ddp"]]],
        tmp_path,
    )
    r0 = res[0]
    assert len(set(r0["valid_per_shard"])) > 1 and min(r0["valid_per_shard"]) > 0  # uneven, none empty
    for case, err in r0["err"].items():
        assert err < TOL, (case, err)
    assert r0["n_params"] and all(n == r0["n_params"]["4 ddp"] for n in r0["n_params"].values())
    assert r0["control_err"] > 1e-3, r0["control_err"]  # the plain per-rank mean is another gradient
    assert set(r0["engine"]) == {"4 ddp", "4 fsdp2", "2x2 ddp"}  # what torch issued = hand_plans.hand_collectives
    for case, (got, pred) in r0["engine"].items():
        assert got == pred, (case, got, pred)
    assert all(r["err"] == r0["err"] for r in res)  # every rank compared the same full gradients


def test_world4_moe_hand_plans_compute_the_global_router_aux_loss(tmp_path):
    """An MoE's router aux loss is a product of two means over the whole batch: the hand plans that split the batch
    all-reduce each layer's router statistics (hand_plans.global_router_means) and give one device's gradients; the
    control, DDP with each rank's own shard's aux loss, gives another gradient."""
    res = launch(
        _rank_hand_grads,
        4,
        [BENCH, [["4", "ddp"], ["4", "fsdp2"], ["2x2", "tp"], ["2x2", "fsdp2_tp"]], "moe-tiny", {"aux_loss_coef": 1.0}],
        tmp_path,
    )
    r0 = res[0]
    for case, err in r0["err"].items():
        assert err < TOL, (case, err)
    assert r0["control_err"] > 1e-3, r0["control_err"]
    assert all(r["err"] == r0["err"] for r in res)
    assert set(r0["engine"]) == {"4 ddp", "4 fsdp2"}  # + each MoE layer's router statistics
    for case, (got, pred) in r0["engine"].items():
        assert got == pred, (case, got, pred)


# ---- one rank (tests/_dist.py runs it) -----------------------------------------------------------------------


def _full(t):
    """The whole tensor of a DTensor (a collective: every rank calls it in the same order), a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank_hand_grads(bench, cases, model=MODEL, overrides=None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, bench)
    from hand_plans import IGNORE_INDEX, _apply, apply_hand, hand_collectives
    from measure import comm_summary
    from autopar.backends.counter import CollectiveCounter
    from autopar import models as M

    ov = overrides or {}
    build = lambda: M.build_model(model, device="cpu", seed=0, **ov)  # noqa: E731
    world = dist.get_world_size()
    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tokens, labels = M.example_inputs(model, batch=4, device="cpu", seed=0, **ov)
    labels = labels.clone()
    labels[0, 3:] = IGNORE_INDEX  # shard 0 of 4 keeps 3 labels, shard 1 (of 2 and 4) loses half
    labels[1, ::2] = IGNORE_INDEX
    ref = build()
    ref(tokens, labels).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    def rel_err(module):
        errs, n = [], 0
        for name, p in module.named_parameters():
            name = name.removeprefix("module.")
            g = _full(p.grad)
            errs.append(float((g - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-12)))
            n += 1
        return max(errs), n

    out = {"err": {}, "n_params": {}, "engine": {}}
    for mesh_s, src in cases:
        mesh = world_mesh if mesh_s == "4" else two_d
        run = apply_hand(src, model, build(), mesh, world_mesh)
        with CollectiveCounter(mesh) as cc:
            run.forward_backward(run.local_inputs((tokens, labels)))
        out["err"][f"{mesh_s} {src}"], out["n_params"][f"{mesh_s} {src}"] = rel_err(run.module)
        pred = hand_collectives(src, build(), world)
        if pred is not None:  # DDP's first step runs one bucket (its rebuilt buckets come after): bytes only
            got = comm_summary(cc.records)
            out["engine"][f"{mesh_s} {src}"] = [
                {k: v["bytes"] if src == "ddp" else v for k, v in d.items()} for d in (got, pred)
            ]
    if model == MODEL:  # the control: each rank's plain mean
        run = apply_hand("ddp", model, build(), world_mesh, world_mesh)
        run.module(*run.local_inputs((tokens, labels))).backward()
    else:  # the control: the loss normalized as above, each rank's own shard's router aux loss
        run = _apply("ddp", model, build(), world_mesh, world_mesh)
        run.forward_backward(run.local_inputs((tokens, labels)))
    out["control_err"] = rel_err(run.module)[0]
    out["valid_per_shard"] = [int((s != IGNORE_INDEX).sum()) for s in labels.chunk(world, 0)]
    return out


def test_world4_torchtitan_train_step_loss_gives_one_devices_gradients(tmp_path):
    """torchtitan 0.2.2's parallelize_llama turns FSDP's gradient division off; with its train_step's loss (summed
    over the global count of valid labels: benchmarks/titan.py titan_loss) the gradients are one device's, on
    FSDP (tp 1) and FSDP x TP with loss_parallel (tp 2). Needs the optional bench extra (torchtitan)."""
    import pytest

    pytest.importorskip("torchtitan")
    res = launch(_rank_titan_grads, 4, [BENCH], tmp_path)
    for tp, err in res[0].items():
        assert err < TOL, (tp, err)


def _rank_titan_grads(bench):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, bench)
    from hand_plans import IGNORE_INDEX, global_tokens
    from measure import _loss_parallel, _null
    from titan import build_titan, titan_loss, titan_model_args
    from torchtitan.models.llama3 import Transformer

    world, rank, seq, out = dist.get_world_size(), dist.get_rank(), 32, {}
    for tp in (1, 2):
        model, lp = build_titan(world, tp, seq)
        ref = Transformer(titan_model_args())  # one device, the parallel model's initial weights
        ref.load_state_dict({n: _full(p).detach() for n, p in model.named_parameters()}, strict=False)
        gen = torch.Generator().manual_seed(0)
        tokens, labels = (torch.randint(0, titan_model_args().vocab_size, (4, seq), generator=gen) for _ in range(2))
        labels[0, 3:] = IGNORE_INDEX
        labels[1, ::2] = IGNORE_INDEX
        F.cross_entropy(ref(tokens).flatten(0, 1).float(), labels.flatten(0, 1)).backward()
        dp = world // tp
        groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]  # the data-parallel ranks
        local = tuple(t.chunk(dp, 0)[rank // tp].contiguous() for t in (tokens, labels))
        with _loss_parallel() if lp else _null():
            titan_loss(model, *local, lp, global_tokens(local[-1], groups[rank % tp])).backward()
        want = dict(ref.named_parameters())
        out[tp] = max(
            float((_full(p.grad) - want[n].grad).abs().max() / want[n].grad.abs().max())
            for n, p in model.named_parameters()
        )
    return out


def test_world4_tp_hand_plan_traced_on_the_fake_group_issues_what_a_real_run_does(tmp_path):
    """benchmarks/hand_trace.py predicts a tp hand plan's collectives by tracing it on the fake process group (the
    harness's prediction for the tp / fsdp2_tp / torchtitan rows): the counted training step equals the one a real
    4-rank gloo run issues, kind by kind, in count and bytes (with fsdp2_tp, both mesh dims)."""
    sys.path.insert(0, BENCH)
    from hand_trace import traced

    cases = [["mlp-tiny", "2x2", "tp"], ["mlp-tiny", "2x2", "fsdp2_tp"]]
    res = launch(_rank_counted_step, 4, [BENCH, cases], tmp_path)
    want = traced([tuple(c) for c in cases])
    for c in cases:
        key = " ".join(c)
        assert res[0][key] and res[0][key] == want[key], (key, res[0][key], want[key])


def _rank_counted_step(bench, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, bench)
    from bench_config import QUICK_MEASURED
    from measure import build, comm_summary
    from autopar import models as M
    from autopar.backends.counter import CollectiveCounter

    world_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for model_key, mesh_s, src in cases:
        cfg = QUICK_MEASURED[model_key]
        x = M.example_inputs(cfg["name"], batch=cfg["batch"], seq=cfg["seq"], device="cpu", seed=0, **cfg["overrides"])
        run = build(src, cfg, two_d if mesh_s == "2x2" else world_mesh, world_mesh, x)
        run.step()
        with CollectiveCounter(two_d) as cc:
            run.step()
        out[f"{model_key} {mesh_s} {src}"] = comm_summary(cc.records)
    return out
