"""Overlap as the engines schedule it (autopar/cost/overlap.py) against hand-drawn timelines."""

import pytest

from autopar.cost import CLUSTERS, TrainingPrecision
from autopar.cost.overlap import Unit, ddp_exposed, fsdp_timeline, optimizer_step_bytes, optimizer_step_time


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


# ---- the engines' overlap in the prediction (autopar/predict.py on NCCL clusters) ----
@pytest.fixture(scope="module")
def fsdp_plans():
    """llama-tiny (2 blocks) with every parameter FSDP-sharded over 2 ranks, overlap=True: on h100 (NCCL links,
    priced as the engines run it) and on the same device with ring alpha-beta links (the plain formula)."""
    import autopar
    from autopar import models as M
    from autopar.cost import RING_CLUSTERS
    from autopar.testing import fsdp_force

    m = M.build_model("llama-tiny", n_layers=2, device="meta")
    x = M.example_inputs("llama-tiny", batch=4, n_layers=2, device="meta")
    kw = dict(force=fsdp_force(m, (2,)), overlap=True, time_limit=30)
    n_params = sum(p.numel() for p in m.parameters())
    return (
        autopar.plan(m, (2,), x, cluster="h100", **kw),
        autopar.plan(m, (2,), x, cluster=RING_CLUSTERS["h100-ring"], **kw),
        n_params,
    )


def test_unit_of_names_the_block():
    from autopar.predict import unit_of

    assert unit_of("layers.3.attention.wq.weight") == "layers.3" and unit_of("layers.3") == "layers.3"
    assert unit_of("model.layers.12.mlp") == "model.layers.12"
    assert unit_of("tok_embeddings.weight") == "" and unit_of("") == "" and unit_of(None) == ""


def test_fsdp_plan_predicts_the_engine_timeline_and_the_optimizer_step(fsdp_plans):
    """On h100 the step is compute + TP comm + the FSDP2 timeline's exposed part + the optimizer step; the
    optimizer step is AdamW (fp32 model: 28 B per parameter) over half of the parameters on each rank at the H100's
    achievable bandwidth (hand figure below); the units are the root and the 2 blocks and carry all the compute
    and comm of the plan."""
    from autopar.predict import engine_units, graph_of

    plan, _, n_params = fsdp_plans
    pr = plan.predicted
    h100 = CLUSTERS["h100"].device
    assert pr["optimizer_s"] == pytest.approx(n_params / 2 * 28 / (3.35e12 * 0.8), rel=1e-9)
    assert pr["step_s"] == pytest.approx(pr["compute_s"] + pr["exposed_comm_s"] + pr["optimizer_s"], rel=1e-12)
    assert optimizer_step_time(n_params / 2, TrainingPrecision.fp32_adam(), h100) == pytest.approx(pr["optimizer_s"])
    g = graph_of(plan)
    times = [r["time_s"] if r["kind"] == "op" else 0.0 for r in plan.nodes]
    units = engine_units(g, plan.nodes, plan.buckets, CLUSTERS["h100"], plan.mesh_shape, times, None)
    assert len(units) == 3
    comm = pr["comm_by_class_s"]
    assert sum(u.fw + u.bw for u in units) == pytest.approx(pr["compute_s"] + comm["act"], rel=1e-9)
    assert sum(u.ag + u.ag_bw + u.rs for u in units) == pytest.approx(comm["param"] + comm["grad"], rel=1e-9)
    tl = fsdp_timeline(units)
    assert pr["exposed_comm_s"] == pytest.approx(comm["act"] + tl["exposed_s"], rel=1e-12)
    # the first gather overlaps nothing and the last reduction runs past the backward: exposed even where the
    # global bound max(0, gathers + reductions - compute) of the plain formula says all of it hides
    assert tl["exposed_s"] >= units[0].ag > 0 and units[0].ag > 0
    assert tl["exposed_s"] > max(0.0, comm["param"] + comm["grad"] - pr["compute_s"])


def test_ring_cluster_keeps_the_plain_formula(fsdp_plans):
    """Without NCCL links (the analytic ring presets, cpu-gloo) the prediction is the formula of before: no
    optimizer term, gathers and reductions hidden up to the compute."""
    _, ring, _ = fsdp_plans
    pr = ring.predicted
    comm = pr["comm_by_class_s"]
    assert "optimizer_s" not in pr
    exposed = comm["act"] + max(0.0, comm["param"] + comm["grad"] - pr["compute_s"])
    assert pr["step_s"] == pytest.approx(pr["compute_s"] + exposed, rel=1e-12)


