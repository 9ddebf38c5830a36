"""A cost model for tests of plan *shapes* (engine lowering): the CPU preset autopar shipped before it was
calibrated on the 2-core CI machine (benchmarks/cpu_calibrate.py). With its cheap collectives (50 us, 2 GB/s) the
tiny test models plan the Megatron / FSDP shapes those tests lower; with the calibrated preset's milliseconds per
gloo collective the planner rightly avoids per-layer collectives on them."""
from autopar.cost.cluster import ClusterSpec, DeviceSpec, LinkSpec

_DEV = DeviceSpec("cpu-fast-links", {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11}, mem_bw=2e10, mem_bytes=16e9,
                  matmul_eff=0.5, mem_eff=0.7)
_LINK = LinkSpec("fast-loopback", alpha=5e-5, bw=2e9)
SHAPES = ClusterSpec("cpu-fast-links", _DEV, 1 << 20, _LINK, _LINK)
