"""Recognition of plans as torch-engine constructs, the exported code, the planner's precision and checkpointing
decisions, and the bad-input errors: all without processes (backends/torch/, passes/precision.py,
passes/checkpointing.py). Execution on real gloo groups is tests/test_engines_dist.py."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import models as M
from autopar.capture import NLL_LOSSES
from autopar.backends.torch.recognize import EngineLoweringError, recognize
from autopar.backends.torch.collectives import engine_collectives
from _bench import batch_pin, torchtitan_placements, torchtitan_styles
from _clusters import GLOO_PER_STEP, SHAPES

B, S = 8, 64
# These tests check how plans are recognized and lowered, not cost constants: see tests/_clusters.py.
CLUSTER = SHAPES  # and overlap=False: every collective priced in full, as the TP engine runs them (no prefetch)


def _model(batch=B):
    return M.build_model("llama-tiny", device="meta"), M.example_inputs("llama-tiny", batch=batch, seq=S, device="meta")


# The calibrated cpu-gloo model computes a small batch of llama-tiny again on every rank rather than pay a gloo
# gradient reduction (milliseconds a call) for the compute it saves; a batch of 16 it splits over every rank of a
# 4-rank mesh, and 32 over both dims of 2x2 (below that it computes replicated on one dim): the plans these tests lower.
DP_BATCH = {1: 16, 2: 32}
GATHER_BATCH = {1: 16, 2: 16}  # the batches under which GLOO_PER_STEP's free plan gathers the loss input


def _fsdp(mesh=(2,), names=("dp",), **kw):
    m, x = _model()
    force = {k: ("S0",) for k, _ in m.named_parameters()}
    return autopar.plan(
        m,
        autopar.MeshSpec(mesh, names),
        x,
        cluster=CLUSTER,
        overlap=False,
        force=force,
        pin=batch_pin([0], (B, S)),
        **kw,
    ), m


def _tt(mesh, names):
    m, x = _model()
    force, pin = torchtitan_placements(
        m, names, "dp" if "dp" in names else None, "tp" if "tp" in names else None, (B, S)
    )
    return autopar.plan(m, autopar.MeshSpec(mesh, names), x, cluster=CLUSTER, overlap=False, force=force, pin=pin), m


@pytest.fixture(scope="module")
def fsdp():
    return _fsdp()


@pytest.fixture(scope="module")
def tp():
    return _tt((2,), ("tp",))


def test_fsdp_units_one_per_block_root_last(fsdp):
    plan, m = fsdp
    low = recognize(plan, m)
    assert low.expressible, low.report()
    assert low.shard_dims == [0] and low.tp_dim is None and not low.styles
    assert [u.fqn for u in low.units] == ["layers.0", "layers.1", ""]
    assert sorted(low.units[0].params) == sorted(k for k, _ in m.named_parameters() if k.startswith("layers.0."))
    # the plan gathers block parameters again in the backward -> reshard_after_forward=True
    bw_gathers = {
        r["param"]
        for n in plan.nodes
        if n["phase"] == "bw"
        for r in n.get("redistribute", [])
        if r["class"] == "param" and r["collectives"] and r["collectives"][0][0] == "all_gather"
    }
    for u in low.units:
        assert u.reshard_after_forward == any(p in bw_gathers for p in u.params), u


def test_fsdp_engine_collectives_regroup_the_plans_bytes(fsdp):
    """FSDP2 runs one all_gather / reduce_scatter per unit: the gradient bytes equal the plan's exactly; the
    gathers differ only by what FSDP2 gathers for a whole unit in the backward (the embedding) ."""
    plan, m = fsdp
    low = recognize(plan, m)
    exp, notes = engine_collectives(plan, low)
    assert low.mean_loss and exp.count(("all_reduce", 0, 8)) == 1  # the loss hook: (weighted loss, count)
    exp.remove(("all_reduce", 0, 8))
    kinds = {k for k, _, _ in exp}
    assert kinds == {"all_gather", "reduce_scatter"}
    n_units = len(low.units)
    assert sum(1 for k, _, _ in exp if k == "reduce_scatter") == n_units
    plan_rs = sum(
        c[2]
        for n in plan.nodes
        for r in n.get("redistribute", [])
        if r["input"] == "opt"
        for c in r["collectives"]
        if c[0] == "reduce_scatter"
    )
    assert sum(b for k, _, b in exp if k == "reduce_scatter") == plan_rs
    fw_ag = sum(
        c[2]
        for n in plan.nodes
        if n["phase"] == "fw"
        for r in n.get("redistribute", [])
        if r["class"] == "param"
        for c in r["collectives"]
        if c[0] == "all_gather"
    )
    total = sum(p.numel() * 4 for p in m.parameters())
    assert fw_ag == total  # the plan gathers every parameter once in the forward
    size = {n: p.numel() * 4 for n, p in m.named_parameters()}
    unit_bytes = {u.fqn: sum(size[f] for f in u.params) for u in low.units}
    assert sum(unit_bytes.values()) == total
    ag = sorted(b for k, _, b in exp if k == "all_gather")
    assert ag == sorted(unit_bytes[u.fqn] for u in low.units for _ in range(1 + u.reshard_after_forward))
    assert any("scalar" in n or "loss" in n for n in notes)


def test_tp_sp_plan_is_torchtitans(tp):
    """The pinned TP+SP plan lowers to exactly torchtitan's parallelize_llama styles (loss_parallel=False)."""
    plan, m = tp
    low = recognize(plan, m)
    assert low.expressible, low.report()
    from autopar.backends.torch.source import _fold

    ours = {k: v.code() for k, v in _fold(low.styles, low.block_fqns).items()}
    theirs = {k: v.replace(" ", "") for k, v in torchtitan_styles(loss_parallel=False).items()}
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for k in ours:
        assert ours[k].replace(" ", "").replace(",)", ")") == theirs[k].replace(",)", ")"), (k, ours[k], theirs[k])
    assert not low.loss_parallel and not low.units
    assert any("PrepareModuleInput" in n for n in low.notes)  # the plan's per-consumer gathers, deduplicated


