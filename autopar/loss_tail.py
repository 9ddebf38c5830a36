"""The loss tail: small values the loss needs reduced, all-reduced together at the end of the forward.

A small forward value (at most HELD_NUMEL elements) is in the loss tail when its one forward consumer, and
everything that consumer feeds in the forward, reads no parameter: it flows into the loss without meeting another
weight (an MoE router's per-expert load and mean probability, (E,) vectors whose product is a layer's aux loss added
to the training loss; a loss's sum and count of targets), so nothing the rest of the forward computes waits for it.
Where the plan all-reduces such values to Replicate (the exact aux loss of a batch split across ranks needs each
layer's load vector summed over the ranks), the consumers can wait until the last of them is ready and take one
all_reduce of their summed size, as XLA's all-reduce combiner does, instead of one collective per layer.

`tail_values` names them (the cost model prices their all_reduces as one bucket's: passes/costs.py); `coalesce_tail`
groups the plan's reductions of them (the redistribute pass) and returns the forward's order of execution, with each
group's consumers after its last source (a lexicographic topological sort: otherwise the graph's own order).
"""

from __future__ import annotations

import networkx as nx

from .graph import Ref, TensorMeta, param_root
from .collectives import all_reduced, collectives

# A value this small is reduced once and held from the forward to the backward (its shared redistribute spans both
# phases: passes/redistribute.py, passes/costs.py): 4 KiB in fp32, less than any collective it saves.
HELD_NUMEL = 1024


def _fw_consumers(g, r) -> list[tuple[int, int]]:
    return [
        (u, j)
        for u in dict.fromkeys(g.nodes[r.node].users)
        if g.nodes[u].kind == "op" and g.nodes[u].phase == "fw"
        for j, x in enumerate(g.nodes[u].inputs())
        if x == r
    ]


def tail_values(g, partial) -> set[tuple[int, int]]:
    """(node, output) of every forward value in the loss tail (module docstring) that can be partial (`partial(node,
    output)`: some candidate strategy leaves it P, a sum the ranks hold parts of) and that no other such value's
    consumer computes; parameters' views excluded."""
    weighted: dict[int, bool] = {}  # fw op -> it or anything it feeds reads a parameter
    for n in reversed(g.nodes):
        if n.kind != "op" or n.phase != "fw":
            continue
        weighted[n.idx] = any(param_root(g, r.node) is not None for r in n.inputs()) or any(
            weighted[u] for u in n.users if g.nodes[u].kind == "op" and g.nodes[u].phase == "fw"
        )
    found = {}
    for n in g.nodes:
        if n.kind != "op" or n.phase != "fw" or param_root(g, n.idx) is not None:
            continue
        for o, m in enumerate(n.outs):
            if m is None or m.numel > HELD_NUMEL:
                continue
            cons = _fw_consumers(g, Ref(n.idx, o))
            if len(cons) == 1 and not weighted[cons[0][0]] and partial(n.idx, o):
                found[(n.idx, o)] = cons[0][0]
    # a value computed from another's consumer (a layer's aux loss, from its reduced load vector) would take a
    # second collective after the first group's: not in the tail, priced and run as its own. Consumers with one
    # input do not count: they take their input's placement (passes/costs.py followers), reduced or not
    down = set()
    consumers = {v for v in found.values() if len(g.nodes[v].inputs()) > 1}
    for n in g.nodes:
        if n.kind == "op" and n.phase == "fw" and (n.idx in consumers or any(r.node in down for r in n.inputs())):
            down.add(n.idx)
    return {k for k in found if k[0] not in down}


def coalesce_tail(g, red: dict, shares: dict, coalesced: dict, mesh_shape, cluster, partial) -> list[int] | None:
    """Group the plan's all_reduces of loss-tail values into as few collectives as the graph allows, one group per
    destination placement and dtype (a partial mean joins partial sums, scaled by 1 / its ranks on the way in:
    backends/spmd/program.py). A group never holds a value computed from another member's consumer: that would need a
    second collective after the first. Each group's collective rides on the input of its first consumer in the new
    order; `red` and `coalesced` are updated in place (the other members carry no collective and name that input).
    partial: as for tail_values. Returns the forward nodes' order of execution, or None when nothing was grouped."""
    tail = tail_values(g, partial)
    units: dict = {}  # (consumer, input) of a collective -> its inputs it carries (node-local coalescing)
    for (v, j), (src, dst, cs) in red.items():
        if not isinstance(j, int) or not cs or (v, j) in shares or g.nodes[v].phase != "fw":
            continue
        r = g.nodes[v].inputs()[j]
        if (r.node, r.out) in tail and all_reduced(src, dst, g.meta(r), mesh_shape):
            units[(v, j)] = [(v, j)] + [k for k, lead in coalesced.items() if lead == (v, j)]
    if len(units) < 2:
        return None
    fw = [n.idx for n in g.nodes if n.kind == "op" and n.phase == "fw"]
    H = nx.DiGraph()
    H.add_nodes_from(fw)
    H.add_edges_from((r.node, i) for i in fw for r in g.nodes[i].inputs() if g.nodes[r.node].kind == "op")
    groups: list[dict] = []  # {"key", "units", "sources", "after"}: sources = producers, after = consumers' reach
    for v, j in sorted(units, key=lambda u: u[0]):
        src, dst, _ = red[(v, j)]
        srcs = {g.nodes[a].inputs()[b].node for a, b in units[(v, j)]}
        reach = nx.descendants(H, v) | {v}
        key = (tuple("P" if x == "Pa" else x for x in src), tuple(dst), g.meta(g.nodes[v].inputs()[j]).dtype)
        for grp in groups:
            if grp["key"] == key and not (grp["after"] & srcs) and not (reach & grp["sources"]):
                grp["units"].append((v, j))
                grp["sources"] |= srcs
                grp["after"] |= reach
                break
        else:
            groups.append({"key": key, "units": [(v, j)], "sources": set(srcs), "after": set(reach)})
    groups = [grp for grp in groups if len(grp["units"]) > 1]
    if not groups:
        return None
    for k, grp in enumerate(groups):  # the collective after its last source, before any consumer
        H.add_edges_from((s, ("group", k)) for s in grp["sources"])
        H.add_edges_from((("group", k), v) for v, _ in grp["units"])
    try:
        order = [
            x
            for x in nx.lexicographical_topological_sort(H, key=lambda x: x if isinstance(x, int) else -1)
            if isinstance(x, int)
        ]
    except nx.NetworkXUnfeasible:  # (cannot happen: no member reads another's consumer)
        return None
    at = {i: k for k, i in enumerate(order)}
    for grp in groups:
        lead = min(grp["units"], key=lambda u: (at[u[0]], u[1]))
        members = [m for u in grp["units"] for m in units[u]]
        src, dst, _ = red[lead]
        total = TensorMeta((sum(g.meta(g.nodes[a].inputs()[b]).numel for a, b in members),), grp["key"][2])
        red[lead] = (src, dst, collectives(src, dst, total, mesh_shape, cluster))
        for m in members:
            if m != lead:
                red[m] = (red[m][0], red[m][1], ())
                coalesced[m] = lead
        coalesced.pop(lead, None)
    return order


def can_be_partial(state):
    """partial(node, output) for tail_values: whether a candidate strategy of the node (its layer's representative)
    leaves that output partial (a sum or a mean the ranks hold parts of)."""
    S, rep = state.strategies, state.rep
    return lambda i, o: any(s.out[o] is not None and any(p in ("P", "Pa") for p in s.out[o]) for s in S[rep[i]])
