"""Cross-entropy on class-sharded logits (autopar/strategies/vocab_parallel.py, backends/spmd/vocab_loss.py): the
loss ops' class-sharded candidates, their row all_reduces priced and recorded, their temporaries in the memory
peak, and runs equal to one device (label smoothing and ignored targets on simulated ranks; llama-tiny on 4 gloo
ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost import collective_time
from autopar.collectives import link_of
from autopar.graph import TensorMeta
from autopar.strategies import Strategy, vocab_parallel
from autopar.testing import TP_FRIENDLY

VOCAB, DIM = 256, 32
LOSS_OPS = ("_log_softmax.default", "nll_loss_forward.default", "nll_loss_backward.default")


class TinyLM(nn.Module):
    """Embedding -> MLP -> head -> cross entropy, with label smoothing (the log-probs' gradient gets a second
    term before log_softmax's backward) and ignored targets."""

    def __init__(self, smoothing: float = 0.1, vocab: int = VOCAB):
        super().__init__()
        self.emb, self.up = nn.Embedding(vocab, DIM), nn.Linear(DIM, 4 * DIM)
        self.head, self.smoothing = nn.Linear(4 * DIM, vocab, bias=False), smoothing

    def forward(self, x, y):
        logits = self.head(F.gelu(self.up(self.emb(x))))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=self.smoothing, ignore_index=-100)


def _case(vocab: int = VOCAB, tokens=(4, 16)):
    torch.manual_seed(0)
    x, y = torch.randint(0, vocab, tokens), torch.randint(0, vocab, tokens)
    y[0, :5] = -100
    force = {"head.weight": ("R", "S0"), "up.weight": ("R", "S0"), "up.bias": ("R", "S0")}
    return TinyLM(vocab=vocab), (x, y), force


def _loss_nodes(plan) -> dict:
    return {n["target"]: n for n in plan.nodes if n["target"] in (*LOSS_OPS, "_log_softmax_backward_data.default")}


def test_loss_ops_offer_the_class_dim():
    m, x, force = _case()
    _, state = autopar.plan(m, (2, 2), x, cluster=TP_FRIENDLY, force=force, return_state=True)
    g = state.graph
    by_op = {str(n.target): state.strategies[n.idx] for n in g.nodes if n.kind == "op"}
    assert Strategy((("S1", "R"),), (("S1", "R"),)) in by_op["aten._log_softmax.default"]
    assert Strategy((("S0", "S1"),), (("S0", "S1"), ("S0", "S1"))) in by_op["aten._log_softmax_backward_data.default"]
    # the forward's loss a partial sum over the class-sharding dim, the count of targets whole there
    assert Strategy((("R", "P"), ("R", "R")), (("R", "S1"), ("R", "R"))) in by_op["aten.nll_loss_forward.default"]
    nll_bw = Strategy((("R", "S1"),), (("R", "R"), ("R", "S1"), ("R", "R"), ("R", "R")))
    assert nll_bw in by_op["aten.nll_loss_backward.default"]


def test_loss_ops_follow_the_log_probs():
    """nll_loss and both backward ops read the log-probs: they follow log_softmax's decision (passes/costs.py
    `_lead_input`), not one each (as decisions of their own they made an 8B plan's LP relaxation take a minute),
    and take the log-probs as log_softmax gives them, or the nearest placement they have: class-sharded here."""
    m, x, force = _case(vocab=VOCAB)
    plan, state = autopar.plan(m, (2, 2), x, cluster=TP_FRIENDLY, force=force, return_state=True)
    g = state.graph
    (lsm,) = [n.idx for n in g.nodes if n.kind == "op" and n.target is vocab_parallel.LOG_SOFTMAX]
    for op, pos in vocab_parallel.LOG_PROBS_INPUT.items():
        (i,) = [n.idx for n in g.nodes if n.kind == "op" and n.target is op]
        assert state.follow[i] == (lsm, 0, pos), (op, state.follow.get(i))
    loss = _loss_nodes(plan)
    log_probs = loss["_log_softmax.default"]["placement"]["out"][0]
    assert "S1" in log_probs, log_probs  # class-sharded
    assert loss["nll_loss_forward.default"]["placement"]["ins"][0] == log_probs
    # nll_loss's backward has no batch-sharded strategy here (a mean over the targets): class-sharded still
    assert loss["nll_loss_backward.default"]["placement"]["ins"][1][1] == "S1"
    assert loss["_log_softmax_backward_data.default"]["placement"]["ins"][1] == log_probs


def test_class_sharding_only_where_exact():
    class Node:  # what class_dim reads of a node
        def __init__(self, target, args, outs=()):
            self.target, self.args, self.kwargs, self.outs = target, args, {}, outs

    logits = TensorMeta((8, 16), torch.float32)
    ints = TensorMeta((8,), torch.int64)
    nll = vocab_parallel.NLL
    assert vocab_parallel.class_dim(Node(nll, (None, None, None, 2, -100)), [logits, ints]) == 1
    assert vocab_parallel.class_dim(Node(nll, (None, None, None, 1, -100)), [logits, ints]) is None  # a mean
    assert vocab_parallel.class_dim(Node(nll, (None, None, "w", 2, -100)), [logits, ints, logits]) is None  # weights
    assert vocab_parallel.class_dim(Node(vocab_parallel.LOG_SOFTMAX, (None, -1, False)), [logits]) == 1
    assert vocab_parallel.class_dim(Node(vocab_parallel.LOG_SOFTMAX, (None, 1, False)), [ints]) is None


