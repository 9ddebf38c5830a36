"""Async tensor parallelism: which TP collectives torch fuses with a GEMM, and what of them still shows.

Read from torch/_inductor/fx_passes/micro_pipeline_tp.py (torch.compile with
`torch._inductor.config._micro_pipeline_tp = True` and symmetric memory enabled for the TP group, torchtitan's
`enable_async_tensor_parallel`):
  * an all_gather whose output is the left operand of mm / _scaled_mm (directly, or through the reshape of an N-D
    matmul) becomes `symm_mem.fused_all_gather_matmul` with every such consumer: the local shard's matmuls run
    while the copy engines pull the other ranks' shards, then each arriving shard's matmuls;
  * a reduce_scatter of an mm / _scaled_mm output (directly or through its reshape) becomes
    `symm_mem.fused_matmul_reduce_scatter`: the matmul runs one destination rank's chunk at a time while the
    finished chunks are sent, and the received partial chunks are summed at the end.
Symmetric memory maps peer GPUs' memory over NVLink, so only groups inside one node fuse.

Timeline of a fused op on a group of k ranks with collective seconds C and matmul seconds M: the k-1 remote
chunks move under the matmul of the chunks before them, so the op takes max(M, C + M / k) and shows
max(0, C - M (k - 1) / k) beyond its matmul; the reduce-scatter also reads the k partial chunks of its output
shard and writes their sum (memory-bound). The copy engines move the data, so the matmul keeps its SMs (assumed
to run at its undecomposed rate).

The prediction (autopar/predict.py, passes/stage_metrics.py) prices this; the solver does not: it places the
tensors as it would without async TP, and the plan's fused collectives are then priced as hidden. (A gather into
a view that an mm reads is a follower's redistribute in the solver's groups, whose matmul decides in another
group: charging it exactly would couple two groups' choices.)
"""

from __future__ import annotations

import torch

from .compute import is_view

aten = torch.ops.aten
GEMMS = frozenset({aten.mm.default, aten._scaled_mm.default})


def enabled(cluster) -> bool:
    """Async TP is priced: the device says the program runs it and the cluster's GPUs talk over NCCL."""
    return cluster.device.async_tp and bool(cluster.intra.nccl)


def fused_kind(collectives, cluster, mesh_shape) -> str | None:
    """The kind ("all_gather" or "reduce_scatter") when a redistribute's collectives are that one collective
    over one mesh dim inside a node (what symmetric memory can fuse), else None."""
    if len(collectives) != 1:
        return None
    c = collectives[0]
    if c.kind not in ("all_gather", "reduce_scatter") or not isinstance(c.mesh_dim, int) or c.group < 2:
        return None
    return c.kind if cluster.link_for(tuple(mesh_shape), c.mesh_dim) is cluster.intra else None


def lhs_gemms(graph, node: int, j) -> list[int]:
    """The GEMMs that take node `node`'s input j as their left operand, as the fusion pass finds them: the node
    itself (input 0 of an mm), or the mms its view / reshape of that input feeds on their left."""
    n = graph.nodes[node]
    if not isinstance(j, int) or n.kind != "op":
        return []
    if n.target in GEMMS:
        return [node] if j == 0 else []
    if not is_view(n.target) or j != 0:
        return []
    return [u for u in n.users if graph.nodes[u].target in GEMMS and graph.nodes[u].inputs()[0].node == node]


def producer_gemm(graph, producer: int) -> int | None:
    """The GEMM whose output `producer`'s output is: the producer itself or the GEMM its view / reshape reads."""
    n = graph.nodes[producer]
    if n.kind != "op":
        return None
    if n.target in GEMMS:
        return producer
    if is_view(n.target) and n.inputs():
        src = n.inputs()[0].node
        return src if graph.nodes[src].target in GEMMS else None
    return None


def hidden(kind: str, comm_s: float, gemm_s: float, group: int, out_shard_bytes: float, device) -> float:
    """Seconds of a fused collective that run under its matmuls (module docstring); a reduce-scatter gives back
    less by its final sum over the k partial chunks of its output shard."""
    show = max(0.0, comm_s - gemm_s * (group - 1) / group)
    if kind == "reduce_scatter":
        show += (group + 1) * out_shard_bytes / (device.mem_bw * device.mem_eff)
    return max(0.0, comm_s - show)
