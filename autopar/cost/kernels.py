"""Kernel-level compute times for GPU devices: GEMMs by shape and dtype, attention by sequence length and head dim.

Used where a DeviceSpec says `kernels="shapes"` (the GPU presets); `kernels="roofline"` (the default, the cpu-gloo
preset and every test cluster) keeps one `matmul_eff` for every op (autopar/cost/compute.py `roofline_time`).

GEMM (mm, addmm, bmm, baddbmm, _scaled_mm): achievable fraction of the dtype's dense peak =
    gemm_eff_max * max over cuBLAS-like tiles (tile_reuse(tile) * tile_fill * wave_fill) * K / (K + gemm_k_overhead)
and the time is the larger of the FLOPs at that rate and the bytes at mem_bw * mem_eff. Why each factor:
  * tiles: cuBLAS runs one thread block per output tile and picks among 256x128 ... 64x64 tiles; larger tiles reuse
    each loaded element more (arithmetic intensity tm*tn/(tm+tn)), so they run closer to the SM's peak, smaller
    ones fit small outputs better (NVIDIA, "Matrix Multiplication Background User's Guide", sections 2.3 and 3:
    https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/).
  * tile_fill (tile quantization): an output dimension that is not a multiple of the tile still pays whole tiles.
  * wave_fill (wave quantization): tiles run in waves of one per SM (num_sms); a last partial wave idles the rest
    (same guide, section 3.2; Horace He, "What Shapes Do Matrix Multiplications Like?", 2024). Outputs with fewer
    tiles than SMs are split along K (split-K, as cuBLAS does) down to chunks of SPLIT_K_MIN.
  * K / (K + k0): each tile's main loop over K is preceded and followed by a fixed prologue / epilogue (pipeline
    fill, the output write), worth about k0 = 128 steps of K (assumption; it reproduces an A100 bf16 bmm of
    512 x 1024x1024x128 at 132 TFLOP/s, pytorch/pytorch#83272, within 2%: tests/test_cost_kernels.py).
  * gemm_eff_max: the ceiling of the curve, set per preset so that the best shape of the Maximum Achievable Matmul
    FLOPS table (stas00/ml-engineering, compute/accelerator/README.md) comes out at its measured TFLOP/s.
  * float8 (1-byte operands, `torch._scaled_mm`, passes/float8.py): the same curve at the fp8 peak, with k0 doubled.
    Assumption: Hopper's fp8 GEMMs (cuBLASLt, CUTLASS sm90) use the same output tiles as bf16 with a K block twice
    as long (128 vs 64 elements: the same bytes per K step), so a tile's fixed prologue / epilogue is worth twice as
    many K elements of a main loop that runs twice as fast. It reproduces torchao's float8 matmul benchmark of
    Llama 70B's TP-8 shapes on H100 (meta-pytorch/float8_experimental#38: 1095-1414 TFLOP/s) within 10%
    (tests/test_cost_kernels.py); the ceiling gemm_eff_max is the bf16 one (no fp8 ceiling measured here).

Attention (torch's SDPA ops; FLOPs from torch's formulas: forward 4*B*H*Sq*Sk*D, backward 2.5x that):
  * attention="flash": FlashAttention-2, which torch's flash SDPA backend runs: a causal kernel skips the KV
    blocks above the diagonal, so it does (n+1)/(2n) of the counted work (n = Sq/128 blocks), at attn_causal_eff
    of a non-causal kernel's per-FLOP rate; the rate is
    attn_fwd_eff (attn_bwd_eff) of the dense peak, times the wave fill of its B*H*ceil(S/128) blocks, times
    Sk / (Sk + attn_seq_overhead) (the per-block prologue and epilogue) and D/(D+32) normalised at D=128 (a 64-wide
    head does less math per loaded byte). FlashAttention-2 (Dao, arXiv 2307.08691) reaches 50-73% of the A100
    peak; on H100 about 35% (FlashAttention-3, Shah et al., arXiv 2407.08608, which itself reaches 75%).
  * attention="unfused": attention as Megatron-LM ran it in 2021: QK^T (a batched GEMM over B*H), the fused
    scale-mask-softmax over the B*H*Sq*Sk scores (read and written once), dropout over the probabilities when the
    op has dropout_p > 0, then PV; the backward: the four GEMMs (dV, dP, dQ, dK) and the softmax (and dropout)
    backward over B*H*Sq*Sk. It computes the whole square even when causal.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .cluster import DeviceSpec
from . import ring_attention
from .compute import roofline_time

aten = torch.ops.aten

# cuBLAS's tile shapes (the guide's section 2.3), largest first.
TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))
TILE_INTENSITY_HALF = 16.0  # tile arithmetic intensity (MACs per loaded element) at which an SM runs at half rate
SPLIT_K_MIN = 256  # cuBLAS splits K for outputs too small to fill the SMs, not below chunks of this many
ATTN_BLOCK = 128  # FlashAttention-2's query / key block (its causal kernel skips whole blocks)
HEAD_DIM_HALF = 32.0  # head dim at which the attention kernel runs at half its per-FLOP rate

_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_SCALED = {aten._scaled_mm.default} if hasattr(aten, "_scaled_mm") else set()  # float8 operands, any output dtype
_GEMMS |= _SCALED
_ATTENTION = {
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    )
    if hasattr(aten, name)
}
ATTENTION_KERNELS = ("flash", "unfused")


def _intensity(tm: int, tn: int) -> float:
    return tm * tn / (tm + tn)


_BEST_INTENSITY = max(_intensity(*t) for t in TILES)


def tile_reuse(tm: int, tn: int) -> float:
    """Relative per-SM rate of a tm x tn tile (1.0 for the largest): intensity / (intensity + half), normalised."""
    f = lambda a: a / (a + TILE_INTENSITY_HALF)
    return f(_intensity(tm, tn)) / f(_BEST_INTENSITY)


def wave_fill(blocks: int, sms: int) -> float:
    """Fraction of SM time doing work when `blocks` equal thread blocks run in waves of `sms`."""
    return blocks / (math.ceil(blocks / sms) * sms)


@lru_cache(maxsize=65536)
def _gemm_fraction(m: int, n: int, k: int, batch: int, sms: int, k0: float) -> float:
    best = 0.0
    for tm, tn in TILES:
        gm, gn = math.ceil(m / tm), math.ceil(n / tn)
        tiles = batch * gm * gn
        split = max(1, min(sms // tiles, k // SPLIT_K_MIN)) if tiles < sms else 1
        kk = k / split
        fill = (m * n) / (gm * tm * gn * tn)
        best = max(best, tile_reuse(tm, tn) * fill * wave_fill(tiles * split, sms) * kk / (kk + k0))
    return best


def k_overhead(device: DeviceSpec, dtype=None) -> float:
    """A tile's prologue + epilogue in elements of K: the device's figure, doubled for 1-byte (float8) operands,
    whose K block is twice as long (module docstring)."""
    return device.gemm_k_overhead * (2.0 if dtype is not None and dtype.itemsize == 1 else 1.0)


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1, dtype=None) -> float:
    """Achievable fraction of the dtype's dense peak for a (batch x) M x K @ K x N GEMM, compute side only."""
    if min(m, n, k, batch) <= 0:
        return device.gemm_eff_max
    return device.gemm_eff_max * _gemm_fraction(
        int(m), int(n), int(k), int(batch), _sms(device), k_overhead(device, dtype)
    )


