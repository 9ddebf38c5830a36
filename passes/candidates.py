"""Pass: candidate placements for every node (DTensor's registry + autopar's rules), in topological order.

Nodes of repeated layers (regions pass) share their representative's candidates. Leaves (parameters, inputs) may take any Replicate/Shard placement that divides them evenly; each op gets the
strategies its rule admits given its producers' candidate output placements. Ops that fell back to
Replicate-only are listed in `state.coverage`; by default they are an error (`allow_replicate=True` or
`replicate_ops=[...]` accepts them).
"""

from __future__ import annotations

from autopar.strategies import NoStrategyError, Strategy, describe, leaf_strategies, node_strategies, user_op


def run(state) -> None:
    g, mesh_shape = state.graph, state.mesh.shape
    strategies: list[list[Strategy]] = [None] * len(g.nodes)
    sources: list[str] = [""] * len(g.nodes)
    out_cands: dict[tuple[int, int], list] = {}
    forced = state.options.get("force", {})
    pin = state.options.get("pin")
    rep, shared = state.rep, {}  # repeated layers: the first node of a class (in topological order; backward
    for n in g.nodes:  # runs layers in reverse) enumerates, the same op on the same shapes copies it
        if rep[n.idx] in shared:
            strats, src = shared[rep[n.idx]]
        elif n.kind == "op":
            in_cands = [out_cands[(r.node, r.out)] for r in n.inputs()]
            strats, src = node_strategies(n, g.meta, mesh_shape, in_cands)
        elif n.kind in ("param", "input", "buffer"):
            strats, src = leaf_strategies(n.out, mesh_shape), "leaf"
            if n.kind == "param" and n.target in forced:
                want = tuple(forced[n.target])
                strats = [s for s in strats if s.out[0] == want]
                if not strats:
                    raise ValueError(
                        f"placement {want} forced on parameter '{n.target}' of shape {n.out.shape} does "
                        f"not divide it evenly over mesh {dict(zip(state.mesh.names, mesh_shape))}"
                    )
        else:
            strats, src = [Strategy((("R",) * len(mesh_shape),), ())], "constant"
        strategies[n.idx], sources[n.idx] = strats, src
        shared.setdefault(rep[n.idx], (strats, src))
        for i in range(len(n.outs)):
            out_cands[(n.idx, i)] = list(dict.fromkeys(s.out[i] for s in strats if s.out[i] is not None))
    if pin is not None:  # placements a node's tensor outputs must take (_keeps); applied after enumeration, so
        for n in g.nodes:  # consumers still see every producer candidate (the solver redistributes between)
            want = pin(n)
            if want:
                kept = [s for s in strategies[n.idx] if _keeps(s.out, want)]
                if not kept:
                    raise ValueError(
                        f"pinned placement {want} is not a candidate of {n.name} in module "
                        f"'{n.module or '<root>'}' (candidates: "
                        f"{sorted({s.out for s in strategies[n.idx]})[:6]})"
                    )
                strategies[n.idx] = kept
    state.strategies, state.sources = strategies, sources
    fallback = {}
    for n in g.ops():
        if sources[n.idx].startswith("fallback"):
            fallback.setdefault(user_op(n), []).append((describe(n), n.module, sources[n.idx]))
    state.coverage = fallback
    allowed = set(state.options.get("replicate_ops", ()))
    bad = {op: v for op, v in fallback.items() if op not in allowed}
    if bad and not state.options.get("allow_replicate", False):
        lines = [
            f"  {op}: {len(v)} node(s), first {v[0][0]} in module '{v[0][1] or '<root>'}' [{v[0][2]}]"
            for op, v in sorted(bad.items())
        ]
        raise NoStrategyError(
            "no placement rule (and no DTensor decomposition) for these ops; they could only run "
            "replicated:\n"
            + "\n".join(lines)
            + "\npass replicate_ops=[...] (or allow_replicate=True) to accept Replicate for them"
        )


def _keeps(outs, want) -> bool:
    """Whether output placements `outs` satisfy pin `want`: {mesh dim: placement} for every tensor output,
    {(mesh dim, output index): placement} for one."""
    for key, p in want.items():
        d, sel = (key, outs) if isinstance(key, int) else (key[0], outs[key[1] : key[1] + 1])
        if any(o is not None and o[d] != p for o in sel):
            return False
    return True
