"""Pipeline plans of third-party models called as their users call them (transformers models: keyword inputs, the
loss inside the model) executed on real gloo process groups equal one device.

The parent plans each case (autopar.plan with a "pp" mesh dim and `example_kwargs`, the schedule pinned; stage
cuts, micro-batch count and per-stage data parallelism are the planner's) and saves the plans; each rank builds
the same zoo model (tests/third_party/zoo.py: random weights under a fixed seed, dropout off), loads the plan,
runs one step with `PipelineRunner.step_model(**its dp rows of the batch)` (backends/pipelining/forward_stage.py:
every stage runs the model's own forward) and compares with one device: the loss of its rows on the ranks
holding the last stage, every local parameter's gradient (|diff| <= 1e-6 + 1e-4 max|ref|, FSDP-sharded ones
gathered), and that every parameter is on some stage. Each case then feeds a batch of another sequence length:
every rank must raise PipelineShapeError (none may wait for activations that never come). Cases: world 2 (pp=2):
Llama (1F1B; ZBVZeroBubble: split backward, V placement), GPT-NeoX (Interleaved1F1B: two stages per rank), ViT
(GPipe: an image classifier), GPT-2 (1F1B: its tied embedding and head on the first and the last stage, the
gradient summed between them), BART (GPipe: encoder and decoder stages, one embedding tensor shared three ways), DistilBERT (1F1B: a masked LM
whose micro-batches count 2-3 masked tokens a row: the loss and gradients are the batch's token mean, not the mean of
the micro-batches' means), BLOOM (1F1B: its blocks return their attention weights after the running tensor, which
nothing reads; ALiBi), Swin (GPipe: its patch embedding returns the patch grid's (height, width) with the
tensor, which a later stage's stand-in returns as probed), FNet (1F1B: its pooler runs though no loss reads it), MPNet
(Interleaved1F1B: its relative position bias, made from a trainable table before the blocks, sent with the running
tensor through every stage, side_values.py), mT5 (1F1B: the encoder's output, sent to the decoder's stage); world 4: pp=2 x dp=2, Llama Interleaved1F1B with FSDP2-sharded stages (one stage of
them holds no block), mT5 Interleaved1F1B with FSDP2 (the encoder output passed through stages that do not read
it, which get no gradient for it) and Qwen2-MoE and RoBERTa 1F1B with DDP stages; pp=2 x tp=2, Llama Interleaved1F1B with Megatron's
placements forced (ParallelStyles inside the stages, attention on local heads), MPNet 1F1B with the planner's own
tp placements (its head column-wise: the head's tied bias kept tied through parallelize_module, the word embedding
tied to the first stage's summed whole; side values), Falcon 1F1B (it adds into a row-wise Linear's output in
place: the styled modules' outputs are the model's own copies) and OPT 1F1B (q/k/v weights Shard(0) with replicated
biases: column-wise, the biases sharded too). Without processes: what a stage
boundary cannot carry is refused, naming the block (DeBERTa-v2, PoolFormer; ALBERT's block run twice).
"""

from __future__ import annotations

import os
import sys

import pytest

from _dist import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "third_party"))

TOL_ABS, TOL_REL = 1e-6, 1e-4
CASES = {
    2: [("llama", "1F1B", None), ("llama", "ZBVZeroBubble", None), ("gpt_neox", "Interleaved1F1B", None),
        ("vit", "GPipe", None), ("gpt2", "1F1B", None), ("bart", "GPipe", None),
        ("distilbert", "1F1B", None), ("bloom", "1F1B", None), ("swin", "GPipe", None), ("fnet", "1F1B", None),
        ("mpnet", "Interleaved1F1B", None), ("mt5", "1F1B", None)],
    4: [("llama", "Interleaved1F1B", "fsdp"), ("qwen2_moe", "1F1B", None), ("llama", "Interleaved1F1B", "tp"),
        ("roberta", "1F1B", None), ("mt5", "Interleaved1F1B", "fsdp"), ("mpnet", "1F1B", "tp"),
        ("falcon", "1F1B", "tp"), ("opt", "1F1B", "tp")],
}  # fmt: skip
MEGATRON = r"(q_proj|k_proj|v_proj|gate_proj|up_proj|o_proj|down_proj)\.weight$"  # colwise, then rowwise ones


def _model(name):
    import zoo

    model, args, kwargs, _ = zoo.ZOO[name]()
    zoo.zero_dropout(model)
    return model, args, kwargs


