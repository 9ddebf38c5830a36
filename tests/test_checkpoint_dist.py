"""Checkpoint and resume with torch.distributed.checkpoint (DCP) on gloo: the parallelized model's state dict
and the optimizer's state (`get_state_dict`: FQN keys, DTensors where sharded), saved after step K of N and loaded
into a fresh parallel model built from OTHER weights (so nothing passes by accident), resume with the losses of the
uninterrupted run; loading into other placements, another backend, another world size and the plain model too.

One launch of 4 ranks (tests/_dist.py: 60 s per collective, 300 s per launch; a module fixture, its checkpoints
serve the other tests) runs every 4-rank case:
* graph backend, 2x2 mesh, the SHAPES cost model (tests/_clusters.py) with parameters pinned FSDP-like on dp and
  Megatron-like on tp (asserted: sharded; the step communicates), AdamW (step, exp_avg, exp_avg_sq);
* torch backend (FSDP2, every parameter Shard(0) over 4 ranks);
* resharding: the graph checkpoint loaded into the graph backend with every parameter replicated (other
  placements, same mesh) and into the torch backend's FSDP2 model (other mesh, other backend).
Then this process (no process group) loads the 4-rank checkpoint into the plain model and optimizer
(dcp.load(no_dist=True)) and trains on, and loads dcp_to_torch_save's file with load_state_dict; and one launch of
2 ranks loads both 4-rank checkpoints into (2,)-mesh plans (DCP resharding across world sizes).

Every run is compared with the same model trained uninterrupted on one device (|diff| <= 1e-6 + 1e-4 max|ref| on
each step's loss and, at the end, every parameter); a resume on the same plan must give the uninterrupted parallel
run's losses exactly (the same computation on the same values). A control loads nothing into the fresh model: its
losses differ, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from _dist import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

MLP = dict(dim=128, hidden=512)  # big enough that SHAPES shards parameters (as tests/test_state_dist.py)
BATCH, SEQ = 8, 12
N, K = 4, 2  # N steps; the checkpoint is written after step K
LR = 1e-3


def _diff(a, b) -> float:
    """max |a - b| over the tolerance 1e-6 + 1e-4 max |b| (<= 1 passes)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / (1e-6 + 1e-4 * b.abs().max())).item()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(seed):
    from autopar import models

    return models.build_model("mlp-tiny", device="cpu", seed=seed, **MLP)


def _batch(step):
    from autopar import models

    return models.example_inputs("mlp-tiny", batch=BATCH, seq=SEQ, seed=50 + step, **MLP)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _state(model, opt):
    """{"model": ..., "optim": ...} as DCP saves it: FQN-keyed, DTensors where the model is sharded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save(model, opt, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt), checkpoint_id=path)


def load(model, opt, path) -> None:
    """DCP load in place into this model's (and optimizer's) own layout, whatever layout wrote the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def run_steps(model, opt, steps, step_fn=None) -> list[float]:
    """Train `steps` (global step indices) and return each step's global loss."""
    losses = []
    for s in steps:
        x, y = _batch(s)
        opt.zero_grad(set_to_none=True)
        loss = step_fn(x, y) if step_fn else model(x, y)
        if not step_fn:
            loss.backward()
            loss = _full(loss).detach()
        opt.step()
        losses.append(float(loss))
    return losses


def _params(model) -> dict:
    return {k: _full(p.detach()).clone() for k, p in model.named_parameters()}


def reference():
    """The uninterrupted single-device run: each step's loss and the final parameters."""
    model = _build(0)
    opt = _opt(model)
    return run_steps(model, opt, range(N)), _params(model)


def _compare(losses, params, ref_losses, ref_params, first=0) -> dict:
    out = {"loss": max(_diff(a, b) for a, b in zip(losses, ref_losses[first:]))}
    if params is not None:
        out["param"] = max(_diff(params[k], v) for k, v in ref_params.items())
    return out


def _torch_step(model, mesh):
    """A step on the torch backend: this rank's batch shard in, the global mean loss out (equal batch shards)."""
    import torch.distributed as dist
    import autopar.backends.torch as engines

    def step(x, y):
        xl, yl = engines.local_inputs(model, mesh, x, y)
        with engines.train_context(model):
            loss = model(xl, yl)
            loss.backward()
        lv = _full(loss).detach().clone()
        dist.all_reduce(lv)
        return lv / dist.get_world_size()

    return step


def _shapes_plan(mesh):
    """The graph backend's plan: the SHAPES cost model, parameters pinned FSDP-like on the first mesh dim and
    Megatron-like on the second (so every parameter is sharded; the solver alone needs tens of seconds here)."""
    import autopar
    from _clusters import SHAPES
    from autopar.testing import fsdp_force, fsdp_tp_force

    model, shape = _build(0), tuple(mesh.shape)
    force = fsdp_tp_force(model, shape) if len(shape) == 2 else fsdp_force(model, shape)
    return autopar.plan(model, mesh, _batch(0), cluster=SHAPES, force=force, overlap=False, return_state=True)