def gemm_time(m, n, k, device: DeviceSpec, dtype, batch: int = 1, nbytes: float | None = None, flops=None) -> float:
    """Seconds of one GEMM: max(FLOPs at gemm_efficiency, bytes at mem_bw * mem_eff). nbytes defaults to reading
    both operands and writing the output once in `dtype`; flops to 2*batch*M*N*K."""
    size = dtype.itemsize
    if nbytes is None:
        nbytes = batch * (m * k + k * n + m * n) * size
    if flops is None:
        flops = 2.0 * batch * m * n * k
    rate = device.flops_for(dtype) * gemm_efficiency(m, n, k, device, batch, dtype)
    return max(flops / rate if flops else 0.0, nbytes / (device.mem_bw * device.mem_eff))


def _sms(device: DeviceSpec) -> int:
    if device.num_sms <= 0:
        raise ValueError(f"device {device.name!r}: kernels='shapes' needs num_sms (its SM count), got {device.num_sms}")
    return int(device.num_sms)


def flash_efficiency(bh: int, sq: int, sk: int, d: int, device: DeviceSpec, backward: bool = False) -> float:
    """Fraction of the dense peak a FlashAttention-2 kernel reaches on B*H = bh heads of Sq x Sk, head dim d."""
    top = device.attn_bwd_eff if backward else device.attn_fwd_eff
    blocks = bh * math.ceil((sk if backward else sq) / ATTN_BLOCK)
    head = min(1.0, (d / (d + HEAD_DIM_HALF)) / (128 / (128 + HEAD_DIM_HALF)))
    return top * wave_fill(blocks, _sms(device)) * sk / (sk + device.attn_seq_overhead) * head


