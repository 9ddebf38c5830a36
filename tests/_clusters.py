"""A cost model for tests of plan *shapes* (engine lowering): the CPU preset autopar shipped before it was
calibrated on the 2-core CI machine (benchmarks/cpu_calibrate.py). With its cheap collectives (50 us, 2 GB/s) the
tiny test models plan the Megatron / FSDP shapes those tests lower; with the calibrated preset's milliseconds per
gloo collective the planner rightly avoids per-layer collectives on them."""

from autopar.cost.cluster import ClusterSpec, DeviceSpec, LinkSpec

_DEV = DeviceSpec(
    "cpu-fast-links",
    {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11},
    mem_bw=2e10,
    mem_bytes=16e9,
    matmul_eff=0.5,
    mem_eff=0.7,
)
_LINK = LinkSpec("fast-loopback", alpha=5e-5, bw=2e9)
SHAPES = ClusterSpec("cpu-fast-links", _DEV, 1 << 20, _LINK, _LINK)

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

# Slow compute, links slow in bandwidth only: on llama-tiny at 8 tokens a row a replicated weight would cost a
# gradient all_reduce larger than the activations tensor parallelism reduces, so the planner shards the blocks'
# Linears over tp (and the batch over dp): tests/test_pipeline_dist.py's stage plans, tests/test_report.py's page.
_DEV_SLOW = DeviceSpec(
    "cpu-slow-compute",
    {"fp32": 1e8, "bf16": 1e8, "fp16": 1e8},
    mem_bw=2e10,
    mem_bytes=16e9,
    matmul_eff=0.5,
    mem_eff=0.7,
)
_LINK_SLOW = LinkSpec("slow-bandwidth-loopback", alpha=1e-6, bw=1e8)
TP_FRIENDLY = ClusterSpec("tp-friendly", _DEV_SLOW, 1 << 20, _LINK_SLOW, _LINK_SLOW)
