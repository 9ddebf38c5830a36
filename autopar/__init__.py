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
           "CaptureError", "InfeasibleMemoryError", "NoStrategyError"]
__version__ = "0.1.0"
