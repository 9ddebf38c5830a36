"""Pipeline plans executed on real gloo process groups equal single-device training.

The parent plans (autopar.plan with a "pp" mesh dim; the schedule is pinned per case, stage cuts and micro-batch
count are the planner's), saves the plans, and launches one process per rank (tests/_dist.py, running
`_rank_cases`). Every rank builds the same model, computes the single-device reference loss and gradients itself,
runs one pipeline step with backends/pipelining/runtime.py and compares: loss (fp32, rtol 1e-5) on the ranks holding the last
stage, each local parameter's gradient (rtol 1e-5 of the tensor's scale; FSDP-sharded gradients gathered). Several
cases share one launch per world size (start-up costs seconds); every collective has a 60 s timeout, the launch a
300 s one. Cases: world 2 (pp=2): GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, and
1F1B under a memory budget that makes the planner checkpoint blocks; world 4 (pp=2 x dp=2): GPipe, 1F1B (DDP/FSDP2
per stage as planned), Interleaved1F1B with FSDP-sharded parameters; world 4 (pp=2 x tp=2, a cost model where
TP pays, 2 micro-batches to keep it short): GPipe and Interleaved1F1B with the planner's tp placements, 1F1B with
torchtitan's, ParallelStyles inside the stages, DTensor gradients gathered with full_tensor and also compared
elementwise (rtol 1e-5, atol 1e-6); world 8 (pp=2 x dp=2 x tp=2, FSDP2 / replicate over tensor-parallel stages;
skipped on machines with fewer than 8 cores unless AUTOPAR_TEST_WORLD8 is set). Each case also feeds a batch of the
wrong shape: every rank must raise PipelineShapeError (none may hang waiting for activations); on world 2 each rank
then brings another plan (GPipe, 1F1B): PlanMismatchError on both. Without processes:
the layouts stage_tp_styles derives, and its error for a stage placement no ParallelStyle expresses.
"""

from __future__ import annotations

import os

import pytest

from _dist import launch

MODEL, LAYERS, BATCH, SEQ = "llama-tiny", 4, 8, 32
TP_SEQ = 8  # the tensor-parallel cases (_tp_cluster)
WORLD8 = pytest.mark.skipif(
    (os.cpu_count() or 1) < 8 and not os.environ.get("AUTOPAR_TEST_WORLD8"),
    reason="8 gloo ranks: 1-2 min on a 2-core machine (set AUTOPAR_TEST_WORLD8=1 to run it there)",
)


def _tp_cluster():
    """A cost model where tensor parallelism pays on llama-tiny at TP_SEQ tokens a row (slow compute, links slow in
    bandwidth only): a stage's replicated weights would cost a gradient all_reduce larger than the activations TP
    reduces, so the planner shards the blocks' Linears over the stage's tp dim and keeps the batch whole there. (At
    SEQ tokens the activations outweigh the weights: the planner rightly splits the batch or the sequence instead,
    as under the calibrated cpu-gloo preset and tests/_clusters.py SHAPES.)"""
    from _clusters import TP_FRIENDLY

    return TP_FRIENDLY


def _plans(tmp_path, world):
    import autopar
    from autopar import models

    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta", n_layers=LAYERS)
    mesh = autopar.MeshSpec((2,), ("pp",)) if world == 2 else autopar.MeshSpec((2, 2), ("pp", "dp"))
    cases = []
    for sched in ("GPipe", "1F1B", "Interleaved1F1B"):
        force = None
        if world == 4 and sched == "Interleaved1F1B":  # exercise FSDP2 inside the stages too
            force = {n: ("S0",) for n, p in m.named_parameters() if p.shape[0] % 2 == 0}
        plan = autopar.plan(m, mesh, x, cluster="h100", force=force, pipeline={"schedules": [sched]})
        cases.append(_case(plan, tmp_path, f"{world}_{sched}", sched))
    if world == 2:  # the zero-bubble family too (split backward; V-shaped stage placement)
        for sched in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
            plan = autopar.plan(m, mesh, x, cluster="h100", pipeline={"schedules": [sched]})
            cases.append(_case(plan, tmp_path, f"2_{sched}", sched))
    if world == 2:  # a memory budget the stages only meet by checkpointing blocks (runtime recompute)
        peak = cases[1]["peak"]
        for f in (0.85, 0.7, 0.55):
            plan = autopar.plan(m, mesh, x, cluster="h100", memory_budget=f * peak, pipeline={"schedules": ["1F1B"]})
            if any(st["recompute_blocks"] for st in plan.stages):
                break
        cases.append(_case(plan, tmp_path, "2_1F1B_recompute", "1F1B"))
    return cases


