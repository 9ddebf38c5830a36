"""Context parallelism: sequence-sharded attention (q Shard(seq), K/V all-gathered, dK/dV partial), the
(batch, seq) flatten of a sequence-sharded activation (autopar/strategies/merged_views.py), the planner choosing it
for long sequences, and the graph backend running it on 4 gloo ranks equal to one device (causal mask offset by
each rank's first query row)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar.testing import TP_FRIENDLY

from autopar.cost import CLUSTERS
from autopar.cost import kernels as K
from autopar.cost import ring_attention as RA

from autopar.strategies.merged_views import dim_groups, merged_view_strategies

B, S = 2, 32  # the executed case: one sequence per dp rank, the sequence split over cp


def test_dim_groups_pair_merges_and_splits():
    assert dim_groups((2, 32, 64), (64, 64)) == [((0, 1), (0,)), ((2,), (1,))]
    assert dim_groups((64, 64), (2, 32, 4, 16)) == [((0,), (0, 1)), ((1,), (2, 3))]
    assert dim_groups((2, 3), (7,)) is None


def test_merged_view_is_a_block_only_with_one_outer_element_per_rank():
    # (batch, seq, d) -> (batch * seq, d) on dp x cp: batch 2 over dp leaves one sequence per rank, so the rows of
    # the flattened dim are one block per rank, ordered dp-major like the mesh
    assert merged_view_strategies((2, 32, 64), (64, 64), True, (2, 2)) == [(("S0", "S0"), ("S0", "S1"))]
    # and the split back to (batch, seq, d)
    assert merged_view_strategies((64, 64), (2, 32, 64), True, (2, 2)) == [(("S0", "S1"), ("S0", "S0"))]
    # two sequences per dp rank: each rank's rows would be two blocks, not one: no strategy
    assert merged_view_strategies((4, 32, 64), (128, 64), True, (2, 2)) == []
    # the sequence sharded by the earlier mesh dim and the batch by the later one: not the mesh's block order
    assert (("S0", "S0"), ("S1", "S0")) not in merged_view_strategies((2, 32, 64), (64, 64), True, (2, 2))
    # one sequence in all on a 1-D cp mesh; an integer view (labels) has no partial option
    assert merged_view_strategies((1, 32), (32,), False, (4,)) == [(("S0",), ("S1",))]


def _attention_placements(plan) -> list:
    return [n["placement"] for n in plan.nodes if n["target"] == "_scaled_dot_product_flash_attention_for_cpu.default"]


@pytest.mark.timeout(300)
def test_planner_shards_the_sequence_where_sequences_are_long():
    """The same tokens per step (64K) on 2 x 4 H100: 2 sequences of 32K cannot be split over 8 ranks by batch,
    and head-parallel attention moves more than the all-gathered K/V of grouped-query attention (8 of 32 heads),
    so the attention shards the sequence on the second dim; 64 sequences of 1K split by batch on both dims, no
    seq. (The planner's free choice: the second dim is named "x", not cp*, so nothing is pinned. It chose
    head-parallel attention while a causal kernel on sequence-sharded queries was priced as the full
    Sq x Sk rectangle, twice the causal share head-parallel attention got: autopar/cost/kernels.py
    causal_fraction.) Priced as the all-gathered form the graph backend executes (cp_attention="allgather"): under
    the default ring pricing (torch's context_parallel: per-step kernels on 4K chunks plus merges) this 8K-row
    case goes head-parallel instead."""
    import autopar
    from autopar.models import build_model, example_inputs

    mesh = autopar.MeshSpec((2, 4), ("dp", "x"))
    cluster = CLUSTERS["h100"].with_device(cp_attention="allgather")
    seen = {}
    for batch, seq in ((2, 32768), (64, 1024)):
        model = build_model("llama3-8b", n_layers=2, max_seq_len=seq)
        x = example_inputs("llama3-8b", batch=batch, seq=seq, device="meta")
        seen[seq] = _attention_placements(autopar.plan(model, mesh, x, cluster=cluster))
    assert seen[32768] and all(p["out"][0][1] == "S2" and p["ins"][1][1] == "R" for p in seen[32768]), seen[32768]
    assert seen[1024] and not any("S2" in p["out"][0] for p in seen[1024]), seen[1024]


@pytest.mark.timeout(300)
def test_a_cp_mesh_dim_splits_the_sequence_without_a_pin():
    """A dim named cp is the user's request for context parallelism: 64 sequences of 1K on the same 2 x 4 H100,
    which the free choice above splits by batch, now split the sequence on cp (the token inputs Shard(1) there, every
    attention's queries Shard(2) with K/V all-gathered there) while the batch stays on dp."""
    import autopar
    from autopar.models import build_model, example_inputs

    model = build_model("llama3-8b", n_layers=2, max_seq_len=1024)
    x = example_inputs("llama3-8b", batch=64, seq=1024, device="meta")
    p = autopar.plan(model, autopar.MeshSpec((2, 4), ("dp", "cp")), x, cluster="h100")
    att = _attention_placements(p)
    assert att and all(a["out"][0] == ["S0", "S2"] and a["ins"][1] == ["S0", "R"] for a in att), att
    inputs = [n["placement"]["out"][0] for n in p.nodes if n["kind"] == "input"]
    assert len(inputs) == 2 and all(pl[1] == "S1" for pl in inputs), inputs  # tokens and labels
    gathers = _cp_collectives(p, 1, "fw", "all_gather")
    assert gathers, "no K/V all-gather on cp"


def test_a_cp_mesh_dim_on_a_model_without_a_sequence_names_the_dim():
    import autopar

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = (torch.randn(8, 16),)
    with pytest.raises(ValueError, match=r"context-parallel mesh dim \(named cp\*\).*name the dim otherwise"):
        autopar.plan(model, autopar.MeshSpec((2, 2), ("dp", "cp")), x, loss_fn=lambda y: y.sum())


# ---- cp inside pipeline / stage plans (passes/stage_costs.py, autopar/strategies/context_parallel.py) -----------


def _cp_collectives(plan, cp: int, phase: str, kind: str) -> list:
    """(node target, bytes) of the activation collectives of `kind` on stage-mesh dim `cp` in `phase`."""
    return [
        (str(n["target"]), c[2])
        for n in plan.nodes
        if n["phase"] == phase
        for r in n["redistribute"]
        if r["class"] == "act"
        for c in r["collectives"]
        if c[0] == kind and c[1] == cp
    ]


@pytest.mark.timeout(300)
def test_pipeline_stage_mesh_with_cp_plans_and_prices_its_collectives():
    """(pp, cp, tp) = (2, 2, 2), 4 micro-batches of one 8K sequence: each stage's per-op plan splits the sequence
    on cp (attention's queries Shard(2) there, K/V whole), and the step's predicted collectives include, per
    micro-batch, the representative block's cp all-gathers (forward) and reduce-scatters (backward) once per layer
    (a stage's collectives counted once, as its submesh's ranks issue them together)."""
    import autopar
    from autopar.models import build_model, example_inputs

    ov = dict(n_layers=4, dim=1024, n_heads=16, n_kv_heads=2, ffn_dim=3072, max_seq_len=8192)
    model = build_model("llama-tiny", device="meta", **ov)
    x = example_inputs("llama-tiny", batch=4, seq=8192, device="meta")
    mesh = autopar.MeshSpec((2, 2, 2), ("pp", "cp", "tp"))
    p = autopar.plan(model, mesh, x, cluster="h100", pipeline=dict(schedules=["1F1B"], n_microbatches=[4]))
    sc = p.schedule
    assert (sc["pp"], sc["stage_mesh_names"], sc["n_microbatches"]) == (2, ["cp", "tp"], 4)
    att = _attention_placements(p)
    assert att and all(a["out"][0][0] == "S2" and a["ins"][1][0] == "R" and a["ins"][2][0] == "R" for a in att), att
    fw = _cp_collectives(p, 0, "fw", "all_gather")
    bw = _cp_collectives(p, 0, "bw", "reduce_scatter")
    assert fw and bw, (fw, bw)
    block = lambda cs: sum(nb for t, nb in cs)  # noqa: E731  (the sub-model holds one block: every layer's copy)
    per_step = 4 * sc["n_microbatches"]  # layers x micro-batches
    pred = p.predicted["collectives"]
    assert pred["all_gather"]["bytes"] >= block(fw) * per_step, (pred, fw)
    assert pred["reduce_scatter"]["bytes"] >= block(bw) * per_step, (pred, bw)
    from backends.pipelining.runtime import _check_cp

    _check_cp(p)  # the runtime runs it (tests/test_pipeline_dist.py: pp x cp, and pp x cp x tp on 8 ranks)


@pytest.mark.timeout(300)
def test_torchtitan_cp_layout_plans_with_fsdp_over_dp_and_cp():
    """TorchTitan's 8B CP row shape (FSDP 4 x CP 2, one 64K sequence per FSDP rank, full recomputation) on the
    95 GiB H100 preset, 4 of its 32 layers, as the published layout is forced: a pp = 1 pipeline plan of the
    (dp, cp) stage mesh. Under a budget that replicated parameters do not fit, they are sharded over dp x cp (8
    ranks, torchtitan's dp_shard_cp), and the attention keeps the sequence split on cp."""
    import torch

    import autopar
    from autopar.models import build_model, example_inputs

    seq = 65536
    model = build_model("llama3-8b", device="meta", dtype=torch.bfloat16, n_layers=4, max_seq_len=seq)
    x = example_inputs("llama3-8b", batch=4, seq=seq, device="meta")
    opts = dict(layers_per_stage=[4], schedules=["GPipe"], n_microbatches=[1], recompute="all")
    mesh = autopar.MeshSpec((1, 4, 2), ("pp", "dp", "cp"))
    # 70 GiB: the loss tail's fp32 logits gradients (2 x 16.8 GB) and the sharded state fit, replicated state not
    p = autopar.plan(model, mesh, x, cluster="h100-95g", memory_budget=70 * 2**30, pipeline=opts)
    n_params = sum(t.numel() for t in model.parameters())
    state = p.stages[0]["memory"]["state_bytes"]
    per_param = autopar.TrainingPrecision.mixed_bf16_adam().bytes_per_param
    assert state == pytest.approx(n_params * per_param / 8, rel=0.02), (state, n_params)
    assert p.predicted["peak_mem_bytes"] <= 70 * 2**30
    att = _attention_placements(p)
    assert att and all(a["out"][0] == ["S0", "S2"] and a["ins"][1] == ["S0", "R"] for a in att), att
    assert _cp_collectives(p, 1, "fw", "all_gather") and _cp_collectives(p, 1, "bw", "reduce_scatter")


@pytest.mark.timeout(120)
def test_torch_engines_refuse_a_sequence_split_naming_cp():
    """fully_shard / parallelize_module have no context parallelism: recognition lists the cp dim as the reason
    (the graph backend runs the plan: test_cp_world4_gloo_equals_one_device)."""
    import autopar
    from autopar.models import build_model, example_inputs
    from backends.torch.lowering import EngineLoweringError
    from backends.torch.entry import lower

    model = build_model("llama-tiny", n_layers=2)
    x = example_inputs("llama-tiny", batch=B, seq=S, n_layers=2)
    p = autopar.plan(model, autopar.MeshSpec((2, 2), ("dp", "cp")), x, cluster="cpu-gloo", pin=_seq_pin)
    with pytest.raises(EngineLoweringError, match=r"mesh dim cp: inputs are placed \['S1'\].*context parallelism"):
        lower(model, p, None)


# ---- execution on 4 gloo ranks -------------------------------------------------------------------------------------


def _seq_pin(n):
    """Context parallel on mesh dim 1: the step's inputs and every forward activation (batch, seq, ...) split on
    the sequence, attention's queries too (K/V are then all-gathered by the attention rule); dp is the planner's."""
    from autopar.capture import SDPA

    if n.target is SDPA:
        return {1: "S2"}
    if n.kind == "input":
        return {1: "S1"}
    out = n.outs[0] if n.kind == "op" and n.outs else None
    if (
        n.kind == "op"
        and n.phase == "fw"
        and out is not None
        and len(out.shape) >= 3
        and tuple(out.shape[:2]) == (B, S)
    ):
        return {1: "S1"}
    return None


def job_cp(tmp, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import build_model, example_inputs
    from autopar.testing import train_and_compare

    ov = dict(n_layers=2)  # llama-tiny: causal attention, RoPE, grouped-query heads (4 q, 2 kv)
    model = build_model("llama-tiny", device=device, seed=7, **ov)
    x = example_inputs("llama-tiny", batch=B, seq=S, seed=8, device=device, **ov)
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "cp"))
    pm = autopar.parallelize(model, mesh, x, pin=_seq_pin)
    rep = train_and_compare(pm, copy.deepcopy(model), x, steps=2, lr=0.5, rtol=1e-5, atol=1e-6)
    kv = [
        (n["phase"], n["module"], r["collectives"])
        for n in pm.plan.nodes
        if str(n["target"]).startswith("_scaled_dot_product_flash_attention_for_cpu")
        for r in n["redistribute"]
        if r["input"] in ((1, 2) if n["phase"] == "fw" else (2, 3))
    ]
    return {
        "failures": rep.failures[:5],
        "collective_diff": rep.collective_diff,
        "measured": [list(c) for c in rep.measured],
        "losses": rep.losses,
        "max_abs": rep.max_abs,
        "attention": _attention_placements(pm.plan),
        "kv": kv,
        "hash": pm.plan.hash(),
        "threads": torch.get_num_threads(),
    }


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_cp_world4_gloo_equals_one_device(tmp_path):
    from _dist import launch_equal

    res = launch_equal(job_cp, 4, [str(tmp_path), "cpu"], tmp_path, timeout=200)[0]
    # both layers' attention (fw) shard the queries' sequence on cp with K/V whole there
    fw = [p for p in res["attention"]]
    assert len(fw) == 2 and all(p["out"][0] == ["S0", "S2"] and p["ins"][1] == ["S0", "R"] for p in fw), fw
    # K and V all-gathered on cp before each forward attention (and again for its backward), each as planned
    fw_kv = [c for ph, _, cs in res["kv"] if ph == "fw" for c in cs]
    assert len(fw_kv) == 4 and all(c[0] == "all_gather" and c[1] == 1 for c in fw_kv), res["kv"]
    gathers = [c for c in res["measured"] if c[0] == "all_gather" and c[1] == 1]
    assert len(gathers) >= 4, res["measured"]
    assert any(c[0] == "reduce_scatter" and c[1] == 1 for c in res["measured"]), res["measured"]


def job_hf_cp(tmp, names, shape=(2, 2), dims=("dp", "cp"), cluster="h100"):
    """Third-party models from the zoo on a mesh (default (dp, cp) 2 x 2), no pin, one after another in one launch:
    3 AdamW steps each against one device (tests/third_party/zoo_check.py), every collective of the first step
    kept."""
    import os
    import sys

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import autopar.testing
    from autopar.backends.counter import CollectiveCounter, compare

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "third_party"))
    import zoo_check as zc

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(dims))
    cluster = getattr(autopar.testing, cluster[1:]) if cluster.startswith(":") else cluster  # ":TP_FRIENDLY"
    out = {"failures": [], "collective_diff": [], "losses": [], "hash": "", "models": {}}
    for name in names:
        steps = []  # one counter per step, entered for the forward-backward and again for the optimizer step

        class Kept(CollectiveCounter):
            def __exit__(self, *exc):
                if self not in steps:
                    steps.append(self)
                return super().__exit__(*exc)

        model, args, kwargs, _ = zc.build(name)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, mesh, args, cluster=cluster, **zc.call_kwargs(kwargs))
        chk, rec = zc.Checker(), {}
        zc._train(pm, ref, args, kwargs, chk, rec, Kept)
        first = list(steps[0].collectives())
        out["failures"] += [f"{name}: {f}" for f in chk.failures[:5]]
        diff = compare(first, pm.plan.collectives())
        out["collective_diff"] += [f"{name}: {diff}"] if diff else []
        out["losses"] += rec["losses"]
        out["hash"] += pm.plan.hash()
        out["models"][name] = {
            "inputs": [n["placement"]["out"][0] for n in pm.plan.nodes if n["kind"] == "input"],
            "measured": [list(c) for c in first],
            "params": {f: list(pl) for f, pl in pm.plan.params.items()},
        }
    out["threads"] = torch.get_num_threads()
    return out


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_cp_mesh_dim_on_third_party_models_equals_one_device(tmp_path):
    """transformers' Llama (SDPA attention), GPT-2 (attention decomposed under its dropout on CPU), T5 (encoder and
    decoder sequences, relative position bias) and Mamba (no attention: a scan along the sequence) on ("dp", "cp")
    with no pin: every token input split on cp, 3 AdamW steps equal to one device, the first step's collectives
    as planned, activations gathered on cp among them."""
    from _dist import launch_equal

    names = ["llama", "gpt2", "t5", "mamba"]
    res = launch_equal(job_hf_cp, 4, [str(tmp_path), names], tmp_path, timeout=350)[0]
    for name in names:
        r = res["models"][name]
        assert r["inputs"] and all(pl[1] == "S1" for pl in r["inputs"]), (name, r["inputs"])
        assert any(c[0] == "all_gather" and c[1] == 1 for c in r["measured"]), (name, r["measured"])


