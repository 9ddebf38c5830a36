"""Hardware description for the cost model: one device type, intra-node and inter-node links.

Numbers are dense (no sparsity) peaks; bandwidths are unidirectional bytes/s per rank.
Seed figures: /work/shared/reference/seed_figures.json "hardware" (copied into tests/test_seed_figures.py).
"""

from __future__ import annotations
import collections
import functools
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
import torch

_DTYPE_KEY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp32"}
for _n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _n):
        _DTYPE_KEY[getattr(torch, _n)] = "fp8"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: dict[str, float]  # "bf16","fp16","fp32","tf32","fp8" -> dense FLOP/s
    mem_bw: float  # bytes/s HBM (or DRAM)
    mem_bytes: float  # capacity per device, bytes
    matmul_eff: float = 0.7  # achievable fraction of peak for large matmuls
    mem_eff: float = 0.8  # achievable fraction of mem_bw
    op_overhead: float = 0.0  # fixed seconds per op (dispatch / launch); 0 for GPU presets (launches overlap)
    # How GEMMs and attention are priced: "roofline" (every op at matmul_eff of the peak) or "shapes" (by GEMM
    # shape and attention sequence length / head dim, autopar/cost/kernels.py); the figures below serve "shapes".
    kernels: str = "roofline"
    num_sms: int = 0  # streaming multiprocessors: one GEMM tile / attention block each per wave
    gemm_eff_max: float = 0.8  # the GEMM curve's ceiling: fraction of peak with full tiles, whole waves, long K
    gemm_k_overhead: float = 128.0  # a tile's prologue + epilogue in steps of K: efficiency K / (K + this)
    attention: str = "flash"  # "flash" (FlashAttention-2, torch's flash SDPA) or "unfused" (Megatron-LM 2021)
    attn_fwd_eff: float = 0.35  # flash forward: fraction of peak at long sequences, head dim 128
    attn_bwd_eff: float = 0.30  # flash backward, likewise
    attn_seq_overhead: float = 128.0  # a query block's fixed cost in keys: efficiency Sk / (Sk + this)
    # a causal kernel's per-FLOP rate on the blocks it computes, relative to a non-causal one (its diagonal blocks
    # are masked and its query blocks do unequal work); 1.0 where the attention figures were measured causal
    attn_causal_eff: float = 1.0
    # Sequence-sharded (cp) attention: "ring" (torch's context_parallel: per-step kernels on chunk pairs plus
    # merges, autopar/cost/ring_attention.py) or "allgather" (one kernel on the all-gathered K/V, Llama 3's form)
    cp_attention: str = "ring"
    # "eager" (one kernel per op), "inductor" (torch.compile per ModuleList layer: memory-bound chains fused) or
    # "inductor-graph" (the whole model compiled); autopar/cost/fusion.py
    fusion: str = "eager"
    # under fusion="inductor*": the share of the reads/writes fusion.py says a fused program skips that it does
    # save; unused when eager. 1.0 (the model as built): fitted on TorchTitan Table 1's compile gain it is 0.37,
    # which moves the held-back Table 2 compile row from 1.04x to 0.93x of published, so it is left at 1.0
    fusion_eff: float = 1.0
    # async TP (torch.compile's micro-pipelined TP on symmetric memory, autopar/cost/async_tp.py): a TP all_gather
    # into a matmul and a reduce_scatter of a matmul's output run in chunks under that matmul (NCCL clusters only)
    async_tp: bool = False

    def flops_for(self, dtype: torch.dtype, allow_tf32: bool = False) -> float:
        """Peak dense FLOP/s for matmuls in `dtype`. Missing keys fall back (fp8 -> bf16 -> fp32)."""
        key = _DTYPE_KEY.get(dtype, "fp32")
        if key == "fp32" and allow_tf32 and "tf32" in self.peak_flops:
            key = "tf32"
        for k in (key, "bf16" if key == "fp8" else key, "fp32"):
            if k in self.peak_flops:
                return float(self.peak_flops[k])
        return float(max(self.peak_flops.values()))

    def __hash__(self):
        return hash(tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in asdict(self).items()))