def _loss_parallel_plan(smoothing=0.0):
    m, x = _model()
    if smoothing:  # the same model with label smoothing: its log-probs also feed a sum over the vocab
        m.forward = types.MethodType(
            lambda self, t, y: F.cross_entropy(
                self.logits(t).flatten(0, 1).float(), y.flatten(0, 1), label_smoothing=smoothing
            ),
            m,
        )
    force, pin = torchtitan_placements(m, ("tp",), None, "tp", (B, S), loss_parallel=True)
    return autopar.plan(m, autopar.MeshSpec((2,), ("tp",)), x, cluster=CLUSTER, overlap=False, force=force, pin=pin), m


def test_tp_sp_loss_parallel_plan_is_torchtitans():
    """torchtitan's default loss: the class-sharded cross entropy lowers to its output style and loss_parallel();
    the engines' collectives are torch's handlers' (three row all_reduces in the forward, none in the backward)."""
    plan, m = _loss_parallel_plan()
    low = recognize(plan, m)
    assert low.expressible and low.loss_parallel, low.report()
    from autopar.backends.torch.source import _fold

    ours = {k: v.code().replace(" ", "").replace(",)", ")") for k, v in _fold(low.styles, low.block_fqns).items()}
    theirs = {k: v.replace(" ", "").replace(",)", ")") for k, v in torchtitan_styles(loss_parallel=True).items()}
    assert ours == theirs, set(ours.items()) ^ set(theirs.items())
    exp, _ = engine_collectives(plan, low)
    rows = B * S * 4  # one fp32 value per token: the tokens are whole on tp around the loss
    assert sum(1 for c in exp if c == ("all_reduce", 0, rows)) == 3, exp


def test_loss_parallel_refuses_other_uses_of_the_log_probs():
    """torch's loss_parallel fuses nll_loss's backward with log_softmax's: label smoothing's second use of the
    log-probs would get a wrong gradient there, so that plan is not lowered (backend="auto" runs it on the graph
    backend, which computes each op exactly)."""
    plan, m = _loss_parallel_plan(smoothing=0.1)
    low = recognize(plan, m)
    assert not low.expressible and not low.loss_parallel
    assert "loss_parallel runs a plain cross_entropy only" in low.report(), low.report()