# ---- ring attention pricing (autopar/cost/ring_attention.py) -------------------------------------------------------


def _unit_kernel(sq, sk, causal, work):
    return work * 1e-12  # one second per 1e12 counted FLOPs: the hand timeline below in round numbers


def test_ring_attention_matches_a_hand_timeline():
    # cp = 4, 8192 local rows (two chunks of 4096), torch's all-gathered count of 8e12 FLOPs: step 0 is the causal
    # local square (1/4 of the count: 2 s), steps 1-3 half rectangles (1/8: 1 s each); each merge 0.25 s
    n, s, flops = 4, 8192, 8e12
    dev = dataclasses.replace(CLUSTERS["h100"].device, mem_bw=1e12, mem_eff=1.0)
    q = 0.25 * 1e12 / RA.MERGE_BYTES
    assert RA.ring_kernels(s, n, _unit_kernel, flops) == pytest.approx([2.0, 1.0, 1.0, 1.0])
    fwd = lambda comm: RA.ring_attention_time(s, n, q, q, dev, _unit_kernel, flops, False, comm)
    assert fwd(0.0) == pytest.approx(2.0 + 3 * 1.25)  # no transfer: kernels plus merges
    # a 1.5 s transfer per step: hidden under step 0 (2 s), exposed behind steps 1 and 2 (1.25 s), none after step 3
    assert fwd(1.5) == pytest.approx(2.0 + 1.5 + 1.5 + 1.25)
    # backward: the same kernels (the callable is told backward through flops), fp32 dQ/dK/dV accumulation and the
    # dK/dV send copy every step
    acc = (RA.ACCUM_BYTES * 3 * q + RA.SEND_BYTES * 2 * q) / 1e12
    bwd = RA.ring_attention_time(s, n, q, q, dev, _unit_kernel, 2.5 * flops, True, 0.0)
    assert bwd == pytest.approx(5.0 + acc + 3 * (2.5 + acc))


