"""Async TP (autopar/cost/async_tp.py): the fused op against a chunk-by-chunk timeline, and a TP plan priced with
and without it (which collectives hide, under which matmuls, and only inside a node)."""

import pytest
import torch

import autopar
from autopar import models
from autopar.cost import CLUSTERS
from autopar.cost.async_tp import hidden
from autopar.testing import tp_force


def _chunk_timeline(comm_s: float, gemm_s: float, k: int) -> float:
    """fused_all_gather_matmul on k ranks drawn chunk by chunk: the local shard's matmul (gemm_s / k) starts at
    once; remote shard i arrives at i * comm_s / (k - 1) (the copy engine pulls them one after another) and its
    matmul starts when it has arrived and the previous matmul is done. Returns the op's end."""
    end = gemm_s / k
    for i in range(1, k):
        end = max(end, i * comm_s / (k - 1)) + gemm_s / k
    return end


@pytest.mark.parametrize("comm_s, gemm_s, k", [(2.0, 3.0, 8), (4.0, 3.0, 8), (1.0, 1.0, 2), (3.0, 0.5, 4)])
def test_all_gather_matmul_against_a_chunk_timeline(comm_s, gemm_s, k):
    """Unfused, the gather then the matmul take comm + gemm; fused, the chunk timeline's end: the difference is
    what `hidden` says runs under the matmul."""
    h100 = CLUSTERS["h100"].device
    assert hidden("all_gather", comm_s, gemm_s, k, 0.0, h100) == pytest.approx(
        comm_s + gemm_s - _chunk_timeline(comm_s, gemm_s, k)
    )


def test_reduce_scatter_pays_the_final_sum():
    """The fused matmul-reduce-scatter sums the k partial chunks of the rank's output shard at the end: k reads
    and a write of it, memory-bound, taken off what it hides (never below nothing)."""
    h100 = CLUSTERS["h100"].device
    shard = 64e6
    final = 9 * shard / (h100.mem_bw * h100.mem_eff)
    assert hidden("reduce_scatter", 2.0, 3.0, 8, shard, h100) == pytest.approx(2.0 - final)
    assert hidden("reduce_scatter", 1e-6, 3.0, 8, shard, h100) == 0.0


def _plan(mesh, cluster):
    m = models.build_model("llama3-8b", device="meta", dtype=torch.bfloat16, n_layers=2)
    x = models.example_inputs("llama3-8b", batch=1, seq=8192, device="meta")  # no batch to shard: TP moves activations
    return autopar.plan(m, mesh, x, cluster=cluster, force=tp_force(m, mesh.shape, -1))


def _act_records(plan):
    for n in plan.nodes:
        for r in n.get("redistribute", []):
            if r.get("class") == "act" and r["collectives"]:
                yield n, r


def test_tp_plan_hides_its_gathers_and_scatters_under_matmuls():
    """Llama blocks with Megatron TP on 8 H100s of one node: async TP hides part of the all_gathers into a
    column-parallel matmul and of the reduce_scatters out of a row-parallel one, and nothing else; the step is
    shorter."""
    mesh = autopar.MeshSpec((8,), ("tp",))
    sync = _plan(mesh, CLUSTERS["h100"])
    fused = _plan(mesh, CLUSTERS["h100"].with_device(async_tp=True))
    kinds = set()
    for n, r in _act_records(fused):
        if r.get("hidden_s"):
            kind = r["collectives"][0][0]
            kinds.add(kind)
            assert len(r["collectives"]) == 1 and 0 < r["hidden_s"] <= r["time_s"]
            src = fused.nodes[n["inputs"][r["input"]][0]]
            if kind == "all_gather":  # into an mm's left operand, or a view that an mm reads on its left
                assert n["target"] == "mm.default" and r["input"] == 0 or n["target"].endswith("view.default")
            else:  # out of an mm, or out of the view of its output
                assert kind == "reduce_scatter" and "mm" in (src["target"] + fused.nodes[src["inputs"][0][0]]["target"])
    assert kinds == {"all_gather", "reduce_scatter"}
    hid = fused.predicted["async_tp_hidden_s"]
    assert hid > 0 and "async_tp_hidden_s" not in sync.predicted
    assert f"async TP: {hid * 1e3:.3f} ms" in fused.summary() and "async TP" not in sync.summary()
    assert "async TP hides" in fused.dump() and "async TP" not in sync.dump()
    # the prediction's total is its records' (a shared or bucketed redistribute hides nothing of its own)
    assert hid == pytest.approx(sum(r.get("hidden_s", 0.0) for _, r in _act_records(fused)), rel=1e-12)
    # the MILP does not see async TP; the overlap search picks among its candidates by the prediction, which does
    assert fused.predicted["step_s"] < sync.predicted["step_s"]


def test_tp_across_nodes_does_not_fuse():
    """Symmetric memory maps peers over NVLink: a TP group spanning two nodes (16 ranks, 8 per node) keeps
    NCCL's collectives, nothing hidden."""
    mesh = autopar.MeshSpec((16,), ("tp",))
    plan = _plan(mesh, CLUSTERS["h100"].with_device(async_tp=True))
    assert any(True for _ in _act_records(plan))
    assert not any(r.get("hidden_s") for _, r in _act_records(plan))
    assert "async_tp_hidden_s" not in plan.predicted
