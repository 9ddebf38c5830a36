"""SPMD execution (autopar.parallelize) under LocalTensorMode: every rank simulated in one process, real values.
Plans are made as `parallelize` makes them for this executor (overlap=False: its collectives block).

The property sweeps (200 examples per run) draw model families (MLP; Llama with GQA; GPT-2 with tied
embeddings; MoE with experts and top-k), random small and odd sizes, meshes (1-D of 2 and 4, 2-D 2x2) and plan
constraints (none, FSDP-like and Megatron-like `force=`, both, memory budgets). Every example trains 3 SGD steps next to the single-device model:
the loss of every step, every gradient of the first step and every parameter after the last step must agree
(fp32, rtol 1e-5, atol 1e-6), and the collectives the first step issues (kind, mesh dim, bytes) must equal the
plan's list. LocalTensorMode costs ~1-3 ms per view op on a sharded value, so examples are tiny and plans cached.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import autopar
from _simulated import simulated
from autopar.backends.counter import CollectiveCounter, compare
from autopar.backends.spmd.comm import redistribute_local
from autopar.backends.spmd.local_ops import attention_bw_math, attention_fw_math
from autopar.testing import fsdp_force, fsdp_tp_force, tp_force, train_and_compare
from autopar.graph import TensorMeta
from autopar.models import build_model, example_inputs
from autopar.collectives import collectives
from autopar.strategies._torch_adapter import per_rank, to_placement
from _clusters import SHAPES

lt = pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed.tensor import DTensor  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MESHES = [(2,), (4,), (2, 2)]


def _force(model, mesh_shape, constraint):
    if constraint == "fsdp":
        return fsdp_force(model, mesh_shape)
    if constraint == "tp":
        return tp_force(model, mesh_shape)
    if constraint == "fsdp+tp":
        return fsdp_tp_force(model, mesh_shape)
    return {}


_PLANS: dict = {}


def planned(name, overrides, batch, seq, mesh_shape, constraint, budget_frac=None):
    """(plan, state) for this model config, shapes, mesh and constraint; cached (weights do not matter)."""
    key = (name, tuple(sorted(overrides.items())), batch, seq, mesh_shape, constraint, budget_frac)
    if key not in _PLANS:
        model = build_model(name, **overrides)
        x = example_inputs(name, batch=batch, seq=seq, device="meta", **overrides)
        kw = dict(cluster="cpu-gloo", overlap=False, force=_force(model, mesh_shape, constraint), time_limit=5)
        if budget_frac is not None:
            free = autopar.plan(model, mesh_shape, x, cluster="cpu-gloo", overlap=False)
            kw["memory_budget"] = budget_frac * free.predicted["peak_mem_bytes"]
        _PLANS[key] = autopar.plan(model, mesh_shape, x, return_state=True, **kw)
    return _PLANS[key]


def run_example(name, overrides, batch, seq, mesh_shape, constraint, seed, lr, steps=3, budget_frac=None):
    model = build_model(name, device="cpu", seed=seed, **overrides)
    x = example_inputs(name, batch=batch, seq=seq, seed=seed + 1, **overrides)
    plan, state = planned(name, overrides, batch, seq, mesh_shape, constraint, budget_frac)
    ref = copy.deepcopy(model)
    with simulated(mesh_shape) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=steps, lr=lr)
    with contextlib.suppress(Exception):  # note() only works inside a Hypothesis test
        note(
            f"{name} {overrides} batch {batch} seq {seq} mesh {mesh_shape} {constraint}: {len(rep.measured)} "
            f"collectives, max abs {rep.max_abs:.2e}"
        )
    assert not rep.failures, "\n".join(rep.failures[:10])
    assert not rep.collective_diff, rep.collective_diff
    assert len(rep.measured) == len(plan.collectives())
    return rep, plan


@st.composite
def mesh_and_constraint(draw, meshes=tuple(MESHES)):
    mesh = draw(st.sampled_from(meshes))
    options = ["none", "fsdp", "tp"] + (["fsdp+tp"] if len(mesh) == 2 else [])
    return mesh, draw(st.sampled_from(options))


def sweep(n):
    # examples per run: each CI run draws others (no example database on a clean clone), so the counts are sized
    # to the suite's 20-minute budget rather than to cover everything in one run
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


# ---- property sweeps ---------------------------------------------------------------------------------------------


@sweep(70)
@given(
    dim=st.sampled_from([4, 6, 8]),
    hidden=st.sampled_from([6, 8, 10, 12]),
    layers=st.integers(1, 2),
    vocab=st.sampled_from([12, 16, 17]),
    batch=st.sampled_from([2, 3, 4]),
    seq=st.sampled_from([3, 4]),
    mc=mesh_and_constraint(),
    seed=st.integers(0, 10_000),
    lr=st.sampled_from([0.05, 0.5]),
)
def test_sweep_mlp(dim, hidden, layers, vocab, batch, seq, mc, seed, lr):
    run_example("mlp-tiny", dict(dim=dim, hidden=hidden, n_layers=layers, vocab=vocab), batch, seq, *mc, seed, lr)


@st.composite
def transformer(draw):
    family = draw(st.sampled_from(["llama-tiny", "gpt2-tiny", "moe-tiny"]))
    heads = draw(st.sampled_from([2, 4]))
    dim = heads * draw(st.sampled_from([2, 4]))
    vocab = draw(st.sampled_from([16, 17]))
    if family == "gpt2-tiny":
        return family, dict(dim=dim, n_layers=1, n_heads=heads, vocab_size=vocab, max_seq_len=8)
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))  # GQA: kv heads < heads
    if family == "llama-tiny":
        return family, dict(
            dim=dim,
            n_layers=1,
            n_heads=heads,
            n_kv_heads=kv,
            vocab_size=vocab,
            ffn_dim=draw(st.sampled_from([8, 10, 12])),
        )
    experts = draw(st.sampled_from([2, 3, 4]))
    return family, dict(
        dim=dim,
        n_layers=1,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=vocab,
        n_experts=experts,
        top_k=draw(st.integers(1, min(2, experts))),
        moe_hidden=draw(st.sampled_from([4, 6])),
        dense_ffn_dim=8,
    )


@sweep(30)
@given(
    cfg=transformer(),
    batch=st.sampled_from([2, 3]),
    seq=st.sampled_from([4, 5]),
    mc=mesh_and_constraint(meshes=((2,), (4,))),
    seed=st.integers(0, 10_000),
    lr=st.sampled_from([0.05, 0.5]),
)
def test_sweep_transformers(cfg, batch, seq, mc, seed, lr):
    """1-D meshes here (a 2x2 transformer example costs ~5x more under LocalTensorMode); the 2x2 mesh is swept with
    the MLP family and run with Llama / GPT-2 on real gloo ranks (test_execute_dist.py) and in the fixed cases."""
    run_example(*cfg, batch, seq, *mc, seed, lr)


BUDGETED = [
    ("mlp-tiny", dict(dim=8, hidden=16, n_layers=2, vocab=16), (2,), 0.5),
    ("mlp-tiny", dict(dim=8, hidden=16, n_layers=2, vocab=16), (4,), 0.5),
]


@sweep(12)
@given(which=st.sampled_from(range(len(BUDGETED))), seed=st.integers(0, 10_000), lr=st.sampled_from([0.05, 0.5]))
def test_sweep_memory_budget(which, seed, lr):
    name, ov, mesh, frac = BUDGETED[which]
    rep, plan = run_example(name, ov, 4, 4, mesh, "none", seed, lr, budget_frac=frac)
    assert any(pl != ["R"] for pl in plan.params.values()), "a budget below the replicated footprint must shard"


# ---- fixed cases ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_vocab_sharded_embedding_masked_partial(mesh_shape):
    """A vocab-sharded table the planner keeps sharded through the lookup: DTensor's masked partial (the indices
    outside a rank's rows are masked, the output is reduced by the plan's all_reduce / reduce_scatter)."""
    ov = dict(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=65536, ffn_dim=8)
    f = ("S0",) + ("R",) * (len(mesh_shape) - 1)
    key = ("llama-tiny", tuple(sorted(ov.items())), 2, 2, mesh_shape, "vocab", None)
    if key not in _PLANS:
        model = build_model("llama-tiny", **ov)
        x = example_inputs("llama-tiny", batch=2, seq=2, device="meta", **ov)
        force = {"tok_embeddings.weight": f, "output.weight": f}
        _PLANS[key] = autopar.plan(
            model, mesh_shape, x, cluster=SHAPES, overlap=False, force=force, return_state=True
        )  # cheap collectives: the table stays sharded
    plan, state = _PLANS[key]
    emb = next(n for n in plan.nodes if n["name"].endswith(":embedding.default"))
    assert emb["placement"]["out"][0][0] == "Pm", emb["placement"]
    model = build_model("llama-tiny", device="cpu", seed=3, **ov)
    x = example_inputs("llama-tiny", batch=2, seq=2, seed=4, **ov)
    ref = copy.deepcopy(model)
    with simulated(mesh_shape) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= {c[0] for c in rep.measured}


def test_consumers_of_one_value_share_its_redistribute():
    """Megatron TP with sequence-parallel norms: the normed activation, sequence-sharded, is gathered once for
    wq, wk and wv (and once for w1, w3), not once per projection. The plan lists the shared redistributes with no
    collectives of their own, the step issues exactly the plan's collectives, and it equals one device."""
    ov = dict(dim=8, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=16, ffn_dim=8)
    model = build_model("llama-tiny", device="cpu", seed=5, **ov)
    x = example_inputs("llama-tiny", batch=2, seq=4, seed=6, **ov)
    force = tp_force(model, (2,))
    pin = lambda n: (
        {0: "S1"}
        if n.module.endswith(("attention_norm", "ffn_norm"))
        and n.phase == "fw"
        and n.out is not None
        and len(n.out.shape) == 3
        else None
    )  # sequence-parallel norms, as torchtitan
    plan, state = autopar.plan(model, (2,), x, cluster=SHAPES, overlap=False, force=force, pin=pin, return_state=True)
    shared = [(nd["name"], r) for nd in plan.nodes for r in nd.get("redistribute", []) if "shares" in r]
    assert len(shared) >= 3, [nd["name"] for nd, _ in shared]
    assert all(r["collectives"] == [] for _, r in shared)
    assert "(shares %" in plan.dump()
    ref = copy.deepcopy(model)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)
    assert len(rep.measured) == len(plan.collectives())


