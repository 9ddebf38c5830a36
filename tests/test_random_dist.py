"""Random ops in the SPMD executor (issue 23, point 3): each rank draws its piece of the GLOBAL random tensor from
the program's generator (backends/spmd/local_ops.draw_random), so the result does not depend on the plan and, seeded
with s, equals one device after torch.manual_seed(s).

* every random op the executor draws, in one process: the pieces two "ranks" draw (each from its own generator
  seeded s) put together equal the op on one device after torch.manual_seed(s), to the bit;
* on 4 gloo ranks (tests/_dist.py: 60 s per collective, 300 s per launch), a model with a dropout mask
  (torch.bernoulli of a probability tensor, as capture records it until dropout's bernoulli_ arrives functional)
  and torch.rand_like noise: a replicated plan, a data-parallel plan (the random ops' outputs sharded on both
  mesh dims, asserted), a tensor-parallel one (the mask split over batch and hidden dim, asserted) and a plan on
  a cost model on which sharding pays (tests/_clusters.py SHAPES; it keeps these tiny activations whole) each equal
  one device seeded alike (loss of 3 SGD steps, every gradient of the first); two runs with the same seed give
  the same losses to the bit; with p = 0 (nothing dropped) every plan equals one device seeded differently; neither
  parallelize nor the steps advance the user's generator.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import launch

aten = torch.ops.aten
SEED, STEPS, B, D, H, C = 1234, 3, 8, 32, 64, 16


def _pieces(op, args, kwargs, out_metas, dim, n=2):
    """What n ranks holding Shard(dim) of every tensor draw, concatenated (each rank its own generator)."""
    from autopar.backends.spmd.local_ops import draw_random

    parts = []
    for r in range(n):
        gen = torch.Generator().manual_seed(SEED)
        cut = lambda t: t.chunk(n, dim)[r] if isinstance(t, torch.Tensor) else t
        node = SimpleNamespace(outs=out_metas)
        res = draw_random(
            op,
            node,
            [cut(a) for a in args],
            {k: cut(v) for k, v in kwargs.items()},
            gen,
            torch.device("cpu"),
            lambda full, k: full.chunk(n, dim)[r],
            _null,
        )
        parts.append(res)
    return [torch.cat([p[k] for p in parts], dim) for k in range(len(out_metas))]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_every_random_op_draws_one_devices_values():
    from autopar.backends.spmd.local_ops import RANDOM
    from autopar.graph import TensorMeta

    x = torch.randn(6, 10)
    probs = torch.rand(6, 10)
    meta = (TensorMeta((6, 10), torch.float32),)
    cases = {
        aten.bernoulli.p: ((x, 0.3), {}, meta),
        aten.bernoulli.default: ((probs,), {}, meta),
        aten.native_dropout.default: ((x, 0.25, True), {}, meta + (TensorMeta((6, 10), torch.bool),)),
        aten.rand_like.default: ((x,), {}, meta),
        aten.randn_like.default: ((x,), {}, meta),
        aten.rand.default: (([6, 10],), {}, meta),
        aten.randn.default: (([6, 10],), {}, meta),
        aten.uniform.default: ((x, -2.0, 3.0), {}, meta),
        aten.normal_functional.default: ((x, 1.0, 2.0), {}, meta),
        aten.randint.default: ((7, [6, 10]), {}, (TensorMeta((6, 10), torch.int64),)),
        aten.randint.low: ((2, 9, [6, 10]), {}, (TensorMeta((6, 10), torch.int64),)),
        aten.randint_like.default: ((x, 7), {"dtype": torch.int64}, (TensorMeta((6, 10), torch.int64),)),
        aten.randint_like.low_dtype: ((x, 2, 9), {"dtype": torch.int64}, (TensorMeta((6, 10), torch.int64),)),
        aten.exponential.default: ((x, 2.0), {}, meta),
        aten.geometric.default: ((x, 0.3), {}, meta),
        aten.log_normal.default: ((x, 0.5, 1.5), {}, meta),
        aten.cauchy.default: ((x, 0.5, 2.0), {}, meta),
    }
    assert set(cases) == RANDOM
    for op, (args, kwargs, metas) in cases.items():
        torch.manual_seed(SEED)
        ref = op(*args, **kwargs)
        ref = list(ref) if isinstance(ref, tuple) else [ref]
        for dim in (0, 1):
            got = _pieces(op, args, kwargs, metas, dim)
            for g, r in zip(got, ref):
                assert g.dtype == r.dtype and torch.equal(g, r), (op, dim)
    # native_dropout in eval draws nothing: the op runs as it is
    from autopar.backends.spmd.local_ops import draw_random

    assert (
        draw_random(
            aten.native_dropout.default,
            SimpleNamespace(outs=meta * 2),
            [x, 0.5, False],
            {},
            None,
            torch.device("cpu"),
            None,
            _null,
        )
        is None
    )


class DropNet(nn.Module):
    """A dropout mask as capture records it today (bernoulli of a probability tensor) and additive noise."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.fc1, self.fc2, self.out = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, C)

    def forward(self, x, y):
        h = F.relu(self.fc1(x))
        h = h * torch.bernoulli(torch.full_like(h, 1 - self.p)) / (1 - self.p)
        h = F.relu(self.fc2(h)) + 0.01 * self.p * torch.rand_like(h)
        return F.cross_entropy(self.out(h), y)


