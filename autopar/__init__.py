"""autopar: a compiler-style auto-parallelizer for PyTorch training.

plan = autopar.plan(model, mesh, example_inputs=(tokens, labels), cluster="h100")
print(plan.dump())
"""

from .api import plan
from .capture import CaptureError
from .cost import CLUSTERS, ClusterSpec, TrainingPrecision, get_cluster
from .mesh import MeshSpec
from .plan import Plan
from .solver import InfeasibleMemoryError, SolverTimeLimitError
from .strategies import NoStrategyError

__all__ = [
    "plan",
    "Plan",
    "MeshSpec",
    "ClusterSpec",
    "CLUSTERS",
    "get_cluster",
    "TrainingPrecision",
    "CaptureError",
    "InfeasibleMemoryError",
    "NoStrategyError",
    "SolverTimeLimitError",
    "parallelize",
]


def parallelize(model, mesh, example_inputs=None, *, backend: str = "graph", **kwargs):
    """Plan `model` for the DeviceMesh `mesh` and return a module that runs each training step SPMD on this rank
    (see autopar.backends.spmd.module.parallelize; imported on first use so planning never loads the backends).

    backend: "graph" (autopar's SPMD executor: any plan), "torch" (the user's own module, parallelized in place by
    fully_shard / parallelize_module; EngineLoweringError when the plan does not fit them), "mixed" (the torch
    engines for what they express, the graph backend for the modules they cannot) or "auto" (the torch engines
    when they express the plan; else "mixed" where the cost model predicts it no slower than the graph backend,
    else the graph backend). The result's `.autopar_dump` says which part went where and why. See
    autopar.backends.engines."""
    if backend == "graph":
        from .backends.spmd.module import parallelize as _parallelize

        return _parallelize(model, mesh, example_inputs, **kwargs)
    if backend in ("torch", "mixed", "auto"):
        from .backends.engines import parallelize_torch

        return parallelize_torch(model, mesh, example_inputs, backend=backend, **kwargs)
    raise ValueError(f"backend must be 'graph', 'torch', 'mixed' or 'auto', got {backend!r}")


__version__ = "0.1.0"