def test_one_device_mesh_with_a_masked_partial():
    """A mesh of one device: the planner may label a lookup's output a masked partial of a Shard(0) table on the
    size-1 dim (every label costs the same there; pinned so the case stays exercised); DTensor's embedding then
    masks nothing (its mask buffer is never filled) and the step must equal the single-device one, with no
    collective."""
    ov = dict(dim=16, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=8, tie_embeddings=False)
    model = build_model("gpt2-small", device="cpu", seed=3, **ov)
    x = example_inputs("gpt2-small", batch=1, seq=8, seed=4, **ov)
    plan, state = autopar.plan(
        model,
        (1,),
        x,
        cluster="cpu-gloo",
        overlap=False,
        return_state=True,
        pin=lambda n: {0: "Pm"} if n.name.endswith(":embedding.default") else None,
    )
    assert any(n["placement"]["out"][0] == ["Pm"] for n in plan.nodes if n["name"].endswith(":embedding.default"))
    ref = copy.deepcopy(model)
    with simulated((1,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)
    assert rep.measured == [] and plan.collectives() == []


def test_parameters_keep_fqns_placements_and_tying():
    ov = dict(dim=8, n_layers=1, n_heads=2, vocab_size=16, max_seq_len=8)
    model = build_model("gpt2-tiny", device="cpu", seed=0, **ov)
    x = example_inputs("gpt2-tiny", batch=2, seq=4, **ov)
    plan, state = planned("gpt2-tiny", ov, 2, 4, (2, 2), "fsdp+tp")
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        assert pm.plan is plan
        assert [k for k, _ in pm.named_parameters()] == [k for k, _ in model.named_parameters()]
        assert set(pm.state_dict()) == set(model.state_dict())  # incl. the tied lm_head.weight key
        assert pm.lm_head.weight is pm.wte.weight  # tied parameters stay one parameter
        want = plan.param_placements()
        for k, p in pm.named_parameters():
            assert isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter)
            assert tuple(p.placements) == want[k], k
            full = p.full_tensor()
            assert torch.equal(
                lt.LocalTensor.reconcile(full) if isinstance(full, lt.LocalTensor) else full,
                dict(model.named_parameters())[k].detach(),
            )
        sharded = [k for k, p in pm.named_parameters() if any(not pl.is_replicate() for pl in p.placements)]
        assert len(sharded) >= 4, sharded
        # training the parallel module never writes into the original model
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loss = pm(*x)
        loss.backward()
        torch.optim.SGD(pm.parameters(), lr=1.0).step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_inputs_as_dtensors_give_the_same_step():
    ov = dict(dim=8, hidden=8, n_layers=1, vocab=16)
    model = build_model("mlp-tiny", device="cpu", seed=1, **ov)
    x = example_inputs("mlp-tiny", batch=4, seq=4, seed=2, **ov)
    plan, state = planned("mlp-tiny", ov, 4, 4, (2, 2), "fsdp+tp")
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        a = pm(*x)
        sharded = pm.shard_inputs(*x)
        assert all(isinstance(t, DTensor) for t in sharded)
        b = pm(*sharded)
        # a DTensor at other placements is redistributed to the plan's
        other = [DTensor.from_local(t, mesh, [to_placement("R")] * 2, run_check=False) for t in x]
        c = pm(*other)
    for v in (b, c):
        assert torch.equal(
            lt.LocalTensor.reconcile(v) if isinstance(v, lt.LocalTensor) else v,
            lt.LocalTensor.reconcile(a) if isinstance(a, lt.LocalTensor) else a,
        )


