"""Estimated stage costs (passes/stage_estimate.py): a key priced from another key of its family against the key's
own intra-op plans, and the search that solves only some keys exactly against the one that solves all of them.
Planning only (meta tensors)."""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar import models
from autopar import pipeline_model as pm
from autopar.cost import get_cluster
from autopar.mesh import MeshSpec

from _stage import stage_context
from autopar.passes.stage_costs import find_layers, layer_signature
from autopar.passes.stage_estimate import estimate, family, per_rank, representatives
from autopar.passes.stage_search import lower_bound, search_config, stage_plans

DP_TP = ("dp", "tp")
# llama-tiny widened to compute-bound blocks (8 heads of 128, a 4x MLP)
SMALL = dict(n_layers=4, dim=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=32000)


def _keys_of(*specs):
    return [(MeshSpec(shape, names), mb) for shape, names, mb in specs]


def test_representatives_take_each_familys_smallest_per_rank_batch():
    keys = _keys_of(
        ((4, 2), DP_TP, 4),  # tp 2, per rank 1
        ((2, 2), DP_TP, 8),  # tp 2, per rank 4
        ((8, 2), DP_TP, 16),  # tp 2, per rank 2
        ((8,), ("dp",), 8),  # tp 1, per rank 1
        ((2,), ("tp",), 4),  # tp 2 without dp: the same family (dp 1), per rank 4 too
    )
    assert [per_rank(k) for k in keys] == [1, 4, 2, 1, 4]
    assert family(keys[0]) == family(keys[4]) == (("tp", 2),) and family(keys[3]) == ()
    assert representatives(keys) == [keys[0], keys[3]]  # per family one key, the larger ones are estimated


@pytest.fixture(scope="module")
def llama_keys():
    """Exact intra-op plans of a 4-block llama-tiny on three stage submeshes of one family (data parallel only):
    per-rank micro-batch 1 on dp 2 and dp 4, per-rank micro-batch 2 on dp 2."""
    m = models.build_model("llama-tiny", device="meta", **SMALL)
    x = models.example_inputs("llama-tiny", batch=16, device="meta", **SMALL)
    prefix = find_layers(m)
    blocks = list(m.get_submodule(prefix))
    sigs = [layer_signature(b) for b in blocks]
    reps = [i for i, s in enumerate(sigs) if s not in sigs[:i]]
    # a loaded machine must not cut a solve short
    ctx = stage_context(get_cluster("h100"), n_variants=2, time_limit=600, recompute=True, float8=None)
    keys = _keys_of(((2,), ("dp",), 2), ((4,), ("dp",), 4), ((2,), ("dp",), 4))
    pos_of = [reps.index(sigs.index(s)) for s in sigs]
    return stage_plans(m, prefix, reps, pos_of, x, 16, keys, ctx, workers=1), keys, ctx["cluster"]


def test_estimate_on_another_dp_size_moves_only_the_dp_terms(llama_keys):
    """Same per-rank shapes (one sample per rank) from dp 2 to dp 4: compute and activations are the
    source's, the FSDP-sharded state halves, the dp comm follows the larger dp group, and the exact
    dp-4 plan is within 25% of the estimate on compute (it may place a few ops otherwise on the larger group)."""
    solved, (k2, k4, _), cluster = llama_keys
    est = estimate(k4, {k2: solved[k2]}, cluster)
    assert est.source == k2 and len(est.costs()) == len(solved[k2].costs())
    for cv, src in zip(est.costs(), solved[k2].costs()):
        for name in ("F", "B", "W", "act", "xbytes"):
            np.testing.assert_array_equal(getattr(cv, name), getattr(src, name), err_msg=name)
        np.testing.assert_allclose(cv.state, src.state - src.state_dp / 2, rtol=1e-12)
        assert (cv.dp >= src.dp * (1 - 1e-12)).all() and cv.dp.sum() > 0
    sharded = est.costs()[-1]
    assert sharded.state_dp.sum() > 0.5 * sharded.state.sum()  # FSDP: most of the state is sharded on dp
    exact = min((cv.F + cv.B + cv.W).sum() for cv in solved[k4].costs())
    assert min((cv.F + cv.B + cv.W).sum() for cv in est.costs()) == pytest.approx(exact, rel=0.25)


def test_estimate_from_a_larger_per_rank_batch_is_a_lower_bound(llama_keys):
    """Scaled down from two samples per rank, the per-sample terms are at most the exact one-sample plan's (a
    kernel is at least as efficient on the larger batch); on this latency-bound toy model well below it, but above
    half."""
    solved, (k2, _, k2b), cluster = llama_keys
    est = estimate(k2, {k2b: solved[k2b]}, cluster)
    assert est.source == k2b
    lo = np.min([cv.F + cv.B + cv.W for cv in est.costs()], axis=0).sum()
    ex = np.min([cv.F + cv.B + cv.W for cv in solved[k2].costs()], axis=0).sum()
    assert 0.5 * ex <= lo <= ex * 1.02


def test_search_with_estimates_finds_the_exhaustive_plan():
    """A flat 4-rank set with every key but each family's representative estimated: the search solves
    exactly only the keys that look better (within estimate_margin) and comes within 1% of the exhaustive search's
    step time (here 0.6%: the exhaustive optimum, pp 2 with two stages per rank, was estimated more than 10% slow),
    never below it."""
    m = models.build_model("llama-tiny", device="meta", **SMALL)
    x = models.example_inputs("llama-tiny", batch=8, device="meta", **SMALL)
    full = autopar.plan(m, (4,), x, cluster="h100", pipeline={"exact_keys": 1000})
    fast = autopar.plan(m, (4,), x, cluster="h100", pipeline={"exact_keys": 0})
    s_full, s_fast = full.schedule["search"], fast.schedule["search"]
    assert s_full["estimated_keys"] == 0 and s_fast["estimated_keys"] > 0
    assert s_fast["intra_op_keys"] < s_full["intra_op_keys"]
    ratio = fast.predicted["step_s"] / full.predicted["step_s"]
    assert 1 - 1e-9 <= ratio <= 1.01


def test_a_configuration_whose_dp_closed_form_exceeds_the_cutoff_is_not_simulated(llama_keys):
    """The search prunes a configuration on its lower bound, and after the DP on the partition's own closed form
    (the bound's target, so at least the bound): above the cutoff it is not simulated, at or below the result is
    the unpruned one."""
    solved, (k2, _, _), cluster = llama_keys
    ops, spec = solved[k2], pm.get_schedule("1F1B")
    c = {"p": 2, "mesh": k2[0], "m": 8, "spec": spec, "v": 1, "key": k2}
    order = pm.actions(spec, 2, 8, 1)
    full = search_config(c, order, ops, cluster, 60e9)
    assert full["fits"]
    closed = full["part"].proxy_s
    assert lower_bound(ops.costs(), spec, 2, 1, 8) <= closed
    assert search_config(c, order, ops, cluster, 60e9, above=closed * 0.999) == {"pruned": True}
    kept = search_config(c, order, ops, cluster, 60e9, above=closed * 1.001)
    assert kept["step_s"] == full["step_s"] and kept["part"].bounds == full["part"].bounds
