"""The benchmarks' torchtitan hand plan and batch pins (benchmarks/torchtitan_plan.py) for the tests; a plain
module, not a test file. benchmarks/ is not a package: its folder goes on sys.path here, so the rank processes of
the distributed tests (which have tests/ as their script directory) import it the same way."""

from __future__ import annotations

import os
import sys

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from torchtitan_plan import batch_pin, loss_parallel_delta, torchtitan_placements, torchtitan_styles  # noqa: E402

__all__ = ["batch_pin", "loss_parallel_delta", "torchtitan_placements", "torchtitan_styles"]