def test_tp_without_sequence_parallel_is_megatron():
    m, x = _model()
    force, pin = torchtitan_placements(m, ("tp",), None, "tp", (B, S), sequence_parallel=False)
    plan = autopar.plan(m, autopar.MeshSpec((2,), ("tp",)), x, cluster=CLUSTER, overlap=False, force=force, pin=pin)
    low = recognize(plan, m)
    assert low.expressible, low.report()
    from autopar.backends.torch.source import _fold

    st = {k: v.code() for k, v in _fold(low.styles, low.block_fqns).items()}
    assert st["layers.*.attention.wq"] == "ColwiseParallel()" and st["layers.*.feed_forward.w2"] == "RowwiseParallel()"
    assert st["tok_embeddings"] == "RowwiseParallel(input_layouts=Replicate())"
    assert not any("SequenceParallel" in v or "PrepareModuleInput" in v for v in st.values()), st
    exp, _ = engine_collectives(plan, low)
    # Megatron: forward, one all_reduce per rowwise output (2 per block) and the embedding's; backward, one per
    # colwise Linear fed the replicated activation (wq, wk, wv, w1, w3 per block, and the output projection);
    # plus the forward gather of the logits for the replicated loss
    ar = [b for k, _, b in exp if k == "all_reduce"]
    assert len(ar) == (2 * 2 + 1) + (5 * 2 + 1) and set(ar) == {B * S * 64 * 4}
    assert [k for k, _, _ in exp if k != "all_reduce"] == ["all_gather"]


