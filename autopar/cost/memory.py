"""Model-state memory (params, grads, fp32 master copy, optimizer states) per rank, with ZeRO/FSDP sharding."""

from __future__ import annotations
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingPrecision:
    """Bytes per element of each kind of model state."""

    param: int = 4
    grad: int = 4
    master: int = 0  # fp32 master copy of the weights (mixed precision); 0 when params are already fp32
    optim_states: int = 2  # number of optimizer state tensors per param (AdamW: exp_avg, exp_avg_sq)
    optim_bytes: int = 4  # bytes per optimizer state element

    @classmethod
    def mixed_bf16_adam(cls) -> TrainingPrecision:
        return cls(param=2, grad=2, master=4, optim_states=2, optim_bytes=4)

    @classmethod
    def fp32_adam(cls) -> TrainingPrecision:
        return cls(param=4, grad=4, master=0, optim_states=2, optim_bytes=4)

    @classmethod
    def fp32_sgd(cls) -> TrainingPrecision:
        return cls(param=4, grad=4, master=0, optim_states=0, optim_bytes=4)

    @property
    def bytes_per_param(self) -> int:
        return self.param + self.grad + self.master + self.optim_states * self.optim_bytes


def model_state_bytes(
    n_params: float, prec: TrainingPrecision, param_shard=1, grad_shard=1, master_shard=1, optim_shard=1
) -> dict[str, float]:
    """Per-rank bytes of each model-state kind when it is sharded `*_shard` ways."""
    d = {
        "params": n_params * prec.param / param_shard,
        "grads": n_params * prec.grad / grad_shard,
        "master": n_params * prec.master / master_shard,
        "optim": n_params * prec.optim_states * prec.optim_bytes / optim_shard,
    }
    d["total"] = d["params"] + d["grads"] + d["master"] + d["optim"]
    return d


# stage -> which of (params, grads, master, optim) are sharded over the data-parallel group
ZERO_STAGES: dict = {
    0: (False, False, False, False),  # DDP: everything replicated
    1: (False, False, True, True),  # ZeRO-1 as usually defined: fp32 master + optimizer states sharded
    "1-seed": (False, False, False, True),  # seed doc 003 s6.2.7: only the Adam moments sharded (master replicated)
    2: (False, True, True, True),  # ZeRO-2: + gradients
    3: (True, True, True, True),  # ZeRO-3 / FSDP2 full shard: everything
}


