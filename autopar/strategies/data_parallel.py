"""Data parallelism as a mesh dim's meaning: on a dim named dp* an activation never moves. The step's batched inputs
are split on dim 0 there, and every op that reads a batch split keeps reading it as it is and passes it on where its
placement rules put it (the batch dim of its output, or a partial sum where it reduces over the batch: a weight's
gradient, the loss; that partial sum moves only into its reduction). Values the step makes from no input (RoPE tables,
masks, positions) are whole there. Parameters and whatever else does not carry the batch stay free on the dim
(replicated, FSDP-sharded, partial), so the solver still picks DDP, FSDP or a mix, and everything on the other dims.

This is what DDP, FSDP and torchtitan's dp dims do. Per-op plans read it on meshes of 3+ dims (autopar/api.py), where
letting every activation take every placement on every dim makes hundreds of candidates per op and an LP of a
million columns; with the data dims fixed an op keeps the candidates of its other dims.
"""

from __future__ import annotations

import math


def dp_dims(names, shape) -> list[int]:
    """The data-parallel mesh dims (named dp*, of size > 1)."""
    return [d for d, (nm, n) in enumerate(zip(names, shape)) if nm.startswith("dp") and n > 1]


def _tensor_inputs(graph):
    """(node index, first output's meta) of the step's inputs with at least one dim, in order."""
    for n in graph.nodes:
        o = n.outs[0] if n.kind == "input" and n.outs else None
        if o is not None and len(o.shape):
            yield n.idx, o


def batch_rows(graph) -> int:
    """The step's batch size: dim 0 of its first tensor input (1 where no input has a dim)."""
    return next((int(o.shape[0]) for _, o in _tensor_inputs(graph)), 1)


def batch_pin(graph, names, shape, dims):
    """A pin (passes/candidates.py) splitting every batched input on dim 0 over the data dims `dims` (plans of 3+
    dims, autopar/api.py; pipeline stage plans, passes/stage_costs.py); a batch that does not divide over them is
    refused here, naming them."""
    rows, ranks = batch_rows(graph), math.prod(shape[d] for d in dims)
    if rows % ranks:
        sizes = {names[d]: shape[d] for d in dims}
        raise ValueError(
            f"batch {rows} does not divide over the data-parallel mesh dims {sizes} "
            f"({ranks} ranks): on a pipeline stage or a mesh of 3+ dims a dim named dp* splits the batch; pass a "
            f"batch divisible by {ranks}, or name the dim otherwise to let the planner place everything on it"
        )
    carriers = {i for i, o in _tensor_inputs(graph) if o.shape[0] == rows}

    def pin(n):
        return {d: "S0" for d in dims} if n.idx in carriers else None

    return pin


def keep_batch_splits(state, dims) -> dict:
    """Keep, for every op reading a batch split or a partial sum over the batch on the data dims `dims`, the
    strategies that read it as it is (where none does, those that reduce the partial sums first); an output carries
    on what those strategies agree on for it (a split, or a partial sum: a weight's gradient moves on these dims only
    into its reduction). An op with no such strategy keeps all of its own (the solver moves the value there) and its
    outputs carry nothing. An op that reads only values made from no input, parameter or buffer (RoPE tables, masks,
    positions: every data rank computes them whole) keeps its replicated strategies there. The batch enters at the
    inputs that every strategy splits on `dims` (batch_pin's). Returns {(node, output): its placements on `dims`};
    `state.strategies` is narrowed in place."""
    g, carry = state.graph, {}
    if not dims:
        return carry
    for i, _ in _tensor_inputs(g):
        pls = {tuple(s.out[0][d] for d in dims) for s in state.strategies[i]}
        if len(pls) == 1 and all(p.startswith("S") for p in next(iter(pls))):
            carry[(i, 0)] = next(iter(pls))
    made = {n.idx for n in g.nodes if n.kind == "constant"}  # values the step makes from nothing
    for n in g.nodes:
        strats = state.strategies[n.idx]
        if n.kind != "op" or not strats:
            continue
        refs = n.inputs()
        if all(r.node in made for r in refs):
            made.add(n.idx)
            whole = [s for s in strats if all(o is None or all(o[d] == "R" for d in dims) for o in s.out)]
            state.strategies[n.idx] = whole or strats
            continue
        read = [(k, carry[(r.node, r.out)]) for k, r in enumerate(refs) if (r.node, r.out) in carry]
        kept = _reading(strats, read, dims, False) or _reading(strats, read, dims, True) if read else []
        if not kept:
            continue
        state.strategies[n.idx] = kept
        for j, meta in enumerate(n.outs):
            pls = {s.out[j] and tuple(s.out[j][d] for d in dims) for s in kept} if meta is not None else set()
            (pl,) = pls if len(pls) == 1 else (None,)
            if pl and all(p[0] in "SP" for p in pl):
                carry[(n.idx, j)] = pl
    return carry


def _reading(strats, read, dims, reduced: bool) -> list:
    """The strategies reading each carried input (k, its placements on `dims`) as it is, or with `reduced` a partial
    sum reduced first (a batch norm's mean, the loss's token count: what an op needs whole)."""

    def ok(want, got):
        return got == want or (reduced and want[0] == "P" and got == "R")

    return [s for s in strats if all(ok(pl[j], s.ins[k][d]) for k, pl in read for j, d in enumerate(dims))]


def searched_as_data(names, dims) -> str:
    """What an infeasible plan over data dims adds to its error: the space it searched."""
    named = ", ".join(names[d] for d in dims)
    return (
        f"(searched with mesh dims {named} as data parallel: activations split by the batch there, parameters free; "
        f"name a dim otherwise to let the planner place activations on it too, a much larger search)"
    )