@dataclass(frozen=True)
class LinkSpec:
    name: str
    alpha: float  # seconds per message step (latency)
    bw: float  # bytes/s, unidirectional per rank
    kinds: tuple = ()  # ((kind, alpha, bw[, launch]), ...): a calibrated link's fit per kind; other kinds: the link's
    launch: float = 0.0  # seconds per collective call whatever its group size (0 for the analytic presets)
    # NCCL's model (autopar/cost/nccl.py) where `nccl` names the GPU generation of its constants ("ampere",
    # "hopper"); "" keeps the ring alpha-beta formula above (analytic and calibrated links). Free figures:
    # bus_eff (bus bandwidth / bw), nvls_eff (in-node NVLink SHARP all_reduce bus bandwidth / bw; 0: none),
    # lat_scale (x NCCL's latency constants). net: an inter-node link, bw = one GPU's NIC (rail-optimized).
    nccl: str = ""
    bus_eff: float = 1.0
    nvls_eff: float = 0.0
    lat_scale: float = 1.0
    net: bool = False
    local: int = 1  # ranks of the group per node (set by ClusterSpec.group_link for an inter-node group)
    node_bw: float = 0.0  # bus bandwidth inside each node of a hierarchical group (set by ClusterSpec.group_link)

    def __post_init__(self):  # JSON: {"all_gather": [alpha, bw(, launch)], ...} or [[kind, alpha, bw(, launch)], ...]
        rows = [(k, *v) for k, v in self.kinds.items()] if isinstance(self.kinds, dict) else self.kinds
        object.__setattr__(self, "launch", float(self.launch))
        object.__setattr__(
            self,
            "kinds",
            tuple(
                sorted((str(r[0]), float(r[1]), float(r[2]), float(r[3]) if len(r) > 3 else self.launch) for r in rows)
            ),
        )
        nccl = (self.nccl, self.bus_eff, self.nvls_eff, self.lat_scale, self.net, self.local, self.node_bw)
        object.__setattr__(self, "_hash", hash((self.name, self.alpha, self.bw, self.kinds, self.launch, nccl)))

    def __hash__(self):
        return self._hash

    def of(self, kind: str) -> tuple[float, float]:
        """(alpha, bw) of one collective kind on this link."""
        for k, a, b, _ in self.kinds:  # empty for the analytic presets
            if k == kind:
                return a, b
        return self.alpha, self.bw

    def launch_of(self, kind: str) -> float:
        """Seconds one collective call of `kind` costs on top of its ring steps and bytes."""
        for k, _, _, c in self.kinds:
            if k == kind:
                return c
        return self.launch


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device: DeviceSpec
    gpus_per_node: int
    intra: LinkSpec
    inter: LinkSpec

    def __post_init__(self):  # a key of the planner's cost caches: hashed once
        object.__setattr__(self, "_hash", hash((self.name, self.device, self.gpus_per_node, self.intra, self.inter)))

    def __hash__(self):
        return self._hash

    def link_for(self, mesh_shape: tuple[int, ...], dim: int) -> LinkSpec:
        """Link used by the process group along mesh dim `dim`. Ranks are row-major over mesh_shape (last dim
        fastest) and nodes hold consecutive ranks; the group along `dim` spans stride*size consecutive ranks
        (stride = prod(mesh_shape[dim+1:])). It stays in one node iff that span tiles a node exactly."""
        mesh_shape = tuple(int(s) for s in mesh_shape)
        dim = dim % len(mesh_shape)
        if mesh_shape[dim] <= 1 or math.prod(mesh_shape) <= self.gpus_per_node:
            return self.intra
        if self.inter.nccl:
            return self.group_link(mesh_shape, (dim,))
        span = math.prod(mesh_shape[dim:])
        return self.intra if span <= self.gpus_per_node and self.gpus_per_node % span == 0 else self.inter

    def group_link(self, mesh_shape: tuple[int, ...], dims: tuple[int, ...]) -> LinkSpec:
        """The link of the group along mesh dims `dims` (their flattened group for several) on a cluster with
        NCCL links: `intra` when the group stays in one node, else `inter` with the group's ranks per node and
        the in-node bus bandwidth, so autopar/cost/nccl.py tells a rail group from a hierarchical one."""
        nodes, local = _span(tuple(int(s) for s in mesh_shape), tuple(dims), self.gpus_per_node)
        if nodes == 1:
            return self.intra
        return replace(self.inter, local=local, node_bw=self.intra.bw * self.intra.bus_eff if local > 1 else 0.0)

    def with_device(self, **changes) -> ClusterSpec:
        """This cluster with some DeviceSpec fields changed, e.g. `CLUSTERS["a100"].with_device(attention="unfused")`
        (the attention kernel a run used) or a fitted `gemm_eff_max`; the name says which fields changed."""
        unknown = sorted(set(changes) - {f.name for f in fields(DeviceSpec)})
        if unknown:
            raise ValueError(f"cluster {self.name!r}: {unknown} are not DeviceSpec fields")
        tag = ",".join(f"{k}={v}" for k, v in sorted(changes.items()))
        return replace(self, name=f"{self.name}[{tag}]", device=replace(self.device, **changes))

    @property
    def peak_bf16(self) -> float:
        return self.device.flops_for(torch.bfloat16)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ClusterSpec:
        return cls(
            name=d["name"],
            device=DeviceSpec(**d["device"]),
            gpus_per_node=int(d["gpus_per_node"]),
            intra=LinkSpec(**d["intra"]),
            inter=LinkSpec(**d["inter"]),
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


@functools.lru_cache(maxsize=4096)
def _span(mesh_shape: tuple[int, ...], dims: tuple[int, ...], gpus_per_node: int) -> tuple[int, int]:
    """(nodes, most ranks on one node) of the group through rank 0 along mesh dims `dims`: ranks are row-major
    over mesh_shape and each node holds gpus_per_node consecutive ranks (the groups through other ranks are
    translates of it, node-aligned when the mesh tiles nodes)."""
    strides = [math.prod(mesh_shape[d + 1 :]) for d in range(len(mesh_shape))]
    ranks = [0]
    for d in dims:
        ranks = [r + i * strides[d] for r in ranks for i in range(mesh_shape[d])]
    per_node = collections.Counter(r // gpus_per_node for r in ranks)
    return len(per_node), max(per_node.values())


# ---- presets ----
# GPU presets: sources and assumptions in docs/cost_model.md, "GPU presets". Dense (no sparsity) peaks from NVIDIA's
# H100 / A100 datasheets; matmul_eff 0.7 is the flat roofline's figure (kernels="roofline", the seed documents'),
# the "shapes" figures price GEMMs and attention by shape (autopar/cost/kernels.py).
GB = 1e9
GIB = 2**30
_HOPPER_KERNELS = dict(
    kernels="shapes",
    num_sms=132,  # H100 SXM5 / H200: 132 SMs
    # GEMM ceiling: this project's H200 measurement (benchmarks/results/bench_gpu_cluster.json, torch 2.11, cuBLAS):
    # five bf16 shapes 4096^3 .. 16384x14336x4096 at 667-779 TFLOP/s, the curve's ceiling fitted to their median
    # (stas00/ml-engineering's MAMF table: H100 SXM best shape 792 TFLOP/s = 80.1% of 989)
    gemm_eff_max=0.78,
    # SDPA on Hopper (the same H200 run): causal bf16 [8, 16, 2048, 128] forward+backward at 846.8 TFLOP/s counted by
    # torch's formula (the full square) = 0.50 of peak on the blocks a causal kernel computes
    attn_fwd_eff=0.50,
    attn_bwd_eff=0.50,
)
_H100 = DeviceSpec(
    "H100-SXM",
    {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12},
    mem_bw=3.35e12,
    mem_bytes=80 * GB,
    **_HOPPER_KERNELS,
)
_H200 = DeviceSpec("H200-SXM", dict(_H100.peak_flops), mem_bw=4.8e12, mem_bytes=141 * GB, **_HOPPER_KERNELS)
# FlashAttention-2 on Hopper: what torch's SDPA ran there before it preferred cuDNN attention on sm90 (torch 2.11's
# bundled cuDNN >= 9.15; cuDNN had been made opt-in by pytorch/pytorch#138522 after the 2.5 bugs), and what torch's
# ring attention (context_parallel) calls per chunk. Forward: torch's own flash SDPA, head dim 128, non-causal, 33%
# of the bf16 peak (tritonbench on a torch 2.6 nightly, meta-pytorch/tritonbench#97: 329 TFLOP/s at
# (1, 24, 4608, 128); pytorch/benchmark#2296, June 2024: 288-304 TFLOP/s at 1K-16K). Backward and causal: the
# ratios of FlashAttention-2's own H100 SXM figures at head dim 128, 16K (FlashAttention-3, Shah et al., arXiv
# 2407.08608, figures 5-7): backward 322 vs forward 370 TFLOP/s (0.87), causal forward 335 vs non-causal 370
# (0.905, causal FLOPs counted as half the square).
FA2_HOPPER = dict(attn_fwd_eff=0.33, attn_bwd_eff=0.33 * 322 / 370, attn_causal_eff=335 / 370)
# TorchTitan's H100s (arXiv 2410.06511: 95 GiB): "non-standard ... HBM2e and limited to a lower TDP. The actual peak
# TFLOPs should be between SXM and NVL" (PyTorch's async-TP post, same team and cluster). Assumed: peaks midway
# between the SXM part (989 TF bf16) and H100 NVL (835 TF); HBM2e as the H100 PCIe's (2.0 TB/s for 80 GB, five
# stacks) with a sixth stack for 96 GB: 2.4 TB/s. Both are free figures for a fit (benchmarks/published.py). Its
# attention is FlashAttention-2's: TorchTitan's 2024 runs predate torch's cuDNN default.
_H100_95G = DeviceSpec(
    "H100-95GiB-HBM2e",
    {"bf16": 912e12, "fp16": 912e12, "fp8": 1824e12, "tf32": 456e12, "fp32": 63.4e12},
    mem_bw=2.4e12,
    mem_bytes=95 * GIB,
    **{**_HOPPER_KERNELS, **FA2_HOPPER},
)
_A100 = DeviceSpec(
    "A100-SXM-80GB",
    {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    mem_bw=2.0e12,
    mem_bytes=80 * GB,
    kernels="shapes",
    num_sms=108,
    gemm_eff_max=0.86,  # MAMF table (stas00/ml-engineering): A100 SXM bf16 best shape 267.9 TFLOP/s = 85.9% of 312
    attn_fwd_eff=0.70,  # FlashAttention-2 on A100: 50-73% of peak (Dao, arXiv 2307.08691), forward the higher end
    attn_bwd_eff=0.60,
)
# cpu-gloo: one of 4 gloo ranks on the 2-core CI machine; how it was measured: docs/cost_model.md, "The cpu-gloo preset"
_CPU = DeviceSpec(
    "cpu",
    {"fp32": 47e9, "bf16": 47e9, "fp16": 47e9},
    mem_bw=8.6e9,
    mem_bytes=16 * GB,
    matmul_eff=1.0,
    mem_eff=1.0,
    op_overhead=39e-6,
)

_NVLINK4 = LinkSpec("nvlink4", alpha=3e-6, bw=450 * GB)  # seed: 450 GB/s, alpha 2-5 us
_NVLINK3 = LinkSpec("nvlink3", alpha=3e-6, bw=300 * GB)
_IB_NDR = LinkSpec("ib-ndr400", alpha=15e-6, bw=40 * GB)  # seed: 40 GB/s effective, alpha 10-20 us
_IB_HDR = LinkSpec("ib-hdr200", alpha=15e-6, bw=25 * GB)
_LOOP = LinkSpec(
    "gloo-loopback",
    alpha=0.71e-3,
    bw=0.85 * GB,
    launch=2.03e-3,  # (kind, alpha, bw, launch)
    kinds=(
        ("all_gather", 1.27e-3, 0.68 * GB, 1.48e-3),
        ("all_reduce", 0.64e-3, 1.02 * GB, 1.98e-3),
        ("all_to_all", 0.60e-3, 0.98 * GB, 1.75e-3),
        ("reduce_scatter", 1.51e-3, 0.36 * GB, 1.69e-3),
    ),
)

# NCCL links of the GPU presets (docs/cost_model.md, "Collectives as NCCL runs them"): the link's line rate per GPU
# (NVLink 4: 450 GB/s, NVLink 3: 300 GB/s; one 400 Gb/s NDR / 200 Gb/s HDR NIC per GPU) and the bus efficiency
# nccl-tests measures on it.
_NV4_NCCL = LinkSpec("nvlink4", alpha=3e-6, bw=450 * GB, nccl="hopper", bus_eff=0.80, nvls_eff=1.04)
_NV3_NCCL = LinkSpec("nvlink3", alpha=3e-6, bw=300 * GB, nccl="ampere", bus_eff=0.80)
_NDR_NCCL = LinkSpec("ib-ndr400", alpha=15e-6, bw=50 * GB, nccl="hopper", bus_eff=0.95, net=True)
_HDR_NCCL = LinkSpec("ib-hdr200", alpha=15e-6, bw=25 * GB, nccl="ampere", bus_eff=0.95, net=True)

CLUSTERS: dict[str, ClusterSpec] = {
    "h100": ClusterSpec("h100", _H100, 8, _NV4_NCCL, _NDR_NCCL),
    "h200": ClusterSpec("h200", _H200, 8, _NV4_NCCL, _NDR_NCCL),
    "a100": ClusterSpec("a100", _A100, 8, _NV3_NCCL, _HDR_NCCL),
    "h100-95g": ClusterSpec("h100-95g", _H100_95G, 8, _NV4_NCCL, _NDR_NCCL),
    "cpu-gloo": ClusterSpec("cpu-gloo", _CPU, 1 << 20, _LOOP, _LOOP),
}


# ---- presets fitted to published runs (benchmarks/published.py; rows, method and every row's figures in
# benchmarks/results/published.md). Each is a base preset with its free figures multiplied by the factors that
# `python benchmarks/published.py --fit` found (benchmarks/results/published_fit.json); fields at their cap
# (published.py CAPS: the best measured kernels) say the model misses those runs elsewhere.
def _fitted(name: str, base: ClusterSpec, desc: str, inter: dict | None = None, **device) -> ClusterSpec:
    """`base` with the fitted DeviceSpec fields `device` and inter-node LinkSpec fields `inter`."""
    return ClusterSpec(
        name,
        replace(base.device, name=f"{base.device.name}-{desc}", **device),
        base.gpus_per_node,
        base.intra,
        replace(base.inter, **(inter or {})),
    )


# Written as preset value x fitted factor.
FITTED: dict[str, ClusterSpec] = {
    # Megatron-LM SC21 Table 1 (Selene, A100 80 GB; attention unfused as Megatron-LM ran it in 2021), fitted on
    # rows 1, 3, 5, 7, 9
    "a100-selene": _fitted(
        "a100-selene",
        CLUSTERS["a100"],
        "selene",
        dict(bus_eff=_HDR_NCCL.bus_eff * 0.9914),
        attention="unfused",
        gemm_eff_max=_A100.gemm_eff_max * 0.9687,
        mem_eff=_A100.mem_eff * 0.7503,
    ),
    # Llama 3's H100 SXM 80 GB 700 W (arXiv 2407.21783 Table 4), fitted on the 8,192-GPU row
    "h100-llama3": _fitted(
        "h100-llama3",
        CLUSTERS["h100"],
        "llama3",
        gemm_eff_max=0.86,  # at its cap
        mem_eff=_H100.mem_eff * 1.0971,
    ),
    # TorchTitan's 95 GiB power-limited H100 (arXiv 2410.06511), fitted on Tables 1-2's selective-AC rows; one
    # compute factor on GEMMs and attention alike (the part's lower clock)
    "h100-95g-titan": _fitted(
        "h100-95g-titan",
        CLUSTERS["h100-95g"],
        "titan",
        dict(bus_eff=_NDR_NCCL.bus_eff * 0.9903),
        gemm_eff_max=_H100_95G.gemm_eff_max * 0.913,
        attn_fwd_eff=_H100_95G.attn_fwd_eff * 0.913,
        attn_bwd_eff=_H100_95G.attn_bwd_eff * 0.913,
    ),
}
CLUSTERS.update(FITTED)
# ---- end of the fitted presets

# The same GPUs on the seed documents' ring alpha-beta links (the analytic model of tests/test_seed_figures.py).
RING_CLUSTERS: dict[str, ClusterSpec] = {
    "h100-ring": ClusterSpec("h100-ring", _H100, 8, _NVLINK4, _IB_NDR),
    "h200-ring": ClusterSpec("h200-ring", _H200, 8, _NVLINK4, _IB_NDR),
    "a100-ring": ClusterSpec("a100-ring", _A100, 8, _NVLINK3, _IB_HDR),
}


def get_cluster(name_or_path: str | ClusterSpec) -> ClusterSpec:
    """A ClusterSpec, a preset name from CLUSTERS (or RING_CLUSTERS), or a path to a JSON file written by ClusterSpec.to_json."""
    if isinstance(name_or_path, ClusterSpec):
        return name_or_path
    key = str(name_or_path)
    for k in (key, key.lower()):
        if k in CLUSTERS or k in RING_CLUSTERS:
            return CLUSTERS.get(k) or RING_CLUSTERS[k]
    if os.path.isfile(key):
        with open(key) as f:
            return ClusterSpec.from_json(json.load(f))
    raise ValueError(f"unknown cluster {key!r}: not a file and not one of {sorted(CLUSTERS)}")