def test_sequence_sharded_attention_is_priced_as_the_ring_by_default():
    dev, bf16 = CLUSTERS["h100"].device, torch.bfloat16
    assert dev.cp_attention == "ring"
    bh, s, d, n = 32, 8192, 128, 4  # local queries s of n * s keys: the shapes of a cp = 4 rank
    flops, nbytes = 4 * bh * s * (n * s) * d, 0.0
    ring = K.ring_time(bh, s, n * s, d, dev, bf16, False, flops, nbytes)
    diag = K.flash_time(bh, s, s, d, dev, bf16, True, False, flops / n, 0.0)
    half = flops / (2 * n)
    off = max(
        K.flash_time(bh, s, s // 2, d, dev, bf16, False, False, half, 0.0),
        K.flash_time(bh, s // 2, s, d, dev, bf16, False, False, half, 0.0),
    )
    merge = RA.MERGE_BYTES * bh * s * d / (dev.mem_bw * dev.mem_eff)
    assert ring == pytest.approx(diag + (n - 1) * (off + merge))
    # the same work as one load-balanced kernel on the all-gathered K/V, but on shorter chunks plus the merges
    gathered = K.flash_time(bh, s, n * s, d, dev, bf16, True, False, flops, nbytes)
    assert ring > gathered
    args = (None, None, None, 0.0, True)  # q, k, v, dropout_p, is_causal
    target = torch.ops.aten._scaled_dot_product_flash_attention.default
    shapes = [(1, bh, s, d), (1, bh, n * s, d), (1, bh, n * s, d)]
    assert K.kernel_time(target, args, {}, shapes, flops, nbytes, dev, bf16) == pytest.approx(ring)
    allgather = dataclasses.replace(dev, cp_attention="allgather")
    assert K.kernel_time(target, args, {}, shapes, flops, nbytes, allgather, bf16) == pytest.approx(gathered)
    with pytest.raises(ValueError, match="cp_attention"):
        K.kernel_time(target, args, {}, shapes, flops, nbytes, dataclasses.replace(dev, cp_attention="x"), bf16)


# ---- cp in the automatic search (passes/stage_search.py cp_degrees, candidate_meshes) ---------------------------


def test_cp_candidates_only_for_long_sequences():
    """A short sequence (8K: 4K per rank at cp 2, under CP_MIN_TOKENS) leaves the candidate list as it is without a
    sequence; a 64K one adds cp 2-8 (>= 8K tokens per rank, powers of 2 dividing the stage's ranks), dims named
    (dp, cp, tp)."""
    from autopar.cost import get_cluster
    from autopar.mesh import MeshSpec
    from autopar.passes.stage_search import CP_MIN_TOKENS, candidate_meshes

    h100, flat = get_cluster("h100"), MeshSpec((16,), ("dp",))
    base = candidate_meshes(flat, 40, h100, {}, {8})
    assert candidate_meshes(flat, 40, h100, {}, {8}, seq=CP_MIN_TOKENS) == base
    assert all("cp" not in sm.names for _, sm in base)
    long = candidate_meshes(flat, 40, h100, {}, {8}, seq=8 * CP_MIN_TOKENS)
    cps = {sm.shape[sm.names.index("cp")] for _, sm in long if "cp" in sm.names}
    assert cps == {2, 4, 8}, cps
    assert set(base) < set(long)
    assert all(list(sm.names) == [nm for nm in ("dp", "cp", "tp") if nm in sm.names] for _, sm in long)
    assert all(p * sm.size == 16 for p, sm in long)


@pytest.mark.timeout(300)
def test_auto_search_shards_a_long_sequence_over_cp():
    """One 32K sequence on 4 flat ranks, tp off: without cp no layout exists (one sequence feeds neither dp nor
    micro-batches for pp), so pipeline='auto' must find the cp stage mesh (cp 4, 8K tokens per rank)."""
    import autopar
    from autopar.models import build_model, example_inputs

    ov = dict(n_layers=2, dim=256, n_heads=8, n_kv_heads=2, ffn_dim=512, max_seq_len=32768)
    model = build_model("llama-tiny", device="meta", **ov)
    x = example_inputs("llama-tiny", batch=1, seq=32768, device="meta")
    with pytest.raises(Exception, match="no pipeline plan fits|no \\(pp, dp, tp\\) layout"):
        autopar.plan(model, (4,), x, cluster="h100", pipeline=dict(tp=[1], cp=[1]))
    p = autopar.plan(model, (4,), x, cluster="h100", pipeline=dict(tp=[1]))
    sc = p.schedule
    shape = dict(zip(sc["stage_mesh_names"], sc["stage_mesh_shape"]))
    assert (sc["pp"], shape) == (1, {"cp": 4}), sc  # cp 2 would leave dp 2 for one sequence
    assert p.predicted["peak_mem_bytes"] <= p.predicted["budget_bytes"]


class _GRULM(nn.Module):
    def __init__(self, d=8, vocab=60):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(vocab, d), nn.GRU(d, d, batch_first=True), nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])


