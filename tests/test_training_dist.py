"""Training in practice on the graph backend, 2 gloo ranks, one launch: shapes that change (a plan per shape, the
parameters kept where they are), an indivisible batch, ranks with different shapes, eval under inference_mode
(a forward-only plan), and gradient accumulation (no_sync / set_requires_gradient_sync) with its collectives counted
per micro-step. Every number is compared with one device: |diff| <= 1e-6 + 1e-4 max|ref|."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

SEED = 11


class Net(nn.Module):
    """Embedding, MLP with dropout (so eval mode and the shared random stream matter), a token loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.fc1 = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(64, 64)

    def forward(self, tokens, labels):
        h = self.drop(F.gelu(self.fc1(self.embed(tokens))))
        return F.cross_entropy(self.fc2(h).flatten(0, 1), labels.flatten(0, 1))


def _batch(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)


def _worst(pm, ref) -> float:
    """The largest |grad diff| / (1e-6 + 1e-4 max|ref grad|) over every parameter (<= 1 passes)."""
    worst = 0.0
    for name, p in ref.named_parameters():
        got = pm.get_parameter(name).grad
        if got is None or p.grad is None:
            return float("inf") if (got is None) != (p.grad is None) else worst
        diff = (got.full_tensor() - p.grad).abs().max().item()
        worst = max(worst, diff / (1e-6 + 1e-4 * p.grad.abs().max().item()))
    return worst


def _close(a, b) -> bool:
    return abs(float(a) - float(b)) <= 1e-6 + 1e-4 * abs(float(b))


def _step(pm, ref, x, seed, backward=True):
    """One forward (+ backward) of both at the same dropout seed; (loss, ref loss)."""
    torch.manual_seed(seed)
    r = ref(*x)
    pm.program.manual_seed(seed)
    got = pm(*x)
    if backward:
        r.backward()
        got.backward()
    return got.item(), r.item()