def _tp_plans(tmp_path):
    """pp=2 x tp=2: the planner's own tensor-parallel stage plans (GPipe; Interleaved1F1B, 4 stages, 2 per rank)
    and torchtitan's placements forced (1F1B: colwise q/k/v/w1/w3/output, rowwise wo/w2, vocab-sharded embedding)."""
    import autopar
    from autopar import models
    from _bench import torchtitan_placements

    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=TP_SEQ, device="meta", n_layers=LAYERS)
    mesh = autopar.MeshSpec((2, 2), ("pp", "tp"))
    force = torchtitan_placements(m, ("tp",), None, "tp")[0]
    cases = []
    for sched, f in (("GPipe", None), ("1F1B", force), ("Interleaved1F1B", None)):
        plan = autopar.plan(
            m, mesh, x, cluster=_tp_cluster(), force=f, pipeline={"schedules": [sched], "n_microbatches": [2]}
        )
        assert plan.schedule["batch_placement"] == ["R"], plan.schedule["batch_placement"]
        for st in plan.stages:  # every stage really shards parameters over tp, a block's Linears among them
            tp_sharded = [f for f in st["params"] if plan.params[f][0] != "R"]
            assert any(".attention.wq." in f for f in tp_sharded), (sched, st["index"], tp_sharded)
        cases.append(_case(plan, tmp_path, f"tp_{sched}", sched, TP_SEQ))
    return cases


