"""torch.compile (Inductor) fusion of memory-bound ops, for pricing: which tensor reads and writes a fused program
skips.

Where a DeviceSpec says `fusion="inductor"` or `"inductor-graph"` (e.g. `get_cluster("h100").with_device(fusion="inductor")`: the run
compiled its model with torch.compile), the costs pass prices the memory-bound ops between GEMMs as Inductor runs
them: chains of pointwise ops, reductions and views fuse into kernels that read each input from memory once and
write only the values something outside the chain needs. `fusion="eager"` (the default, every preset) prices each
op's own reads and writes, as eager PyTorch runs one kernel per op.

Scope (which ops one torch.compile call covers): "inductor" compiles each layer of a model's ModuleList on its own,
as torchtitan's apply_compile does (`torch.compile(block, fullgraph=True)` per TransformerBlock, the placement
FSDP2's per-block wrapping asks for): a region never crosses a layer's boundary (the residual stream is written at
the end of one layer and read by the next), and the ops outside the layers (embedding, final norm, loss, the RoPE
tables) run eagerly. A model without ModuleList layers is compiled whole. "inductor-graph" compiles the whole
model as one program (`torch.compile(model)`).

The model of a fused region:
  * fusible ops: torch's pointwise ops (torch.Tag.pointwise), the reductions and other ops Inductor generates code
    for (FUSIBLE below: sums, means, softmax, the NLL loss, embedding lookups, concatenation, dtype casts, factory
    ops), and views; never an op with a FLOP formula (GEMMs, attention, convolutions: library kernels) nor an op
    not listed (priced as eager, the safe side).
  * a region: the fusible ops connected by values one of them produces and another reads, within one phase
    (AOTAutograd compiles the forward and the backward as separate graphs) and one compiled program; views are transparent (an op reading a
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

FUSIONS = ("eager", "inductor", "inductor-graph")
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
    return device.fusion != "eager"


def compile_units(device, g, layer_of) -> list:
    """Each node's compiled program (module docstring: scope): a key shared by the nodes one torch.compile call
    covers, None for a node run eagerly. layer_of: the regions pass's node -> (ModuleList prefix, layer index)."""
    if device.fusion == "inductor-graph" or not any(k is not None for k in layer_of):
        return [0] * len(g.nodes)
    return list(layer_of)


def fusible(n, units=None) -> bool:
    """An op Inductor fuses (module docstring); views included. units: compile_units (None: all one program)."""
    if n.kind != "op" or has_flop_formula(n.target) or (units is not None and units[n.idx] is None):
        return False
    return is_view(n.target) or n.target in FUSIBLE or torch.Tag.pointwise in getattr(n.target, "tags", ())


def _root(g, node: int) -> int:
    """The node a value is read from through views."""
    while g.nodes[node].kind == "op" and is_view(g.nodes[node].target) and g.nodes[node].inputs():
        node = g.nodes[node].inputs()[0].node
    return node


def fused_producer(g, ref, consumer, units=None) -> bool:
    """Is the value `ref` computed by a fusible (non-view) op of the consumer's phase and compiled program, so a
    reduction over it there can run in the kernel that produces it?"""
    p = g.nodes[_root(g, ref.node)]
    same = units is None or units[p.idx] == units[consumer.idx]
    return fusible(p, units) and not is_view(p.target) and p.phase == consumer.phase and same


def fused_io(g, units=None) -> FusedIO:
    """The skipped reads and writes of every op of graph g under Inductor's fusion (module docstring); units:
    compile_units, None for one program over the whole graph."""
    nodes = g.nodes
    units = units if units is not None else [0] * len(nodes)
    parent = list(range(len(nodes)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def internal(producer: int, consumer) -> bool:
        p = nodes[_root(g, producer)]
        same = p.phase == consumer.phase and units[p.idx] == units[consumer.idx]
        return fusible(p, units) and not is_view(p.target) and fusible(consumer, units) and same

    for n in g.ops():
        if not fusible(n, units) or is_view(n.target):
            continue
        for r in n.inputs():
            if internal(r.node, n):
                parent[find(_root(g, r.node))] = find(n.idx)
    skip_reads, seen = set(), set()
    for n in g.ops():
        if not fusible(n, units) or is_view(n.target):
            continue
        for j, r in enumerate(n.inputs()):
            key = (find(n.idx), r.node, r.out)
            if internal(r.node, n) or key in seen:
                skip_reads.add((n.idx, j))
            seen.add(key)
    outputs = {_root(g, r.node) for r in g.outputs()}
    skip_writes = set()
    for n in g.ops():
        if fusible(n, units) and not is_view(n.target) and n.idx not in outputs:
            skip_writes.update((n.idx, o) for o in range(len(n.outs)) if _read_inside(g, n, n.idx, o, units))
    return FusedIO(frozenset(skip_reads), frozenset(skip_writes))


def _read_inside(g, producer, node: int, out: int, units) -> bool:
    """Is output `out` of `node` (a fusible op, or a view of one) read only by fusible ops of producer's phase and
    compiled program?"""
    for u in g.nodes[node].users:
        c = g.nodes[u]
        if not any(r.node == node and r.out == out for r in c.inputs()):
            continue
        if c.kind == "op" and is_view(c.target):
            if not all(_read_inside(g, producer, u, o, units) for o in range(len(c.outs))):
                return False
        elif not (fusible(c, units) and c.phase == producer.phase and units[u] == units[producer.idx]):
            return False
    return True
