"""torch.compile (Inductor) fusion of memory-bound ops, for pricing: which tensor reads and writes a fused program
skips.

Where a DeviceSpec says `fusion="inductor"` (e.g. `get_cluster("h100").with_device(fusion="inductor")`: the run
compiled its model with torch.compile), the costs pass prices the memory-bound ops between GEMMs as Inductor runs
them: chains of pointwise ops, reductions and views fuse into kernels that read each input from memory once and
write only the values something outside the chain needs. `fusion="eager"` (the default, every preset) prices each
op's own reads and writes, as eager PyTorch runs one kernel per op.

The model of a fused region:
  * fusible ops: torch's pointwise ops (torch.Tag.pointwise), the reductions and other ops Inductor generates code
    for (FUSIBLE below: sums, means, softmax, the NLL loss, embedding lookups, concatenation, dtype casts, factory
    ops), and views; never an op with a FLOP formula (GEMMs, attention, convolutions: library kernels) nor an op
    not listed (priced as eager, the safe side).
  * a region: the fusible ops connected by values one of them produces and another reads, within one phase
    (AOTAutograd compiles the forward and the backward as separate graphs); views are transparent (an op reading a
    view of a fused value reads the fused value).
  * reads: an op reads from memory only the inputs produced outside its region (a GEMM's output, a parameter, a
    forward value saved for the backward), each distinct input value once per region (the first op reading it).
  * writes: an op writes an output only when something outside its region reads it (a GEMM, the other phase) or it
    is an output of the step (the loss, a gradient, a buffer's new value).
Assumed: Inductor fuses every such chain into one kernel (it splits some, e.g. a reduction whose result feeds a
pointwise over the whole input reads that input twice when the row does not fit one block: not modelled); a
redistribute between two fused ops (a layout change inside the chain) does not split it; recomputed forward ops
under activation checkpointing are priced as their forward. FLOP-bound ops and collectives are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compute import has_flop_formula, is_view

aten = torch.ops.aten

FUSIONS = ("eager", "inductor")
# non-pointwise ops Inductor generates code for (reductions, loss, indexing, concatenation, casts, factories)
_FUSIBLE_NAMES = (
    "sum.dim_IntList",
    "sum.default",
    "mean.dim",
    "mean.default",
    "amax.default",
    "amin.default",
    "var_mean.correction",
    "_softmax.default",
    "_log_softmax.default",
    "_softmax_backward_data.default",
    "_log_softmax_backward_data.default",
    "nll_loss_forward.default",
    "nll_loss_backward.default",
    "embedding.default",
    "embedding_dense_backward.default",
    "cat.default",
    "_to_copy.default",
    "arange.default",
    "arange.start_step",
    "ones_like.default",
    "zeros_like.default",
    "full.default",
    "where.self",
)
FUSIBLE = {getattr(getattr(aten, packet), overload) for packet, overload in (n.split(".") for n in _FUSIBLE_NAMES)}


@dataclass(frozen=True)
class FusedIO:
    """The reads and writes a fused program skips: (node, input position) pairs and (node, output index) pairs."""

    skip_reads: frozenset
    skip_writes: frozenset


def check(device) -> bool:
    """Is the device's fusion Inductor's? A ValueError naming the device for an unknown setting."""
    if device.fusion not in FUSIONS:
        raise ValueError(f"device {device.name!r}: fusion must be one of {FUSIONS}, got {device.fusion!r}")
    return device.fusion == "inductor"


def fusible(n) -> bool:
    """An op Inductor fuses (module docstring); views included."""
    if n.kind != "op" or has_flop_formula(n.target):
        return False
    return is_view(n.target) or n.target in FUSIBLE or torch.Tag.pointwise in getattr(n.target, "tags", ())


def _root(g, node: int) -> int:
    """The node a value is read from through views."""
    while g.nodes[node].kind == "op" and is_view(g.nodes[node].target) and g.nodes[node].inputs():
        node = g.nodes[node].inputs()[0].node
    return node


def fused_producer(g, ref, phase: str) -> bool:
    """Is the value `ref` computed by a fusible (non-view) op of `phase`, so a reduction over it there can run in
    the kernel that produces it?"""
    p = g.nodes[_root(g, ref.node)]
    return fusible(p) and not is_view(p.target) and p.phase == phase


def fused_io(g) -> FusedIO:
    """The skipped reads and writes of every op of graph g under Inductor's fusion (module docstring)."""
    nodes = g.nodes
    parent = list(range(len(nodes)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def internal(producer: int, consumer) -> bool:
        p = nodes[_root(g, producer)]
        return fusible(p) and not is_view(p.target) and fusible(consumer) and p.phase == consumer.phase

    for n in g.ops():
        if not fusible(n) or is_view(n.target):
            continue
        for r in n.inputs():
            if internal(r.node, n):
                parent[find(_root(g, r.node))] = find(n.idx)
    skip_reads, seen = set(), set()
    for n in g.ops():
        if not fusible(n) or is_view(n.target):
            continue
        for j, r in enumerate(n.inputs()):
            key = (find(n.idx), r.node, r.out)
            if internal(r.node, n) or key in seen:
                skip_reads.add((n.idx, j))
            seen.add(key)
    outputs = {_root(g, r.node) for r in g.outputs()}
    skip_writes = set()
    for n in g.ops():
        if fusible(n) and not is_view(n.target) and n.idx not in outputs:
            skip_writes.update((n.idx, o) for o in range(len(n.outs)) if _read_inside(g, n, n.idx, o))
    return FusedIO(frozenset(skip_reads), frozenset(skip_writes))


def _read_inside(g, producer, node: int, out: int) -> bool:
    """Is output `out` of `node` (a fusible op, or a view of one) read only by fusible ops of producer's phase?"""
    for u in g.nodes[node].users:
        c = g.nodes[u]
        if not any(r.node == node and r.out == out for r in c.inputs()):
            continue
        if c.kind == "op" and is_view(c.target):
            if not all(_read_inside(g, producer, u, o) for o in range(len(c.outs))):
                return False
        elif not (fusible(c) and c.phase == producer.phase):
            return False
    return True