def zero_bytes(n_params: float, prec: TrainingPrecision, P: int, stage) -> dict[str, float]:
    """Per-rank model-state bytes under ZeRO `stage` (0, 1, "1-seed", 2, 3) over P data-parallel ranks.
    Excludes the transient unsharded layer FSDP gathers during forward/backward."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"unknown ZeRO stage {stage!r}; expected one of {list(ZERO_STAGES)}")
    p, g, m, o = (P if s else 1 for s in ZERO_STAGES[stage])
    return model_state_bytes(n_params, prec, param_shard=p, grad_shard=g, master_shard=m, optim_shard=o)


def valid_tp_degrees(n_heads: int, n_kv_heads: int | None, max_tp: int, *other_dims: int) -> list[int]:
    """Tensor-parallel degrees <= max_tp that evenly split the query heads, the KV heads (GQA: no KV-head
    replication) and any further sharded dims (e.g. the MLP intermediate size)."""
    dims = (n_heads, n_kv_heads or n_heads, *other_dims)
    return [t for t in range(1, max_tp + 1) if all(d % t == 0 for d in dims)]


def sp_activation_saving_bytes(b: int, s: int, h: int, dtype_bytes: int, tp: int) -> float:
    """Bytes per layer saved by sequence parallelism on one [b, s, h] activation that TP alone keeps replicated
    (the LayerNorm/dropout regions): SP shards it tp ways, saving (tp-1)/tp of it."""
    return b * s * h * dtype_bytes * (tp - 1) / tp


# ---- the caching allocator (PyTorch's CUDACachingAllocator, c10/cuda/CUDACachingAllocator.cpp) ----
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to 512 bytes
SMALL_SIZE = 2**20  # kSmallSize: requests up to 1 MiB come from 2 MiB segments of the small pool
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: requests of 1-10 MiB are packed into 20 MiB segments
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc: larger requests get a segment of their own ...
ROUND_LARGE = 2 * 2**20  # kRoundLarge: ... rounded up to 2 MiB


def allocated_bytes(nbytes: float) -> float:
    """Bytes the caching allocator hands out for one request (memory_allocated counts these): rounded up to 512."""
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK if nbytes > 0 else 0


def segment_bytes(nbytes: float) -> float:
    """Bytes of the cudaMalloc segment a request of nbytes opens when no cached block fits it (memory_reserved
    grows by these): 2 MiB for a small request, 20 MiB for one of 1-10 MiB, else the request rounded to 2 MiB."""
    if nbytes <= 0:
        return 0
    if nbytes <= SMALL_SIZE:
        return 2 * SMALL_SIZE
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def reserved_peak(tensors: list[float], frag: float = 0.0) -> float:
    """memory_reserved at a peak where `tensors` (bytes each) are live: each large tensor in a segment rounded as
    `segment_bytes` (a persistent tensor keeps its own), the small ones packed into 2 MiB segments, 1-10 MiB ones
    into 20 MiB segments; `frag` adds the share of the reserved bytes that free blocks split by earlier
    allocations hold (a free figure: 0 assumes every cached block is reused exactly)."""
    small = sum(allocated_bytes(t) for t in tensors if 0 < t <= SMALL_SIZE)
    mid = sum(allocated_bytes(t) for t in tensors if SMALL_SIZE < t < MIN_LARGE_ALLOC)
    large = sum(segment_bytes(t) for t in tensors if t >= MIN_LARGE_ALLOC)
    packed = -(-small // (2 * SMALL_SIZE)) * 2 * SMALL_SIZE + -(-mid // LARGE_BUFFER) * LARGE_BUFFER
    return (packed + large) * (1 + frag)


def _fit(segs: list, pool: str, size: int):
    """The smallest free block of `pool` that holds `size` (the allocator's best fit): (segment, block index)."""
    best = None
    for seg in segs:
        if seg["pool"] != pool:
            continue
        for k, (n, key) in enumerate(seg["blocks"]):
            if key is None and n >= size and (best is None or n < best[0]):
                best = (n, seg, k)
    return best[1:] if best else None


def idle_cached_bytes(events: list) -> float:
    """Bytes the caching allocator holds reserved beyond the allocated peak of an allocation trace from a cold
    cache (what memory_reserved adds over memory_allocated there): events [(key, nbytes)] allocate, [(key, None)]
    free. CUDACachingAllocator's rules: requests rounded to 512 B; up to 1 MiB from the small pool, larger from the
    large one; the smallest free cached block of the pool that holds the request, split when the rest exceeds
    1 MiB (large pool) or 512 B (small); else a new segment of `segment_bytes`; a freed block merges with its free
    neighbours; segments are never returned (no empty_cache, no OOM retry). E.g. a loss's bf16 logits (2 N V B),
    freed before its backward asks for two fp32 buffers (4 N V B each) while log_softmax's output is held, leave
    their segment idle at the peak: N V x 2 B more reserved than allocated."""
    segs, where = [], {}
    live = peak = 0
    for key, nbytes in events:
        if nbytes is None:
            seg, blk = where.pop(key)
            k = next(i for i, b in enumerate(seg["blocks"]) if b is blk)
            live -= blk[0]
            blk[1] = None
            for j in (k + 1, k):  # merge with the free neighbour after, then before
                if 0 < j < len(seg["blocks"]) and seg["blocks"][j][1] is None and seg["blocks"][j - 1][1] is None:
                    seg["blocks"][j - 1][0] += seg["blocks"].pop(j)[0]
            continue
        size = int(allocated_bytes(nbytes))
        if size <= 0:
            continue
        pool = "small" if size <= SMALL_SIZE else "large"
        hit = _fit(segs, pool, size)
        if hit is None:
            segs.append({"pool": pool, "size": segment_bytes(size), "blocks": [[segment_bytes(size), None]]})
            hit = (segs[-1], 0)
        seg, k = hit
        rest = seg["blocks"][k][0] - size
        if rest > (SMALL_SIZE if pool == "large" else MIN_BLOCK - 1):
            seg["blocks"][k][0] = size
            seg["blocks"].insert(k + 1, [rest, None])
        blk = seg["blocks"][k]
        blk[1] = key
        where[key] = (seg, blk)
        live += blk[0]
        peak = max(peak, live)
    return sum(s["size"] for s in segs) - peak
