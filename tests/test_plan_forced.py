"""Plans with every parameter forced to FSDP-like placements (`force=`), the benchmark's "fsdp2" hand plan.

Regression: planning GPT-2 with every parameter Shard(0) failed with VerificationError "node %213:view.default has
no single chosen placement". Repeated layers share one decision per region (the solver picks an index into the
representative layer's candidate list and passes/solve.py `expand_choice` applies it to every copy), but each copy used
to enumerate its own candidates, and a copy's boundary inputs come from other producers: the last block's backward
starts from the final LayerNorm's backward (candidates R, S0, S1 of the (B, S, D) gradient), the other blocks' from
a residual add (also S2 and partials). DTensor's full-mesh view strategy follows its input's candidates, so the
view in the last block's mlp.c_proj backward lacked S2 -> S1 (and P), which the representative could choose.
The candidates pass now gives every copy its region's list, and `verify` checks that invariant after candidates.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

import autopar
from _clusters import SHAPES
from _simulated import simulated
from autopar.testing import fsdp_force, train_and_compare
from autopar.models import build_model, example_inputs
from autopar.passmanager import VerificationError, verify

lt = pytest.importorskip("torch.distributed._local_tensor")

pytestmark = pytest.mark.timeout(300)

# benchmarks/bench_config.py MEASURED["gpt2-smallish"] (the benchmark row that failed)
SMALLISH = dict(dim=384, n_layers=4, n_heads=6, vocab_size=8192, max_seq_len=128, tie_embeddings=False)
_PLANS: dict = {}


def fsdp2_force(model, mesh_shape) -> dict:
    """benchmarks/hand_plans.py "fsdp2": every parameter Shard(0) on every mesh dim (all divide evenly here)."""
    out = {}
    for fqn, p in model.named_parameters():
        assert p.shape[0] % math.prod(mesh_shape) == 0, (fqn, p.shape)
        out[fqn] = ("S0",) * len(mesh_shape)
    return out


def smallish_plan(mesh_shape):
    if mesh_shape not in _PLANS:
        model = build_model("gpt2-small", **SMALLISH)
        x = example_inputs("gpt2-small", batch=4, seq=64, device="meta", **SMALLISH)
        force = fsdp2_force(model, mesh_shape)
        _PLANS[mesh_shape] = (
            force,
            *autopar.plan(model, mesh_shape, x, cluster=SHAPES, force=force, return_state=True),
        )
    return _PLANS[mesh_shape]


def assert_forced(plan, state, force):
    g = state.graph
    for fqn, want in force.items():
        assert tuple(plan.params[fqn]) == want, (fqn, plan.params[fqn], want)
        assert state.placement[g.params[fqn]].out[0] == want, fqn


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_gpt2_fsdp2_forced_plan_verifies(mesh_shape):
    force, plan, state = smallish_plan(mesh_shape)
    g = state.graph
    assert_forced(plan, state, force)
    # the case that failed: the 4 blocks form one region, decided once and applied to every copy
    assert [r["layers"] for r in plan.regions] == [[0, 1, 2, 3]]
    copies = [n.idx for n in g.nodes if state.rep[n.idx] != n.idx]
    assert len(copies) == 3 * plan.regions[0]["nodes_per_layer"] > 0
    for i in copies:
        r = state.rep[i]
        assert state.placement[i] == state.placement[r], g.nodes[i].name
        assert set(state.strategies[r]) <= set(state.strategies[i]), g.nodes[i].name
    for after in ("candidates", "solve", "redistribute"):
        verify(state, after)
    # every parameter's gradient ends at its parameter's placement (reduce-scatter for Shard(0))
    for fqn in force:
        src, dst, _ = state.redistributes.get((g.params[fqn], "opt"), (None, force[fqn], ()))
        assert dst == force[fqn], fqn
    assert plan.predicted["collectives"].get("reduce_scatter", {}).get("count", 0) > 0


def test_verify_rejects_copy_missing_its_representatives_choice():
    """The invariant the bug broke: a copy whose candidates lack its representative's is rejected after
    candidates (naming both nodes), and a copy whose chosen placement is not its own is rejected after solve."""
    _, _, state = smallish_plan((4,))
    g = state.graph
    i = next(
        n.idx
        for n in g.nodes
        if state.rep[n.idx] != n.idx
        and n.kind == "op"
        and n.phase == "bw"
        and len(state.strategies[state.rep[n.idx]]) > 1
    )
    chosen = state.placement[i]
    strategies = list(state.strategies)
    strategies[i] = [s for s in strategies[i] if s != chosen]
    bad = dataclasses.replace(state, strategies=strategies, placement=None, redistributes=None)
    with pytest.raises(VerificationError, match=rf"{g.nodes[i].name}.*repeats {g.nodes[state.rep[i]].name}"):
        verify(bad, "candidates")
    bad = dataclasses.replace(state, strategies=strategies, redistributes=None)
    with pytest.raises(VerificationError, match=rf"{g.nodes[i].name} has no single chosen placement.*representative"):
        verify(bad, "solve")


@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
def test_gpt2_tiny_fsdp_forced_plan_matches_single_device(mesh_shape):
    """gpt2-tiny (tied embeddings), every parameter Shard(0): on mesh (2,) this plan failed verification before
    the fix. Loss and every gradient of two SGD steps, and the parameters after them, equal the single-device
    model's (fp32, rtol 1e-5, atol 1e-6); the collectives of the first step are the plan's."""
    meta = build_model("gpt2-tiny")
    force = fsdp_force(meta, mesh_shape)
    assert all(v == ("S0",) for v in force.values())
    plan, state = autopar.plan(
        meta,
        mesh_shape,
        example_inputs("gpt2-tiny", 2, 4, device="meta"),
        cluster="cpu-gloo",
        force=force,
        return_state=True,
    )
    assert_forced(plan, state, force)
    assert [r["layers"] for r in plan.regions] == [[0, 1]]
    model = build_model("gpt2-tiny", device="cpu", seed=3)
    ref = copy.deepcopy(model)
    x = example_inputs("gpt2-tiny", 2, 4, seed=4)
    with simulated(mesh_shape) as mesh:
        pm = autopar.parallelize(model, mesh, x, planned=(plan, state))
        for fqn, p in pm.named_parameters():
            assert tuple(str(q) for q in p.placements) == ("S(0)",), fqn
        rep = train_and_compare(pm, ref, x, steps=2, lr=0.1, rtol=1e-5, atol=1e-6, all_grads=True)
    assert not rep.failures, "\n".join(rep.failures[:10])
    assert len(rep.losses) == 2 and all(math.isfinite(a) for a, _ in rep.losses)
    assert not rep.collective_diff, rep.collective_diff
    assert len(rep.measured) == len(plan.collectives()) > 0
