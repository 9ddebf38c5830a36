"""Pipeline stage planning: the schedule model, the stage DP against brute force, balance on uneven models, plan
fields, and the runtime's static-shape check. Planning only (meta tensors); tests/test_pipeline_dist.py runs plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import autopar
from autopar import models
from autopar import pipeline_model as pm
from autopar.cost import get_cluster
from autopar.mesh import MeshSpec

from _stage import stage_context
from autopar.passes.stage_costs import Costs, StageOps, find_layers, layer_signature


# ---- schedule model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4)])
def test_uniform_stages_match_published_bubbles(name, v):
    """Uniform stages: the simulation of torch's order gives GPipe/1F1B's (p-1)/(m+p-1) bubble and interleaving's
    (p-1)/(v*m + p-1) (Narayanan et al. SC'21), and the closed form equals the simulation exactly."""
    spec, p, m = pm.get_schedule(name), 4, 8
    S, c = p * v, 1.0 / v
    order = pm.actions(spec, p, m, v)
    sim = pm.simulate(order, pm.stage_ranks(spec, p, v), [c / 3] * S, [c / 3] * S, [c / 3] * S, [0.0] * S)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert sim.step_s == pytest.approx(pm.proxy_step(spec, p, v, m, [c] * S, [c] * S), rel=1e-12)


def test_inflight_counts_follow_the_schedules():
    p, m = 4, 8
    assert pm.inflight(pm.actions(pm.get_schedule("GPipe"), p, m, 1), p, False) == [m] * p
    assert pm.inflight(pm.actions(pm.get_schedule("1F1B"), p, m, 1), p, False) == [p - k for k in range(p)]
    zbv = pm.get_schedule("ZBVZeroBubble")
    assert pm.inflight(pm.actions(zbv, p, m, 2), 2 * p, True) == [8, 7, 6, 5, 4, 3, 2, 1]


def test_single_stage_orders_mirror_torch():
    """Our GPipe/1F1B orders are what torch's _step_microbatches executes; torch's drawing IR agrees except for the
    last rank of 1F1B (whose micro-batch labels it shifts)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    p, m = 4, 8
    for name, ranks in (("GPipe", range(p)), ("1F1B", range(p - 1))):
        ir = get_schedule_ops(name, p, m)
        ours = pm.actions(pm.get_schedule(name), p, m, 1)
        for r in ranks:
            want = [
                (a.stage_index, a.computation_type.value, a.microbatch_index)
                for a in ir[r]
                if a is not None and a.computation_type.value in "FB"
            ]
            assert list(ours[r]) == want


def test_zero_bubble_beats_1f1b_when_backward_splits():
    p, m = 4, 8
    one = pm.simulate(
        pm.actions(pm.get_schedule("1F1B"), p, m, 1), tuple(range(p)), [1.0] * p, [1.0] * p, [1.0] * p, [0.0] * p
    )
    zb = pm.get_schedule("ZBVZeroBubble")
    two = pm.simulate(pm.actions(zb, p, m, 2), pm.stage_ranks(zb, p, 2), [0.5] * 8, [0.5] * 8, [0.5] * 8, [0.0] * 8)
    assert one.bubble_fraction == pytest.approx(3 / 11)
    assert two.bubble_fraction < 0.1 < one.bubble_fraction
    assert pm.timeline(two, 40)[0].startswith("rank   0 |F")


# ---- the stage DP against brute force -------------------------------------------------------------------------
def _random_costs(rng, n, V):
    out = []
    legal = rng.random(n - 1) > 0.2
    for v in range(V):
        c = Costs(
            f"v{v}",
            rng.random(n),
            rng.random(n),
            rng.random(n) * 0.5,
            rng.random(n) * 3,
            rng.random(n) * 10,
            rng.random(n),
            rng.random(n - 1),
            legal,
            np.ones(n - 1, int),
        )
        c.blk = np.array([False] + [True] * (n - 2) + [False])
        c.save = np.where(c.blk, c.act * rng.random(n), 0.0)
        c.rtime = np.where(c.blk, c.F, 0.0)
        out.append(c)
    return out


def test_dp_equals_brute_force_random_instances():
    rng = np.random.default_rng(0)
    compared = feasible = 0
    for _ in range(150):
        n, V = int(rng.integers(4, 9)), int(rng.integers(1, 3))
        spec = pm.get_schedule(str(rng.choice(["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])))
        v = 2 if spec.multi else 1
        p = int(rng.integers(1, 3)) if v == 2 else int(rng.integers(2, 5))
        m, S = int(rng.integers(p, 3 * p + 1)), p * v
        if S > n:
            continue
        costs = _random_costs(rng, n, V)
        fl = [int(rng.integers(1, m + 1)) for _ in range(S)]
        xfer = np.array([rng.random(n - 1) * 0.2 for _ in range(V)])
        cap = float(rng.uniform(5, 40))
        a = pm.partition(costs, xfer, spec, p, v, m, fl, cap)
        b = pm.brute_force(costs, xfer, spec, p, v, m, fl, cap)
        compared += 1
        assert (a is None) == (b is None)
        if a is not None:
            feasible += 1
            assert a.proxy_s == pytest.approx(b.proxy_s, rel=1e-12)
    assert compared > 100 and feasible > 50


@pytest.fixture(scope="module")
def moe_ops():
    """Intra-op plans of an uneven MoE model (MoE, dense, MoE, dense, ... with a shared expert) on a 2-rank stage."""
    m = models.build_model("moe-alt-tiny", device="meta", n_layers=6)
    x = models.example_inputs("moe-alt-tiny", batch=4, device="meta", n_layers=6)
    blocks = list(m.get_submodule(find_layers(m)))
    sigs = [layer_signature(b) for b in blocks]
    reps = [i for i, s in enumerate(sigs) if s not in sigs[:i]]
    # the flat roofline: the tight caps below are met by recomputing blocks at its compute / memory ratio
    ctx = stage_context(get_cluster("h100").with_device(kernels="roofline"), n_variants=2)
    ops = StageOps(m, "layers", reps, [reps.index(sigs.index(s)) for s in sigs], x, MeshSpec((2,), ("dp",)), ctx)
    return ops, reps


def test_dp_equals_brute_force_on_a_real_model(moe_ops):
    ops, reps = moe_ops
    assert len(reps) == 2  # dense and MoE blocks are distinct clusters
    costs = ops.costs()
    F = costs[0].F
    assert F[1] != F[2] and F[1] == F[3]  # alternating block costs reach the DP
    xfer = np.array([[collective_time_p2p(b) for b in cv.xbytes] for cv in costs])
    checkpointed = 0
    for name, p, v in (("GPipe", 2, 1), ("1F1B", 3, 1), ("1F1B", 4, 1), ("Interleaved1F1B", 2, 2)):
        spec = pm.get_schedule(name)
        for m in (p, 2 * p):
            fl = pm.inflight(pm.actions(spec, p, m, v), p * v, spec.split_backward)
            for cap in (1e12, _tight_cap(costs, fl)):
                a = pm.partition(costs, xfer, spec, p, v, m, fl, cap)
                b = pm.brute_force(costs, xfer, spec, p, v, m, fl, cap)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.proxy_s == pytest.approx(b.proxy_s, rel=1e-12), (name, p, m, cap)
                    checkpointed += sum(a.recompute) > 0
    assert checkpointed >= 2  # the tight caps were met by recomputing blocks


def collective_time_p2p(nbytes):
    from autopar.cost import collective_time

    return collective_time("send_recv", float(nbytes), 2, get_cluster("h100").inter)


def _tight_cap(costs, fl):
    """A per-stage cap some stages only meet by checkpointing blocks."""
    cv = costs[0]
    return float(cv.state.sum() + max(fl) * cv.act.sum()) / 3


def test_cut_points_carry_the_block_outputs(moe_ops):
    ops, _ = moe_ops
    cv = ops.costs()[0]
    assert cv.legal.all()
    # after the embedding only h crosses; once the first block (MoE) ran, its aux loss rides along to the loss
    assert cv.ntensors[0] == 1 and set(cv.ntensors[1:]) == {2}
    emb = next(n for n in ops.plans[0].nodes if n["target"] == "embedding.default")
    split = 2 if emb["placement"]["out"][0] != ["R"] else 1
    assert cv.xbytes[0] == 4 * 16 * 64 * 4 / split  # (batch 4 x seq 16 x dim 64) fp32 as the plan places it


# ---- balance on uneven models --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,over,pp",
    [
        ("llama3-8b", dict(n_layers=8), 4),  # 128k-vocab embedding and head
        ("moe-debug", dict(n_layers=8, first_k_dense=4, moe_every=1), 4),  # dense half, MoE half
    ],
)
def test_dp_partition_beats_even_layer_split(name, over, pp):
    m = models.build_model(name, device="meta", dtype=torch.bfloat16, **over)
    x = models.example_inputs(name, batch=8, seq=1024, device="meta", **over)
    plan = autopar.plan(m, MeshSpec((pp,), ("pp",)), x, cluster="h100", pipeline={"schedules": ["1F1B"]})
    sc = plan.schedule
    even = sc["even_split"]
    assert even is not None and even["fits"]
    ratio = even["step_s"] / sc["step_s"]
    print(
        f"\n{name} {over} pp={pp}: DP {sc['step_s'] * 1e3:.2f} ms bounds {sc['bounds']}, even split "
        f"{even['step_s'] * 1e3:.2f} ms -> {ratio:.3f}x"
    )
    assert ratio > 1.05
    times = [st["time"]["per_microbatch_s"] for st in plan.stages]
    assert max(times) < 0.9 * max(even["stage_s"])  # the bottleneck stage got lighter
    assert sc["bounds"] != even["bounds"]


# ---- plan fields, dump, API ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_plan():
    m = models.build_model("llama-tiny", device="meta", n_layers=4)
    x = models.example_inputs("llama-tiny", batch=8, device="meta", n_layers=4)
    return autopar.plan(
        m, MeshSpec((2, 2), ("pp", "dp")), x, cluster="h100", pipeline={"schedules": ["1F1B", "Interleaved1F1B"]}
    ), m


def test_plan_lists_stages_schedule_and_dump(tiny_plan, tmp_path):
    plan, m = tiny_plan
    names = [n for n, _ in m.named_parameters()]
    held = [f for st in plan.stages for f in st["params"]]
    assert sorted(held) == sorted(names)  # every parameter on exactly one stage
    sc = plan.schedule
    assert sc["name"] in ("1F1B", "Interleaved1F1B") and sc["num_stages"] == len(plan.stages)
    assert 8 % sc["n_microbatches"] == 0 and sc["microbatch_shapes"][0] == [8 // sc["n_microbatches"], 32]
    for st in plan.stages:
        assert st["submesh"]["shape"] == [2] and st["time"]["F_s"] > 0 and st["memory"]["state_bytes"] > 0
        assert st["memory"]["inflight_microbatches"] >= 1
    assert 0 <= sc["bubble_fraction"] < 1 and sc["step_s"] == plan.predicted["step_s"]
    assert min(c["step_s"] for c in sc["candidates"]) == sc["step_s"]
    text = plan.dump()
    assert "timeline" in text and sc["timeline"][0] in text and f"schedule {sc['name']}" in text
    plan.save(tmp_path / "p.json")
    again = autopar.Plan.load(tmp_path / "p.json")
    assert again.stages == plan.stages and again.hash() == plan.hash()


def test_pipeline_collectives_count_each_stage_once_not_every_rank(tiny_plan):
    """A stage's collectives are issued by its submesh's ranks together: counted once per stage as an SPMD plan's
    are (not once per rank of the submesh), and the activation p2p twice per micro-batch per cross-rank boundary."""
    plan, _ = tiny_plan
    sc, coll = plan.schedule, plan.predicted["collectives"]
    ranks = [st["pp_rank"] for st in plan.stages]
    crossings = sum(1 for a, b in zip(ranks, ranks[1:]) if a != b)
    assert crossings >= 1 and coll["send_recv"]["count"] == 2 * sc["n_microbatches"] * crossings, (sc, coll)


def test_runtime_rejects_batches_that_break_static_shapes(tiny_plan):
    from autopar.backends.pipelining.runtime import PipelineShapeError, check_batch

    plan, _ = tiny_plan
    local = plan.schedule["local_batch_shapes"][0]
    check_batch(plan, (torch.zeros(local, dtype=torch.long),))
    with pytest.raises(PipelineShapeError, match=r"pipeline input 0: got shape \[4, 64\].*micro-batches of"):
        check_batch(plan, (torch.zeros((local[0], 64), dtype=torch.long),))
    with pytest.raises(PipelineShapeError, match="got shape"):
        check_batch(plan, (None, torch.zeros((local[0] + 1, local[1]), dtype=torch.long)))


def test_keyword_inputs_plan_as_the_positional_call(tiny_plan):
    """model(tokens=x, labels=y) plans the stages the positional call does (the bound call's leaves are split into
    micro-batches); the plan says it was made from keyword inputs (the pipelining runtime then runs the model's own
    forward per stage: tests/test_pipeline_models_dist.py)."""
    plan, m = tiny_plan
    tokens, labels = models.example_inputs("llama-tiny", batch=8, device="meta", n_layers=4)
    mesh, opts = MeshSpec((2, 2), ("pp", "dp")), {"schedules": ["1F1B", "Interleaved1F1B"]}
    kw = autopar.plan(m, mesh, example_kwargs={"labels": labels, "tokens": tokens}, cluster="h100", pipeline=opts)
    assert kw.meta["keyword_inputs"] == ["tokens", "labels"] and "keyword_inputs" not in plan.meta
    assert [st["modules"] for st in kw.stages] == [st["modules"] for st in plan.stages]
    assert kw.schedule["bounds"] == plan.schedule["bounds"] and kw.params == plan.params
    assert kw.predicted["step_s"] == pytest.approx(plan.predicted["step_s"], rel=1e-9)


def test_transformers_model_plans_pipeline_stages():
    """A transformers causal LM called as its users call it (input_ids=, labels=: the loss inside the model)
    plans pipeline stages: its decoder layers split over pp, the embedding (and the rotary table) on the first
    stage, the final norm and head on the last."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    plan = autopar.plan(
        m,
        MeshSpec((2, 2), ("pp", "dp")),
        example_kwargs={"input_ids": ids, "labels": ids},
        cluster="h100",
        pipeline={"schedules": ["1F1B"]},
    )
    mods = [st["modules"] for st in plan.stages]
    assert len(mods) == 2 and mods[0][0] == "model.embed_tokens" and mods[-1][-2:] == ["model.norm", "lm_head"]
    blocks = [f for st in mods for f in st if f.startswith("model.layers.")]
    assert blocks == [f"model.layers.{i}" for i in range(4)] and all(any(f in blocks for f in st) for st in mods)
    assert plan.meta["keyword_inputs"] == ["input_ids", "labels"] and plan.predicted["step_s"] > 0