def job(tmp):
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from _clusters import SHAPES
    from autopar.backends.counter import CollectiveCounter, compare
    from _bench import batch_pin
    from autopar.backends.spmd.shapes import ShapeMismatchError

    out = {}
    t0 = time.perf_counter()
    say = lambda what: print(f"{time.perf_counter() - t0:7.2f} s  {what}", flush=True)  # the log's timeline
    torch.manual_seed(SEED)
    model = Net()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    force = {
        "embed.weight": ("S0",),
        "fc1.weight": ("S0",),
        "fc1.bias": ("S0",),  # FSDP-like
        "fc2.weight": ("R",),
        "fc2.bias": ("R",),
    }  # DDP-like
    x8 = _batch(8, 16, 1)
    pm = autopar.parallelize(model, mesh, x8, cluster=SHAPES, force=force, pin=batch_pin([0]))
    first = {k: list(v) for k, v in pm.plan.params.items()}
    out["sharded"] = [k for k, v in first.items() if v != ["R"]]
    out["input_placement"] = list(pm.program.P[pm.program.g.inputs[0]].out[0])

    say("the first shape, then a new batch and se")
    # --- the first shape, then a new batch and sequence length (re-plan), then the first again (cached)
    with CollectiveCounter(mesh) as cc:
        out["loss8"] = _step(pm, ref, x8, 1)
    full = len(cc.collectives())
    out["full_step"] = [list(r) for r in cc.collectives()]
    out["worst8"] = _worst(pm, ref)
    pm.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    x4 = _batch(4, 12, 2)
    t = time.perf_counter()
    out["loss4"] = _step(pm, ref, x4, 2)
    out["first_step4_s"] = time.perf_counter() - t
    out["worst4"] = _worst(pm, ref)
    out["replans"] = [
        dict(r, plan_s=round(r["plan_s"], 3), total_s=round(r["total_s"], 3)) for r in pm.plan_cache.replans
    ]
    pm.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    out["loss4b"] = _step(pm, ref, _batch(4, 12, 3), 3)
    out["loss8b"] = _step(pm, ref, _batch(8, 16, 4), 4)
    out["n_programs"] = len(pm.programs)
    out["placements_kept"] = all({k: list(v) for k, v in p.plan.params.items()} == first for p in pm.programs.values())
    pm.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)

    say("5 rows on 2 ranks with the batch pinned ")
    # --- 5 rows on 2 ranks with the batch pinned sharded: a clear error on every rank, and the module still works
    try:
        pm(*_batch(5, 16, 5))
        out["uneven"] = "ran"
    except ValueError as e:
        out["uneven"] = str(e)

    say("ranks with different shapes: ShapeMismat")
    # --- ranks with different shapes: ShapeMismatchError on both, before any collective of a plan
    try:
        pm(*_batch(6, 8 + 2 * dist.get_rank(), 6))
        out["mismatch"] = "ran"
    except ShapeMismatchError as e:
        out["mismatch"] = str(e)

    say("eval under inference_mode at a new batch")
    # --- eval under inference_mode at a new batch size: a forward-only plan, one device's eval loss
    pm.eval(), ref.eval()
    x6 = _batch(6, 16, 7)
    with torch.inference_mode():
        got = pm(*x6).item()  # plans (the ranks agree on the shape and on the plan first)
    with torch.no_grad(), CollectiveCounter(mesh) as cc:
        out["eval_again"] = pm(*x6).item()
    with torch.no_grad():
        out["eval"] = (got, ref(*x6).item())
    ev = pm.programs[max(pm.programs, key=lambda k: (not k[1], not k[2]))]
    out["eval_plan"] = {
        "buckets": len(ev.plan.buckets),
        "bw_nodes": sum(n.phase == "bw" for n in ev.g.nodes),
        "collectives": [list(r) for r in cc.collectives()],
        "diff": compare(cc.collectives(), ev.plan.collectives()),
        "train_plan_collectives": len(pm.plan.collectives()),
    }
    pm.train(), ref.train()

    say("accumulation: 2 micro-steps under no_syn")
    # --- accumulation: 2 micro-steps under no_sync, 1 outside; the same 3 micro-batches on one device
    micro = [_batch(8, 16, 20 + k) for k in range(3)]
    counts, losses = [], []
    for k, x in enumerate(micro):
        with CollectiveCounter(mesh) as cc:
            if k < 2:
                with pm.no_sync():
                    losses.append(_step(pm, ref, x, 30 + k))
            else:
                losses.append(_step(pm, ref, x, 30 + k))
        counts.append([list(r) for r in cc.collectives()])
        if k == 0:
            out["acc_grad_untouched"] = all(p.grad is None for p in pm.parameters())
            out["acc_bytes"] = pm.accumulated_bytes()
    out["acc_counts"] = counts
    out["acc_losses"] = losses
    out["acc_worst"] = _worst(pm, ref)
    out["full_count"] = full
    prog = pm.program  # the plan's gradient reductions: its buckets and any unbucketed redistribute
    bucketed = {f for bs in prog.chains.values() for f in bs[0].params}
    out["grad_comm"] = len(prog.plan.buckets) + sum(
        len(prog.red[(prog.g.params[f], "opt")][2])
        for f in prog.grad_fqns
        if f not in bucketed and (prog.g.params[f], "opt") in prog.red
    )
    pm.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)

    say("FSDP2's spelling, micro-batches of two s")
    # --- FSDP2's spelling, micro-batches of two shapes (the old plan's sum is reduced once when the plan changes)
    pm.set_requires_gradient_sync(False)
    mixed = []
    for k, x in enumerate([_batch(8, 16, 40), _batch(4, 12, 41)]):
        with CollectiveCounter(mesh) as cc:
            mixed.append(_step(pm, ref, x, 50 + k))
        mixed.append(len(cc.collectives()))
    pm.set_requires_gradient_sync(True)
    mixed.append(_step(pm, ref, _batch(8, 16, 42), 52))
    out["mixed"] = mixed
    out["mixed_worst"] = _worst(pm, ref)
    say("DDP-like: all_reduce buckets filled in place")
    # --- DDP-like plan (every parameter replicated): all_reduce buckets the backward fills in place
    torch.manual_seed(SEED)
    model = Net()
    ref = copy.deepcopy(model)
    ddp = autopar.parallelize(
        model,
        mesh,
        x8,
        cluster=SHAPES,
        force={k: ("R",) for k, _ in model.named_parameters()},
        pin=batch_pin([0], (8, 16)),
    )  # every activation batch-sharded, as DDP
    with CollectiveCounter(mesh) as cc:
        _step(ddp, ref, x8, 60)
    out["ddp_full"] = [list(r) for r in cc.collectives()]
    out["ddp_flat"] = len(ddp.program.flat_sizes)
    out["ddp_buckets"] = len(ddp.plan.buckets)
    ddp.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    out["ddp_counts"], out["ddp_losses"] = [], []
    for k, x in enumerate(micro):
        with CollectiveCounter(mesh) as cc:
            if k < 2:
                with ddp.no_sync():
                    out["ddp_losses"].append(_step(ddp, ref, x, 70 + k))
            else:
                out["ddp_losses"].append(_step(ddp, ref, x, 70 + k))
        out["ddp_counts"].append([list(r) for r in cc.collectives()])
    out["ddp_worst"] = _worst(ddp, ref)
    say("done")
    return out


