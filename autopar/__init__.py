"""autopar: a compiler-style auto-parallelizer for PyTorch training.

plan = autopar.plan(model, mesh, example_inputs=(tokens, labels), cluster="h100")
print(plan.dump())
plan.save("plan.json")
pm = autopar.parallelize(model, device_mesh, (tokens, labels), plan=autopar.Plan.load("plan.json"))  # no planning
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
    "TorchTarget": ".targets",
    "parallelize": ".parallel",
    "graph_planner": ".parallel",
    "PlanningFailedError": ".across_ranks",
}


# the submodules a user reaches as attributes after `import autopar` (the eager imports used to load them)
_SUBMODULES = {
    name: "." + name
    for name in ("api", "backends", "capture", "cost", "examples", "graph", "mesh", "models", "passes", "solver")
    + ("strategies", "testing")
}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name], __name__)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
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
    "PlanningFailedError",
    "SolverTimeLimitError",
    "TorchTarget",
    "parallelize",
]


__version__ = "0.1.0"