def _titan(max_seq_len: int, device="cpu"):
    """torchtitan's Llama 3 debug model (4 layers, its RoPE table `freqs_cis` a buffer of max_seq_len rows) with its
    trainer's cross entropy, and a (tokens, labels) batch of BATCH x SEQ."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from torchtitan.models.llama3 import Transformer, llama3_args

    class TitanLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens, labels):
            return F.cross_entropy(self.model(tokens).flatten(0, 1).float(), labels.flatten(0, 1))

    args = dataclasses.replace(llama3_args["debugmodel"], max_seq_len=max_seq_len, n_layers=LAYERS)
    torch.manual_seed(0)
    with torch.device(device):
        m = Transformer(args)
    if device == "cpu":
        with torch.no_grad():
            m.init_weights(buffer_device=torch.device("cpu"))
    tok = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return TitanLoss(m), (tok, torch.roll(tok, -1, 1))


def _case(plan, tmp_path, name, sched, seq=SEQ):
    path = tmp_path / f"plan_{name}.json"
    plan.save(path)
    return {
        "schedule": sched,
        "seq": seq,
        "path": str(path),
        "stages": len(plan.stages),
        "m": plan.schedule["n_microbatches"],
        "bounds": plan.schedule["bounds"],
        "peak": plan.predicted["peak_mem_bytes"],
        "recompute": [st["recompute_blocks"] for st in plan.stages],
        "params_on_dp": sorted({pl[0] for pl in plan.params.values()}),
    }


def _check(results, cases):
    for ci, case in enumerate(cases):
        holders = [r["cases"][ci] for r in results]
        assert sum(1 for h in holders if h["loss_diff"] is not None) >= 1, case
        # every rank holds parameters; a stage may hold only the head (norm + output) where the planner cuts there
        assert any(h["has_layers"] for h in holders), f"{case['schedule']}: no rank holds a block"
        for h in holders:
            head_only = {p.split(".")[0] for p in h["params"]} <= {"norm", "output"}
            assert h["n_params"] > 0 and (h["has_layers"] or head_only), (
                f"{case['schedule']}: rank holds neither a block nor the head: {h}"
            )
            assert h["max_grad_rel"] <= 1e-5, f"{case['schedule']}: gradient mismatch {h}"
            if h["loss_diff"] is not None:
                assert h["loss_diff"] <= 1e-5 * abs(h["loss_ref"]), f"{case['schedule']}: loss mismatch {h}"
            assert "PipelineShapeError" in h["shape_error"] and "micro-batches" in h["shape_error"], h
            assert h["kept_outputs"] == 0, f"{case['schedule']}: the last stage kept its micro-batches' logits"
        covered = set().union(*(set(h["params"]) for h in holders))
        assert covered == set(results[0]["cases"][ci]["all_params"]), "some parameter was on no stage"


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_equals_single_device(tmp_path, world):
    cases = _plans(tmp_path, world)
    for c in cases:  # the planner placed the cuts itself (stage counts as configured)
        assert c["stages"] == (2 if c["schedule"] in ("GPipe", "1F1B") else 4), c
    if world == 2:
        assert any(cases[-1]["recompute"]), f"the tight budget did not make the planner checkpoint: {cases[-1]}"
    results = launch(_rank_cases, world, [cases], tmp_path)
    _check(results, cases)
    if world == 2:  # ranks holding different pipeline plans are told so on every rank, before any stage runs
        for r in results:
            assert "ranks hold different plans" in r["mismatch"] and "ranks [0]" in r["mismatch"], r["mismatch"]
    if world == 4:  # the dp dim really ran data parallel (different rows per dp rank), DDP or FSDP2
        for i, c in enumerate(cases):
            assert {tuple(r["cases"][i]["local_rows"]) for r in results} == {(0, 4), (4, 8)}
            for r in results:  # FSDP2 where the stage plan shards parameters on dp, DDP where it replicates
                h = r["cases"][i]
                assert all(w.startswith(h["want_wrapper"]) for w in h["wrappers"]), (c, h["wrappers"])
        assert cases[2]["params_on_dp"] == ["R", "S0"] or cases[2]["params_on_dp"] == ["S0"], cases[2]
    print(
        "\n"
        + "\n".join(
            f"world {world} {c['schedule']}: stages {c['stages']} bounds {c['bounds']} m={c['m']} "
            f"recompute {c['recompute']} params on dp {c['params_on_dp']} "
            f"max grad rel diff {max(r['cases'][i]['max_grad_rel'] for r in results):.2e} "
            f"max loss diff {max(r['cases'][i]['loss_diff'] or 0 for r in results):.2e}"
            for i, c in enumerate(cases)
        )
    )


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_pipeline_tensor_parallel_stages_equal_single_device(tmp_path):
    """pp=2 x tp=2 on 4 gloo ranks: ParallelStyles inside each stage (parallelize_module over the stage's tp
    submesh), the loss on class-sharded logits under torch's loss_parallel() as planned, loss and every gradient
    (DTensor gradients gathered with full_tensor) equal to single device."""
    from autopar.backends.pipelining.tp_styles import LOSS_STYLE

    cases = _tp_plans(tmp_path)
    results = launch(_rank_cases, 4, [cases], tmp_path)
    _check(results, cases)
    for i, c in enumerate(cases):
        for r in results:
            h = r["cases"][i]
            assert h["allclose"], f"{c['schedule']}: gradients not within rtol 1e-5 / atol 1e-6: {h}"
            styles = {v.split("(")[0] for st in h["tp_styles"] for v in st.values()}
            assert {"ColwiseParallel", "RowwiseParallel"} <= styles, (c["schedule"], h["tp_styles"])
            # the styles really ran: parameters are DTensors sharded over the tp mesh, holding 1/2 of that dim
            assert h["tp_sharded"] >= 8 and h["tp_sharded"] == h["tp_local_split"], (c["schedule"], h)
            # every plan here reads the logits class-sharded (the planner's choice; torchtitan's loss_parallel):
            # the last stage's head keeps them sharded and its rank steps under loss_parallel(), equal to one device
            heads = [st["output"] for st in h["tp_styles"] if "output" in st]
            assert h["loss_parallel"] == h["is_last"] and heads == ([LOSS_STYLE] if h["is_last"] else []), h
        if c["schedule"] == "1F1B":  # torchtitan's layout: vocab-parallel embedding, Megatron feed-forward
            first = [st for r in results for st in r["cases"][i]["tp_styles"][:1] if "tok_embeddings" in st]
            assert first and all(
                st["tok_embeddings"].startswith("RowwiseParallel")
                and st["layers.0.feed_forward.w2"] == "RowwiseParallel()"
                for st in first
            ), first
    print(
        "\n"
        + "\n".join(
            f"pp2 x tp2 {c['schedule']}: stages {c['stages']} bounds {c['bounds']} m={c['m']} "
            f"max grad rel diff {max(r['cases'][i]['max_grad_rel'] for r in results):.2e} "
            f"max loss diff {max(r['cases'][i]['loss_diff'] or 0 for r in results):.2e}"
            for i, c in enumerate(cases)
        )
    )


@pytest.mark.dist
@pytest.mark.timeout(600)
@WORLD8
def test_pipeline_fsdp_x_tp_stages_equal_single_device(tmp_path):
    """pp=2 x dp=2 x tp=2 on 8 gloo ranks (1F1B): TP styles first, then FSDP2 over the dp submesh on the
    tp-sharded DTensor parameters (torchtitan's composition) where the stage plan shards on dp (torchtitan's
    placements forced; the planner's own plan, which shards some weights on dim 1 over dp and mixes colwise and
    rowwise q/k/v), FSDP2's replicate (DDP for DTensor parameters) where it replicates on dp."""
    import autopar
    from autopar import models
    from _bench import torchtitan_placements

    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=TP_SEQ, device="meta", n_layers=LAYERS)
    mesh = autopar.MeshSpec((2, 2, 2), ("pp", "dp", "tp"))
    fsdp = torchtitan_placements(m, ("dp", "tp"), "dp", "tp")[0]
    ddp = {k: ("R", v[1]) for k, v in fsdp.items()}
    cases, want = [], []
    for name, f, wrapper in (("fsdp_tp", fsdp, "FSDP"), ("ddp_tp", ddp, "Replicate"), ("auto", None, "FSDP")):
        plan = autopar.plan(
            m, mesh, x, cluster=_tp_cluster(), force=f, pipeline={"schedules": ["1F1B"], "n_microbatches": [2]}
        )
        assert plan.schedule["batch_placement"] == ["S0", "R"], plan.schedule["batch_placement"]
        assert all(any(plan.params[f][1] != "R" for f in st["params"]) for st in plan.stages)
        cases.append(_case(plan, tmp_path, name, "1F1B", TP_SEQ))
        want.append(wrapper)
    results = launch(_rank_cases, 8, [cases], tmp_path)
    _check(results, cases)
    for i, c in enumerate(cases):
        assert {tuple(r["cases"][i]["local_rows"]) for r in results} == {(0, 4), (4, 8)}
        for r in results:
            h = r["cases"][i]
            assert h["allclose"] and all(w.startswith(want[i]) for w in h["wrappers"]), (c, h["wrappers"])
            # torchtitan's layout shards every block Linear on tp; the planner's own ("auto") at least one
            assert h["tp_sharded"] >= (8, 8, 1)[i] and h["tp_sharded"] == h["tp_local_split"], (c, h)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_pipeline_context_parallel_stages_equal_single_device(tmp_path):
    """pp=2 x cp=2 on 4 gloo ranks: each cp rank runs its half of every sequence (the RoPE tables cut to its
    positions), attention against K and V gathered along the sequence with the causal mask of its query positions
    (backends/context_parallel.py), gradients averaged over cp by DDP (torchtitan's dp x cp), the loss the whole
    sequence's mean; GPipe and 1F1B, the second with K/V at the KV heads (SDPA's enable_gqa), and torchtitan's
    Llama 3 (its RoPE table a buffer the blocks take)."""
    import autopar
    from autopar import models

    mesh = autopar.MeshSpec((2, 2), ("pp", "cp"))
    cases = []
    for sched, gqa in (("GPipe", "repeat"), ("1F1B", "native"), ("1F1B", "titan")):
        m = models.build_model(MODEL, device="meta", n_layers=LAYERS, gqa=gqa) if gqa != "titan" else None
        x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta", n_layers=LAYERS)
        m, x = (m, x) if m is not None else _titan(SEQ)  # its freqs_cis as long as the sequence, cut per rank
        plan = autopar.plan(m, mesh, x, cluster="h100", pipeline={"schedules": [sched], "n_microbatches": [2]})
        assert plan.schedule["batch_placement"] == ["S1"], plan.schedule["batch_placement"]
        cases.append({**_case(plan, tmp_path, f"cp_{sched}_{gqa}", sched), "gqa": gqa})
    results = launch(_rank_cases, 4, [cases], tmp_path)
    _check(results, cases)
    for i, c in enumerate(cases):
        for r in results:
            h = r["cases"][i]
            assert h["allclose"] and all(w.startswith("DistributedDataParallel") for w in h["wrappers"]), (c, h)
            assert h["cp_gathers"] > 0, h  # K and V really gathered along the sequence


