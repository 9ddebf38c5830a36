"""autopar: a compiler-style auto-parallelizer for PyTorch training.

    plan = autopar.plan(model, mesh, example_inputs=(tokens, labels), cluster="h100")
    print(plan.dump())
"""
from .api import plan
from .capture import CaptureError
from .cost import CLUSTERS, ClusterSpec, TrainingPrecision, get_cluster
from .mesh import MeshSpec
from .plan import Plan
from .solver import InfeasibleMemoryError
from .strategies import NoStrategyError

__all__ = ["plan", "Plan", "MeshSpec", "ClusterSpec", "CLUSTERS", "get_cluster", "TrainingPrecision",
           "CaptureError", "InfeasibleMemoryError", "NoStrategyError", "parallelize"]


def parallelize(model, mesh, example_inputs, **kwargs):
    """Plan `model` for the DeviceMesh `mesh` and return a module that runs each training step SPMD on this rank
    (see autopar.backends.graph.parallelize; imported on first use so planning never loads the backends)."""
    from .backends.graph import parallelize as _parallelize
    return _parallelize(model, mesh, example_inputs, **kwargs)
__version__ = "0.1.0"
