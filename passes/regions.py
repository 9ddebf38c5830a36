"""Pass: find repeated layers (the children of an nn.ModuleList whose fw+bw subgraphs are identical) so later
passes decide once per region and share the decision across layers.

A layer's nodes are those whose module path lies under `<list>.<i>`. Two layers are the same region when their
node sequences match op for op, shape for shape, with internal edges at the same relative positions (an exact
signature; `layer_hash` gives networkx's Weisfeiler-Lehman hash of a layer for reports and tests).
"""

from __future__ import annotations

import re
from collections import defaultdict

import warnings

import networkx as nx

from autopar.graph import Ref

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _layer_of(module: str):
    m = _LAYER.match(module)
    return (m.group(1), int(m.group(2))) if m else None


def _signature(g, members: list[int], force=None, pin=None):
    """Exact signature of a layer; user constraints (forced parameter placements, pinned nodes) are part of it,
    so a layer constrained differently from its siblings gets its own decisions."""
    pos = {idx: i for i, idx in enumerate(members)}
    force = force or {}

    def arg(a):
        if isinstance(a, Ref):
            if a.node in pos:
                return ("in", pos[a.node], a.out)
            n = g.nodes[a.node]
            return ("ext", n.kind, tuple(n.outs[a.out].shape), a.out)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, arg(v)) for k, v in a.items()))
        return a

    sig = []
    for idx in members:
        n = g.nodes[idx]
        leaf_name = _LAYER.sub("", n.target) if n.kind == "param" else None
        user = (
            force.get(n.target) if n.kind == "param" else None,
            tuple(sorted((pin(n) or {}).items(), key=str)) if pin is not None else None,
        )
        sig.append(
            (n.kind, str(n.target) if n.kind == "op" else leaf_name, n.phase, n.outs, arg(n.args), arg(n.kwargs), user)
        )
    return tuple(sig)


def layer_hash(g, members) -> str:
    pos = set(members)
    G = nx.DiGraph()
    for idx in members:
        n = g.nodes[idx]
        G.add_node(idx, label=f"{n.kind}:{n.target if n.kind == 'op' else ''}:{n.outs}")
        for r in n.inputs():
            if r.node in pos:
                G.add_edge(r.node, idx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # networkx 3.5 notes that directed hashes changed; we only compare them
        return nx.weisfeiler_lehman_graph_hash(G, node_attr="label", iterations=2)


def run(state) -> None:
    g = state.graph
    layers: dict[tuple[str, int], list[int]] = defaultdict(list)
    for n in g.nodes:
        key = _layer_of(n.target if n.kind == "param" else n.module)
        if key is not None:
            layers[key].append(n.idx)
    by_list = defaultdict(list)
    for (prefix, i), members in sorted(layers.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        by_list[prefix].append((i, members))
    rep = list(range(len(g.nodes)))
    region_of = [None] * len(g.nodes)
    regions = []
    for prefix, items in sorted(by_list.items()):
        groups: dict[tuple, list] = defaultdict(list)
        for i, members in items:
            groups[_signature(g, members, state.options.get("force"), state.options.get("pin"))].append((i, members))
        for base_sig, same in groups.items():
            copies = same
            if len(copies) < 2:
                for i, m in same:
                    for idx in m:
                        region_of[idx] = (prefix, i)
                continue
            base = copies[0][1]
            regions.append({"prefix": prefix, "layers": [i for i, _ in copies], "nodes_per_layer": len(base)})
            for i, m in copies:
                for a, b in zip(base, m):
                    rep[b] = a
                    region_of[b] = (prefix, i)
    state.rep, state.region_of, state.regions = rep, region_of, regions