def test_rendered_code_is_importable_and_complete(tp, tmp_path):
    from autopar.backends.torch import render

    plan, m = tp
    path = tmp_path / "tp_plan.py"
    path.write_text(render(plan, m))
    spec = importlib.util.spec_from_file_location("tp_plan", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    assert isinstance(mod.parallelize_plan["layers.*.attention.wq"], ColwiseParallel)
    assert isinstance(mod.parallelize_plan["layers.*.feed_forward.w2"], RowwiseParallel)
    assert isinstance(mod.parallelize_plan["layers.*.attention"], PrepareModuleInput)
    assert isinstance(mod.parallelize_plan["norm"], SequenceParallel)
    assert mod.fsdp_units == [] and callable(mod.apply) and mod.loss_parallel is False


def test_fsdp_x_tp_and_hsdp_are_recognized():
    plan, m = _tt((2, 2), ("dp", "tp"))
    low = recognize(plan, m)
    assert low.expressible, low.report()
    assert low.shard_dims == [0] and low.tp_dim == 1 and [u.fqn for u in low.units][-1] == ""
    assert 'mesh["tp"]' in low.code() and 'dp_mesh = mesh["dp"]' in low.code()
    m2, x = _model()
    hs = autopar.plan(
        m2,
        autopar.MeshSpec((2, 2), ("rep", "shard")),
        x,
        cluster=CLUSTER,
        overlap=False,
        force={k: ("R", "S0") for k, _ in m2.named_parameters()},
        pin=batch_pin([0, 1], (B, S)),
    )
    low2 = recognize(hs, m2)
    assert low2.expressible, low2.report()
    assert low2.replicate_dims == [0] and low2.shard_dims == [1]
    assert "mesh[('rep', 'shard')]" in low2.code()
    exp, _ = engine_collectives(hs, low2)
    assert sum(1 for k, d, _ in exp if k == "all_reduce" and d == 0) == len([u for u in low2.units if u.params])


def test_mixed_precision_is_a_planner_decision():
    m, x = _model()
    p = autopar.plan(m, (2,), x, cluster="h100", allow_bf16=True)
    d = p.meta["precision_decision"]
    assert d["chosen"].startswith("bf16") and set(d["candidates"]) == {"fp32", "bf16 params / fp32 reduce"}
    c = d["candidates"]
    assert c["bf16 params / fp32 reduce"]["step_s"] < c["fp32"]["step_s"]
    # (its peak need not be lower: with bf16 compute this tiny step is cheapest computed whole on both ranks, no
    # collective at all, where the fp32 plan splits the batch and holds half the activations)
    assert p.meta["mixed_precision"]["grad_casts"] == len(dict(m.named_parameters()))
    assert autopar.plan(m, (2,), x, cluster="h100").meta.get("mixed_precision") is None
    # the bf16 plan gathers bf16 parameters and reduce-scatters fp32 gradients
    fs, _ = _fsdp(allow_bf16=True)
    assert fs.meta["mixed_precision"]["param_dtype"] == "bfloat16"
    low = recognize(fs, m)
    assert low.mixed_precision == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in low.code()
    ag = [c for n in fs.nodes for r in n.get("redistribute", []) if r["class"] == "param" for c in r["collectives"]]
    rs = [c for n in fs.nodes for r in n.get("redistribute", []) if r["input"] == "opt" for c in r["collectives"]]
    total = sum(p.numel() for p in m.parameters())
    assert sum(c[2] for c in ag if c[0] == "all_gather") >= 2 * total and sum(c[2] for c in rs) == 4 * total


def test_checkpointing_when_memory_bound_and_charged():
    m, x = _model()
    mesh = autopar.MeshSpec((2,), ("dp",))
    free = autopar.plan(m, mesh, x, cluster=CLUSTER, overlap=False)
    assert free.meta["checkpointing"]["blocks"] == [] and "not memory-bound" in free.meta["checkpointing"]["why"]
    tight = autopar.plan(
        m, mesh, x, cluster=CLUSTER, overlap=False, memory_budget=0.6 * free.predicted["peak_mem_bytes"]
    )
    ck = tight.meta["checkpointing"]
    assert ck["blocks"] == ["layers.0", "layers.1"], ck
    assert tight.predicted["peak_mem_bytes"] <= 0.6 * free.predicted["peak_mem_bytes"]
    assert tight.predicted["recompute_s"] > 0
    fw = sum(n["time_s"] for n in tight.nodes if n["phase"] == "fw" and n["module"].startswith("layers."))
    assert tight.predicted["recompute_s"] == pytest.approx(fw, rel=1e-9)  # = the blocks' forward compute
    off = None
    with pytest.raises(autopar.InfeasibleMemoryError):
        off = autopar.plan(
            m,
            mesh,
            x,
            cluster=CLUSTER,
            overlap=False,
            memory_budget=0.6 * free.predicted["peak_mem_bytes"],
            allow_checkpointing=False,
        )
    assert off is None
    with pytest.raises(autopar.InfeasibleMemoryError, match="checkpointing of all 2 blocks"):
        autopar.plan(m, mesh, x, cluster=CLUSTER, overlap=False, memory_budget=0.2 * free.predicted["peak_mem_bytes"])
    low = recognize(tight, m)
    assert low.checkpoint == ["layers.0", "layers.1"] and "checkpoint_blocks = ['layers.0', 'layers.1']" in low.code()


# ---- bad input ------------------------------------------------------------------------------------------------


def test_forced_style_that_contradicts_the_plan(tp):
    plan, m = tp
    with pytest.raises(EngineLoweringError, match=r"RowwiseParallel forced on 'layers.0.attention.wq' contradicts"):
        recognize(plan, m, styles={"layers.*.attention.wq": "RowwiseParallel"})
    with pytest.raises(EngineLoweringError, match="gives that module no ParallelStyle"):
        recognize(plan, m, styles={"layers.0.feed_forward.w1.bias": "ColwiseParallel"})
    ok = recognize(plan, m, styles={"layers.*.attention.wq": "ColwiseParallel"})
    assert ok.expressible


def test_fsdp_unit_boundary_inside_a_repeated_block(fsdp):
    plan, m = fsdp
    with pytest.raises(EngineLoweringError, match="'layers.0.attention' lies inside the repeated block 'layers.0'"):
        recognize(plan, m, units=["layers.0.attention", "layers.1"])
    low = recognize(plan, m, units=["layers.0", "layers.1"])
    assert [u.fqn for u in low.units] == ["layers.0", "layers.1", ""]


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(h)))