def causal_fraction(sq: int, sk: int) -> float:
    """Share of the full Sq x Sk score matrix a causal flash kernel computes: the blocks on and below the diagonal,
    1/2 + 1/(2 nb) of nb x nb blocks. Queries that are a 1/n share of the keys' sequence (context parallelism) are
    priced as the load-balanced split torch's context_parallel and Llama 3 run (each rank holds sequence chunks r
    and 2n-1-r: the same half of its Sq x Sk rectangle plus its diagonal blocks on every rank); other causal
    shapes as the full square."""
    if sk % sq:
        return 1.0
    return 0.5 + 0.5 / math.ceil(sk / ATTN_BLOCK)


def flash_time(bh, sq, sk, d, device, dtype, causal, backward, flops, nbytes) -> float:
    """Seconds of one flash attention op (forward or backward), `flops` as torch counts them (the full square)."""
    work = flops * (causal_fraction(sq, sk) if causal else 1.0)
    rate = device.flops_for(dtype) * flash_efficiency(bh, sq, sk, d, device, backward)
    rate *= device.attn_causal_eff if causal else 1.0
    return max(work / rate, nbytes / (device.mem_bw * device.mem_eff))


def ring_time(bh, sq, sk, d, device, dtype, backward, flops, nbytes) -> float:
    """Seconds of a sequence-sharded causal attention op (sq local queries of sk = n * sq keys: context
    parallelism) as torch's ring attention runs it (autopar/cost/ring_attention.py): n flash kernels at the chunk
    shapes plus the merge / accumulation passes; its K/V movement is priced by the plan's redistribute edges."""
    n = sk // sq

    def kernel(q_rows, k_rows, causal, work):
        share = q_rows * k_rows / (sq * sk)
        return flash_time(bh, q_rows, k_rows, d, device, dtype, causal, backward, work, nbytes * share)

    elems = float(bh) * sq * d
    return ring_attention.ring_attention_time(sq, n, elems, elems, device, kernel, flops, backward)


def unfused_time(bh, sq, sk, d, device, dtype, backward: bool, dropout: bool) -> float:
    """Seconds of attention as separate kernels (Megatron-LM 2021): batched GEMMs plus the memory-bound softmax
    (and dropout) passes over the bh*Sq*Sk scores; see the module docstring for the list."""
    e = dtype.itemsize
    scores = bh * sq * sk
    mem = lambda nbytes: nbytes / (device.mem_bw * device.mem_eff)
    g = lambda m, n, k: gemm_time(m, n, k, device, dtype, batch=bh)
    drop = mem(scores * (2 * e + 1)) if dropout else 0.0  # read, write, one byte of mask per score
    if not backward:  # QK^T, scale-mask-softmax (read + write), dropout, PV
        return g(sq, sk, d) + mem(2 * e * scores) + drop + g(sq, d, sk)
    # dV = P^T dO, dP = dO V^T, dropout backward, softmax backward (reads grad and probs, writes grad), dQ, dK
    return g(sk, d, sq) + g(sq, sk, d) + drop + mem(3 * e * scores) + g(sq, d, sk) + g(sk, d, sq)


