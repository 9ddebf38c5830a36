"""Bad input to autopar.parallelize and to the parallel module: each a clear error naming what is wrong.
(A rank holding a different plan needs real processes: tests/test_execute_dist.py checks it on gloo.)"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.models import build_model, example_inputs

lt = pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

pytestmark = pytest.mark.timeout(300)
OV = dict(dim=8, hidden=8, n_layers=1, vocab=16)


@contextlib.contextmanager
def fake_world(n):
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mlp():
    model = build_model("mlp-tiny", device="cpu", **OV)
    x = example_inputs("mlp-tiny", batch=4, seq=4, **OV)
    plan = autopar.plan(model, (2,), x, cluster="cpu-gloo", return_state=True)
    return model, x, plan


def test_input_shape_differs_from_example(mlp):
    model, x, planned = mlp
    x6 = example_inputs("mlp-tiny", batch=4, seq=6, **OV)  # made outside: the same values on every rank
    with torch.no_grad():
        want = model(*x6)
    with fake_world(2), lt.LocalTensorMode(frozenset(range(2))):
        pm = autopar.parallelize(model, init_device_mesh("cpu", (2,)), x, planned=planned)
        assert torch.allclose(pm(*x6).detach(), want, atol=1e-6)  # another shape: its own plan
        assert len(pm.programs) == 2
        with pytest.raises(
            ValueError,
            match=r"re-planning for new input shapes \(4, 6\), \(4, 4\) failed: Expected "
            r"input batch_size \(24\) to match target batch_size \(16\)",
        ):
            pm(x6[0], x[1])
        with pytest.raises(
            ValueError,
            match=r"input 'labels' has dtype torch.int32 but the example input has "
            r"torch.int64",
        ):
            pm(x[0], x[1].int())
        with pytest.raises(TypeError, match="missing a required argument: 'labels'"):
            pm(x[0])


def test_mesh_size_differs_from_world_size(mlp):
    model, x, planned = mlp
    with fake_world(4):
        mesh = DeviceMesh("cpu", [0, 1])
        with pytest.raises(ValueError, match=r"the mesh has 2 ranks .* but the world has 4 processes"):
            autopar.parallelize(model, mesh, x, planned=planned)


def test_plan_for_another_mesh_shape(mlp):
    model, x, planned = mlp
    with fake_world(4):
        with pytest.raises(ValueError, match=r"the plan is for mesh \(2,\) but the mesh is \(4,\)"):
            autopar.parallelize(model, init_device_mesh("cpu", (4,)), x, planned=planned)


def test_not_a_device_mesh_and_no_process_group(mlp):
    model, x, _ = mlp
    with pytest.raises(TypeError, match="needs a torch DeviceMesh"):
        autopar.parallelize(model, (2,), x)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        autopar.parallelize(model, mesh, x)


class CountingNorm(nn.Module):
    """Updates a running-statistics buffer in forward (like BatchNorm in training)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("running_mean", torch.zeros(dim))

    def forward(self, x):
        self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(dim=(0, 1)))
        return x * self.weight


class BufferModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = CountingNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens, labels):
        return F.cross_entropy(self.head(self.norm(self.emb(tokens))).flatten(0, 1), labels.flatten())


def test_forward_that_mutates_a_buffer():
    """A buffer the forward updates in place is a state update of the plan: after two steps of a sharded plan the
    parallel module's buffer holds what one device computes (the mean over the global batch)."""
    import copy
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _clusters import SHAPES
    from _simulated import simulated
    from autopar.strategies._torch_adapter import outside_local_tensor_mode

    torch.manual_seed(0)
    model = BufferModel()
    ref = copy.deepcopy(model)
    x = example_inputs("mlp-tiny", batch=64, seq=64, **OV)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, cluster=SHAPES)
        g, P = pm.program.g, pm.program.P
        b, r = g.buffers["norm.running_mean"], g.state_updates["norm.running_mean"]
        assert "S0" in P[g.inputs[0]].out[0] + P[b].out[0] + P[r.node].out[r.out], "the test needs a sharded plan"
        for _ in range(2):
            pm(*x).backward()
        got = pm.norm.running_mean.full_tensor()
        with outside_local_tensor_mode():
            for _ in range(2):
                ref(*x).backward()
    want = ref.norm.running_mean
    assert not torch.equal(want, torch.zeros_like(want))
    torch.testing.assert_close(
        torch.as_tensor(got.reconcile() if hasattr(got, "reconcile") else got), want, rtol=1e-5, atol=1e-6
    )


def test_planned_together_with_plan_options(mlp):
    model, x, planned = mlp
    with fake_world(2):
        with pytest.raises(TypeError, match=r"planned=\.\.\. given together with plan options \['force'\]"):
            autopar.parallelize(model, init_device_mesh("cpu", (2,)), x, planned=planned, force={})


def test_attention_option_is_checked(mlp):
    model, x, planned = mlp
    with fake_world(2):
        with pytest.raises(ValueError, match="attention must be 'auto', 'kernel' or 'math'"):
            autopar.parallelize(model, init_device_mesh("cpu", (2,)), x, planned=planned, attention="flash")
