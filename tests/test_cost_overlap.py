"""Overlap as the engines schedule it (autopar/cost/overlap.py) against hand-drawn timelines."""

import pytest

from autopar.cost import CLUSTERS, TrainingPrecision
from autopar.cost.overlap import Unit, ddp_exposed, fsdp_timeline, optimizer_step_bytes, optimizer_step_time
from autopar.cost.overlap import tp_exposed


def test_fsdp2_four_units_against_a_hand_timeline():
    """4 units, forward 2 s, backward 4 s, all-gather 3 s, reduce-scatter 1 s each, resharded after forward.
    Forward: the first gather (0-3) overlaps nothing; each next gather (3 s) runs under the unit before it (2 s):
    units compute at 3-5, 6-8, 9-11, 12-14 (6 s exposed). Backward: the re-gather of unit 3 (14-17) is exposed, the
    next ones (3 s) hide under 4 s backwards: 17-21, 21-25, 25-29, 29-33; reduce-scatters at 21-22, 25-26, 29-30,
    33-34: the last one shows. Step 34 s = 24 s compute + 10 s exposed."""
    t = fsdp_timeline([Unit(fw=2, bw=4, ag=3, rs=1)] * 4)
    assert t["fw_end_s"] == [5, 8, 11, 14] and t["bw_end_s"] == [33, 29, 25, 21]
    assert (t["step_s"], t["compute_s"], t["exposed_s"]) == (34, 24, 10)
    # the global bound the MILP uses today, max(0, comm - compute) = 28 - 24, misses the pipeline's ends
    assert t["exposed_s"] > max(0, 4 * (3 + 3 + 1) - 24)


def test_fsdp2_hidden_when_compute_is_longer():
    """Gathers shorter than compute: only the first gather and the last reduce-scatter show; without the
    backward re-gather (reshard_after_forward=False) the backward's first gather disappears too."""
    t = fsdp_timeline([Unit(fw=5, bw=10, ag=1, rs=2)] * 3)
    assert t["exposed_s"] == pytest.approx(1 + 1 + 2)
    t = fsdp_timeline([Unit(fw=5, bw=10, ag=1, rs=2, regather=False)] * 3)
    assert t["exposed_s"] == pytest.approx(1 + 2)


def test_ddp_buckets_under_the_backward():
    """4 buckets ready at 1, 2, 3, 4 s of a 4 s backward, 1.5 s each: they run 1-2.5, 2.5-4, 4-5.5, 5.5-7."""
    assert ddp_exposed([1, 2, 3, 4], [1.5] * 4, 4.0) == pytest.approx(3.0)
    assert ddp_exposed([1, 2, 3, 4], [0.5] * 4, 4.0) == pytest.approx(0.5)


def test_tp_exposed_unless_async():
    assert tp_exposed(2.0, matmul_s=3.0) == 2.0
    assert tp_exposed(2.0, matmul_s=3.0, async_tp=True) == 0.0 and tp_exposed(4.0, 3.0, async_tp=True) == 1.0


def test_optimizer_step_is_memory_bound_and_divided_by_sharding():
    """AdamW with bf16 parameters and an fp32 master: read + write master (8 B), read grad (2), read + write two
    fp32 states (16), write the bf16 copy (2): 28 B per parameter; 8B parameters over 8 ranks on an H100 at
    3.35 TB/s x 0.8 achievable: 28 GB / 2.68 TB/s = 10.45 ms."""
    mixed = TrainingPrecision.mixed_bf16_adam()
    assert optimizer_step_bytes(1, mixed) == 28
    h100 = CLUSTERS["h100"].device
    assert optimizer_step_time(8e9, mixed, h100, shards=8) == pytest.approx(28e9 / 2.68e12, rel=1e-9)
    assert optimizer_step_time(8e9, mixed, h100, shards=1) == pytest.approx(
        8 * optimizer_step_time(8e9, mixed, h100, 8)
    )
    assert optimizer_step_bytes(1, TrainingPrecision.fp32_adam()) == 4 * 2 + 4 + 2 * 8


def test_caching_allocator_rounding():
    """PyTorch's caching allocator: requests rounded to 512 B; small ones in 2 MiB segments, 1-10 MiB ones in 20 MiB
    segments, larger ones to a multiple of 2 MiB; the reserved peak of a set of live tensors follows."""
    from autopar.cost.memory import allocated_bytes, reserved_peak, segment_bytes

    MiB = 2**20
    assert allocated_bytes(1) == 512 and allocated_bytes(1024) == 1024 and allocated_bytes(1025) == 1536
    assert segment_bytes(100) == 2 * MiB and segment_bytes(3 * MiB) == 20 * MiB
    assert segment_bytes(11 * MiB + 1) == 12 * MiB and segment_bytes(64 * MiB) == 64 * MiB
    # 4 x 0.75 MiB small (3 MiB -> two 2 MiB segments), 3 x 8 MiB (24 MiB -> two 20 MiB), one 11 MiB + 1 B (12 MiB)
    live = [0.75 * MiB] * 4 + [8 * MiB] * 3 + [11 * MiB + 1]
    assert reserved_peak(live) == (4 + 40 + 12) * MiB
    assert reserved_peak(live, frag=0.1) == pytest.approx(1.1 * 56 * MiB)