def op_arg(target, args, kwargs, name):
    """A constant argument of an aten op by its schema name (positional or keyword, else the schema default)."""
    for i, a in enumerate(target._schema.arguments):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value)
    return None


def _gemm_dims(target, shapes):
    """(batch, M, N, K) of a GEMM op from its local tensor input shapes, or None."""
    a, b = (shapes[1], shapes[2]) if target in (aten.addmm.default, aten.baddbmm.default) else (shapes[0], shapes[1])
    if len(a) == 3 and len(b) == 3:
        return a[0], a[1], b[2], a[2]
    if len(a) == 2 and len(b) == 2:
        return 1, a[0], b[1], a[1]
    return None


def kernel_time(target, args, kwargs, shapes, flops, nbytes, device: DeviceSpec, dtype) -> float | None:
    """Seconds of one op call under the device's kernel model, from its local tensor input shapes (flatten order);
    None where the device prices ops by the flat roofline or the op is neither a GEMM nor attention."""
    if device.kernels == "roofline":
        return None
    if device.kernels != "shapes":
        raise ValueError(f"device {device.name!r}: kernels must be 'roofline' or 'shapes', got {device.kernels!r}")
    if target in _GEMMS:
        dims = _gemm_dims(target, shapes)
        if dims is None:
            return None
        batch, m, n, k = dims
        if target in _SCALED:  # the output dtype is bf16 or fp32; the math runs at the fp8 rate
            dtype = torch.float8_e4m3fn
        return gemm_time(m, n, k, device, dtype, batch=batch, nbytes=nbytes, flops=flops)
    if target not in _ATTENTION:
        return None
    backward = target._schema.arguments[0].name.startswith("grad_out")
    q, kv = shapes[1 if backward else 0], shapes[2 if backward else 1]
    if len(q) != 4 or len(kv) != 4:
        return None
    bh, sq, d, sk = q[0] * q[1], q[2], q[3], kv[2]
    causal = bool(op_arg(target, args, kwargs, "is_causal"))
    if device.attention == "flash":
        # the ring's chunk pairs need an even count of local rows (torch: the sequence divides by 2 * cp)
        if causal and sk > sq and sk % sq == 0 and sq % 2 == 0 and ring_attention.check(device) == "ring":
            return ring_time(bh, sq, sk, d, device, dtype, backward, flops, nbytes)
        return flash_time(bh, sq, sk, d, device, dtype, causal, backward, flops, nbytes)
    if device.attention == "unfused":
        dropout = float(op_arg(target, args, kwargs, "dropout_p") or 0.0) > 0.0
        return unfused_time(bh, sq, sk, d, device, dtype, backward, dropout)
    raise ValueError(f"device {device.name!r}: attention must be one of {ATTENTION_KERNELS}, got {device.attention!r}")


def local_shape(shape, placement, mesh_shape) -> tuple[int, ...]:
    """A tensor's shape on one rank: dims sharded ("S<d>") over a mesh dim divided by its size (rounded up)."""
    out = list(shape)
    for p, size in zip(placement or (), mesh_shape):
        if p[0] == "S" and p[1:].isdigit() and int(p[1:]) < len(out):
            out[int(p[1:])] = -(-out[int(p[1:])] // size)
    return tuple(out)


def node_time(target, args, kwargs, metas, placements, mesh_shape, flops, nbytes, device, dtype) -> float:
    """Seconds of one graph op on one rank: the kernel model where it applies (local input shapes from each input's
    meta and placement), else the flat roofline. The costs pass and autopar/symbolic.py both price ops here."""
    if device.kernels != "roofline":
        shapes = [local_shape(m.shape, p, mesh_shape) for m, p in zip(metas, placements)]
        t = kernel_time(target, args, kwargs, shapes, flops, nbytes, device, dtype)
        if t is not None:
            return t
    return roofline_time(flops, nbytes, device, dtype)