@pytest.mark.dist
@pytest.mark.timeout(600)
@WORLD8
def test_pipeline_context_x_tensor_parallel_stages_equal_single_device(tmp_path):
    """pp=2 x cp=2 x tp=2 on 8 gloo ranks (1F1B, torchtitan's tp placements): ParallelStyles over tp, attention
    on local heads gathered over cp, FSDP2's replicate (DDP for DTensor parameters) over cp."""
    import autopar
    from autopar import models
    from _bench import torchtitan_placements

    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, device="meta", n_layers=LAYERS)
    mesh = autopar.MeshSpec((2, 2, 2), ("pp", "cp", "tp"))
    force = {k: ("R", v[1]) for k, v in torchtitan_placements(m, ("cp", "tp"), None, "tp")[0].items()}
    pipeline = {"schedules": ["1F1B"], "n_microbatches": [2]}
    plan = autopar.plan(m, mesh, x, cluster=_tp_cluster(), force=force, pipeline=pipeline)
    cases = [_case(plan, tmp_path, "cp_tp", "1F1B")]
    results = launch(_rank_cases, 8, [cases], tmp_path)
    _check(results, cases)
    for r in results:
        h = r["cases"][0]
        assert h["allclose"] and h["cp_gathers"] > 0 and h["tp_sharded"] >= 8, h
        assert all(w.startswith("Replicate") for w in h["wrappers"]), h["wrappers"]


