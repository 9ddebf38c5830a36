"""`simulated(mesh_shape)`: every rank of a mesh in this one process (the fake process group + LocalTensorMode),
for tests that run autopar's executor on real values without processes. A plain module, not a test file."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed import _local_tensor as lt
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def simulated(mesh_shape):
    """A fake process group the size of the mesh, the mesh, and LocalTensorMode over all its ranks."""
    assert not dist.is_initialized(), "a process group is already initialized in this test process"
    n = math.prod(mesh_shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        names = ("dp", "tp") if len(mesh_shape) == 2 else ("dp",)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        with lt.LocalTensorMode(frozenset(range(n))):
            yield mesh
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
