"""autopar: a compiler-style auto-parallelizer for PyTorch training.

plan = autopar.plan(model, mesh, example_inputs=(tokens, labels), cluster="h100")
print(plan.dump())
plan.save("plan.json")
pm = autopar.parallelize(model, device_mesh, (tokens, labels), plan=autopar.Plan.load("plan.json"))  # no planning
"""

import torch

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


def parallelize(model, mesh, example_inputs=None, *, backend: str = "graph", plan: Plan | None = None, **kwargs):
    """A module that runs each training step of `model` SPMD on this rank of the DeviceMesh `mesh`: planned now
    (autopar.plan's options: cluster, memory_budget, force, ...), or `plan=autopar.Plan.load(path)`, a finished plan
    run as it is (no planning; the model is captured again and must give the plan's graph). The backends are
    imported on first use, so planning never loads them; they only run a plan, never make one.

    backend: "graph" (autopar's SPMD executor, backends/spmd: any plan; options attention, assume_identical,
    check_replicas, compile, see autopar.backends.spmd.lower; `planned=(plan, state)` runs a plan made with
    autopar.plan(..., return_state=True)), "torch" (the user's own module, parallelized in place by fully_shard /
    parallelize_module; EngineLoweringError when the plan does not fit them), "mixed" (the torch engines for what
    they express, the graph backend for the modules they cannot) or "auto" (the torch engines when they express the
    plan; else "mixed" where the cost model predicts it no slower than the graph backend, else the graph backend).
    The result's `.autopar_dump` says which part went where and why. See autopar.backends.engines."""
    if backend == "graph":
        return _parallelize_graph(model, mesh, example_inputs, plan, kwargs)
    if backend in ("torch", "mixed", "auto"):
        from .backends.engines import parallelize_torch

        extra = {"plan": plan} if plan is not None else {}
        return parallelize_torch(model, mesh, example_inputs, backend=backend, **extra, **kwargs)
    raise ValueError(f"backend must be 'graph', 'torch', 'mixed' or 'auto', got {backend!r}")


def _parallelize_graph(model, mesh, example_inputs, plan, kwargs):
    """Plan (or take the finished plan), then hand the graph backend the Executable and a planner for new shapes:
    the front door plans, the backend only runs (autopar/execution.py)."""
    from .backends import spmd
    from .execution import graph_inputs

    options = {k: kwargs.pop(k) for k in spmd.OPTIONS if k in kwargs}
    spmd.check_call(model, mesh, example_inputs, kwargs.get("example_kwargs"), options.get("compile", False))
    with torch.random.fork_rng(devices=spmd.rng_devices(mesh)):  # the user's random state is left as it was
        executable, replan = graph_inputs(model, mesh, example_inputs, plan=plan, **kwargs)
    return spmd.lower(model, mesh, executable, replan=replan, **options)


__version__ = "0.1.0"