def test_a_recurrence_is_not_split_over_cp_by_its_hidden_units():
    """On a cp dim only sequence-long dims are split (autopar/strategies/context_parallel.py `_sequence_long`: the
    sequence, or a multiple of all the step's tokens): a GRU's per-step state (batch, 8) over 4 steps has a dim
    that is a multiple of the sequence but no sequence, so it stays whole (or partial) on cp. The looser test (any
    multiple of the sequence) split 87 values of this model by their hidden units there, and its LP was twice as
    large (50k columns, 62 s; the suite's GRU LM: 271k columns, 300 s; now 26k and 122k columns, 4 s and 8.5 s)."""
    seq, batch = 4, 4
    x = torch.randint(0, 60, (batch, seq))
    mesh = autopar.MeshSpec((2, 2, 2), ("dp", "cp", "tp"))
    plan = autopar.plan(_GRULM(), mesh, (x,), cluster=TP_FRIENDLY, loss_fn=lambda y: y.mean())
    split = []
    for n in plan.nodes:
        pl, shape = (n["placement"]["out"] or [None])[0], n["shape"][0] if n["shape"] else None
        if n["kind"] == "op" and pl and shape and pl[1].startswith("S"):
            size = shape[int(pl[1][1:])]
            if size != seq and size % (batch * seq):
                split.append((n["name"], shape, pl))
    assert not split, split[:5]
    assert [n["placement"]["out"][0][1] for n in plan.nodes if n["kind"] == "input"] == ["S1"]
    assert plan.solver["n_vars"] < 40_000, plan.solver