# ---- building blocks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_shape,placements", [((2, 2), ["R", "S0", "S1", "P"]), ((4,), ["R", "S0", "S1", "S2", "P", "Pa"])]
)
def test_redistribute_every_pair_equals_dtensor_and_plan(mesh_shape, placements):
    """Every (src, dst) pair: the local shards after `redistribute_local` are the DTensor layout of dst (checked
    through full_tensor), and the collectives run are the plan's (nested shards on 2x2 included)."""
    full = torch.randn(4, 8, 4)
    meta = TensorMeta(tuple(full.shape), full.dtype)
    nd = len(mesh_shape)
    checked = 0
    with simulated(mesh_shape) as mesh:
        base = per_rank(full)
        for src in itertools.product(placements, repeat=nd):
            x = redistribute_local(base, ("R",) * nd, src, mesh)  # local: chunk / zero / keep
            for dst in itertools.product(placements, repeat=nd):
                c = CollectiveCounter(mesh)
                with c:
                    y = redistribute_local(x, src, dst, mesh)
                sums = [to_placement("P" if p == "Pa" else p) for p in dst]
                got = DTensor.from_local(
                    y, mesh, sums, run_check=False, shape=full.shape, stride=full.stride()
                ).full_tensor()
                for m, p in enumerate(dst):
                    if p == "Pa":
                        got = got / mesh.size(m)
                got = lt.LocalTensor.reconcile(got) if isinstance(got, lt.LocalTensor) else got
                assert torch.allclose(got, full, atol=1e-6), (src, dst)
                plan_c = [(k.kind, k.mesh_dim, k.nbytes) for k in collectives(src, dst, meta, mesh_shape)]
                assert not compare(c.collectives(), plan_c), (src, dst, compare(c.collectives(), plan_c))
                checked += 1
    assert checked == len(placements) ** (2 * nd)