def _torch_plan(mesh):
    """The FSDP2 plan (every parameter Shard(0) on the first mesh dim, the batch split), made once per mesh."""
    import autopar
    from _bench import batch_pin

    model, ndim = _build(0), mesh.ndim
    return autopar.plan(
        model,
        mesh,
        _batch(0),
        force={k: ("S0",) + ("R",) * (ndim - 1) for k, _ in model.named_parameters()},
        pin=batch_pin(list(range(ndim)), (BATCH, SEQ)),
        cluster="cpu-gloo",
        return_state=True,
    )


def _torch_model(mesh, seed, planned):
    import autopar

    model = _build(seed)
    autopar.parallelize(model, mesh, _batch(0), backend="torch", planned=planned)
    return model


def job_world4(tmp):
    import autopar
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.backends.counter import CollectiveCounter

    ref_losses, ref_params = reference()
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    x0 = _batch(0)
    out = {"cases": {}, "t": []}
    import time

    t0 = time.perf_counter()

    # graph backend, a plan that shards: uninterrupted run, the checkpoint written after step K on the way
    planned = _shapes_plan(mesh22)
    pm = autopar.parallelize(_build(0), mesh22, x0, planned=planned)
    out["sharded"] = sorted(k for k, v in pm.plan.params.items() if any(p != "R" for p in v))
    out["keys_match"] = sorted(pm.state_dict()) == sorted(_build(0).state_dict())
    opt = _opt(pm)
    counter = CollectiveCounter(mesh22)
    with counter:
        first = run_steps(pm, opt, range(1))
    out["collectives"] = len(counter.collectives())
    full = first + run_steps(pm, opt, range(1, K))
    save(pm, opt, f"{tmp}/graph")
    full += run_steps(pm, opt, range(K, N))
    out["cases"]["graph_uninterrupted"] = _compare(full, _params(pm), ref_losses, ref_params)
    out["graph_losses"] = full

    out["t"].append(round(time.perf_counter() - t0, 1))
    pm2 = autopar.parallelize(_build(7), mesh22, x0, planned=planned)  # other weights: the load must win
    opt2 = _opt(pm2)
    load(pm2, opt2, f"{tmp}/graph")
    resumed = run_steps(pm2, opt2, range(K, N))
    out["cases"]["graph_resumed"] = _compare(resumed, _params(pm2), ref_losses, ref_params, first=K)
    out["graph_resumed_exact"] = max(abs(a - b) for a, b in zip(resumed, full[K:]))

    pm3 = autopar.parallelize(_build(7), mesh22, x0, planned=planned)  # control: nothing loaded
    out["control"] = _compare(run_steps(pm3, _opt(pm3), range(K, N)), None, ref_losses, ref_params, first=K)

    out["t"].append(round(time.perf_counter() - t0, 1))
    # resharding on 4 ranks: the graph checkpoint into a replicated plan (data parallel over all 4 ranks)
    from _bench import batch_pin

    rep = {k: ("R", "R") for k, _ in _build(0).named_parameters()}
    pmr = autopar.parallelize(
        _build(7), mesh22, x0, force=rep, pin=batch_pin([0, 1], (BATCH, SEQ)), overlap=False, cluster="cpu-gloo"
    )
    out["replicated"] = all(all(p == "R" for p in v) for v in pmr.plan.params.values())
    optr = _opt(pmr)
    load(pmr, optr, f"{tmp}/graph")
    out["cases"]["graph_into_replicated"] = _compare(
        run_steps(pmr, optr, range(K, N)), _params(pmr), ref_losses, ref_params, first=K
    )

    out["t"].append(round(time.perf_counter() - t0, 1))
    # torch backend (FSDP2 over 4): uninterrupted, checkpoint after K, resume into a fresh model of other weights
    tplan = _torch_plan(mesh4)
    tm = _torch_model(mesh4, 0, tplan)
    topt = _opt(tm)
    tfull = run_steps(tm, topt, range(K), _torch_step(tm, mesh4))
    save(tm, topt, f"{tmp}/torch")
    tfull += run_steps(tm, topt, range(K, N), _torch_step(tm, mesh4))
    out["cases"]["torch_uninterrupted"] = _compare(tfull, _params(tm), ref_losses, ref_params)
    tm2 = _torch_model(mesh4, 7, tplan)
    topt2 = _opt(tm2)
    load(tm2, topt2, f"{tmp}/torch")
    tres = run_steps(tm2, topt2, range(K, N), _torch_step(tm2, mesh4))
    out["cases"]["torch_resumed"] = _compare(tres, _params(tm2), ref_losses, ref_params, first=K)
    out["torch_resumed_exact"] = max(abs(a - b) for a, b in zip(tres, tfull[K:]))
    out["fsdp"] = all(type(p).__name__ == "DTensor" and p.placements[0].is_shard() for p in tm2.parameters())

    out["t"].append(round(time.perf_counter() - t0, 1))
    # resharding across backends: the graph (2x2 SHAPES) checkpoint into the torch backend's FSDP2 model on (4,)
    tm3 = _torch_model(mesh4, 7, tplan)
    topt3 = _opt(tm3)
    load(tm3, topt3, f"{tmp}/graph")
    out["cases"]["graph_into_torch"] = _compare(
        run_steps(tm3, topt3, range(K, N), _torch_step(tm3, mesh4)), _params(tm3), ref_losses, ref_params, first=K
    )
    out["t"].append(round(time.perf_counter() - t0, 1))
    dist.barrier()
    return out


