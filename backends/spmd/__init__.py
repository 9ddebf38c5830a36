"""The SPMD graph executor: runs a finished Plan's captured graph node by node on this rank's shards, with the
plan's own collectives (comm), gradient buckets (buckets) and optional torch.compile of the local runs (compiled).

One entry: `lower(model, mesh, executable, replan=None, **options) -> ParallelModule`, where `executable` is an
autopar.execution.Executable (a Plan and its graph). The backend never plans; `autopar.parallelize` is the front
door that plans, or loads, and calls it."""

from .module import OPTIONS, ParallelModule, check_call, lower
from .module import _rng_devices as rng_devices
from .shapes import NoPlanForShapesError, ShapeMismatchError

__all__ = [
    "lower",
    "check_call",
    "OPTIONS",
    "ParallelModule",
    "NoPlanForShapesError",
    "ShapeMismatchError",
    "rng_devices",
]
