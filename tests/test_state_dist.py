"""One model state on every rank (issue 27), on 4 gloo ranks: every rank builds its model from its OWN seed (a
script that seeds each rank differently), and `parallelize` must make all of them train rank 0's model.

One launch (tests/_dist.py: 60 s per collective, 300 s per launch) runs every case: the graph backend with a plan
that shards parameters (cost model tests/_clusters.py SHAPES on a 2x2 mesh; asserted sharded) and with a plan that
replicates every parameter (default cpu-gloo cost model, data parallel on a 2x2 mesh), and the torch backend with
FSDP (every parameter Shard(0) over 4 ranks) and with replicated parameters (gradient hooks) on (4,). Each case is
compared with rank 0's model on one device: the loss and every gradient of the first step, the loss of every step
and every parameter after 3 AdamW steps (|diff| <= 1e-6 + 1e-4 max|ref|). A control with assume_identical=True
(the ranks' own values kept) shows the test can fail: the first step's replica checksum names a parameter. Also:
the user's RNG state is unchanged by parallelize, the agreed seed is rank 0's, a parameter changed on one rank
only after parallelize is named in the first step's error, and DCP loading after parallelize gives the saved
values (loaded values win over rank 0's).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _dist import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

MLP = dict(dim=128, hidden=512)  # big enough that SHAPES shards parameters
BATCH, SEQ, STEPS = 8, 12, 3  # 96 tokens: no weight dim is the batch (batch_pin)


def _diff(a, b) -> float:
    """max |a - b| over the tolerance 1e-6 + 1e-4 max |b| (<= 1 passes)."""
    return ((a - b).abs().max() / (1e-6 + 1e-4 * b.abs().max())).item()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(pm, ref, x, y, local=None, ctx=None):
    """3 AdamW steps on the parallel module and on the single-device reference; the worst scaled differences."""
    import contextlib

    ctx = ctx or contextlib.nullcontext
    xl, yl = local if local is not None else (x, y)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    named, ref_named = dict(pm.named_parameters()), dict(ref.named_parameters())
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        with ctx():
            loss = pm(xl, yl)
            loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        lv = _full(loss).detach()
        if local is not None:  # the torch backend: each rank's mean over its equal batch shard
            import torch.distributed as dist

            dist.all_reduce(lv)
            lv = lv / dist.get_world_size()
        worst["loss"] = max(worst["loss"], _diff(lv, ref_loss.detach()))
        if s == 0:
            for k, p in ref_named.items():
                worst["grad"] = max(worst["grad"], _diff(_full(named[k].grad), p.grad))
        opt.step()
        ref_opt.step()
    for k, p in ref_named.items():
        worst["param"] = max(worst["param"], _diff(_full(named[k].detach()), p.detach()))
    return worst


def job_state(tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from _clusters import SHAPES
    from autopar import models
    from _bench import batch_pin
    from autopar.backends.spmd.state import ReplicaMismatchError

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # each rank its own generator, as a careless script has
    build = lambda: models.build_model("mlp-tiny", device="cpu", seed=rank, **MLP)  # each rank its own weights
    ref0 = models.build_model("mlp-tiny", device="cpu", seed=0, **MLP)  # rank 0's, on one device
    x, y = models.example_inputs("mlp-tiny", batch=BATCH, seq=SEQ, seed=5, **MLP)
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    out = {"cases": {}}

    # graph backend, a plan that shards (SHAPES); the user's RNG state is not touched by parallelize
    planned = autopar.plan(build(), mesh22, (x, y), cluster=SHAPES, overlap=False, return_state=True)
    rng = torch.get_rng_state()
    pm = autopar.parallelize(build(), mesh22, (x, y), planned=planned)
    out["rng_same"] = bool(torch.equal(rng, torch.get_rng_state()))
    out["seed"], out["initial_seed"] = pm.program.rng_seed, torch.initial_seed()
    out["sharded"] = sorted(k for k, v in pm.plan.params.items() if any(p != "R" for p in v))
    out["init_comm"], out["repr"] = pm.init_comm, repr(pm).splitlines()[1]
    out["cases"]["graph_sharded"] = _train(pm, copy.deepcopy(ref0), x, y)
    # DCP: the saved state wins over rank 0's values taken at construction
    import torch.distributed.checkpoint as dcp

    dcp.save(pm.state_dict(), checkpoint_id=f"{tmp}/ckpt")
    saved = {k: _full(v).clone() for k, v in pm.state_dict().items()}
    pm2 = autopar.parallelize(build(), mesh22, (x, y), planned=planned)
    sd = pm2.state_dict()
    dcp.load(sd, checkpoint_id=f"{tmp}/ckpt")
    out["dcp_diff"] = max((_full(v) - saved[k]).abs().max().item() for k, v in sd.items())

    # graph backend, every parameter replicated, the batch split over all 4 ranks (data parallel)
    rep = {k: ("R", "R") for k, _ in ref0.named_parameters()}
    planned = autopar.plan(
        build(),
        mesh22,
        (x, y),
        force=rep,
        pin=batch_pin([0, 1], (BATCH, SEQ)),
        overlap=False,
        cluster="cpu-gloo",
        return_state=True,
    )
    pm = autopar.parallelize(build(), mesh22, (x, y), planned=planned)
    out["replicated"] = all(all(p == "R" for p in v) for v in pm.plan.params.values())
    out["cases"]["graph_replicated"] = _train(pm, copy.deepcopy(ref0), x, y)

    # a parameter changed on one rank after parallelize: the first step names it
    pm = autopar.parallelize(build(), mesh22, (x, y), planned=planned)
    with torch.no_grad():
        if rank == 1:
            pm.get_parameter("layers.1.fc2.bias").to_local().add_(1.0)
    out["changed"] = _first_step_error(pm, x, y, ReplicaMismatchError)
    # control: the ranks' own weights kept (assume_identical=True): the checksum catches it, and without the check
    # the model trained is not rank 0's
    pm = autopar.parallelize(build(), mesh22, (x, y), planned=planned, assume_identical=True)
    out["control_error"] = _first_step_error(pm, x, y, ReplicaMismatchError)
    # a complex replica (a RoPE table) that differs only in its imaginary part on one rank is caught too
    from autopar.backends.spmd.state import check_replicas

    z = torch.complex(torch.ones(4), torch.full((4,), float(rank == 1)))
    try:
        check_replicas([("freqs_cis", z, ("R", "R"))], mesh22, torch.device("cpu"))
        out["complex_error"] = ""
    except ReplicaMismatchError as e:
        out["complex_error"] = str(e)
    pm = autopar.parallelize(build(), mesh22, (x, y), planned=planned, assume_identical=True, check_replicas=False)
    out["control"] = _train(pm, copy.deepcopy(ref0), x, y)

    # torch backend: FSDP2 over 4 ranks (fully_shard does not broadcast), and replicated parameters (hooks)
    for name, pl in (("torch_fsdp", ("S0",)), ("torch_replicated", ("R",))):
        model = build()
        rng = torch.get_rng_state()
        autopar.parallelize(
            model,
            mesh4,
            (x, y),
            backend="torch",
            force={k: pl for k, _ in ref0.named_parameters()},
            pin=batch_pin([0], (BATCH, SEQ)),
        )
        out[f"{name}_rng_same"] = bool(torch.equal(rng, torch.get_rng_state()))
        out[f"{name}_dump"] = model.autopar_dump.splitlines()[:3]
        out[f"{name}_init"] = model.autopar_init_comm
        import autopar.backends.torch as engines

        local = engines.local_inputs(model, mesh4, x, y)
        out["cases"][name] = _train(
            model, copy.deepcopy(ref0), x, y, local=local, ctx=lambda: engines.train_context(model)
        )
    return out


def _first_step_error(pm, x, y, err) -> str:
    try:
        pm(x, y)
    except err as e:
        return str(e)
    return ""


def test_world4_every_rank_trains_rank0s_model(tmp_path):
    res = launch(job_state, 4, [str(tmp_path)], tmp_path)
    print({k: v for k, v in res[0].items() if k not in ("changed", "control_error")})
    for r, out in enumerate(res):
        for name, w in out["cases"].items():
            assert max(w.values()) <= 1.0, (r, name, w)
        assert out["sharded"], out["sharded"]  # the SHAPES plan shards parameters
        assert out["replicated"]
        ic = out["init_comm"]
        assert ic["scatter_bytes"] > 0 and ic["collectives"] >= 1, ic
        assert "state from rank 0" in out["repr"] and "B once" in out["repr"], out["repr"]
        assert out["dcp_diff"] == 0.0
        assert out["rng_same"] and out["torch_fsdp_rng_same"] and out["torch_replicated_rng_same"]
        assert out["seed"] == 100 and out["initial_seed"] == 100 + r  # rank 0's initial_seed, agreed
        assert "layers.1.fc2.bias" in out["changed"] and "replicas" in out["changed"], out["changed"]
        assert "replicas" in out["control_error"], out["control_error"]
        assert "freqs_cis" in out["complex_error"], out["complex_error"]
        assert max(out["control"].values()) > 1.0, out["control"]  # without the broadcast: another model
        for name in ("torch_fsdp", "torch_replicated"):
            assert out[f"{name}_init"]["broadcast_bytes"] > 0, out[f"{name}_init"]
            assert any("from rank 0" in line for line in out[f"{name}_dump"]), out[f"{name}_dump"]