def test_all_to_all_is_a_real_all_to_all():
    with simulated((4,)) as mesh:
        x = DTensor.from_local(torch.arange(32.0).view(8, 4), mesh, [to_placement("R")], run_check=False)
        x0 = redistribute_local(x.to_local(), ("R",), ("S0",), mesh)
        c = CollectiveCounter(mesh)
        with c:
            y = redistribute_local(x0, ("S0",), ("S1",), mesh)
    assert c.collectives() == [("all_to_all", 0, 8 * 4 * 4)]
    assert all(torch.equal(t, torch.arange(32.0).view(8, 4)[:, r : r + 1]) for r, t in y._local_tensors.items())


def test_sharded_indices_into_a_masked_partial_are_gathered():
    """Indices sharded on the batch that a vocab-sharded embedding reads ("Pm": masked by DTensor's rule) come whole
    on every rank, with the all_gather the planner prices (autopar.collectives.collectives)."""
    from autopar.backends.spmd.comm import executed_placements

    ids = torch.arange(8).view(4, 2)
    with simulated((2,)) as mesh:
        x0 = redistribute_local(per_rank(ids), ("R",), ("S0",), mesh)
        c = CollectiveCounter(mesh)
        with c:
            y = redistribute_local(x0, ("S0",), ("Pm",), mesh)
    assert executed_placements(("S0",), ("Pm",)) == ("R",) and executed_placements(("R",), ("Pm",)) == ("R",)
    assert [r[:2] for r in c.collectives()] == [("all_gather", 0)]
    assert all(torch.equal(t, ids) for t in y._local_tensors.values())