def _model(p):
    torch.manual_seed(0)
    return DropNet(p)


def _run(pm_or_ref, x, y, seed=None):
    """3 SGD steps; the losses and the first step's gradients (full tensors)."""
    from torch.distributed.tensor import DTensor

    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
    if seed is not None:
        torch.manual_seed(seed)
    opt = torch.optim.SGD(pm_or_ref.parameters(), lr=0.5)
    losses, grads = [], None
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = pm_or_ref(x, y)
        loss.backward()
        losses.append(full(loss).item())
        if s == 0:
            grads = {k: full(p.grad).clone() for k, p in pm_or_ref.named_parameters()}
        opt.step()
    return losses, grads


def _worst(a, b) -> float:
    """max |a - b| over the tolerance 1e-6 + 1e-4 max |b| (<= 1 passes)."""
    la, ga = a
    lb, gb = b
    w = max(abs(u - v) / (1e-6 + 1e-4 * abs(v)) for u, v in zip(la, lb))
    for k in gb:
        w = max(w, ((ga[k] - gb[k]).abs().max() / (1e-6 + 1e-4 * gb[k].abs().max())).item())
    return w


def job_random(_):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from _clusters import SHAPES
    from _bench import batch_pin

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(B, D, generator=gen), torch.randint(0, C, (B,), generator=gen)
    out = {"worst": {}, "rng_same": True}
    names = [k for k, _ in _model(0.5).named_parameters()]
    plans = {
        "replicated": dict(force={k: ("R", "R") for k in names}),
        "data_parallel": dict(force={k: ("R", "R") for k in names}, pin=batch_pin([0, 1], (B, 1))),
        "tensor_parallel": dict(
            force={"fc1.weight": ("R", "S0"), "fc1.bias": ("R", "S0"), "fc2.weight": ("R", "S1")},
            pin=batch_pin([0], (B, 1)),
        ),
        "shapes": dict(cluster=SHAPES),
    }
    for p in (0.5, 0.0):
        ref = _run(_model(p), x, y, seed=SEED if p else SEED + 1)  # p = 0: another seed, the same result
        for name, kw in plans.items():
            model = _model(p)
            torch.manual_seed(SEED + rank)  # rank 0's seed is the one agreed
            before = torch.get_rng_state()
            pm = autopar.parallelize(model, mesh, (x, y), **kw)
            out["rng_same"] &= bool(torch.equal(before, torch.get_rng_state()))
            res = _run(pm, x, y)
            out["rng_same"] &= bool(torch.equal(before, torch.get_rng_state()))  # the steps draw elsewhere
            out["worst"][f"{name} p={p}"] = _worst(res, ref)
            out[f"losses {name} p={p}"] = res[0]
            if p and name == "shapes":  # the same seed again: the same losses, to the bit
                model = _model(p)
                torch.manual_seed(SEED + rank)
                out["again"] = _run(autopar.parallelize(model, mesh, (x, y), **kw), x, y)[0]
            if p:
                out[f"random_pl {name}"] = [
                    n["placement"]["out"][0]
                    for n in pm.plan.nodes
                    if n["kind"] == "op" and n["name"].split(":")[-1].split(".")[0] in ("bernoulli", "rand_like")
                ]
    return out


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_world4_dropout_equals_one_device_on_every_plan(tmp_path):
    res = launch(job_random, 4, [0], tmp_path)
    print(res[0])
    for r, out in enumerate(res):
        assert out["rng_same"]
        for case, w in out["worst"].items():
            assert w <= 1.0, (r, case, w)
        assert out["again"] == out["losses shapes p=0.5"]
        a, b = out["losses replicated p=0.5"], out["losses data_parallel p=0.5"]
        assert max(abs(u - v) for u, v in zip(a, b)) <= 1e-5 * max(abs(v) for v in b), (a, b)
        # the data-parallel plan draws sharded pieces (batch split over both mesh dims), the replicated one whole
        assert all(pl == ["S0", "S0"] for pl in out["random_pl data_parallel"]), out["random_pl data_parallel"]
        assert all(pl == ["R", "R"] for pl in out["random_pl replicated"]), out["random_pl replicated"]
        # the tensor-parallel plan: the mask split over the batch (dp) and the hidden dim (tp)
        assert ["S0", "S1"] in out["random_pl tensor_parallel"], out["random_pl tensor_parallel"]


