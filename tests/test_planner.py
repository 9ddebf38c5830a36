"""Planning core: structure of the plans, memory budgets, GQA, determinism, dump/save/load, pass manager."""

import re

import pytest
import torch

import autopar
from autopar import models as M
from autopar.cost import get_cluster
from autopar.passmanager import VerificationError, verify
from autopar.strategies import _CACHE

MEGATRON = {
    "attention.wq": "S0",
    "attention.wk": "S0",
    "attention.wv": "S0",
    "attention.wo": "S1",
    "feed_forward.w1": "S0",
    "feed_forward.w3": "S0",
    "feed_forward.w2": "S1",
}


def _plan(name, mesh, batch=None, seq=None, dtype=torch.float32, **kw):
    over = {k: kw.pop(k) for k in list(kw) if k in ("n_layers",)}
    m = M.build_model(name, dtype=dtype, **over)
    x = M.example_inputs(name, batch=batch, seq=seq, device="meta", **over)
    return autopar.plan(m, mesh, x, **kw)


@pytest.fixture(scope="module")
def dp_plan():
    return _plan("llama3-debug", (8,), batch=32, seq=512, n_layers=2)


def test_1d_mesh_ample_memory_is_data_parallel(dp_plan):
    block = {k: v for k, v in dp_plan.params.items() if k.startswith("layers.")}
    assert block and all(pl == ["R"] for pl in block.values()), block
    grads = {n["target"]: n["redistribute"] for n in dp_plan.nodes if n["kind"] == "param"}
    synced = 0
    for fqn, reds in grads.items():
        opt = [r for r in reds if r["input"] == "opt"]
        kinds = [c[0] for c in opt[0]["collectives"]] if opt else []
        if fqn in block:
            assert kinds == ["all_reduce"], (fqn, reds)
        else:  # embedding/head may also store sharded: all_gather + reduce_scatter costs the same as all_reduce
            assert kinds in (["all_reduce"], ["reduce_scatter"]), (fqn, reds)
        synced += bool(kinds)
    assert synced == len(dp_plan.params)
    # the planner's DDP traffic is one all-reduce of every block gradient (seed formula 2M(P-1)/P per rank)
    ar = [c for c in dp_plan.collectives() if c[0] == "all_reduce"]
    block_bytes = sum(
        4 * n["shape"][0][0] * (n["shape"][0][1] if len(n["shape"][0]) > 1 else 1)
        for n in dp_plan.nodes
        if n["kind"] == "param" and n["target"] in block
    )
    assert sum(c[2] for c in ar) >= block_bytes


def test_memory_budget_below_replicated_footprint_shards_parameters():
    # the flat roofline: priced by their shapes, this model's 512-token GEMMs fill a few of 132 SMs whole or
    # split, so sharding saves no compute and the planner keeps a replicated plan that shards the embedding alone
    flat = get_cluster("h100").with_device(kernels="roofline")
    free = _plan("llama3-debug", (8,), batch=8, seq=64, n_layers=2, cluster=flat)
    assert all(v == ["R"] for k, v in free.params.items() if k.startswith("layers."))
    budget = 0.6 * free.predicted["peak_mem_bytes"]
    p = _plan("llama3-debug", (8,), batch=8, seq=64, n_layers=2, memory_budget=budget, cluster=flat)
    sharded = [k for k, v in p.params.items() if v != ["R"]]
    assert len(sharded) >= 3, "a budget below the replicated footprint must shard parameters"
    assert p.predicted["state_mem_bytes"] < free.predicted["state_mem_bytes"]
    assert p.predicted["peak_mem_bytes"] <= budget
    # some sharded storage is gathered before use (FSDP-like): a parameter-class all_gather
    gathers = [
        r
        for n in p.nodes
        for r in n["redistribute"]
        if r["class"] == "param" and any(c[0] == "all_gather" for c in r["collectives"])
    ]
    assert gathers


def test_budget_no_plan_can_meet_says_minimum():
    with pytest.raises(autopar.InfeasibleMemoryError, match=r"smallest achievable .* [0-9.]+ GB"):
        _plan("llama3-debug", (8,), batch=32, seq=512, n_layers=2, memory_budget=1e6)


@pytest.fixture(scope="module")
def llama8b_dp_tp():
    return _plan("llama3-8b", (8, 8), batch=8, seq=2048, dtype=torch.bfloat16, n_layers=2)


def test_8b_on_dp_tp_mesh_is_megatron_style(llama8b_dp_tp):
    for fqn, pl in llama8b_dp_tp.params.items():
        m = re.match(r"layers\.\d+\.(.*)\.weight", fqn)
        if m and m.group(1) in MEGATRON:
            assert pl[1] == MEGATRON[m.group(1)], (fqn, pl)
    assert "colwise on tp" in llama8b_dp_tp.summary() and "rowwise on tp" in llama8b_dp_tp.summary()