def test_auto_on_flat_ranks_chooses_pp_and_submesh():
    m = models.build_model("llama-tiny", device="meta", n_layers=4)
    x = models.example_inputs("llama-tiny", batch=8, device="meta", n_layers=4)
    plan = autopar.plan(m, (4,), x, cluster="h100", pipeline={"max_microbatch_options": 1})
    sc = plan.schedule
    assert np.prod(plan.mesh_shape) == 4 and plan.mesh_names[0] == "pp" and plan.mesh_shape[0] == sc["pp"]
    assert sc["search"]["pp_degrees"] == [1, 2, 4]  # every pp <= 6 clusters dividing 4
    # tp = 4 would split llama-tiny's 2 KV heads: only tp dividing every head count is a stage submesh
    assert set(sc["search"]["stage_meshes"]) == {"4(dp)", "2x2(dp,tp)", "2(dp)", "2(tp)", "1(dp)"}
    assert sc["step_s"] == min(c["step_s"] for c in sc["candidates"])


def test_tied_embedding_and_head_live_on_the_first_and_the_last_stage():
    """A tied input embedding and output head (one tensor): the first stage holds it as the embedding, the last as
    the head (its name listed there, placed as the tensor), the last stage's model state counts its copy as the
    untied model's counts its own head, and the gradient all-reduce between the two stages is priced there."""
    m = models.build_model("llama-tiny", device="meta", tie_embeddings=True, n_layers=4)
    untied = models.build_model("llama-tiny", device="meta", n_layers=4)
    x = models.example_inputs("llama-tiny", batch=8, device="meta", n_layers=4)
    opts = {"schedules": ["1F1B"], "n_microbatches": [4], "layers_per_stage": [2, 2]}
    plan = autopar.plan(m, MeshSpec((2,), ("pp",)), x, cluster="h100", pipeline=opts)
    ref = autopar.plan(untied, MeshSpec((2,), ("pp",)), x, cluster="h100", pipeline=opts)
    assert plan.schedule["tied"] == {"output.weight": "tok_embeddings.weight"}
    first, last = plan.stages[0], plan.stages[-1]
    assert "tok_embeddings.weight" in first["params"] and "output.weight" in last["params"]
    assert plan.params["output.weight"] == plan.params["tok_embeddings.weight"]
    assert last["memory"]["state_bytes"] == pytest.approx(ref.stages[-1]["memory"]["state_bytes"], rel=1e-6)
    assert last["time"]["dp_comm_s"] > ref.stages[-1]["time"]["dp_comm_s"] == first["time"]["dp_comm_s"] == 0