def test_uneven_shard_is_a_clear_error():
    with simulated((4,)) as mesh:
        x = DTensor.from_local(torch.randn(6, 4), mesh, [to_placement("R")], run_check=False)
        with pytest.raises(ValueError, match="does not divide evenly"):
            redistribute_local(x.to_local(), ("R",), ("S0",), mesh)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_math_mapping_matches_cpu_kernel(causal):
    """The attention used where the captured CPU kernel does not exist (CUDA): same outputs and gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op.default(q, k, v, 0.0, causal)
    mout, mlse = attention_fw_math(q, k, v, 0.0, causal)
    torch.testing.assert_close(mout, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlse, lse, rtol=1e-5, atol=1e-6)
    go = torch.randn(2, 4, 5, 8, generator=g)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        go, q, k, v, out, lse, 0.0, causal
    )
    mgrads = attention_bw_math(go, q, k, v, mout, mlse, 0.0, causal)
    for a, b in zip(mgrads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_math_attention_path_runs_a_whole_step():
    ov = dict(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=8)
    model = build_model("llama-tiny", device="cpu", seed=5, **ov)
    x = example_inputs("llama-tiny", batch=2, seq=4, seed=6, **ov)
    plan, state = planned("llama-tiny", ov, 2, 4, (2,), "tp")
    ref = copy.deepcopy(model)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state), attention="math")
        rep = train_and_compare(pm, ref, x, steps=1)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)


class ScaledMLP(torch.nn.Module):
    """A model with a (read-only) buffer, to check buffers travel at their planned placement."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, tokens, labels):
        h = self.emb(tokens) * self.scale
        return torch.nn.functional.cross_entropy(self.fc(h).flatten(0, 1), labels.flatten())


def test_buffers_and_no_grad_calls():
    torch.manual_seed(0)
    model = ScaledMLP()
    x = example_inputs("mlp-tiny", batch=4, seq=4, dim=8, hidden=8, n_layers=1, vocab=16)
    ref = copy.deepcopy(model)
    plan, state = autopar.plan(
        model, (2,), x, cluster="cpu-gloo", overlap=False, force=fsdp_force(model, (2,)), return_state=True
    )
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        assert set(dict(pm.named_buffers())) == {"scale"}
        with torch.no_grad():
            a = pm(*x)  # no backward state kept
        assert a.grad_fn is None
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)


@pytest.mark.parametrize("constraint,kind", [("dp", "all_reduce"), ("fsdp", "reduce_scatter")])
def test_gradient_buckets_one_collective_each(constraint, kind, monkeypatch):
    """Data-parallel (all_reduce) and FSDP-like (reduce_scatter) gradient reductions ride in buckets: one
    collective per bucket of the summed bytes, issued as planned, with gradients equal to one device. A small
    bucket cap splits them into several buckets, in the backward's order."""
    monkeypatch.setattr("autopar.passes.buckets.BUCKET_BYTES", 600)  # the cap buckets are cut at (not priced)
    ov = dict(dim=8, hidden=12, n_layers=2, vocab=16)
    model = build_model("mlp-tiny", device="cpu", seed=3, **ov)
    x = example_inputs("mlp-tiny", batch=32, seq=16, seed=4, **ov)  # activations outweigh weights
    force = fsdp_force(model, (2,)) if constraint == "fsdp" else {k: ("R",) for k, _ in model.named_parameters()}
    # batch-sharded data and activations (a model this small would rather gather its 512 tokens once, fw and bw)
    pin = lambda n: (
        {0: "S0"}
        if n.kind == "input"
        or n.kind == "op"
        and n.phase == "fw"
        and n.outs
        and n.outs[0] is not None
        and len(n.outs[0].shape) == 3
        else None
    )  # noqa: E731
    plan, state = autopar.plan(model, (2,), x, cluster=SHAPES, overlap=False, force=force, return_state=True, pin=pin)
    grads = [b for b in plan.buckets if b["kind"] == kind]
    assert len(grads) >= 2 and all(b["bytes"] <= 600 or len(b["params"]) == 1 for b in grads)
    in_buckets = [f for b in plan.buckets for f in b["params"]]
    assert len(in_buckets) == len(set(in_buckets)) >= 4
    order = [state.graph.grads[f].node for f in in_buckets]
    assert order == sorted(order)  # the order the backward produces them
    sizes = {f: state.graph.meta(state.graph.grads[f]).nbytes for f in in_buckets}
    assert all(b["bytes"] == sum(sizes[f] for f in b["params"]) for b in plan.buckets)
    act = [
        c for c in plan.collectives()[: -len(plan.buckets)] if c[0] == kind
    ]  # activations' (the loss's (sum, count))
    assert all(c[2] < min(b["bytes"] for b in grads) for c in act)  # no gradient reduced outside its bucket
    ref = copy.deepcopy(model)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)
    assert sorted(c for c in rep.measured if c[0] == kind) == sorted([(kind, 0, b["bytes"]) for b in grads] + act)


