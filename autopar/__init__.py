"""autopar: a compiler-style auto-parallelizer for PyTorch training.

plan = autopar.plan(model, mesh, example_inputs=(tokens, labels), cluster="h100")
print(plan.dump())
"""

import importlib
import sys
import types

# The public names, imported on first use (PEP 562) so that `import autopar` does not import torch: the CLI's
# `--help` answers in well under a second, and commands import what they need.
_EXPORTS = {
    "plan": ".api",
    "CaptureError": ".capture",
    "CLUSTERS": ".cost",
    "ClusterSpec": ".cost",
    "TrainingPrecision": ".cost",
    "get_cluster": ".cost",
    "MeshSpec": ".mesh",
    "Plan": ".plan",
    "InfeasibleMemoryError": ".solver",
    "SolverTimeLimitError": ".solver",
    "NoStrategyError": ".strategies",
}


def __getattr__(name):
    if name not in _EXPORTS:  # a submodule (`autopar.cost.X` after `import autopar`), as the eager imports loaded
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'autopar' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # importing the submodule autopar/plan.py binds it as the package attribute `plan`, which would hide the
        # function autopar.plan (eager imports used to rebind it by import order)
        if name == "plan" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

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
    (see autopar.backends.graph.parallelize; imported on first use so planning never loads the backends).

    backend: "graph" (autopar's SPMD executor: any plan), "torch" (the user's own module, parallelized in place by
    fully_shard / parallelize_module; EngineLoweringError when the plan does not fit them), "mixed" (the torch
    engines for what they express, the graph backend for the modules they cannot) or "auto" (the torch engines
    when they express the plan; else "mixed" where the cost model predicts it no slower than the graph backend,
    else the graph backend). The result's `.autopar_dump` says which part went where and why. See
    autopar.backends.torch."""
    if backend == "graph":
        from .backends.graph import parallelize as _parallelize

        return _parallelize(model, mesh, example_inputs, **kwargs)
    if backend in ("torch", "mixed", "auto"):
        from .backends.torch import parallelize as _parallelize_torch

        return _parallelize_torch(model, mesh, example_inputs, backend=backend, **kwargs)
    raise ValueError(f"backend must be 'graph', 'torch', 'mixed' or 'auto', got {backend!r}")


__version__ = "0.1.0"
