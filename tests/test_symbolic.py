"""The sympy batch formula of a fixed plan equals the cost model evaluated at other batch sizes."""

import pytest
import sympy

import autopar
from autopar import models as M
from autopar.symbolic import b, batch_formula
from _replan import same_placements_at


def test_batch_formula_matches_replanning_with_same_placements():
    force = {"layers.0.attention.wq.weight": ("S0",), "layers.1.feed_forward.w2.weight": ("S1",)}
    m = M.build_model("llama-tiny")
    x4 = M.example_inputs("llama-tiny", batch=4, device="meta")
    p4, st = autopar.plan(m, (2,), x4, cluster="cpu-gloo", return_state=True, force=force)
    f = batch_formula(st, m, x4)
    assert f["comm_s"].free_symbols <= {b} and f["compute_s"].has(b)
    assert float(f["compute_s"].subs(b, 4)) == pytest.approx(p4.predicted["compute_s"], rel=1e-9)
    assert float(f["comm_s"].subs(b, 4)) == pytest.approx(p4.predicted["comm_s"], rel=1e-9)
    # the same placements costed from scratch at batch 8 (no re-solve): the formula must give them exactly
    p8 = same_placements_at(st, m, M.example_inputs("llama-tiny", batch=8, device="meta"))
    assert float(f["compute_s"].subs(b, 8)) == pytest.approx(p8.predicted["compute_s"], rel=1e-9)
    assert float(f["comm_s"].subs(b, 8)) == pytest.approx(p8.predicted["comm_s"], rel=1e-9)
    assert float(f["step_s"].subs(b, 8)) > float(f["step_s"].subs(b, 4))


@pytest.mark.parametrize("flatten", [False, True])
def test_batch_formula_counts_a_flattened_gradient_bucket_once(flatten, monkeypatch):
    """Data parallel over a 2-D mesh: a gradient bucket is a chain of one all_reduce per mesh dim or one all_reduce
    over the flattened group; the formula prices exactly the plan's buckets either way."""
    monkeypatch.setattr("autopar.passes.buckets.flatten_chain", lambda *a: flatten)
    m = M.build_model("llama-tiny")
    x4 = M.example_inputs("llama-tiny", batch=4, device="meta")
    force = {k: ("R", "R") for k, _ in m.named_parameters()}
    from _bench import batch_pin  # batch-sharded activations: else it gathers its tokens

    p4, st = autopar.plan(
        m, (2, 2), x4, cluster="cpu-gloo", return_state=True, force=force, pin=batch_pin([0, 1], tuple(x4[0].shape))
    )
    flat = [bk for bk in p4.buckets if isinstance(bk["mesh_dim"], list)]
    assert bool(flat) == flatten and all(bk["group"] == 4 for bk in flat)
    f = batch_formula(st, m, x4)
    assert float(f["comm_s"].subs(b, 4)) == pytest.approx(p4.predicted["comm_s"], rel=1e-9)
    assert float(f["compute_s"].subs(b, 4)) == pytest.approx(p4.predicted["compute_s"], rel=1e-9)


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_formula_prices_shares_recompute_and_overlap_as_the_prediction(overlap):
    """A plan with shared redistributes (one gather feeds several consumers), checkpointed blocks (a memory
    budget below the free plan's peak) and, with overlap=True, gathers and reductions hidden under compute: the
    formula at the example batch gives the prediction's compute, comm, exposed comm and step exactly. On the h100's
    ring alpha-beta links with overlap=True: on its NCCL links the prediction's exposed comm is the engines' FSDP2
    timeline, which the formula does not price; without overlap the NCCL prediction's step adds the optimizer step,
    which the formula leaves out."""
    m = M.build_model("llama-tiny")
    x4 = M.example_inputs("llama-tiny", batch=4, device="meta")
    from _bench import torchtitan_placements

    force, pin = torchtitan_placements(m, ("tp",), None, "tp", tuple(x4[0].shape))  # TP + sequence parallel
    kw = dict(cluster="h100-ring" if overlap else "h100", force=force, pin=pin, overlap=overlap)
    free = autopar.plan(m, (2,), x4, **kw)
    p4, st = autopar.plan(m, (2,), x4, return_state=True, memory_budget=0.8 * free.predicted["peak_mem_bytes"], **kw)
    assert st.recompute and st.shares, (st.recompute, st.shares)
    f = batch_formula(st, m, x4)
    want = dict(p4.predicted, step_s=p4.predicted["step_s"] - p4.predicted.get("optimizer_s", 0.0))
    assert overlap or p4.predicted["optimizer_s"] > 0
    for k in ("compute_s", "comm_s", "exposed_comm_s", "step_s"):
        assert float(f[k].subs(b, 4)) == pytest.approx(want[k], rel=1e-9), k
    assert p4.predicted["recompute_s"] > 0
    if overlap:
        assert f["step_s"].has(sympy.Max) or p4.predicted["exposed_comm_s"] < p4.predicted["comm_s"]
