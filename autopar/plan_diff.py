"""`autopar diff A.json B.json`: two plans side by side (a pure function of the two Plans; no planner).

Predicted step time and its parts, memory, the collectives of one step per kind and mesh dim (count and bytes),
the parameter placements that differ (repeated layers folded to '*'), and the nodes placed differently, per module.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

_LAYER = re.compile(r"\.(\d+)\.")


def diff(a, b, labels=("A", "B"), per_node: bool = False) -> str:
    lines = [f"{'':<30} {'A':>18} {'B':>18} {'B - A':>18}", f"A: {labels[0]}", f"B: {labels[1]}", ""]
    lines += _headline(a, b)
    lines += ["", "collectives per step (kind, mesh dim): count, MB"] + _collectives(a, b)
    lines += ["", "parameter placements that differ (A -> B)"] + _params(a, b)
    lines += [""] + _nodes(a, b, per_node)
    return "\n".join(lines)


def _row(label: str, x, y, fmt) -> str:
    if x is None or y is None:
        return f"  {label:<28} {fmt(x) if x is not None else '-':>18} {fmt(y) if y is not None else '-':>18}"
    pct = f" ({(y - x) / x * 100:+.1f}%)" if x else ""
    return f"  {label:<28} {fmt(x):>18} {fmt(y):>18} {fmt(y - x, True) + pct:>18}"


def _unit(values, units):
    """A formatter in the largest unit of `units` [(name, scale)] that the largest value reaches."""
    top = max(abs(v) for v in values if v is not None)
    name, scale = next(((n, s) for n, s in units if top >= s), units[-1])
    return lambda v, sign=False: f"{v / scale:+.3f} {name}" if sign else f"{v / scale:.3f} {name}"


def _headline(a, b) -> list[str]:
    pa, pb = a.predicted, b.predicted
    ms = _unit([pa["step_s"], pb["step_s"]], [("ms", 1e-3), ("us", 1e-6)])
    gib = _unit([pa["peak_mem_bytes"], pb["peak_mem_bytes"]], [("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)])
    mesh = lambda p: "x".join(map(str, p.mesh_shape)) + "(" + ",".join(p.mesh_names) + ")"
    lines = [
        f"  {'plan':<28} {a.hash():>18} {b.hash():>18}",
        f"  {'mesh':<28} {mesh(a):>18} {mesh(b):>18}",
        f"  {'cluster':<28} {a.cluster:>18} {b.cluster:>18}",
        _row("predicted step", pa["step_s"], pb["step_s"], ms),
        _row("  compute", pa["compute_s"], pb["compute_s"], ms),
        _row("  exposed comm", pa["exposed_comm_s"], pb["exposed_comm_s"], ms),
        _row("all comm", pa["comm_s"], pb["comm_s"], ms),
    ]
    by_class = pa.get("comm_by_class_s", {}), pb.get("comm_by_class_s", {})
    for k in sorted(set(by_class[0]) | set(by_class[1])):
        lines.append(_row(f"  {k} comm", by_class[0].get(k), by_class[1].get(k), ms))
    lines += [
        _row("peak memory per rank", pa["peak_mem_bytes"], pb["peak_mem_bytes"], gib),
        _row("  model state", pa["state_mem_bytes"], pb["state_mem_bytes"], gib),
        _row("  activation peak", pa["act_peak_bytes"], pb["act_peak_bytes"], gib),
    ]
    return lines


def _by_kind_dim(plan) -> dict:
    out = defaultdict(lambda: [0, 0])
    for kind, dim, nbytes in plan.collectives():
        cell = out[(kind, plan._dim_name(dim))]
        cell[0] += 1
        cell[1] += nbytes
    return out


def _collectives(a, b) -> list[str]:
    ca, cb = _by_kind_dim(a), _by_kind_dim(b)
    cell = lambda c: f"x{c[0]} {c[1] / 1e6:.3f}" if c else "-"
    rows = []
    for key in sorted(set(ca) | set(cb)):
        x, y = ca.get(key), cb.get(key)
        delta = f"{(y or [0, 0])[0] - (x or [0, 0])[0]:+d} {((y or [0, 0])[1] - (x or [0, 0])[1]) / 1e6:+.3f}"
        rows.append(f"  {key[0] + ' ' + key[1]:<28} {cell(x):>18} {cell(y):>18} {delta:>18}")
    return rows or ["  none in either plan"]


def _folded(plan) -> dict:
    rows = defaultdict(set)
    for fqn, pl in plan.params.items():
        rows[_LAYER.sub(".*.", fqn)].add("[" + ",".join(pl) + "]")
    return {k: " ".join(sorted(v)) for k, v in rows.items()}


def _params(a, b) -> list[str]:
    fa, fb = _folded(a), _folded(b)
    rows = [
        f"  {k:<44} {fa.get(k, '-')} -> {fb.get(k, '-')}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)
    ]
    same = sum(1 for k in fa if fa.get(k) == fb.get(k))
    return rows + [f"  ({same} of {len(set(fa) | set(fb))} parameter groups placed alike)"]


def _nodes(a, b, per_node: bool) -> list[str]:
    sig = lambda p: [(n["name"], n["target"], n["module"]) for n in p.nodes]
    if sig(a) != sig(b):
        return [f"the graphs differ ({len(a.nodes)} vs {len(b.nodes)} nodes): node placements not compared"]
    differ = [(x, y) for x, y in zip(a.nodes, b.nodes) if x["placement"] != y["placement"]]
    lines = [f"nodes placed differently: {len(differ)} of {len(a.nodes)}"]
    per_module = Counter(_LAYER.sub(".*.", x["module"] + ".").rstrip(".") or "<root>" for x, _ in differ)
    lines += [f"  {m:<44} {c}" for m, c in sorted(per_module.items())]
    if per_node:
        lines += ["", "node placements that differ (out placements, A -> B)"]
        lines += [f"  {x['name']:<44} {x['module'] or '<root>':<32} {_out(x)} -> {_out(y)}" for x, y in differ]
    return lines


def _out(n: dict) -> str:
    return " ".join("[" + ",".join(p) + "]" if p is not None else "-" for p in n["placement"]["out"])