def _layout(model, world, inside):
    """(mesh, cluster, force, pipeline options) of a case: pp alone, pp x dp (FSDP2-sharded stages where
    inside == "fsdp"), or pp x tp with Megatron's placements forced (a cost model where TP pays, 2 micro-batches)."""
    import re

    import autopar
    from autopar.testing import TP_FRIENDLY

    if world == 2:
        return autopar.MeshSpec((2,), ("pp",)), "h100", None, {}
    if inside == "tp":
        pat = re.compile(MEGATRON)
        force = {
            n: ("S1",) if re.search("(o_proj|down_proj)", n) else ("S0",)
            for n, _ in model.named_parameters()
            if pat.search(n)
        }
        return autopar.MeshSpec((2, 2), ("pp", "tp")), TP_FRIENDLY, force, {"n_microbatches": [2]}
    force = {n: ("S0",) for n, p in model.named_parameters() if p.shape[0] % 2 == 0} if inside == "fsdp" else None
    return autopar.MeshSpec((2, 2), ("pp", "dp")), "h100", force, {}


def _plans(tmp_path, world):
    import autopar

    cases = []
    for name, sched, inside in CASES[world]:
        model, args, kwargs = _model(name)
        mesh, cluster, force, opts = _layout(model, world, inside)
        plan = autopar.plan(
            model, mesh, args, example_kwargs=kwargs, cluster=cluster, force=force,
            pipeline={"schedules": [sched], **opts},
        )  # fmt: skip
        assert plan.meta["keyword_inputs"] and plan.schedule["name"] == sched, (name, plan.schedule["name"])
        path = tmp_path / f"plan_{world}_{name}_{sched}_{inside}.json"
        plan.save(path)
        prefix = plan.schedule["layer_prefix"] + "."
        blockless = any(not any(f.startswith(prefix) for f in st["modules"]) for st in plan.stages)
        cases.append({"name": name, "schedule": sched, "path": str(path), "inside": inside, "blockless": blockless})
    return cases


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_keyword_pipeline_plans_equal_single_device(tmp_path, world):
    cases = _plans(tmp_path, world)
    results = launch(_rank_cases, world, [cases], tmp_path, timeout=420)
    for ci, case in enumerate(cases):
        held = [r["cases"][ci] for r in results]
        assert sum(1 for h in held if h["loss"] is not None) == world // 2, case  # one last-stage rank per dp rank
        for h in held:
            assert h["n_params"] > 0 and h["worst"] <= 1.0, (case, h)
            if h["loss"] is not None:
                assert abs(h["loss"] - h["loss_ref"]) <= 1e-5 * abs(h["loss_ref"]), (case, h)
            assert "PipelineShapeError" in h["shape_error"], (case, h)
            if case["inside"] == "fsdp":
                assert all(w.startswith("FSDP") for w in h["wrappers"]), (case, h)
            elif case["inside"] == "tp":  # Llama: q/k/v colwise (local heads), o rowwise in the block stages
                styles = {m.rsplit(".", 1)[-1]: c for st in h["tp_styles"] for m, c in st.items()}
                mega = styles.get("q_proj") == "ColwiseParallel()" and styles.get("o_proj") == "RowwiseParallel()"
                assert mega or case["name"] != "llama", h
            elif world == 4:
                assert h["wrappers"] == ["DistributedDataParallel"], (case, h)
        if case["inside"] == "tp":  # some stage runs ParallelStyles (MPNet: the planner shards its head)
            assert any(st for h in held for st in h["tp_styles"]), case
        union = set().union(*(set(h["params"]) for h in held))  # every tensor on a stage (a tied one under two names)
        assert set(held[0]["unique_params"]) <= union <= set(held[0]["all_params"]), case
        if (
            case["inside"] == "fsdp"
        ):  # four interleaved stages of a 2-block model: one holds the embedding or the head only
            assert case["blockless"], case