def test_row_all_reduces_are_priced_and_recorded():
    m, x, force = _case()
    plan, state = autopar.plan(m, (2, 2), x, cluster=TP_FRIENDLY, force=force, return_state=True)
    nodes = _loss_nodes(plan)
    fw = nodes["_log_softmax.default"]
    assert fw["placement"]["ins"][0][1] == "S1", fw["placement"]  # the planner keeps the logits vocab-sharded
    rows = 64 // (2 if fw["placement"]["ins"][0][0] == "S0" else 1)
    assert fw["internal"] == [["all_reduce", 1, rows * 4, 2]] * 2  # the row max, then the row sum of exp
    assert nodes["_log_softmax_backward_data.default"]["internal"][0][:2] == ["all_reduce", 1]
    assert sum(1 for n in plan.nodes for _ in n.get("internal", [])) == 3
    assert sum(1 for x in plan.dump().splitlines() if x.startswith("    inside the op: all_reduce(dim")) == 2
    # the op's time holds its two all_reduces: the same op replicated (one device's kernel) costs less by them
    g = state.graph
    n = next(n for n in g.nodes if str(n.target) == "aten._log_softmax.default")
    t = state.cost["node_time"]
    sharded = t(n, Strategy(((fw["placement"]["out"][0][0], "S1"),), ((fw["placement"]["ins"][0][0], "S1"),)))
    batch = t(n, Strategy(((fw["placement"]["out"][0][0], "S0"),), ((fw["placement"]["ins"][0][0], "S0"),)))
    ar = collective_time("all_reduce", rows * 4, 2, link_of(TP_FRIENDLY, (2, 2), 1))
    assert sharded - batch == pytest.approx(2 * ar, rel=0.05), (sharded, batch, ar)


def test_temporaries_count_in_the_memory_peak(monkeypatch):
    x32, x16 = TensorMeta((64, 256), torch.float32), TensorMeta((64, 256), torch.bfloat16)

    class Node:
        target, args, kwargs, outs = vocab_parallel.LOG_SOFTMAX, (None, 1, False), {}, (x32,)

    s = Strategy((("S0", "S1"),), (("S0", "S1"),))
    local = 64 * 256 // 4
    assert vocab_parallel.workspace_bytes(Node, s, [x32], (2, 2)) == local * 4  # shifted beside its exp
    assert vocab_parallel.workspace_bytes(Node, s, [x16], (2, 2)) == local * 8  # + the fp32 copy
    assert vocab_parallel.workspace_bytes(Node, Strategy((("S0", "R"),), (("S0", "R"),)), [x32], (2, 2)) == 0
    # in a plan's liveness peak, where the loss's logits are the largest buffers (1K tokens, 128 hidden features)
    from autopar.liveness import liveness_peak

    m, xs, force = _case(vocab=2048, tokens=(16, 64))
    m.smoothing = 0.0  # (label smoothing's own backward buffers would set the peak)
    _, state = autopar.plan(m, (2, 2), xs, cluster=TP_FRIENDLY, force=force, return_state=True)
    with_ws = liveness_peak(state.graph, state.placement, (2, 2))
    monkeypatch.setattr(vocab_parallel, "workspace_bytes", lambda *a: 0.0)
    assert with_ws > liveness_peak(state.graph, state.placement, (2, 2))


def test_label_smoothing_and_ignored_targets_equal_one_device():
    from _simulated import simulated
    from autopar.testing import train_and_compare

    m, x, force = _case()
    with simulated((2, 2)) as mesh:
        pm = autopar.parallelize(m, mesh, x, cluster=TP_FRIENDLY, force=force)
        rep = train_and_compare(pm, copy.deepcopy(m), x, steps=2, lr=0.5, rtol=1e-5, atol=1e-6)
    assert not rep.failures, rep.failures
    assert not rep.collective_diff, rep.collective_diff
    nodes = _loss_nodes(pm.plan)
    assert all(nodes[k]["placement"]["ins"][j][1] == "S1" for k, j in zip(LOSS_OPS, (0, 0, 1))), nodes
    assert sum(1 for c in rep.measured if c[0] == "all_reduce" and c[1] == 1) >= 3, rep.measured


def job_vocab(tmp, device):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import build_model, example_inputs
    from autopar.testing import tp_force, train_and_compare

    ov = dict(n_layers=1, vocab_size=512)
    model = build_model("llama-tiny", device=device, seed=7, **ov)
    x = example_inputs("llama-tiny", batch=2, seq=32, seed=8, device=device, **ov)
    force = {**tp_force(model, (2, 2), 1), "output.weight": ("R", "S0")}
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(model, mesh, x, cluster=TP_FRIENDLY, force=force)
    rep = train_and_compare(pm, copy.deepcopy(model), x, steps=2, lr=0.5, rtol=1e-5, atol=1e-6)
    return {
        "failures": rep.failures[:5],
        "collective_diff": rep.collective_diff,
        "measured": [list(c) for c in rep.measured],
        "losses": rep.losses,
        "loss_ops": {k: v["placement"] for k, v in _loss_nodes(pm.plan).items()},
        "internal": [c for n in pm.plan.nodes for c in n.get("internal", [])],
        "hash": pm.plan.hash(),
    }


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_vocab_parallel_world4_gloo_equals_one_device(tmp_path):
    from _dist import launch_equal

    res = launch_equal(job_vocab, 4, [str(tmp_path), "cpu"], tmp_path, timeout=200)[0]
    ops = res["loss_ops"]
    assert ops["_log_softmax.default"]["ins"][0][1] == "S1", ops  # the logits stay vocab-sharded on tp
    assert ops["nll_loss_forward.default"]["out"][0][1] == "P", ops
    # the three row all_reduces (max, sum of exp; the gradient's row sum) ran on tp, as planned
    assert [c[:2] for c in res["internal"]] == [["all_reduce", 1]] * 3, res["internal"]
    assert all(c in res["measured"] for c in (c[:3] for c in res["internal"])), res["measured"]
