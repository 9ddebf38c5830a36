"""The graph (SPMD) backend's pieces the torch backend uses, in one place: the Program that runs a graph part
(backend="mixed"), the whole model on the graph backend (the fallback of "mixed" / "auto"), and rank 0's parameters
taken by every rank before the engines shard them."""

from __future__ import annotations

from ..spmd.comm import agree_on_plan
from ..spmd.module import _device, _distribute, _rng_devices
from ..spmd.module import parallelize as parallelize_graph
from ..spmd.program import ExecutionError, Program
from ..spmd.state import prepare_engine_model

__all__ = [
    "ExecutionError",
    "Program",
    "agree_on_plan",
    "parallelize_graph",
    "prepare_engine_model",
    "_device",
    "_distribute",
    "_rng_devices",
]