def test_block_outputs_after_the_running_tensor():
    """GPT-Neo's blocks return (hidden, attention weights): the probe takes the running tensor first and lets the
    other stages' stand-ins return None for the rest (nothing outside the block reads them: check_plan refuses a
    plan whose graph does); a block returning an object (a cache the model keeps using) is refused, naming it."""
    import torch

    from autopar.backends.pipelining.forward_stage import probe

    model, args, kwargs = _model("gpt_neo")
    call = {k: v[:2] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    seen = probe(model, "transformer.h", [], call)
    assert seen["blocks"]["transformer.h.0"] == (tuple, (None,)), seen["blocks"]
    block = model.transformer.h[1]
    run = type(block).forward
    block.forward = lambda *a, **k: (run(block, *a, **k)[0], object())
    with pytest.raises(NotImplementedError, match=r"block 'transformer\.h\.1' returns tuple \(Tensor, object\)"):
        probe(model, "transformer.h", [], call)
    for name, prefix, want in [
        ("openai_gpt", "transformer.h", (list, ())),  # a list of one
        ("swinv2", "swinv2.encoder.layers", (tuple, (None, (16, 16, 8, 8)))),  # reshaped states, output dimensions
    ]:
        model, _, kwargs = _model(name)
        call = {k: v[:2] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        assert probe(model, prefix, [], call)["blocks"][f"{prefix}.0"] == want, name


def _pp_plan(name, **kw):
    import autopar

    model, args, kwargs = _model(name)
    call = dict(example_kwargs=kwargs) if kwargs else {}
    plan = autopar.plan(
        model, autopar.MeshSpec((2,), ("pp",)), args, cluster="h100", pipeline={"schedules": ["GPipe"]}, **call, **kw
    )
    return model, plan


def test_positional_chain_refuses_ops_between_its_modules():
    """A positional plan runs as a chain of the stages' modules: the mean pool of torch's TransformerEncoder
    classifier between the encoder and the head is an op of no module, which the chain would skip (its logits
    were [B, S, C] where one device's are [B, C]). Refused, naming the op and the module; torchtitan's Llama (a
    chain but for its loss) passes."""
    from autopar.backends.pipelining.forward_stage import check_chain

    with pytest.raises(NotImplementedError, match=r"op mean\.dim in module 'model' computes on the running tensor"):
        check_chain(_pp_plan("nn_transformer_encoder")[1])
    check_chain(_pp_plan("titan_llama3")[1])


def test_modules_whose_output_never_reaches_the_loss_stand_in():
    """FNetForMaskedLM runs its pooler though the masked-LM loss never reads it: no stage lists it, so every stage
    but the one holding its parameters runs a stand-in returning zeros (its weights would be meta tensors there)."""
    from autopar.backends.pipelining.forward_stage import unlisted

    model, plan = _pp_plan("fnet")
    assert unlisted(model, plan) == ["fnet.pooler"]
    assert not any(f.startswith("fnet.pooler") for st in plan.stages for f in st["modules"])


def test_stage_copies_of_parametrized_modules():
    """A stage's shallow copy of a weight-normed conv (Wav2Vec2's positional conv) shares its parametrization and
    weights (copy.copy raises on a parametrized module)."""
    import torch

    from autopar.backends.pipelining.forward_stage import _shallow

    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3))
    c = _shallow(conv)
    assert c.parametrizations is conv.parametrizations and torch.equal(c.weight, conv.weight)
    x = torch.randn(2, 4, 8)
    assert torch.equal(c(x), conv(x))