@pytest.mark.parametrize("flatten", [False, True])
def test_data_parallel_on_a_2d_mesh_chains_or_flattens_bucket_all_reduces(flatten, monkeypatch):
    """Replicated parameters and a batch sharded over both mesh dims: each gradient is partial on both dims. Its
    bucket is either a chain, one all_reduce per mesh dim over the same gradients, reduced one after the other,
    or one all_reduce over the flattened group of both dims (which one: the cost model's choice, forced here
    both ways); the step issues exactly those and equals one device."""
    monkeypatch.setattr("autopar.passes.buckets.flatten_chain", lambda *a: flatten)
    ov = dict(dim=8, hidden=12, n_layers=2, vocab=16)
    model = build_model("mlp-tiny", device="cpu", seed=3, **ov)
    x = example_inputs("mlp-tiny", batch=32, seq=256, seed=4, **ov)
    force = {k: ("R", "R") for k, _ in model.named_parameters()}
    plan, state = autopar.plan(
        model,
        (2, 2),
        x,
        cluster=SHAPES,
        overlap=False,
        force=force,
        return_state=True,
        pin=lambda n: {0: "S0", 1: "S0"} if n.kind == "input" else None,
    )
    chains = {}
    for i, b in enumerate(plan.buckets):
        chains.setdefault(b["chain"], []).append((i, b))
    if flatten:
        assert all(len(bs) == 1 for bs in chains.values()), plan.buckets
        flat = [b for b in plan.buckets if isinstance(b["mesh_dim"], list)]
        assert flat and all(b["mesh_dim"] == [0, 1] and b["group"] == 4 for b in flat), plan.buckets
        assert sum(
            "+" in line.split(",")[0] for line in plan.dump().splitlines() if line.startswith("  bucket")
        ) == len(flat)
    else:
        assert any(len(bs) == 2 for bs in chains.values()), plan.buckets
        for bs in chains.values():
            assert [b["step"] for _, b in bs] == list(range(len(bs)))
            assert len({b["mesh_dim"] for _, b in bs}) == len(bs) and all(
                b["params"] == bs[0][1]["params"] for _, b in bs
            )
    assert all(b["kind"] == "all_reduce" and b["from"] == "P" and b["to"] == "R" for b in plan.buckets)
    ref = copy.deepcopy(model)
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)
    key = lambda m: tuple(m) if isinstance(m, list) else m
    # every bucket is issued as planned (the rest, e.g. the loss's (sum, count) all_reduce, is the plan's too: rep.ok)
    measured = Counter(c for c in rep.measured if c[0] == "all_reduce")
    assert not Counter(("all_reduce", key(b["mesh_dim"]), b["bytes"]) for b in plan.buckets) - measured, measured


def test_flattening_a_bucket_chain_follows_the_cost_model():
    """One all_reduce over the flattened group of two mesh dims beats a chain of one all_reduce per dim when its
    bandwidth saving and its one call instead of two outweigh its extra latency steps: on the calibrated gloo link
    for a large bucket and for a tiny one (a call's fixed cost dominates there); on a link with no per-call cost,
    not for a tiny one; with a fast intra-node dim (NVLink) and a slow inter-node dim, the chain's fast hop wins on ring links."""
    from autopar.cost import get_cluster
    from autopar.collectives import _chain_time, flatten_chain

    todo = ((0, "P", "R"), (1, "P", "R"))
    gloo = get_cluster("cpu-gloo")
    assert flatten_chain(todo, 25 * 2**20, (2, 2), gloo) and flatten_chain(todo, 8, (2, 2), gloo)
    assert not flatten_chain(todo, 8, (2, 2), SHAPES)
    chain, flat = _chain_time(todo, 25 * 2**20, (2, 2), gloo, 1.0)
    link = gloo.link_for((2, 2), 0)
    (alpha, bw), c = link.of("all_reduce"), link.launch_of("all_reduce")  # the calibrated link's all_reduce fit
    assert c > 0
    assert chain == pytest.approx(2 * (25 * 2**20 / bw + c + 2 * alpha))
    assert flat == pytest.approx(1.5 * 25 * 2**20 / bw + c + 6 * alpha)
    ring = get_cluster("h100-ring")  # the ring alpha-beta links: dp over IB, tp inside the node
    assert not flatten_chain(todo, 25 * 2**20, (16, 8), ring)
    # NCCL's model: the flattened group leaves each node through all 8 NICs where the dp hop rides one rail
    assert flatten_chain(todo, 25 * 2**20, (16, 8), get_cluster("h100"))
    assert not flatten_chain(((0, "P", "R"), (1, "Pa", "R")), 25 * 2**20, (2, 2), gloo)  # mixed: chain


