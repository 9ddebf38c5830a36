"""`autopar explain PLAN.json`: why each placement, from what the plan recorded at plan time.

The solver decides per group of nodes (a root and the views / pointwise ops that follow it; repeated layers share
their representative's group). `Plan.meta["alternatives"]` (passes/alternatives.py) holds, per group, the chosen
candidate's local cost and the runner-up's: compute plus the communication the group pays, every other group kept
at its choice. A pure function of the Plan: no planner, no torch.
"""

from __future__ import annotations

from collections import Counter

LOCAL_COST = (
    "local cost: the group's compute + the comm it pays (redistributes inside it and to its neighbours), every "
    "other decision fixed; gradient-bucket latency and shared redistributes span groups and are not in it"
)


def explain(plan, module: str | None = None, per_node: bool = False, closest: int | None = None) -> str:
    """The plan's decisions in graph order (those with a node in `module` or below); `closest=N`: only the N whose
    runner-up is nearest in local cost (either way), nearest first."""
    alt = plan.meta.get("alternatives")
    lines = _header(plan)
    nodes = [n for n in plan.nodes if _in_module(n["module"], module)]
    if module is not None and not nodes:
        known = sorted({n["module"] for n in plan.nodes if n["module"]})
        raise ValueError(f"--module {module!r} has no nodes in this plan; modules include: {', '.join(known[:8])}")
    if not alt:
        lines.append("this plan records no runner-ups (a pipeline plan, or saved before they were recorded):")
        lines += [_node_line(n) for n in nodes]
        return "\n".join(lines)
    group_of = alt["group_of"]
    sizes = Counter(group_of)
    members: dict[int, list] = {}
    for n in nodes:
        members.setdefault(group_of[n["idx"]], []).append(n)
    lines += [LOCAL_COST, ""]
    for g in _order(alt["groups"], members, closest):
        lines += _group_lines(plan, alt["groups"][g], members[g], sizes[g])
        if per_node:
            lines += ["      " + _node_line(n) for n in members[g]]
    shown = f"the {min(closest, len(members))} closest of " if closest else ""
    lines.append(
        f"\n{shown}{len(members)} decisions over {len(nodes)} nodes" + (f" of module {module}" if module else "")
    )
    return "\n".join(lines)


def _order(groups: list, members: dict, closest: int | None) -> list[int]:
    if not closest:
        return sorted(members, key=lambda g: groups[g]["node"])
    margin = lambda g: abs(groups[g]["runner_up"]["cost_s"] - groups[g]["chosen"]["cost_s"])
    return sorted((g for g in members if groups[g]["runner_up"]), key=lambda g: (margin(g), groups[g]["node"]))[
        :closest
    ]


def _header(plan) -> list[str]:
    p = plan.predicted
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh_names, plan.mesh_shape))
    return [
        f"plan {plan.hash()}  mesh [{mesh}]  cluster {plan.cluster}",
        f"predicted step {_ms(p['step_s'])} = compute {_ms(p['compute_s'])} + exposed comm "
        f"{_ms(p['exposed_comm_s'])}; peak memory {p['peak_mem_bytes'] / 2**30:.3f} GiB per rank",
        "",
    ]


def _in_module(name: str, module: str | None) -> bool:
    return module is None or name == module or name.startswith(module + ".") or (module in ("", "<root>") and not name)


def _group_lines(plan, group: dict, shown: list, size: int) -> list[str]:
    root = plan.nodes[group["node"]]
    where = root["module"] or "<root>"
    chosen, runner = group["chosen"], group["runner_up"]
    head = (
        f"{root['name']}  {root['phase']}  {where}  ({size} node{'s' * (size > 1)}, {group['candidates']} candidates)"
    )
    if len(shown) != size:
        head += f", {len(shown)} of them here"
    lines = [head, f"    chosen     {_figures(chosen)}"]
    if runner is None:
        return lines + ["    the only candidate"]
    lines.append(f"    runner-up  {_figures(runner)}")
    lines.append(f"    why: {_why(chosen, runner, plan)}")
    return lines


def _figures(f: dict) -> str:
    return (
        f"{f['placement']:<40} {_us(f['cost_s'])} (compute {_us(f['compute_s'])} + comm {_us(f['comm_s'])}), "
        f"memory {_bytes(f['memory_bytes'])}"
    )


def _why(chosen: dict, runner: dict, plan) -> str:
    d = runner["cost_s"] - chosen["cost_s"]
    dm = runner["memory_bytes"] - chosen["memory_bytes"]
    memory = f"{_bytes(abs(dm))} {'more' if dm > 0 else 'less'} memory per rank" if dm else "the same memory"
    scale = max(abs(chosen["cost_s"]), abs(runner["cost_s"]), 1e-12)
    if abs(d) <= 1e-9 * scale:
        return f"a tie on local cost (the runner-up with {memory}); the solver kept the first"
    if d > 0:
        parts = f"compute {_us(runner['compute_s'] - chosen['compute_s'], True)}, comm {_us(runner['comm_s'] - chosen['comm_s'], True)}"
        return f"the runner-up costs {_us(d)} more ({parts}), with {memory}"
    budget = plan.predicted.get("budget_bytes") or plan.meta.get("budget_bytes")
    if dm > 0 and budget:
        return (
            f"the runner-up is {_us(-d)} cheaper here but needs {memory}; the plan peaks at "
            f"{plan.predicted['peak_mem_bytes'] / 1e9:.3f} of {budget / 1e9:.3f} GB"
        )
    return (
        f"the runner-up is {_us(-d)} cheaper here ({memory}); the terms the local cost leaves out (bucket "
        "latency, shared redistributes) or the solver's optimality gap decided"
    )


def _node_line(n: dict) -> str:
    pl = " ".join("[" + ",".join(p) + "]" if p is not None else "-" for p in n["placement"]["out"])
    ins = " ".join("[" + ",".join(p) + "]" for p in n["placement"]["ins"])
    return f"{n['name']:<44} {n['phase']} {n['module'] or '<root>':<32} out {pl}" + (f" in {ins}" if ins else "")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _us(s: float, sign: bool = False) -> str:
    return f"{s * 1e6:+.2f} us" if sign else f"{s * 1e6:.2f} us"


def _bytes(n: float) -> str:
    unit, scale = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= s), ("B", 1))
    return f"{n / scale:.3f} {unit}" if scale > 1 else f"{n:.0f} B"