def test_pipeline_context_parallel_refuses_blocks_that_make_positions():
    """A block computing its RoPE positions itself (an arange inside it) would start every cp rank's chunk at 0:
    refused from the plan, naming the module, before any stage is built."""
    import torch

    import autopar
    from autopar import models
    from autopar.backends.pipelining import PipelineRunner

    m = models.build_model(MODEL, device="cpu", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=SEQ, n_layers=LAYERS)

    class OwnRope(torch.nn.Module):  # the block makes cos / sin from its own input's length
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, h, cos, sin):
            pos = torch.arange(h.shape[1], dtype=h.dtype)
            return self.block(h, cos + 0 * pos[:, None], sin)

    m.layers = torch.nn.ModuleList(OwnRope(b) for b in m.layers)
    mesh = autopar.MeshSpec((2, 2), ("pp", "cp"))
    plan = autopar.plan(m, mesh, x, cluster="h100", pipeline={"schedules": ["GPipe"]})
    with pytest.raises(NotImplementedError, match=r"module 'layers\.\d' makes positions itself \(arange"):
        PipelineRunner(m, plan, mesh=object())
    # torchtitan's freqs_cis longer than the sequence, cut to it from row 0 inside the attention: every cp rank
    # would read positions 0..L-1 (measured: gradients 85% off one device before this refusal)
    m, x = _titan(4 * SEQ, device="meta")
    plan = autopar.plan(m, mesh, x, cluster="h100", pipeline={"schedules": ["GPipe"]})
    with pytest.raises(NotImplementedError, match=r"cuts buffer 'model.freqs_cis' \[128, 8\] to \[32, 8\]"):
        PipelineRunner(m, plan, mesh=object())