@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
def test_batch_sharded_mean_loss_is_exact_with_unevenly_ignored_labels(mesh_shape):
    """A mean cross-entropy sharded on the batch: each shard's loss sum and count of counted targets are partial
    sums, each reduced by an all_reduce before their quotient (capture.py), so labels that `ignore_index` skips
    on one shard only still give the single device's loss and gradients. The per-shard means averaged (DTensor's
    Partial("avg"), DDP's reduction) would not: the test data is checked to tell the two apart."""
    ov = dict(dim=16, hidden=32, n_layers=1, vocab=64)
    model = build_model("mlp-tiny", device="cpu", seed=5, **ov)
    with torch.no_grad():  # larger weights: per-token losses far apart, so the two means differ
        for p in model.parameters():
            p.mul_(30)
    tokens, labels = example_inputs("mlp-tiny", batch=4, seq=8, seed=6, **ov)
    labels = labels.clone()
    labels[0, :7] = -100  # targets skipped on the first shard only
    x = (tokens, labels)
    with torch.no_grad():
        exact = model(tokens, labels)
        n = mesh_shape[0]
        averaged = sum(model(t, y) for t, y in zip(tokens.chunk(n), labels.chunk(n))) / n
    assert abs(averaged - exact) > 1e-3, (averaged, exact)
    pin = lambda node: (
        {0: "P"} if node.kind == "op" and node.target is torch.ops.aten.nll_loss_forward.default else None
    )
    plan, state = autopar.plan(
        build_model("mlp-tiny", **ov),
        mesh_shape,
        example_inputs("mlp-tiny", batch=4, seq=8, device="meta", **ov),
        cluster="cpu-gloo",
        overlap=False,
        pin=pin,
        return_state=True,
    )
    nll = next(n for n in plan.nodes if n["name"].endswith(":nll_loss_forward.default"))
    assert [tuple(p) for p in nll["placement"]["out"]] == [("P",), ("P",)], nll["placement"]
    assert tuple(nll["placement"]["ins"][0]) == ("S0",), nll["placement"]
    # the sum and the count in one all_reduce (coalesced), the backward reads the forward's reduced count (shared)
    assert plan.collectives() == [("all_reduce", 0, 8)], plan.collectives()
    div = next(n for n in plan.nodes if n["name"].endswith(":div.Tensor") and n["phase"] == "fw")
    assert [r.get("coalesced") for r in div["redistribute"]] == [None, 0], div["redistribute"]
    ref = copy.deepcopy(model)
    with simulated(mesh_shape) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)


