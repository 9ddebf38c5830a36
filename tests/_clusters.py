"""Cost models for tests of plan *shapes*: SHAPES and TP_FRIENDLY (autopar/testing.py, where the benchmarks find
them too), and GLOO_PER_STEP, the cpu-gloo preset as it was before its sub-group calibration."""

from autopar.cost.cluster import ClusterSpec, DeviceSpec, LinkSpec
from autopar.testing import SHAPES, TP_FRIENDLY  # noqa: F401  (the tests import them from here)


# The cpu-gloo preset as it was before sub-group and tiny-message calibration (a 2-core machine with 27 GFLOP/s
# matmul; latency per ring step only, no per-call cost): under it the planner gathers a small loss input rather than
# all-reduce the loss's (sum, count), the plan the engine re-planning tests need.
_DEV_OLD = DeviceSpec(
    "cpu-27gflops",
    {"fp32": 27e9, "bf16": 27e9, "fp16": 27e9},
    mem_bw=4.5e9,
    mem_bytes=16e9,
    matmul_eff=1.0,
    mem_eff=1.0,
    op_overhead=10e-6,
)
_LINK_OLD = LinkSpec(
    "gloo-per-step",
    alpha=2.2e-3,
    bw=0.67e9,
    kinds=(
        ("all_gather", 2.9e-3, 0.60e9),
        ("all_reduce", 1.9e-3, 0.85e9),
        ("all_to_all", 1.8e-3, 0.71e9),
        ("reduce_scatter", 3.9e-3, 0.33e9),
    ),
)
GLOO_PER_STEP = ClusterSpec("cpu-gloo-per-step", _DEV_OLD, 1 << 20, _LINK_OLD, _LINK_OLD)