def test_pipeline_tp_refuses_inexpressible_stage_placement():
    """A stage placement no ParallelStyle expresses is refused with the stage, the parameter and its placement: a
    tp plan of the MLP model with fc1's weight Shard(1) (rowwise, its bias replicated) and its bias sharded; a norm
    weight sharded on tp (no style shards an RMSNorm) likewise. fc1's weight Shard(0) with its bias replicated
    (forced) runs ColwiseParallel, the bias sharded with it: the same values."""
    import autopar
    from autopar import models
    from autopar.backends.pipelining.runtime import build_stage_module
    from autopar.backends.pipelining.tp_styles import LOSS_STYLE, loss_head, stage_tp_styles

    mesh = autopar.MeshSpec((2, 2), ("pp", "tp"))
    m = models.build_model("mlp-tiny", device="meta", n_layers=LAYERS)
    x = models.example_inputs("mlp-tiny", batch=BATCH, seq=SEQ, device="meta", n_layers=LAYERS)
    plan = autopar.plan(
        m,
        mesh,
        x,
        cluster=_tp_cluster(),
        pipeline={"schedules": ["GPipe"]},
        force={"layers.0.fc1.weight": ("S0",), "layers.0.fc1.bias": ("R",)},
    )
    fc1 = next(f for f in plan.stages[0]["params"] if f.endswith("fc1.weight"))
    bias = fc1[: -len("weight")] + "bias"
    assert plan.params[fc1] == ["S0"] and plan.params[bias] == ["R"], plan.params
    styles = stage_tp_styles(plan, 0, build_stage_module(m, plan, 0), 0, plan.schedule["block_positions"])
    assert styles[fc1[: -len(".weight")]].startswith("ColwiseParallel("), styles
    plan.params[fc1], plan.params[bias] = ["S1"], ["S0"]
    with pytest.raises(
        NotImplementedError,
        match=rf"stage 0: parameter '{fc1}' is placed S1 on the "
        rf"tensor-parallel stage-mesh dim 'tp'.*weight S1 but bias S0",
    ):
        stage_tp_styles(plan, 0, build_stage_module(m, plan, 0), 0, plan.schedule["block_positions"])
    m = models.build_model(MODEL, device="meta", n_layers=LAYERS)
    x = models.example_inputs(MODEL, batch=BATCH, seq=TP_SEQ, device="meta", n_layers=LAYERS)
    plan = autopar.plan(m, mesh, x, cluster=_tp_cluster(), pipeline={"schedules": ["GPipe"]})
    k = len(plan.stages) - 1
    # layouts from the plan's graph: Megatron pairs keep the activation between them sharded, other styles hand
    # over whole tensors (wk/wv rowwise read the attention input itself: no pair, q/k/v/wo all replicated outside)
    styles = stage_tp_styles(plan, k, build_stage_module(m, plan, k), 0, plan.schedule["block_positions"])
    # the output projection as planned: colwise with the loss reading the logits class-sharded (loss_parallel),
    # handed over whole to a loss function of the user's own
    assert plan.params["output.weight"] == ["S0"] and loss_head(plan, 0) == "output", plan.params["output.weight"]
    assert (
        styles["layers.3.attention.wq"] == "ColwiseParallel()"
        and styles["layers.3.attention.wo"] == "RowwiseParallel()"
        and styles["output"] == LOSS_STYLE
    ), styles
    own = stage_tp_styles(plan, k, build_stage_module(m, plan, k), 0, plan.schedule["block_positions"], False)
    assert own["output"] == "ColwiseParallel(output_layouts=Replicate())", own
    for f in ("wk", "wv"):
        plan.params[f"layers.3.attention.{f}.weight"] = ["S1"]
    styles = stage_tp_styles(plan, k, build_stage_module(m, plan, k), 0, plan.schedule["block_positions"])
    assert (
        styles["layers.3.attention.wq"] == "ColwiseParallel(output_layouts=Replicate())"
        and styles["layers.3.attention.wk"]
        == styles["layers.3.attention.wo"]
        == "RowwiseParallel(input_layouts=Replicate())"
    ), styles
    plan.params["layers.3.ffn_norm.weight"] = ["S0"]
    with pytest.raises(
        NotImplementedError,
        match=rf"stage {k}: parameter 'layers.3.ffn_norm.weight' is placed S0 "
        rf"on the tensor-parallel stage-mesh dim 'tp'.*RMSNorm",
    ):
        stage_tp_styles(plan, k, build_stage_module(m, plan, k), 0, plan.schedule["block_positions"])