def test_a_block_run_twice_is_refused():
    """ALBERT runs its one shared layer group once per layer: a stage cannot hold a block that runs twice, so the
    probe of the first micro-batch refuses it, naming the block (no silent one-layer model)."""
    import torch

    from autopar.backends.pipelining.forward_stage import probe

    model, args, kwargs = _model("albert")
    prefix = "albert.encoder.albert_layer_groups"
    with pytest.raises(NotImplementedError, match=rf"block '{prefix}\.0' runs more than once"):
        probe(model, prefix, [], {k: v[:2] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


@pytest.mark.parametrize(
    "name, why",
    [
        ("deberta_v2", r"reads parameter 'deberta\.encoder\.rel_embeddings\.weight' of a module outside"),
        # its patch embeddings and its stacks of blocks alternate (the layer list found is the embeddings'): the
        # stage skeleton held the modules between as meta stand-ins, a meta-device error mid-step before
        ("poolformer", r"'poolformer\.encoder\.block\.0\.0\.before_norm' holds parameters and runs between the"),
    ],
)
def test_plans_carrying_more_than_the_running_tensor_are_refused(name, why):
    """What a stage boundary cannot carry: a parameter outside the blocks that every block reads (DeBERTa's raw
    relative position table), a module with parameters between two blocks (PoolFormer). Llama passes. (A block's
    second output, Mixtral's router logits or T5's position bias, is a side value: test_pipeline_side_values.py.)"""
    import autopar
    from autopar.backends.pipelining.forward_stage import check_plan

    def plan_of(model_name):
        model, args, kwargs = _model(model_name)
        return autopar.plan(
            model, autopar.MeshSpec((2,), ("pp",)), args, example_kwargs=kwargs, cluster="h100",
            pipeline={"schedules": ["GPipe"]},
        )  # fmt: skip

    with pytest.raises(NotImplementedError, match=why):
        check_plan(plan_of(name))
    if name == "poolformer":
        check_plan(plan_of("llama"))


def test_the_layer_list_is_a_list_of_blocks():
    """DPT's neck holds one conv per feature map (4) and Speech2Text a conv subsampler, each a longer list than
    the transformer stack (2 layers here): the stack of blocks is the layer list, not a list of single layers."""
    from autopar.passes.stage_costs import find_layers

    assert find_layers(_model("dpt")[0]) == "dpt.encoder.layer"
    assert find_layers(_model("speech2text")[0]) == "model.encoder.layers"


def test_a_forward_failing_on_the_sub_model_names_it():
    """Stage costing runs the model with some of its blocks; XLM's forward loops over its layer count across two
    parallel module lists (attentions, ffns), so with one of two attentions it raises IndexError. Said as a
    CaptureError naming the model, the block list and the cause, not a bare IndexError from transformers."""
    from autopar.capture_error import CaptureError

    with pytest.raises(
        CaptureError,
        match=r"XLMWithLMHeadModel with 1 of the 2 blocks of 'transformer\.attentions'.*IndexError.*parallel module lists",
    ):
        _pp_plan("xlm")


def test_batch_norm_over_micro_batches_is_refused():
    """ResNet's BatchNorms in training mode would normalize each micro-batch by its own statistics (one device uses
    the batch's): refused, naming the module, unless the stage sees the whole batch (one micro-batch, no dp)."""
    import autopar
    from autopar.backends.pipelining.batch_split import check_batch_norm

    model, args, kwargs = _model("resnet")
    mesh = autopar.MeshSpec((2,), ("pp",))
    plans = [
        autopar.plan(model, mesh, args, example_kwargs=kwargs, cluster="h100", pipeline={"schedules": ["GPipe"], **o})
        for o in ({}, {"n_microbatches": [1]})
    ]
    assert plans[0].schedule["n_microbatches"] > 1 and plans[1].schedule["n_microbatches"] == 1
    with pytest.raises(NotImplementedError, match=r"module 'resnet\.embedder\.embedder\.normalization' is a BatchNorm"):
        check_batch_norm(model, plans[0])
    check_batch_norm(model, plans[1])
    model.eval()  # running statistics: every micro-batch alike
    check_batch_norm(model, plans[0])


# ---- one rank (tests/_dist.py runs it) -------------------------------------------------------------------------
def _rank_cases(cases):
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import zoo
    from autopar import Plan
    from autopar.backends.pipelining.runtime import PipelineRunner, PipelineShapeError, local_batch

    res = []
    for case in cases:
        plan = Plan.load(case["path"])
        model, args, kwargs = _model(case["name"])
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_names))
        dp = mesh.get_local_rank("dp") if "dp" in plan.mesh_names else 0
        names = list(kwargs)
        local = dict(zip(names, local_batch(plan, tuple(kwargs[n] for n in names), dp)))
        runner = PipelineRunner(model, plan, mesh)
        loss = runner.step_model(*args, **local)
        zoo.loss_of(ref(*args, **kwargs)).backward()
        loss_ref = float(zoo.loss_of(ref(*args, **local)))
        grads, worst, params = dict(ref.named_parameters(remove_duplicate=False)), 0.0, []
        for n, p in runner.named_parameters():
            params.append(n)
            want = grads[n].grad
            if want is None:
                worst = max(worst, 0.0 if p.grad is None else 2.0)
                continue
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, float((got - want).abs().max()) / (TOL_ABS + TOL_REL * float(want.abs().max())))
        wide = lambda v: torch.cat([v, v], 1) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
        try:  # twice the sequence (or channels): refused on every rank, before any stage waits for activations
            runner.step_model(*args, **{n: wide(v) for n, v in local.items()})
            err = "no error"
        except PipelineShapeError as e:
            err = f"PipelineShapeError: {e}"
        res.append(
            {
                "loss": None if loss is None else float(loss),
                "loss_ref": loss_ref,
                "worst": worst,
                "params": params,
                "n_params": len(params),
                "all_params": [n for n, _ in ref.named_parameters(remove_duplicate=False)],
                "unique_params": [n for n, _ in ref.named_parameters()],
                "wrappers": runner.wrappers,
                "tp_styles": runner.tp_styles,
                "shape_error": err,
            }
        )
        dist.barrier()
    return {"rank": dist.get_rank(), "cases": res}