def test_gqa_never_shards_kv_heads_beyond_8():
    p = _plan("llama3-8b", (4, 16), batch=8, seq=1024, dtype=torch.bfloat16, n_layers=1)
    kv_nodes = 0
    for n in p.nodes:
        if n["kind"] != "op" or ".attention" not in n["module"]:
            continue
        for shape, pl in zip(n["shape"], n["placement"]["out"]):
            if shape is None or pl is None or len(shape) != 4:
                continue
            head_dim = next((d for d in (1, 2) if shape[d] == 8), None)  # (B,S,8,D) or (B,8,S,D)
            if head_dim is None:
                continue
            kv_nodes += 1
            shards = 1
            for p_, size in zip(pl, p.mesh_shape):
                if p_ == f"S{head_dim}":
                    shards *= size
            assert shards <= 8, (n["name"], shape, pl)
    assert kv_nodes > 0


def test_plan_is_deterministic_and_round_trips(tmp_path, dp_plan):
    _CACHE.clear()
    again = _plan("llama3-debug", (8,), batch=32, seq=512, n_layers=2)
    assert again.dump() == dp_plan.dump()  # byte for byte
    assert again.hash() == dp_plan.hash()
    path = tmp_path / "plan.json"
    dp_plan.save(path)
    back = autopar.Plan.load(path)
    assert back.dump() == dp_plan.dump()
    pp = back.param_placements()
    from torch.distributed.tensor import Replicate, Shard

    assert set(pp) == set(dp_plan.params)
    assert all(isinstance(x, (Replicate, Shard)) for v in pp.values() for x in v)
    assert all(isinstance(pp[k][0], Replicate) for k in pp if k.startswith("layers."))


def test_dump_has_a_placement_for_every_node(llama8b_dp_tp):
    d = llama8b_dp_tp.dump()
    node_lines = [line for line in d.splitlines() if re.match(r"^(%\d+:|param:|input:)", line)]
    assert len(node_lines) == len(llama8b_dp_tp.nodes)
    assert all(" out [" in line for line in node_lines)
    assert re.search(r"input \d+: \[.*\] -> \[.*\]  (all_gather|all_reduce|reduce_scatter|all_to_all)\(dim tp", d)
    p = llama8b_dp_tp.predicted
    assert p["step_s"] >= p["compute_s"] > 0 and p["peak_mem_bytes"] > p["state_mem_bytes"] > 0
    assert p["exposed_comm_s"] <= p["comm_s"] + 1e-12


def test_repeated_layers_share_decisions():
    a = _plan("llama3-debug", (2, 2), batch=8, seq=64, n_layers=2)
    b = _plan("llama3-debug", (2, 2), batch=8, seq=64, n_layers=6)
    assert a.regions[0]["layers"] == [0, 1] and b.regions[0]["layers"] == list(range(6))
    assert a.solver["n_vars"] == b.solver["n_vars"]
    # identical layers get identical placements
    for k in MEGATRON:
        pls = {tuple(v) for f, v in b.params.items() if f.endswith(k + ".weight")}
        assert len(pls) == 1


def test_one_layer_forced_differently_gets_its_own_decisions():
    """A force on one layer only must not be shared with (or dropped for) its sibling layers."""
    p = _plan("llama3-debug", (2, 2), batch=8, seq=64, n_layers=3, force={"layers.1.attention.wq.weight": ("S0", "R")})
    assert tuple(p.params["layers.1.attention.wq.weight"]) == ("S0", "R")
    assert [r["layers"] for r in p.regions] == [[0, 2]]
    assert tuple(p.params["layers.0.attention.wq.weight"]) == tuple(p.params["layers.2.attention.wq.weight"])


@pytest.mark.parametrize("name", ["mlp-tiny", "llama-tiny", "gpt2-tiny", "moe-tiny", "cnn-tiny"])
def test_one_device_mesh_plans_without_communication(name):
    p = autopar.plan(M.build_model(name), (1,), M.example_inputs(name, device="meta"), cluster="h100")
    assert p.coverage == {} and p.predicted["comm_s"] == 0.0 and p.collectives() == []


def test_pass_manager_times_verifies_and_dumps():
    m = M.build_model("mlp-tiny")
    p, st = autopar.plan(
        m,
        (2,),
        M.example_inputs("mlp-tiny", device="meta"),
        return_state=True,
        dump_after=("candidates", "solve"),
        force={"layers.0.fc1.weight": ("S0",)},
    )
    assert [k for k, _ in p.timings] == [
        "precision",
        "regions",
        "candidates",
        "costs",
        "checkpointing",
        "solve",
        "redistribute",
        "buckets",
    ]
    assert "cands=" in st.dumps["candidates"] and "out=" in st.dumps["solve"]
    bad = st.placement[5]
    st.placement[5] = None
    with pytest.raises(VerificationError, match="no single chosen placement"):
        verify(st, "solve")
    st.placement[5] = bad
    key = next(iter(st.redistributes))
    st.redistributes.pop(key)
    with pytest.raises(VerificationError, match="no redistribute is planned"):
        verify(st, "redistribute")