def test_pipelined_fsdp_step_against_a_hand_timeline():
    """1F1B on 2 ranks, 2 micro-batches, F = 1 s and B = 2 s per stage, one FSDP2 unit per stage gathering 3 s and
    reducing 1 s, optimizer 0.5 s. The gather runs before the first forward only (kept gathered after it): rank 0
    F0 0-4, F1 4-5; rank 1 F0 4-8 (its own gather first), B0 8-10, F1 10-11, B1 11-13; rank 0 B0 10-12, B1 13-15;
    then each rank's reduce-scatter (1 s past its last backward) and optimizer step: 15 + 1 + 0.5 = 16.5 s."""
    from autopar import pipeline_engine as pe
    from autopar import pipeline_model as pm

    spec = pm.get_schedule("1F1B")
    order, rank_of = pm.actions(spec, 2, 2, 1), pm.stage_ranks(spec, 2, 1)
    units = [[Unit(fw=1, bw=2, ag=3, rs=1, regather=False)]] * 2
    eng = pe.engine_step(order, rank_of, [1, 1], [2, 2], [0, 0], [0, 0], units, [0.5, 0.5])
    assert eng["first_s"] == [3, 3] and eng["tail_s"] == [1, 1]
    assert [e[:2] for e in eng["sim"].events[0]] == [(0, 4), (4, 5), (10, 12), (13, 15)]
    assert [e[:2] for e in eng["sim"].events[1]] == [(4, 8), (8, 10), (10, 11), (11, 13)]
    assert eng["step_s"] == 16.5 and eng["optimizer_s"] == 0.5


def test_pipelined_fsdp_stage_memory_keeps_the_unsharded_parameters_and_gradients():
    """A 2 (pp) x 2 (dp) 1F1B plan of llama-tiny with every parameter FSDP-sharded on dp, on h100: each rank's peak
    is its model state + in-flight activations + the recompute transient + what FSDP2 keeps through the pipelined
    step, the stage's parameters unsharded on dp in fp32 plus their fp32 accumulated gradients (8 B per element)."""
    import autopar
    from autopar import models as M
    from autopar.testing import fsdp_force

    m = M.build_model("llama-tiny", n_layers=4, device="meta")
    x = M.example_inputs("llama-tiny", batch=8, n_layers=4, device="meta")
    mesh = autopar.MeshSpec((2, 2), ("pp", "dp"))
    pipe = dict(schedules=["1F1B"], n_microbatches=[4])
    plan = autopar.plan(m, mesh, x, cluster="h100", force=fsdp_force(m, (2,)), pipeline=pipe, time_limit=30)
    numel = {k: p.numel() for k, p in m.named_parameters()}
    for st in plan.stages:
        kept = sum(8 * numel[f] for f in st["params"] if plan.params[f][0] == "S0")
        assert kept > 0
        mem = st["memory"]
        hand = mem["state_bytes"] + mem["inflight_microbatches"] * mem["act_bytes_per_microbatch"] + kept
        assert mem["rank_peak_bytes"] == pytest.approx(hand + mem["transient_bytes"], rel=1e-9)
    assert plan.predicted["optimizer_s"] > 0


def test_fsdp_unsharded_bytes_kept_when_pipelined_two_units_otherwise():
    """Pipelined, every unit of every stage on the rank stays gathered (2 stages of 3 units: 21 B); with one
    pipeline rank only the two largest units are unsharded at once (the one computing, the one prefetched)."""
    from autopar.pipeline_engine import fsdp_unsharded_bytes

    assert fsdp_unsharded_bytes([[1, 2, 3], [4, 5, 6]], p=2) == 21
    assert fsdp_unsharded_bytes([[1, 5, 3]], p=1) == 8


def test_multi_stage_schedule_unshards_its_stages_at_the_start():
    """Interleaved 1F1B (torch's _PipelineScheduleRuntime: UNSHARD of the rank's stages at the step's start,
    REDUCE_GRAD after a stage's last backward), 2 ranks x 2 stages, 0.5 s of gathers per stage: rank 0's first
    forward waits 0.5 s and the others' gathers are done before their inputs arrive, so the whole schedule shifts by
    0.5 s; then the last stage's reduce-scatter (0.25 s) shows."""
    from autopar import pipeline_engine as pe
    from autopar import pipeline_model as pm

    spec = pm.get_schedule("Interleaved1F1B")
    order, rank_of = pm.actions(spec, 2, 4, 2), pm.stage_ranks(spec, 2, 2)
    F, B, W = [1.0] * 4, [2.0] * 4, [0.0] * 4
    plain = pm.simulate(order, rank_of, F, B, W, [0.0] * 4)
    units = [[Unit(fw=1, bw=2, ag=0.5, rs=0.25, regather=False)]] * 4
    eng = pe.engine_step(order, rank_of, F, B, W, [0.0] * 4, units, [0.0] * 4, multi=True)
    assert eng["sim"].events[0][0][:2] == (0.5, 1.5)
    assert eng["sim"].step_s == pytest.approx(plain.step_s + 0.5)
    assert eng["step_s"] == pytest.approx(plain.step_s + 0.5 + 0.25)


def test_one_pipeline_rank_is_the_plain_fsdp2_timeline():
    """pp = 1 (a forced FSDP x TP layout through the pipeline path): one micro-batch, the four-unit hand timeline of
    test_fsdp2_four_units_against_a_hand_timeline (34 s for 24 s of compute) plus a 2 s optimizer step."""
    from autopar import pipeline_engine as pe
    from autopar import pipeline_model as pm

    spec = pm.get_schedule("GPipe")
    order, rank_of = pm.actions(spec, 1, 1, 1), pm.stage_ranks(spec, 1, 1)
    units = [[Unit(fw=2, bw=4, ag=3, rs=1)] * 4]
    eng = pe.engine_step(order, rank_of, [8.0], [16.0], [0.0], [0.0], units, [2.0])
    assert eng["sim"].step_s == 24 and eng["step_s"] == 34 + 2 and eng["optimizer_s"] == 2