@pytest.mark.parametrize("plan_kind", ["data_parallel", "tensor_parallel"])
def test_simulated_ranks_draw_one_devices_masks(plan_kind):
    """The same under LocalTensorMode (all 4 ranks in one process, tests/_simulated.py): the draw happens once,
    outside the mode, and each simulated rank keeps its piece; training equals one device seeded alike
    (the losses of 3 SGD steps, every gradient of the first) and the step's collectives are the plan's."""
    import autopar
    from _simulated import simulated
    from _bench import batch_pin

    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(B, D, generator=gen), torch.randint(0, C, (B,), generator=gen)
    model = _model(0.5)
    names = [k for k, _ in model.named_parameters()]
    kw = (
        dict(force={k: ("R", "R") for k in names}, pin=batch_pin([0, 1], (B, 1)))
        if plan_kind == "data_parallel"
        else dict(
            force={"fc1.weight": ("R", "S0"), "fc1.bias": ("R", "S0"), "fc2.weight": ("R", "S1")},
            pin=batch_pin([0], (B, 1)),
        )
    )
    planned = autopar.plan(
        model,
        autopar.MeshSpec((2, 2), ("dp", "tp")),
        (x, y),
        cluster="cpu-gloo",
        overlap=False,
        return_state=True,
        **kw,
    )
    # the reference first, on its own: LocalTensorMode sets the global generator around every op it runs, and
    # leaving it (outside_local_tensor_mode) restores it, so a reference run between simulated steps would redraw
    ref = _run(copy.deepcopy(model), x, y, seed=SEED)
    from autopar.backends.counter import CollectiveCounter, compare
    from autopar.testing import global_value

    torch.manual_seed(SEED)  # outside LocalTensorMode (inside it, it would seed per-rank generators)
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(model, mesh, (x, y), planned=planned)
        opt = torch.optim.SGD(pm.parameters(), lr=0.5)
        losses, grads = [], None
        for s in range(STEPS):
            opt.zero_grad(set_to_none=True)
            with CollectiveCounter(mesh) as cc:
                loss = pm(x, y)
                loss.backward()
            if s == 0:
                diff = compare(cc.collectives(), pm.plan.collectives())
                grads = {k: global_value(p.grad) for k, p in pm.named_parameters()}
            losses.append(global_value(loss).item())
            opt.step()
    assert not diff, diff
    assert _worst((losses, grads), ref) <= 1.0, (losses, ref[0])
    drawn = [
        n["placement"]["out"][0]
        for n in planned[0].nodes
        if n["kind"] == "op" and n["name"].split(":")[-1].split(".")[0] in ("bernoulli", "rand_like")
    ]
    assert drawn and all(any(p != "R" for p in pl) for pl in drawn), drawn