@pytest.mark.parametrize("name", ["mlp-tiny", "llama-tiny", "gpt2-tiny", "moe-tiny", "moe-alt-tiny", "cnn-tiny"])
def test_example_models_have_full_coverage(name):
    p = autopar.plan(M.build_model(name), (2, 2), M.example_inputs(name, device="meta"), cluster="cpu-gloo")
    assert p.coverage == {}
    assert all(n["source"] != "fallback" for n in p.nodes)


def test_plan_for_large_simulated_mesh_on_meta():
    p = _plan("llama3-70b", (32, 8), batch=32, seq=4096, dtype=torch.bfloat16, n_layers=2)
    assert p.mesh_shape == (32, 8)
    assert p.predicted["peak_mem_bytes"] <= 0.9 * 80e9


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_moe_aux_loss_reductions_take_one_all_reduce(mesh):
    """moe-debug (the benchmark's shape) under the calibrated cpu-gloo model: data parallel, with the exact router
    aux loss over the split batch. Every MoE layer's expert load and mean probability, and the loss's sum and count
    of targets, are all-reduced in ONE collective at the end of the forward (autopar/loss_tail.py), not one per
    layer, nor gathers of the router input: the step issues the gradient buckets and that one all_reduce."""
    m = M.build_model("moe-debug", device="meta")
    x = M.example_inputs("moe-debug", batch=4, seq=32, device="meta")
    plan = autopar.plan(m, mesh, x, cluster="cpu-gloo", overlap=False)
    assert set(plan.predicted["collectives"]) == {"all_reduce"}, plan.predicted["collectives"]
    fw = [
        (n["name"], r)
        for n in plan.nodes
        if n["phase"] == "fw"
        for r in n.get("redistribute", [])
        if r["class"] == "act" and (r["collectives"] or "coalesced" in r)
    ]
    leads = [(name, r) for name, r in fw if r["collectives"]]
    assert len(leads) == 1 and len(leads[0][1]["collectives"]) == 1, leads
    n_moe = sum(1 for k, _ in m.named_modules() if k.endswith(".moe"))
    others = {name for name, r in fw if isinstance(r.get("coalesced"), str)}
    assert len(others) >= n_moe and all(
        r["coalesced"] == f"{leads[0][0]}:{leads[0][1]['input']}" for _, r in fw if isinstance(r.get("coalesced"), str)
    )
    assert plan.predicted["collectives"]["all_reduce"]["count"] == len({b["chain"] for b in plan.buckets}) + 1
    line = f"(in {leads[0][0]}:{leads[0][1]['input']}'s all_reduce)"
    assert line in plan.dump() and ("dim dp+tp" in plan.dump()) == (len(mesh) == 2)
    # DDP / FSDP2 ranks would each compute their own shard's aux loss (not this model's): the lowering refuses,
    # naming the op, also where the reduction runs over the flattened dp+tp group
    from autopar.backends.torch.recognize import recognize

    low = recognize(plan, m)
    assert not low.expressible and any(
        part == f"op {leads[0][0]}" and "sums over the batch ranks" in why for part, why in low.reasons
    ), low.report()


def test_shared_moves_too_large_to_price_once_are_priced_per_consumer(monkeypatch):
    """A value whose consumers share one redistribute is priced once by dense charge matrices (producer choices x
    consumer choices x destinations); past SHARED_MAX_ELEMENTS (an MoE's dispatch on a 4-dim mesh took tens of GB)
    its consumers each pay their own move, the edges' price, and the plan names the values so priced. With the cap
    at 0 every shared value is so priced and the plan still comes out, predicted no faster than with the charges."""
    from autopar.passes import costs
    from autopar.testing import SHAPES

    m = M.build_model("llama-tiny", n_layers=1)
    x = M.example_inputs("llama-tiny", batch=4, seq=16)
    full = autopar.plan(m, (2, 2), x, cluster=SHAPES)
    assert "shared_moves_priced_per_consumer" not in full.meta
    monkeypatch.setattr(costs, "SHARED_MAX_ELEMENTS", 0)
    capped = autopar.plan(m, (2, 2), x, cluster=SHAPES)
    assert capped.meta["shared_moves_priced_per_consumer"], capped.meta.keys()
    assert capped.solver["objective"] >= full.solver["objective"] * (1 - 1e-9)