def test_shapes_eval_accumulation(tmp_path):
    r0, r1 = launch(job, 2, [str(tmp_path)], tmp_path, timeout=200)
    for r in (r0, r1):
        # something is sharded and communicated: FSDP-like weights, the batch on dp
        assert {"embed.weight", "fc1.weight", "fc1.bias"} <= set(r["sharded"]), r["sharded"]
        assert r["input_placement"] == ["S0"]
        kinds = {c[0] for c in r["full_step"]}
        assert {"all_gather", "reduce_scatter"} <= kinds, kinds
        for k in ("loss8", "loss4", "loss4b", "loss8b"):
            assert _close(*r[k]), (k, r[k])
        assert r["worst8"] <= 1 and r["worst4"] <= 1, (r["worst8"], r["worst4"])
        # one re-plan for (4, 12), none for the second call of it or for the first shape again
        assert len(r["replans"]) >= 1 and r["replans"][0]["shapes"][0] == [4, 12], r["replans"]
        assert r["n_programs"] == 2 and r["placements_kept"]
        assert "input 'tokens' dim 0 has size 5" in r["uneven"] and "mesh dim 0 ('dp', 2 ranks)" in r["uneven"], r[
            "uneven"
        ]
        assert (
            "different global input shapes" in r["mismatch"]
            and "(6, 8)" in r["mismatch"]
            and "(6, 10)" in r["mismatch"]
        ), r["mismatch"]
        # eval: dropout off (one device's eval loss), forward only: no backward nodes, no buckets, no gradient
        # collective, exactly the plan's collectives
        assert _close(*r["eval"]) and _close(r["eval_again"], r["eval"][1]), r["eval"]
        ev = r["eval_plan"]
        assert ev["buckets"] == 0 and ev["bw_nodes"] == 0, ev
        assert not ev["diff"] and len(ev["collectives"]) < ev["train_plan_collectives"], ev
        # accumulation: no gradient collective under no_sync (no reduce_scatter, and the full step's count less
        # its gradient reductions), the last micro-step the full step; one device's accumulated gradient
        grad_comm = r["grad_comm"]
        assert grad_comm >= 2, grad_comm  # a reduce_scatter (sharded) and an all_reduce (fc2)
        c0, c1, c2 = (len(c) for c in r["acc_counts"])
        assert c0 == c1 == r["full_count"] - grad_comm, (c0, c1, r["full_count"], grad_comm)
        assert all(c[0] != "reduce_scatter" for c in r["acc_counts"][0] + r["acc_counts"][1])
        assert c2 == r["full_count"] and sorted(r["acc_counts"][2]) == sorted(r["full_step"]), r["acc_counts"][2]
        assert r["acc_grad_untouched"] and r["acc_bytes"] > 0
        assert all(_close(*x) for x in r["acc_losses"]), r["acc_losses"]
        assert r["acc_worst"] <= 1, r["acc_worst"]
        # DDP-like: a step is the loss's all_reduce and the gradient buckets (filled in place); under no_sync the
        # loss's alone, then the full step once
        n, nb = len(r["ddp_full"]), r["ddp_buckets"]
        assert r["ddp_flat"] >= 1 and nb >= 1 and all(c[0] == "all_reduce" for c in r["ddp_full"]), r
        assert [len(c) for c in r["ddp_counts"]] == [n - nb, n - nb, n], r["ddp_counts"]
        assert r["ddp_worst"] <= 1 and all(_close(*x) for x in r["ddp_losses"]), (r["ddp_worst"], r["ddp_losses"])
        assert r["mixed"][1] == c0, r["mixed"]  # no_sync by set_requires_gradient_sync(False)
        assert r["mixed_worst"] <= 1 and _close(*r["mixed"][0]) and _close(*r["mixed"][2]), r["mixed"]