def test_tensors_tied_inside_the_blocks_keep_one_stage():
    """A weight two blocks share (ALBERT-like) cannot be split across pipeline stages: pp = 1 for the automatic
    search, a clear error for a pp mesh dim."""
    m = models.build_model("llama-tiny", device="meta", n_layers=4)
    m.layers[1].attention.wq.weight = m.layers[0].attention.wq.weight
    x = models.example_inputs("llama-tiny", batch=8, device="meta", n_layers=4)
    with pytest.raises(
        ValueError, match=r"tied parameters \['layers.0.attention.wq.weight', 'layers.1.attention.wq.weight'\]"
    ):
        autopar.plan(m, MeshSpec((2,), ("pp",)), x, cluster="h100")
    plan = autopar.plan(m, (4,), x, cluster="h100", pipeline={"max_microbatch_options": 1})
    assert plan.schedule["pp"] == 1 and plan.schedule["search"]["pp_degrees"] == [1]


def test_tp_degrees_divide_heads_and_stay_in_a_node():
    from autopar.passes.stage_search import candidate_meshes, head_counts

    h100 = get_cluster("h100")
    gpt = models.build_model("gpt2-small", device="meta", n_heads=128, dim=1024, n_layers=2, tie_embeddings=False)
    assert head_counts(gpt) == {128}
    tps = {
        sm.shape[sm.names.index("tp")] if "tp" in sm.names else 1
        for _, sm in candidate_meshes(MeshSpec((2520,), ("dp",)), 40, h100, {}, head_counts(gpt))
    }
    assert tps == {1, 2, 4, 8}  # 2520 = 2^3 * 315: 3, 5, 6, 7 divide it but not the heads or the 8-GPU node
    llama = models.build_model("llama-tiny", device="meta")  # 4 query heads, 2 KV heads
    tps = {
        sm.shape[sm.names.index("tp")] if "tp" in sm.names else 1
        for _, sm in candidate_meshes(MeshSpec((12,), ("dp",)), 40, h100, {}, head_counts(llama))
    }
    assert tps == {1, 2}


