"""FSDP2's mixed precision as a graph rewrite: each parameter's gradient cast to the reduce dtype right after its
producer, so its reduction into the fp32 sharded parameter runs in that dtype (FSDP2 casts the unsharded bf16
gradient to `reduce_dtype` before its reduce-scatter).

The planner's precision pass (passes/precision.py) applies it to the graph captured with bf16 parameters; a saved
mixed-precision plan's graph, captured again to run it (autopar/execution.py), gets the same rewrite, so both graphs
repeat each other node for node. The same holds for the float8 pass's retyping of the weights FSDP gathers in
float8 (`retype_float8`).
"""

from __future__ import annotations

import torch

from .graph import Graph, Node, Ref, TensorMeta, map_refs

aten = torch.ops.aten


def cast_gradients(g: Graph, reduce_dtype: torch.dtype) -> int:
    """Insert the gradient casts into `g` in place; returns how many gradients got one (those floating-point
    gradients not already in `reduce_dtype`)."""
    casts: dict[int, list[tuple[str, int]]] = {}  # producer node -> [(param FQN, output index)]
    for fqn, r in g.grads.items():
        m = g.meta(r)
        if m.dtype.is_floating_point and m.dtype != reduce_dtype:
            casts.setdefault(r.node, []).append((fqn, r.out))
    if not casts:
        return 0
    new_idx: dict[int, int] = {}
    out: list[Node] = []
    grad_node: dict[str, int] = {}
    for n in g.nodes:  # first pass: numbering
        new_idx[n.idx] = len(out)
        out.append(n)
        for fqn, o in casts.get(n.idx, []):
            cast = Node(
                -1,
                "op",
                aten._to_copy.default,
                (Ref(n.idx, o),),
                {"dtype": reduce_dtype},
                (TensorMeta(n.outs[o].shape, reduce_dtype),),
                "bw",
                n.module,
            )
            grad_node[fqn] = len(out)
            out.append(cast)
    _renumber(g, out, new_idx, grad_node)
    return len(grad_node)


def _renumber(g: Graph, out: list[Node], new_idx: dict[int, int], grad_node: dict[str, int]) -> None:
    """`g` made of the nodes `out` (old nodes and new casts whose refs still use the old numbering), each
    gradient in `grad_node` read from its cast."""
    fix = lambda r: Ref(new_idx[r.node], r.out)
    for i, n in enumerate(out):
        n.args, n.kwargs, n._ins = map_refs(n.args, fix), map_refs(n.kwargs, fix), None
        n.idx = i
    g.nodes = out
    g.params = {k: new_idx[v] for k, v in g.params.items()}
    g.buffers = {k: new_idx[v] for k, v in g.buffers.items()}
    g.inputs = [new_idx[v] for v in g.inputs]
    g.loss = fix(g.loss)
    g.input_grads = {k: fix(r) for k, r in g.input_grads.items()}
    g.state_updates = {k: fix(r) for k, r in g.state_updates.items()}
    g.grads = {k: Ref(grad_node[k]) if k in grad_node else fix(r) for k, r in g.grads.items()}
    g.__post_init__()  # users lists


def retype_float8(g: Graph, views) -> None:
    """e4m3 on the output of each node in `views`: the transposes / views between a weight FSDP gathers in float8
    and its GEMMs (passes/float8.py prices the gather at one byte an element from it)."""
    for v in views:
        n = g.nodes[v]
        n.outs = (TensorMeta(n.outs[0].shape, torch.float8_e4m3fn),)