class _LeakyModel(nn.Module):
    """The root reads layers[0].fc2.weight directly: a parameter used outside its module."""

    def __init__(self, d=32, vocab=64, n=2, share=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.out = nn.Linear(d, vocab)
        self.share = share
        if share:
            self.layers[1].fc1.weight = self.layers[0].fc1.weight

    def forward(self, x, y):
        h = self.embed(x)
        for blk in self.layers:
            h = blk(h)
        if not self.share:
            h = h + F.linear(F.gelu(h @ self.layers[0].fc1.weight.t()), self.layers[0].fc2.weight)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def _leaky_plan(share):
    with torch.device("meta"):
        m = _LeakyModel(share=share)
    x = (torch.empty(8, 16, dtype=torch.long, device="meta"), torch.empty(8, 16, dtype=torch.long, device="meta"))
    force = {k: ("S0",) for k, _ in m.named_parameters()}
    p = autopar.plan(m, (2,), x, cluster=CLUSTER, overlap=False, force=force, pin=batch_pin([0], (8, 16)))
    return p, m


def test_parameter_used_outside_its_module_is_a_reason():
    plan, m = _leaky_plan(share=False)
    assert recognize(plan, m).expressible  # no repeated blocks found: one root unit holds every parameter
    low = recognize(plan, m, units=["layers.0", "layers.1"])
    assert not low.expressible
    bad = [w for part, w in low.reasons if part == "parameter layers.0.fc2.weight"]
    assert bad and "outside its FSDP unit 'layers.0'" in bad[0] and "<root>" in bad[0], low.reasons
    assert "-> graph  parameter layers.0.fc2.weight" in low.report()
    with pytest.raises(EngineLoweringError, match="layers.0.fc2.weight"):
        from autopar.backends.torch import lower

        lower(m, plan, None, units=["layers.0", "layers.1"])


def test_parameter_shared_across_units_is_a_reason():
    plan, m = _leaky_plan(share=True)
    low = recognize(plan, m, units=["layers.0", "layers.1"])
    assert not low.expressible
    assert any(
        part == "parameter layers.1.fc1.weight" and "same tensor as layers.0.fc1.weight" in w for part, w in low.reasons
    ), low.reasons


# ---- replicated data parallelism, planned freely for the calibrated CPU cluster ---------------------------------


def _bucket_key(b):
    d = b["mesh_dim"]
    return (b["kind"], tuple(d) if isinstance(d, (list, tuple)) else d, b["bytes"])


def _check_replicated_dp(plan, m, n_shards):
    """Every parameter replicated and the batch split over every mesh dim: data parallelism over the whole mesh
    whose gradient hook reduces exactly the plan's buckets (and, in extra buckets, only the gradients the plan
    reduces otherwise)."""
    from collections import Counter

    low = recognize(plan, m)
    assert low.expressible, low.report()
    nd = len(plan.mesh_shape)
    assert low.replicate_dims == list(range(nd)) and not low.shard_dims and low.tp_dim is None and not low.units
    assert all(pl == ["S0"] * nd for pl in low.input_placements), low.input_placements
    assert low.batch_shards == n_shards and sorted(low.replicated_grads) == sorted(plan.params)
    in_plan = {f for b in plan.buckets for f in b["params"]}
    got = [f for b in low.grad_buckets for f in b.params]
    assert sorted(got) == sorted(plan.params)  # every gradient in exactly one bucket
    planned = [b for b in low.grad_buckets if b.planned is not None]
    assert sorted(f for b in planned for f in b.params) == sorted(in_plan)
    for b in planned:  # the plan's bucket: same gradients, same bytes
        chain = [c for c in plan.buckets if c["chain"] == b.planned]
        assert b.params == chain[0]["params"] and all(c["bytes"] == b.nbytes for c in chain)
        assert b.steps == [tuple(c["mesh_dim"]) if isinstance(c["mesh_dim"], list) else (c["mesh_dim"],) for c in chain]
    extra = [b for b in low.grad_buckets if b.planned is None]
    assert sorted(f for b in extra for f in b.params) == sorted(set(plan.params) - in_plan)
    assert all(b.steps == [tuple(range(nd))] for b in extra)
    exp, _ = engine_collectives(plan, low)
    data = 0 if nd == 1 else tuple(range(nd))
    assert Counter(exp) - Counter(_bucket_key(b) for b in plan.buckets) == Counter(
        [("all_reduce", data, b.nbytes) for b in extra] + [("all_reduce", data, 8)]
    )  # + the loss hook
    code = low.code()
    compile(code, "<lowering>", "exec")
    assert "reduce_grads_in_buckets(model, mesh, grad_buckets, batch_shards)" in code
    assert f"batch_shards = {n_shards}" in code
    whole = any(
        n["name"].endswith(":nll_loss_forward.default") and "R" in n["placement"]["ins"][0] for n in plan.nodes
    )  # the plan gathers the log-probs for its loss
    assert whole == any("runs the loss" in n for n in low.notes), low.notes
    return low


@pytest.mark.parametrize("mesh,names", [((4,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_free_cpu_plan_is_replicated_data_parallel_in_the_plans_buckets(mesh, names):
    """llama-tiny (batch 16 / 32, seq 64: DP_BATCH) planned for "cpu-gloo": every parameter replicated and the batch
    split over every mesh dim (plain data parallelism over the whole mesh); the labels are fed batch-sharded like
    the tokens and each rank weighs its own shard's loss; the gradients go in the plan's buckets (on 2x2 one bucket
    over the flattened dp+tp group)."""
    m, x = _model(DP_BATCH[len(mesh)])
    plan = autopar.plan(m, autopar.MeshSpec(mesh, names), x, cluster="cpu-gloo")
    low = _check_replicated_dp(plan, m, 4)
    assert all(b.planned is not None for b in low.grad_buckets)  # the plan reduces every gradient in a bucket


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_harness_llama3_debug_plans_lower(mesh):
    """The benchmark's llama3-debug configuration (benchmarks/bench_config.py) on both measured meshes."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_config import MEASURED

    cfg = MEASURED["llama3-debug"]
    shape = tuple(int(v) for v in mesh.split("x"))
    m = M.build_model(cfg["name"], device="meta", seed=0, **cfg["overrides"])
    x = M.example_inputs(cfg["name"], batch=cfg["batch"], seq=cfg["seq"], device="meta", **cfg["overrides"])
    plan = autopar.plan(m, autopar.MeshSpec(shape, ("dp",) if len(shape) == 1 else ("dp", "tp")), x, cluster="cpu-gloo")
    _check_replicated_dp(plan, m, 4)


def _weighted_loss_plan(weighted):
    class Weighted(nn.Module):
        def __init__(self, d=64, vocab=128):
            super().__init__()
            self.embed, self.fc, self.out = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)
            self.register_buffer("w", torch.linspace(0.5, 1.5, vocab))

        def forward(self, x, y):
            logits = self.out(F.gelu(self.fc(self.embed(x)))).flatten(0, 1)
            return F.cross_entropy(logits, y.flatten(), weight=self.w if weighted else None)

    with torch.device("meta"):
        m = Weighted()
    x = tuple(torch.empty(8, 64, dtype=torch.long, device="meta") for _ in range(2))

    def pin(n):  # the batch split over the ranks up to the loss, which runs on the whole batch (inputs gathered)
        if n.target in NLL_LOSSES:
            return {0: "R"}
        out = n.outs[0] if n.outs else None
        batched = n.kind == "op" and n.phase == "fw" and out is not None and out.shape and out.shape[0] in (8, 8 * 64)
        return {0: "S0"} if n.kind == "input" or batched else None

    return autopar.plan(m, autopar.MeshSpec((4,), ("dp",)), x, cluster=CLUSTER, overlap=False, pin=pin), m


def test_loss_on_the_whole_batch_lowers_only_as_an_unweighted_mean_over_equal_shards():
    """A plan that runs the loss replicated (labels and log-softmax gathered: pinned). A class-weighted mean over
    each rank's shard, averaged, is not the batch's weighted mean: a reason, naming the op (before, a gathered
    loss input was taken for the same values). Unequal batch shards are a reason too (the planner does not shard
    an uneven batch: the plan's mesh is edited to check the lowering)."""
    import copy

    plan, m = _weighted_loss_plan(weighted=False)
    loss = next(n for n in plan.nodes if n["name"].endswith("nll_loss_forward.default"))
    assert loss["placement"]["ins"][1] == ["R"]  # the loss runs on the whole batch
    low = recognize(plan, m)
    assert low.expressible and low.replicate_dims == [0], low.report()
    assert low.input_placements == [["S0"], ["S0"]] and any("gathers the loss input 0" in n for n in low.notes)
    wplan, wm = _weighted_loss_plan(weighted=True)
    wl = next(n for n in wplan.nodes if n["name"].endswith("nll_loss_forward.default"))
    assert len(wl["inputs"]) == 3 and wl["placement"]["ins"][1] == ["R"]
    bad = recognize(wplan, wm)
    assert [part for part, _ in bad.reasons] == [f"op {wl['name']}"], bad.reasons
    assert "class-weighted loss" in bad.reasons[0][1]
    uneven = copy.deepcopy(plan)
    uneven.mesh_shape = (3,)  # the batch of 8 on 3 ranks
    low = recognize(uneven, m)
    assert {part for part, _ in low.reasons} == {"input input:0", "input input:1"}, low.reasons
    assert "does not split into 3 equal shards" in low.reasons[0][1]


@pytest.mark.parametrize("mesh,names", [((4,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_torch_target_plan_predicts_the_engines_collectives(mesh, names):
    """Under a cost model with no per-call cost (GLOO_PER_STEP: the cpu-gloo preset before sub-group calibration)
    the free plan of llama-tiny gathers the log-softmax over the data dims and runs the loss on the whole batch,
    which the engines cannot (each rank computes its shard's loss): target="torch" plans again with
    the loss and the parameter gradients pinned partial on the data dims, and the re-solved plan predicts what the
    engines issue: no gather, the gradients in the plan's buckets, the loss's sum and count in one all_reduce on a
    1-D mesh (the loss hook's (weighted loss, count)); on 2x2 the plan reduces them per mesh dim (a few bytes
    more than the hook's one all_reduce over the flattened group; batch 16 there: GATHER_BATCH)."""
    from collections import Counter

    m, x = _model(GATHER_BATCH[len(mesh)])
    spec = autopar.MeshSpec(mesh, names)
    free = autopar.plan(m, spec, x, cluster=GLOO_PER_STEP)
    assert "all_gather" in free.predicted["collectives"]  # the loss input, gathered
    plan = autopar.plan(m, spec, x, cluster=GLOO_PER_STEP, target="torch")
    note = plan.meta.get("engine_replan")
    assert note and note.startswith("re-planned for the engines") and "nll_loss_forward" in note, note
    assert plan.meta["target"] == "torch"
    nll = next(n for n in plan.nodes if n["name"].endswith(":nll_loss_forward.default"))
    assert all(p == "P" for o in nll["placement"]["out"] for p in o), nll["placement"]
    low = recognize(plan, m)
    assert low.expressible and low.mean_loss and all(b.planned is not None for b in low.grad_buckets), low.report()
    engines = Counter()
    for kind, _, nb in engine_collectives(plan, low)[0]:
        engines[kind] += nb
    predicted = {k: v["bytes"] for k, v in plan.predicted["collectives"].items()}
    assert set(predicted) == set(engines) == {"all_reduce"}, (predicted, engines)
    if len(mesh) == 1:
        assert (
            predicted == dict(engines) and plan.predicted["collectives"]["all_reduce"]["count"] == len(plan.buckets) + 1
        ), (predicted, engines)
    else:
        assert 0 < predicted["all_reduce"] - engines["all_reduce"] <= 16, (predicted, engines)
    assert plan.predicted["step_s"] >= free.predicted["step_s"]  # the free plan is the optimum


@pytest.mark.parametrize("mesh", [(4,), (2,)])
def test_engine_step_time_equals_the_plans_prediction(mesh):
    """backend="auto" weighs a split between the engines and graph parts by engine_step_time (the plan's compute +
    the engines' collectives, each priced on its link). Where the engines run a plan exactly as planned (data
    parallel: the same collectives), that estimate and the planner's own prediction (its redistribute and bucket
    passes) are two computations of one step and must agree."""
    from autopar.backends.torch.collectives import engine_step_time
    from collections import Counter

    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=8, seq=16, device="meta")
    force = {k: ("R",) * len(mesh) for k, _ in m.named_parameters()}

    def pin(n):  # batch-sharded inputs, the loss on the shards (as the engines compute it)
        return (
            {d: ("S0" if n.kind == "input" else "P") for d in range(len(mesh))}
            if n.kind == "input" or n.target in NLL_LOSSES
            else None
        )

    plan = autopar.plan(m, mesh, x, cluster="cpu-gloo", force=force, pin=pin)
    low = recognize(plan, m)
    assert low.expressible, low.report()
    mine, _ = engine_collectives(plan, low)
    assert Counter(c[0] for c in mine)["all_reduce"] >= 2  # the gradient bucket(s) and the loss's reduction
    assert Counter(mine) == Counter(plan.collectives())  # (on 2x2 the engines reduce over the flattened
    # group where the plan chains the two dims)
    t = engine_step_time(plan, low, "cpu-gloo")
    assert abs(t - plan.predicted["step_s"]) <= 1e-6 * plan.predicted["step_s"], (
        t,
        plan.predicted,
        mine,
        plan.collectives(),
    )
