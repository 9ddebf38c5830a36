"""Dims named dp* on a mesh of 3+ dims are data parallel in a per-op plan (autopar/strategies/data_parallel.py):
activations stay split by the batch there, parameters are free (FSDP, DDP, a mix), the other dims the solver's."""

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.testing import TP_FRIENDLY


def _meta_llama():
    m = models.build_model("llama-tiny", device="meta", n_layers=2)
    return m, models.example_inputs("llama-tiny", batch=4, seq=16, device="meta", n_layers=2)


def _fw_matmuls(plan):
    return [n for n in plan.nodes if n["kind"] == "op" and n["phase"] == "fw" and n["name"].endswith(":mm.default")]


@pytest.mark.parametrize("names", [("dp", "cp", "tp"), ("dp_replicate", "dp_shard", "tp")])
def test_dp_dims_of_a_3d_mesh_keep_activations_batch_split(names):
    """llama-tiny on 2 x 2 x 2: a free choice on every dim was a 1.1M-column LP (~100 s); with the dp* dims data
    parallel every forward matmul reads its activation batch-split there and the LP is a few percent of that. The
    tokens are split on dim 0 over each dp* dim, gradients reduced there; the last dim is the solver's."""
    m, x = _meta_llama()
    plan = autopar.plan(m, autopar.MeshSpec((2, 2, 2), names), x, cluster=TP_FRIENDLY)
    data = [d for d, nm in enumerate(names) if nm.startswith("dp")]
    assert plan.solver["n_vars"] < 100_000, plan.solver
    tokens = [n for n in plan.nodes if n["kind"] == "input"]
    assert all(n["placement"]["out"][0][d] == "S0" for n in tokens for d in data)
    mms = _fw_matmuls(plan)
    assert mms and all(
        n["placement"]["ins"][0][d] in ("S0", "S1") and n["placement"]["out"][0][d] == "S0" for n in mms for d in data
    ), [(n["name"], n["placement"]) for n in mms]
    assert any(pl[2] != "R" for pl in plan.params.values()), "tp: something sharded on the free dim"
    grads = [n for n in plan.nodes if n["phase"] == "bw" and n["name"].endswith(":mm.default")]
    assert any(all(n["placement"]["out"][0][d] == "P" for d in data) for n in grads)  # weight gradients: partial
    assert any(c[0] in ("all_reduce", "reduce_scatter") and c[1] in data for c in plan.collectives())


def test_a_pin_on_a_dp_dim_takes_it_over():
    """A user pin that places anything on a dp* dim leaves that dim to the solver (every placement on it)."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, loss = torch.randn(8, 8), lambda y: y.sum()
    mesh = autopar.MeshSpec((2, 2, 2), ("dp", "dp2", "tp"))
    _, state = autopar.plan(net, mesh, (x,), loss_fn=loss, return_state=True)
    pinned = lambda n: {0: "R"} if n.kind == "input" else None  # noqa: E731
    _, free = autopar.plan(net, mesh, (x,), loss_fn=loss, pin=pinned, return_state=True)
    ops = [n.idx for n in state.graph.nodes if n.kind == "op" and n.phase == "fw"]
    ours = sum(len(state.strategies[i]) for i in ops)
    theirs = sum(len(free.strategies[i]) for i in ops)
    assert ours < theirs, (ours, theirs)
    x_in = next(n for n in free.graph.nodes if n.kind == "input")
    assert {s.out[0][0] for s in free.strategies[x_in.idx]} == {"R"}
    assert {s.out[0][1] for s in free.strategies[x_in.idx]} == {"S0"}  # dp2 still data parallel


def test_a_batch_that_does_not_divide_over_the_dp_dims_is_refused():
    m = models.build_model("llama-tiny", device="meta", n_layers=1)
    x = models.example_inputs("llama-tiny", batch=2, seq=16, device="meta", n_layers=1)
    with pytest.raises(ValueError, match=r"batch 2 does not divide over the data-parallel mesh dims .*dp.*dp2"):
        autopar.plan(m, autopar.MeshSpec((2, 2, 2), ("dp", "dp2", "tp")), x)


def test_an_infeasible_plan_over_dp_dims_says_how_it_searched():
    m, x = _meta_llama()
    with pytest.raises(autopar.InfeasibleMemoryError, match=r"dp, dp2 as data parallel"):
        autopar.plan(m, autopar.MeshSpec((2, 2, 2), ("dp", "dp2", "tp")), x, memory_budget=5e5)


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_3d_mesh_with_dp_cp_tp_on_third_party_models_equals_one_device(tmp_path):
    """transformers' Llama and GPT-2 on (dp, cp, tp) = 2 x 2 x 2, 8 gloo ranks, no pin: the tokens split by batch on
    dp and by sequence on cp, something sharded on tp, 3 AdamW steps equal to one device, the first step's
    collectives as planned."""
    from _dist import launch_equal
    from test_cp import job_hf_cp

    names = ["llama", "gpt2"]
    args = [str(tmp_path), names, [2, 2, 2], ["dp", "cp", "tp"], ":TP_FRIENDLY"]
    res = launch_equal(job_hf_cp, 8, args, tmp_path, timeout=350)[0]
    for name in names:
        r = res["models"][name]
        assert r["inputs"] and all(pl[:2] == ["S0", "S1"] for pl in r["inputs"]), (name, r["inputs"])
        assert any(pl[2] != "R" for pl in r["params"].values()), (name, r["params"])
        dims = {d for c in r["measured"] for d in (c[1] if isinstance(c[1], list) else [c[1]])}
        assert {0, 1, 2} <= dims, (name, r["measured"])


def test_batch_norm_statistics_are_reduced_over_the_dp_dims():
    """BatchNorm in training reads its batch mean as a partial sum over the dp dims; no strategy reads it partial, so
    the plan reduces it there (synchronized statistics, equal to one device) and the activations stay batch splits:
    the LP stays small."""
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10)
    )
    x, loss = torch.randn(8, 3, 8, 8), lambda y: y.square().mean()
    plan = autopar.plan(net, autopar.MeshSpec((2, 2, 2), ("dp", "dp2", "tp")), (x,), loss_fn=loss, cluster=TP_FRIENDLY)
    assert plan.solver["n_vars"] < 20_000, plan.solver
    conv = next(n for n in plan.nodes if n["phase"] == "fw" and "convolution" in n["name"])
    assert conv["placement"]["out"][0][:2] == ["S0", "S0"], conv["placement"]
    fw = [c for n in plan.nodes if n["phase"] == "fw" for r in n.get("redistribute", []) for c in r["collectives"]]
    assert any(c[0] == "all_reduce" for c in fw), fw  # the statistics, reduced in the forward


class _RNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(32, 16), nn.LSTM(16, 16, batch_first=True), nn.Linear(16, 32)

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])


def test_an_lstm_keeps_its_per_step_outputs_batch_split():
    """nn.LSTM's steps are stacked (aten.stack): autopar's stack rule keeps the per-step outputs' batch split on the dp
    dims (DTensor's, given several candidates, offered none), so the restriction reaches the head."""
    x = torch.randint(0, 32, (8, 6))
    plan = autopar.plan(_RNN(), autopar.MeshSpec((2, 2, 2), ("dp", "dp2", "tp")), (x,), loss_fn=lambda y: y.mean())
    stacks = [n for n in plan.nodes if n["phase"] == "fw" and n["name"].endswith(":stack.default")]
    assert stacks and all(n["placement"]["out"][0][:2] == ["S1", "S1"] for n in stacks), stacks
    assert plan.solver["n_vars"] < 50_000, plan.solver
