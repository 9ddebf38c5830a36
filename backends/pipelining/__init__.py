"""Pipeline parallelism: a pipeline Plan run with torch.distributed.pipelining (runtime.py)."""

from .runtime import PipelineRunner, PipelineShapeError

__all__ = ["PipelineRunner", "PipelineShapeError"]