@pytest.mark.parametrize("launch", [0.0, 1e-3])
def test_loss_reduce_on_a_2d_mesh_chains_or_flattens_by_the_cost_model(launch):
    """A loss sharded on the batch over both dims of a 2x2 mesh: its (sum, count) is partial on both. Without a
    per-collective cost the ring model prices one all_reduce per mesh dim (2 x 2 latency steps) below one over
    the flattened group of 4 (6 steps); with a millisecond per collective call, as gloo on an oversubscribed CPU
    measures, the flattened one is cheaper. The plan records that choice, the prediction prices it, and the step
    issues exactly it and equals one device."""
    from autopar.cost.cluster import ClusterSpec, LinkSpec
    from autopar.collectives import redistribute_time

    link = LinkSpec("loop", alpha=5e-5, bw=2e9, launch=launch)
    cluster = ClusterSpec("launch", SHAPES.device, 1 << 20, link, link)
    ov = dict(dim=16, hidden=32, n_layers=1, vocab=64)
    model = build_model("mlp-tiny", device="cpu", seed=5, **ov)
    x = example_inputs("mlp-tiny", batch=4, seq=8, seed=6, **ov)
    pin = lambda node: (
        {0: "P", 1: "P"} if node.kind == "op" and node.target is torch.ops.aten.nll_loss_forward.default else None
    )
    plan, state = autopar.plan(
        build_model("mlp-tiny", **ov),
        (2, 2),
        example_inputs("mlp-tiny", batch=4, seq=8, device="meta", **ov),
        cluster=cluster,
        overlap=False,
        pin=pin,
        return_state=True,
    )
    loss = [c for c in plan.collectives() if c[0] == "all_reduce" and c[2] == 8]
    chain = redistribute_time(("P", "P"), ("R", "R"), TensorMeta((2,), torch.float32), (2, 2), SHAPES)
    flat = redistribute_time(("P", "P"), ("R", "R"), TensorMeta((2,), torch.float32), (2, 2), cluster)
    if launch:
        assert loss == [("all_reduce", (0, 1), 8)], plan.collectives()
        assert flat == pytest.approx(launch + 6 * 5e-5 + 1.5 * 8 / 2e9)
    else:
        assert sorted(loss, key=repr) == [("all_reduce", 0, 8), ("all_reduce", 1, 8)], plan.collectives()
        assert flat == chain == pytest.approx(2 * (2 * 5e-5 + 8 / 2e9))
    ref = copy.deepcopy(model)
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        rep = train_and_compare(pm, ref, x, steps=3, lr=0.5)
    assert rep.ok, (rep.failures[:5], rep.collective_diff)


def test_op_bindings_compute_what_their_overloads_compute():
    """The compiled programs call an op's Python binding instead of its OpOverload where local_ops.binding lists
    one: on sample arguments of the kinds captured graphs hold (tensors, Python scalars, dim lists, keywords),
    each binding gives its overload's values, dtype, shape and strides (views: the same storage)."""
    from autopar.backends.spmd.local_ops import binding

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    b3, b3t = torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 5, generator=g)
    cases = {
        aten.view.default: [(x, [4, 3])],
        aten.expand.default: [(x[:, :1], [3, 4]), (x[:1], [3, 4], {"implicit": True})],
        aten.t.default: [(x,)],
        aten.permute.default: [(b3, [2, 0, 1])],
        aten.transpose.int: [(b3, 0, 2)],
        aten.unsqueeze.default: [(x, 1)],
        aten.squeeze.dim: [(x[:1], 0)],
        aten.detach.default: [(x,)],
        aten.mm.default: [(x, y.t())],
        aten.bmm.default: [(b3, b3t)],
        aten.mul.Tensor: [(x, y), (x, 2.5), (x.int(), 3)],
        aten.mul.Scalar: [(x, 0.5), (x.int(), 2)],
        aten.add.Tensor: [(x, y), (x, y, {"alpha": 2}), (x, 1)],
        aten.sub.Tensor: [(x, y), (x, 1.5)],
        aten.div.Tensor: [(x, y), (x, 3)],
        aten.div.Scalar: [(x, 4.0), (x.int(), 2)],
        aten.neg.default: [(x,)],
        aten.pow.Tensor_Scalar: [(x, 2), (x.abs(), 0.5)],
        aten.rsqrt.default: [(x.abs() + 1,)],
        aten.exp.default: [(x,)],
        aten.sum.dim_IntList: [(b3, [1]), (b3, [0, 2], True), (x, [1], False, {"dtype": torch.float64})],
        aten.sum.default: [(x,)],
        aten.mean.dim: [(b3, [-1], True)],
        aten.clone.default: [(x.t(),), (x.t(), {"memory_format": torch.contiguous_format})],
        aten.silu.default: [(x,)],
        aten._softmax.default: [(x, -1, False)],
        aten._softmax_backward_data.default: [(y, torch.softmax(x, -1), -1, torch.float32)],
    }
    from autopar.backends.spmd import local_ops

    binding(aten.mm.default)
    assert set(local_ops._BINDINGS) == set(cases)  # every listed binding is checked here
    for op, samples in cases.items():
        for args in samples:
            kwargs = args[-1] if isinstance(args[-1], dict) else {}
            args = args[:-1] if kwargs else args
            want, got = op(*args, **kwargs), binding(op)(*args, **kwargs)
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), (op, args)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=str(op))
            if op._schema.returns[0].alias_info is not None:  # a view: of the same storage
                assert got.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr(), op