def test_search_shortcuts_agree_with_the_full_evaluation(moe_ops):
    """The stage search's speed-ups (issue 26 part 4) drop only what cannot fit: state_bound never exceeds the
    simulated rank peak of a partition, and evaluate(quick=True) reports the same fits as the full evaluation
    (the same step where it fits); the memoized in-flight counts are the same fresh lists on every call."""
    from autopar.passes.stage_costs import evaluate
    from autopar.passes.stage_search import state_bound

    ops, _ = moe_ops
    costs, h100 = ops.costs(), get_cluster("h100")
    xfer = np.array([[collective_time_p2p(b) for b in cv.xbytes] for cv in costs])
    seen = set()
    for name, p, v in (("1F1B", 2, 1), ("1F1B", 3, 1), ("Interleaved1F1B", 2, 2)):
        spec, m = pm.get_schedule(name), 2 * p
        order = pm.actions(spec, p, m, v)
        fl = pm.inflight(order, p * v, spec.split_backward)
        fl[0] += 1
        assert pm.inflight(order, p * v, spec.split_backward)[0] == fl[0] - 1  # a copy, not the memo's list
        part = pm.partition(costs, xfer, spec, p, v, m, fl, 1e12)
        args = (part.bounds, part.variants, part.recompute, spec, p, v, m, order, h100, 2)
        full = evaluate(costs, *args, 1e12)
        assert state_bound(costs, p) <= full["peak_mem"]
        for budget in (1e12, 0.999 * full["peak_mem"], 0.5 * state_bound(costs, p)):
            a, b = evaluate(costs, *args, budget), evaluate(costs, *args, budget, quick=True)
            assert a["fits"] == b["fits"], (name, budget)
            assert b["step_s"] == (a["step_s"] if a["fits"] else float("inf"))
            seen.add(a["fits"])
    assert seen == {True, False}


@pytest.mark.parametrize("name,v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_live_rows_give_the_action_orders_activation_peak(name, v):
    """spend_room prices a rank's activation peak as max(rows @ act) over its distinct in-flight rows: the same
    peak as the pass over the rank's action order, for any activation sizes."""
    spec, p, m = pm.get_schedule(name), 4, 8
    order, ranks = pm.actions(spec, p, m, v), pm.stage_ranks(spec, p, v)
    rng = np.random.default_rng(0)
    for _ in range(5):
        act = list(rng.uniform(0, 1e9, p * v))
        want = pm.rank_act_peak(order, act, spec.split_backward)
        for r in range(p):
            mine = [k for k in range(p * v) if ranks[k] == r]
            rows = pm.live_rows(order[r], mine, spec.split_backward)
            assert max(0.0, float((rows @ np.array([act[k] for k in mine])).max())) == pytest.approx(want[r], rel=1e-12)
