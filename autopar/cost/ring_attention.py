"""Context-parallel attention as torch's context_parallel runs it: ring attention over the cp ranks.

Read from torch/distributed/tensor/experimental/_context_parallel/_attention.py (`_templated_ring_attention`,
`_templated_ring_attention_backward`, `_SDPAMerger`), with load balancing on (its default for causal masks) and
fp32 merging (`convert_to_f32`, its default). Each rank holds 2 of the 2n sequence chunks (r and 2n-1-r), so its
local Q, K and V have s = S/n rows, and n = cp ring steps run:
  * step 0: one causal SDPA kernel of the local Q (s rows) on the local K/V (s keys);
  * steps 1..n-1: one non-causal kernel on half a rectangle: the whole local Q on the first chunk of the arriving
    K/V (s x s/2) on ranks that have seen it (i <= rank), the second chunk of Q on all of it (s/2 x s) otherwise.
    The ring waits on its slowest rank, so a step costs the slower of the two shapes;
  * forward, after every kernel but the first: the merge of the block's output into the running one in fp32
    (`out - sigmoid(lse_b - lse) * (out - out_b)`, the cast and the partial-row copy): MERGE_BYTES per element of
    the local output, memory-bound;
  * backward: one SDPA backward per step at the same shapes, then dQ, dK, dV accumulated in fp32 and dK/dV
    concatenated for the send: ACCUM_BYTES per element of Q and of K and V, memory-bound;
  * communication: K and V as the kernel receives them (after repeat_kv: all query heads, not the KV heads of
    GQA) go to the next rank while the step's kernel runs (`exchange_buffers` before the kernel); the backward
    rotates K/V and the fp32 dK/dV. Step i's transfer overlaps step i-1's kernel, so the ring costs
    sum over i < n-1 of max(kernel_i + passes_i, comm) + the last step.
The plan pricing (autopar/cost/kernels.py) passes comm = 0: the K/V movement stays priced as the all-gather /
reduce-scatter edges of the sequence-sharded attention strategy (the same bytes as the n-1 rotations when the
edge carries the repeated K/V), exposed; `ring_attention_time` with a comm figure gives the overlapped schedule.
"""

from __future__ import annotations

from typing import Callable

from .cluster import DeviceSpec

MERGE_BYTES = 38.0  # per output element and step: bf16->fp32 cast (2+4), out-out_b (8+4), * (4+4), out-... (8+4)
ACCUM_BYTES = 12.0  # per Q / K / V element and backward step: an fp32 `+=` (read 8, write 4)
SEND_BYTES = 8.0  # per K / V element and backward step: torch.cat of the fp32 dK/dV into the send buffer
CP_ATTENTION = ("ring", "allgather")


def ring_kernels(s: int, n: int, kernel: Callable[[int, int, bool, float], float], flops: float) -> list[float]:
    """Seconds of each ring step's SDPA kernel on one rank's s local rows over n ranks. `kernel(sq, sk, causal,
    flops)` prices one kernel call; `flops` is torch's count for s queries on all n*s keys (the all-gathered form),
    scaled here to each call's rectangle."""
    full = float(s) * n * s
    diag = kernel(s, s, True, flops * s * s / full)
    half = flops * s * (s // 2) / full
    off = max(kernel(s, s // 2, False, half), kernel(s // 2, s, False, half))
    return [diag] + [off] * (n - 1)


def ring_passes(q_elems: float, kv_elems: float, n: int, device: DeviceSpec, backward: bool) -> list[float]:
    """Seconds of each step's memory-bound passes: the forward's merges (none after step 0), the backward's fp32
    accumulation of dQ, dK, dV and the dK/dV send copy."""
    bw = device.mem_bw * device.mem_eff
    if backward:
        step = (ACCUM_BYTES * (q_elems + 2 * kv_elems) + SEND_BYTES * 2 * kv_elems) / bw
        return [step] * n
    return [0.0] + [MERGE_BYTES * q_elems / bw] * (n - 1)


def ring_schedule(kernels: list[float], passes: list[float], comm: float) -> float:
    """Seconds of the ring: step i's transfer (comm seconds, the same every step) overlaps step i-1's kernel and
    passes; the last step has nothing left to receive."""
    steps = [k + p for k, p in zip(kernels, passes)]
    return sum(max(t, comm) for t in steps[:-1]) + steps[-1]


def ring_attention_time(s, n, q_elems, kv_elems, device, kernel, flops, backward, comm=0.0) -> float:
    """Seconds of one ring attention op (forward or backward) on one rank: module docstring."""
    return ring_schedule(ring_kernels(s, n, kernel, flops), ring_passes(q_elems, kv_elems, n, device, backward), comm)


def check(device: DeviceSpec) -> str:
    """The device's cp attention form, refused with a clear error when unknown."""
    form = getattr(device, "cp_attention", "ring")
    if form not in CP_ATTENTION:
        raise ValueError(f"device {device.name!r}: cp_attention must be one of {CP_ATTENTION}, got {form!r}")
    return form