# ---- one rank (tests/_dist.py runs it) -------------------------------------------------------------------------
def _rank_cases(cases):
    """One rank of the launch (tests/_dist.py runs it inside the gloo group): every case, a barrier after each."""
    import copy
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from autopar import Plan, models
    from torch.distributed.tensor import DTensor, Shard
    from autopar.backends.pipelining.runtime import PipelineRunner, PipelineShapeError, local_batch

    res = []
    for case in cases:
        plan = Plan.load(case["path"])
        if case.get("gqa") == "titan":
            model, (x, y) = _titan(SEQ)
        else:
            model = models.build_model(MODEL, device="cpu", n_layers=LAYERS, seed=0, gqa=case.get("gqa", "repeat"))
            x, y = models.example_inputs(MODEL, batch=BATCH, seq=case.get("seq", SEQ), n_layers=LAYERS, seed=1)
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_names))
        dp_rank = mesh.get_local_rank("dp") if "dp" in plan.mesh_names else 0
        runner = PipelineRunner(model, plan, mesh)
        xl, yl = local_batch(plan, (x, y), dp_rank)
        ref(x, y).backward()
        loss_local_ref = ref(xl, yl).item()
        loss = runner.step(xl if runner.is_first else None, yl if runner.is_last else None)
        stages = getattr(runner.schedule, "_stages", None) or [runner.schedule._stage]
        kept = sum(len(s.output_chunks) for s in stages)  # outputs the schedule holds after the step (the logits)
        rel, names, close, tp_sharded, tp_split = 0.0, [], True, 0, 0
        gref = dict(ref.named_parameters())
        for n, p in runner.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = gref[n].grad
            rel = max(rel, float((g - want).abs().max() / want.abs().max().clamp_min(1e-30)))
            close = close and torch.allclose(g, want, rtol=1e-5, atol=1e-6)
            names.append(n)
            if isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names:
                t = p.device_mesh.mesh_dim_names.index("tp")
                if isinstance(p.placements[t], Shard):  # this rank holds at most 1/tp of that dim
                    tp_sharded += 1
                    d = p.placements[t].dim
                    tp_split += p.to_local().shape[d] * p.device_mesh.size(t) <= p.shape[d]
        try:
            bad = torch.cat([x, x], 1)
            runner.step(bad if runner.is_first else None, torch.cat([y, y], 1) if runner.is_last else None)
            err = "no error"
        except PipelineShapeError as e:
            err = f"PipelineShapeError: {e}"
        sharded = "dp" in plan.mesh_names and any(plan.params[n][0] != "R" for n in names)
        res.append(
            {
                "max_grad_rel": rel,
                "params": names,
                "n_params": len(names),
                "wrappers": runner.wrappers,
                "allclose": close,
                "tp_styles": runner.tp_styles,
                "tp_sharded": tp_sharded,
                "tp_local_split": tp_split,
                "want_wrapper": "FSDP" if sharded else "DistributedDataParallel",
                "has_layers": any(".layers." in f".{n}" for n in names),
                "all_params": [n for n, _ in ref.named_parameters()],
                "loss_diff": None if loss is None else abs(loss.item() - loss_local_ref),
                "kept_outputs": kept,
                "cp_gathers": runner.cp_attention.calls if runner.cp_attention else 0,
                "loss_parallel": runner.loss_parallel,
                "is_last": runner.is_last,
                "loss_ref": loss_local_ref,
                "shape_error": err,
                "local_rows": [
                    int(xl.data_ptr() - x.data_ptr()) // (x.element_size() * x.shape[1]),
                    int(xl.data_ptr() - x.data_ptr()) // (x.element_size() * x.shape[1]) + xl.shape[0],
                ],
            }
        )
        dist.barrier()
    mismatch = None
    if dist.get_world_size() == 2:  # each rank a plan of its own (GPipe on rank 0, 1F1B on rank 1): refused on both
        from autopar.backends.spmd.comm import PlanMismatchError

        mine = Plan.load(cases[dist.get_rank()]["path"])
        mesh = init_device_mesh("cpu", tuple(mine.mesh_shape), mesh_dim_names=tuple(mine.mesh_names))
        try:
            PipelineRunner(models.build_model(MODEL, device="cpu", n_layers=LAYERS, seed=0), mine, mesh)
            mismatch = "no error"
        except PlanMismatchError as e:
            mismatch = str(e)
    return {"rank": dist.get_rank(), "cases": res, "mismatch": mismatch}