def job_world2(tmp, full):
    """The 4-rank graph checkpoint loaded on 2 ranks: a (2,) mesh planned with SHAPES, and FSDP2 over 2."""
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    ref_losses, ref_params = reference()
    mesh2 = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = {"cases": {}}
    pm = autopar.parallelize(_build(7), mesh2, _batch(0), planned=_shapes_plan(mesh2))
    out["sharded"] = sorted(k for k, v in pm.plan.params.items() if any(p != "R" for p in v))
    opt = _opt(pm)
    load(pm, opt, f"{tmp}/graph")
    losses = run_steps(pm, opt, range(K, N))
    out["cases"]["graph_4_into_2"] = _compare(losses, _params(pm), ref_losses, ref_params, first=K)
    out["vs_4_ranks"] = _compare(losses, None, full, None, first=K)["loss"]
    tm = _torch_model(mesh2, 7, _torch_plan(mesh2))
    topt = _opt(tm)
    load(tm, topt, f"{tmp}/torch")
    out["cases"]["torch_4_into_2"] = _compare(
        run_steps(tm, topt, range(K, N), _torch_step(tm, mesh2)), _params(tm), ref_losses, ref_params, first=K
    )
    return out


def one_process(tmp) -> dict:
    """No process group: the 4-rank DCP checkpoint into the plain model and its optimizer (dcp.load with
    no_dist), then the remaining steps on one device; and dcp_to_torch_save's single file into the plain model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref_losses, ref_params = reference()
    out = {}
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model = _build(7)
    opt = _opt(model)
    sd = _state(model, opt)  # get_state_dict needs no process group either
    dcp.load(sd, checkpoint_id=f"{tmp}/graph", no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["no_dist"] = _compare(run_steps(model, opt, range(K, N)), _params(model), ref_losses, ref_params, first=K)
    dcp_to_torch_save(f"{tmp}/graph", f"{tmp}/graph.pt")
    plain = _build(7)
    plain.load_state_dict(torch.load(f"{tmp}/graph.pt", weights_only=True)["model"])
    x, y = _batch(K)
    with torch.no_grad():
        out["torch_save_loss"] = _diff(float(plain(x, y)), ref_losses[K])
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """The 4-rank launch (its checkpoints stay in the folder for the other tests), its results and its time."""
    import time

    tmp = tmp_path_factory.mktemp("ckpt4")
    t0 = time.perf_counter()
    res = launch(job_world4, 4, [str(tmp)], tmp)
    return tmp, res, time.perf_counter() - t0


def test_world4_resume_both_backends_and_reshard(world4):
    tmp, res, secs = world4
    print(f"world 4 launch: {secs:.1f} s; section times {res[0]['t']}; {res[0]['cases']}")
    for r, out in enumerate(res):
        assert out["sharded"] and out["collectives"] > 0, (out["sharded"], out["collectives"])
        assert out["keys_match"] and out["replicated"] and out["fsdp"]
        for name, w in out["cases"].items():
            assert max(w.values()) <= 1.0, (r, name, w)
        # the same plan on the same values: the resumed steps are the uninterrupted steps, to the bit
        assert out["graph_resumed_exact"] == 0.0 and out["torch_resumed_exact"] == 0.0, out
        assert out["control"]["loss"] > 1.0, out["control"]  # without the load: other losses


def test_one_process_loads_the_4_rank_checkpoint(world4):
    """No process group: the parallel checkpoint in the plain model and optimizer (dcp.load(no_dist=True)) trains
    on with the single-device losses; dcp_to_torch_save's file loads with load_state_dict."""
    tmp, _, _ = world4
    one = one_process(str(tmp))
    print(one)
    assert max(one["no_dist"].values()) <= 1.0 and one["torch_save_loss"] <= 1.0, one


def test_world2_loads_the_4_rank_checkpoint(world4):
    """DCP resharding across world sizes: 4 writers (2x2 [S0,S0]-style shards), 2 readers ((2,) mesh, S0)."""
    import time

    tmp, res4, _ = world4
    t0 = time.perf_counter()
    res = launch(job_world2, 2, [str(tmp), res4[0]["graph_losses"]], tmp)
    print(f"world 2 launch: {time.perf_counter() - t0:.1f} s; {res[0]['cases']}")
    for r, out in enumerate(res):
        assert out["sharded"], out["sharded"]
        for name, w in out["cases"].items():
            assert max(w.values()) <= 1.0, (r, name, w)
        assert out["vs_4_ranks"] <= 1.0
