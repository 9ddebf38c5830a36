"""An HTML report of a Plan (`autopar report PLAN.json -o plan.html`): one self-contained file, no scripts and no
network, its plots inline SVG drawn here. It shows the per-module placements, the predicted step time split into
its parts, the collectives per kind and mesh dim, memory against the budget and, for pipeline plans, the schedule
as a Gantt chart. It reads the plan's JSON form (`Plan.to_json()`, what `Plan.save` writes), so a saved plan renders
as the planner's own.

Only the standard library is imported at module level: the CLI builds its parser from `add_arguments` and
`autopar --help` must not wait for torch."""

from __future__ import annotations

import html
import itertools
import re
from collections import Counter, defaultdict

NOTATION = (
    "R replicated; S<d> sharded along tensor dim d; P partial sums (a reduction is pending); "
    "Pm masked partial (the lookup of a vocab-sharded embedding). One entry per mesh dim, e.g. [S0,R]."
)
_KIND_ORDER = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
_ACTION_COLOR = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b"}
_ACTION_NAME = {"F": "forward", "B": "backward", "I": "input-grad backward", "W": "weight-grad backward"}
_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1150px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 12px; } td, th { border: 1px solid #ddd; padding: 2px 6px; }
th { background: #f0f0f0; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .pl { font-family: ui-monospace, monospace; } .note { color: #555; font-size: 12px; }
svg text { font: 11px system-ui, sans-serif; }
"""


def _esc(x) -> str:
    return html.escape(str(x))


def _ms(s: float) -> str:
    """Seconds as ms, or as us below 0.1 ms (tiny test models), three decimals."""
    return f"{s * 1e3:.3f} ms" if abs(s) >= 1e-4 or s == 0 else f"{s * 1e6:.3f} us"


def _mb(b: float) -> str:
    """Bytes of a collective: MB, or kB below 0.1 MB."""
    return f"{b / 1e6:.3f} MB" if b >= 1e5 or b == 0 else f"{b / 1e3:.3f} kB"


def _gib(b: float) -> str:
    """Bytes of memory: GiB, or MiB below 0.1 GiB."""
    return f"{b / 2**30:.3f} GiB" if b >= 0.1 * 2**30 or b == 0 else f"{b / 2**20:.3f} MiB"


def _pl(p) -> str:
    return "-" if p is None else "[" + ",".join(p) + "]"


def _table(head: list, rows: list, numeric=()) -> str:
    """An HTML table; cells are escaped here, columns whose index is in `numeric` are right-aligned."""
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=num' if i in numeric else ''}>{_esc(c)}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{th}</tr>{body}</table>"


# ---- SVG primitives -------------------------------------------------------------------------------------------
def _svg(width: int, height: int, body: list, label: str) -> str:
    return f'<svg width="{width}" height="{height}" role="img" aria-label="{_esc(label)}">' + "".join(body) + "</svg>"


def _rect(x, y, w, h, fill, tip: str) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h:.1f}" fill="{fill}" '
        f'stroke="#fff" stroke-width="0.5"><title>{_esc(tip)}</title></rect>'
    )


def _text(x, y, s, anchor="start", fill="#222") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}">{_esc(s)}</text>'


def stacked_bars(rows: list, unit, label: str, width: int = 1000) -> str:
    """Horizontal stacked bars: rows of (name, [(part, value, color)]) on one common scale; `unit` formats a value.
    Each segment carries a <title> (hover) and, when wide enough, its value inside."""
    left, bar_w, row_h = 170, width - 290, 30
    top = max((sum(v for _, v, _ in parts) for _, parts in rows), default=0.0) or 1.0
    body, legend = [], {}
    for i, (name, parts) in enumerate(rows):
        y, x = 8 + i * row_h, float(left)
        body.append(_text(left - 6, y + 16, name, "end"))
        for part, value, color in parts:
            if value <= 0:  # nothing to draw, nothing to name in the legend
                continue
            w = bar_w * value / top
            body.append(_rect(x, y, w, 22, color, f"{name}: {part} {unit(value)}"))
            if w > 70:
                body.append(_text(x + w / 2, y + 15, unit(value), "middle", "#fff"))
            legend.setdefault(part, color)
            x += w
        body.append(_text(x + 6, y + 16, unit(sum(v for _, v, _ in parts))))
    y = 12 + len(rows) * row_h
    x = left
    for part, color in legend.items():
        body += [_rect(x, y, 12, 12, color, part), _text(x + 16, y + 10, part)]
        x += 40 + 7 * len(part)  # about 6.5 px a character at 11 px
    return _svg(width, y + 22, body, label)


# ---- sections -------------------------------------------------------------------------------------------------
def _mesh_text(d: dict) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(d["mesh_names"], d["mesh_shape"]))


def _param_mesh_names(d: dict) -> list:
    """Pipeline plans place parameters and collectives on the stage submesh, not the whole mesh."""
    return list(d["schedule"].get("stage_mesh_names", d["mesh_names"])) if d["stages"] else list(d["mesh_names"])


def cost_section(d: dict) -> str:
    """The predicted step split into the parts the plan's `predicted` holds, and all comm split into exposed and
    overlapped (hidden behind compute)."""
    p = d["predicted"]
    comp, exposed, comm = p["compute_s"], p["exposed_comm_s"], p["comm_s"]
    if "busy_s" in p:  # pipeline plans: compute_s is the busiest rank's work plus its idle bubble
        step = [("busiest rank's compute", p["busy_s"], "#4c78a8"), ("pipeline bubble", p["bubble_s"], "#bab0ac")]
    else:
        rec = p.get("recompute_s", 0.0)
        step = [("compute", comp - rec, "#4c78a8")] + ([("recompute", rec, "#72b7b2")] if rec else [])
    rows = [("predicted step", step + [("exposed comm", exposed, "#e45756")])]
    comm_rows = [("all comm", [("exposed comm", exposed, "#e45756"), ("overlapped comm", comm - exposed, "#f2b701")])]
    by_class = {k: v for k, v in p.get("comm_by_class_s", {}).items() if v}
    colors = ("#9d755d", "#b279a2", "#ff9da6", "#59a14f")
    if by_class:
        comm_rows.append(
            ("comm by tensor class", [(f"{k} comm", v, colors[i % 4]) for i, (k, v) in enumerate(by_class.items())])
        )
    head = (
        f"<p>predicted step <b>{_ms(p['step_s'])}</b> = compute {_ms(comp)} + exposed comm {_ms(exposed)} "
        f"(all comm {_ms(comm)}, the rest overlapped with compute)</p>"
    )
    plots = stacked_bars(rows, _ms, "predicted step time breakdown")
    if comm:  # on its own scale: comm is often a sliver of the step
        plots += "<p>communication (exposed: the step waits for it)</p>" + stacked_bars(comm_rows, _ms, "comm time")
    return "<h2>Cost breakdown</h2>" + head + plots


def memory_section(d: dict) -> str:
    p = d["predicted"]
    peak, state = p["peak_mem_bytes"], p["state_mem_bytes"]
    budget = p.get("budget_bytes", d["meta"].get("budget_bytes"))
    parts = [("model state", state, "#4c78a8"), ("activations and transients", max(peak - state, 0.0), "#f58518")]
    rows = [("peak per rank", parts)]
    if budget is not None and budget < 1e29 and budget <= 20 * peak:
        rows.append(("budget", [("budget", budget, "#bab0ac")]))
    if budget is None or budget >= 1e29:
        note = "no memory budget was set"
    else:
        note = f"budget {_gib(budget)} per rank; peak is {100 * peak / budget:.2f}% of it"
    why = d["meta"].get("checkpointing", {}).get("why")
    return (
        "<h2>Memory</h2>"
        + f"<p>predicted peak <b>{_gib(peak)}</b> per rank (model state {_gib(state)}); {note}</p>"
        + (f"<p class=note>activation checkpointing: {_esc(why)}</p>" if why else "")
        + stacked_bars(rows, _gib, "predicted memory per rank")
    )


def collective_rows(d: dict) -> list:
    """(kind, mesh dim name, count, bytes) of the plan's collectives: the redistributes in the graph (bucketed
    gradient reductions once, as their bucket), those inside ops and the gradient buckets, as `Plan.collectives()`
    counts them."""
    names = _param_mesh_names(d)
    acc = defaultdict(lambda: [0, 0])
    calls = [c for n in d["nodes"] for r in n.get("redistribute", []) if "bucket" not in r for c in r["collectives"]]
    calls += [c for n in d["nodes"] for c in n.get("internal", [])]
    calls = [tuple(c[:3]) for c in calls]  # (kind, mesh dim, bytes[, group size])
    calls += [(b["kind"], b["mesh_dim"], b["bytes"]) for b in d["buckets"]]
    for kind, dim, nbytes in calls:
        dims = dim if isinstance(dim, (list, tuple)) else (dim,)
        key = (kind, "+".join(names[x] for x in dims))
        acc[key][0] += 1
        acc[key][1] += nbytes
    return [(k, dim, c, b) for (k, dim), (c, b) in sorted(acc.items(), key=lambda kv: (_kind_rank(kv[0][0]), kv[0]))]


def collectives_section(d: dict) -> str:
    step = d["predicted"].get("collectives", {})
    head = "<h2>Collectives</h2>"
    if not step:
        return head + "<p>collectives per step: none (every tensor stays where the plan puts it)</p>"
    per_step = [(k, v["count"], _mb(v["bytes"])) for k, v in sorted(step.items(), key=lambda kv: _kind_rank(kv[0]))]
    out = head + "<p>per training step, by kind</p>" + _table(["kind", "count", "bytes"], per_step, (1, 2))
    rows = collective_rows(d)
    if rows:
        where = "the representative stage sub-model's graph" if d["stages"] else "the plan's graph and buckets"
        out += f"<p>by kind and mesh dim, in {where}</p>"
        out += _table(["kind", "mesh dim", "count", "bytes"], [(k, m, c, _mb(b)) for k, m, c, b in rows], (2, 3))
        bars = [(f"{k} ({m})", [(k, b, _kind_color(k))]) for k, m, c, b in rows]
        out += stacked_bars(bars, _mb, "collective bytes per kind and mesh dim")
    return out


def _kind_rank(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)


def _kind_color(kind: str) -> str:
    return ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#bab0ac")[_kind_rank(kind)]


def module_rows(d: dict) -> list:
    """One row per module, in graph order (modules that only own parameters last): module, forward and backward
    op counts, its parameters' placements, its forward ops' output placements (distinct, with counts), the
    collectives its ops' inputs need and, for pipeline plans, the stage that holds it."""
    ops, outs, comm = defaultdict(Counter), defaultdict(Counter), Counter()
    order = {}
    for n in d["nodes"]:
        mod = n["module"] or "<root>"
        order.setdefault(mod, len(order))
        if n["kind"] != "op":
            continue
        ops[mod][n["phase"]] += 1
        if n["phase"] == "fw":
            outs[mod][_pl(n["placement"]["out"][0] if n["placement"]["out"] else None)] += 1
        comm[mod] += sum(len(r["collectives"]) for r in n.get("redistribute", []) if "bucket" not in r)
    params, stage_of = defaultdict(list), {}
    for st in d["stages"]:
        stage_of.update({f: st["index"] for f in st["params"]})
    for fqn, pl in d["params"].items():
        mod, _, leaf = fqn.rpartition(".")
        params[mod or "<root>"].append(f"{leaf} {_pl(pl)}")
        order.setdefault(mod or "<root>", len(order) + 10**6)
    rows = []
    for mod in sorted(order, key=lambda m: (order[m], m)):
        if not ops[mod] and not params[mod]:
            continue
        stages = sorted({stage_of[f] for f in d["params"] if f.rpartition(".")[0] == mod and f in stage_of})
        row = [mod, ops[mod]["fw"], ops[mod]["bw"], ", ".join(params[mod]) or "-"]
        row += [", ".join(f"{p} x{c}" for p, c in outs[mod].most_common()) or "-", comm[mod]]
        rows.append(row + ([",".join(map(str, stages)) or "-"] if d["stages"] else []))
    return rows


def fold_layers(rows: list) -> list:
    """Repeated layers in one row: modules whose names differ only in layer indices ("h.3.mlp" -> "h.*.mlp") and
    whose parameters are placed alike become "h.*.mlp (x12)", their stages (pipeline plans) joined. The rows that
    have ops must agree on them too; a row without ops (a layer a pipeline plan's representative graph does not
    hold) takes them from its group. A layer placed differently keeps its own rows."""
    groups = defaultdict(list)
    for row in rows:
        groups[re.sub(r"\.\d+(?=\.|$)", ".*", row[0])].append(row)
    out = []
    for key, group in groups.items():
        held = [r for r in group if r[1] or r[2]] or group
        if len(group) == 1 or any(r[3] != group[0][3] for r in group) or any(r[1:6] != held[0][1:6] for r in held):
            out += group
            continue
        row = [f"{key} (x{len(group)})", *held[0][1:6]]
        if len(group[0]) > 6:
            stages = sorted({x for r in group for x in r[6].split(",") if x != "-"}, key=int)
            row.append(",".join(stages) or "-")
        out.append(row)
    return out


def modules_section(d: dict) -> str:
    head = ["module", "fw ops", "bw ops", "parameters", "forward outputs", "input collectives"]
    note = ""
    if d["stages"]:
        head.append("stage")
        note = (
            "<p class=note>a pipeline plan's graph is the representative sub-model of its stages (one block per "
            "distinct block): op counts and outputs are for the modules it holds; every parameter is listed.</p>"
        )
    return (
        "<h2>Placements per module</h2>"
        + f"<p class=note>placements per mesh dim ({_esc(', '.join(_param_mesh_names(d)))}): {_esc(NOTATION)}</p>"
        + note
        + "<p class=note>repeated layers placed alike share a row (x count); input collectives: the redistributes "
        "its ops' inputs need (bucketed gradient reductions are counted under Collectives, once per bucket)</p>"
        + _table(head, fold_layers(module_rows(d)), (1, 2, 5))
    )


# ---- pipeline timeline ----------------------------------------------------------------------------------------
def pipeline_events(d: dict) -> list | None:
    """Per pp rank, the schedule's actions as (start_s, end_s, stage, kind, micro-batch): torch's action order for
    the plan's schedule, list-scheduled with the stages' F/B/W times and sends as the planner simulated them. None
    when the schedule cannot be re-simulated or the re-simulation does not reproduce the plan's own timeline (then
    the text timeline is drawn instead)."""
    from . import pipeline_model as pm  # torch's schedule generators: imported only for pipeline plans

    sc, st = d["schedule"], sorted(d["stages"], key=lambda s: s["index"])
    try:
        spec = pm.get_schedule(sc["name"])
        p, v, m = sc["pp"], sc["stages_per_rank"], sc["n_microbatches"]
        order = pm.actions(spec, p, m, v)
        F, B, W = ([s["time"][k] for s in st] for k in ("F_s", "B_s", "W_s"))
        p2p = [s.get("send", {}).get("time_s", 0.0) for s in st]
        sim = pm.simulate(order, pm.stage_ranks(spec, p, v), F, B, W, p2p)
    except (ValueError, KeyError, RuntimeError):  # an unknown schedule name, a field this version lacks
        return None
    return sim.events if pm.timeline(sim) == sc.get("timeline") else None


def _timeline_runs(rows: list) -> list:
    """The plan's text timeline (one character per time slice) as runs (start, end, stage label, kind, None) per
    rank, in slice units."""
    out = []
    for row in rows:
        cells = row.split("|")[1] if "|" in row else row
        runs = [(k, len(list(g))) for k, g in itertools.groupby(cells)]
        t, ev = 0, []
        for ch, n in runs:
            if ch != ".":
                ev.append((t, t + n, "first" if ch.isupper() else "later", ch.upper(), None))
            t += n
        out.append(ev)
    return out


def _action_box(x, y, w, stage, kind, mb, faded: bool, span: str) -> list:
    """One action of the schedule: a box coloured by kind (faded for the rank's later stage), a hover title, and
    its kind and micro-batch written inside when it is wide enough."""
    where = f"stage {stage}" if isinstance(stage, int) else f"the rank's {stage} stage"  # from the text timeline
    tip = f"{where} {_ACTION_NAME.get(kind, kind)}" + ("" if mb is None else f" micro-batch {mb}") + f" {span}"
    out = [
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="26" fill="{_ACTION_COLOR.get(kind, "#999")}"'
        f' fill-opacity="{0.5 if faded else 1.0}" stroke="#fff" stroke-width="0.5"><title>{_esc(tip)}</title></rect>'
    ]
    if mb is not None and w > 26:
        out.append(_text(x + w / 2, y + 17, f"{kind}{mb}", "middle", "#222" if faded else "#fff"))
    return out


def gantt(events: list, label_unit, later_stage: dict, width: int = 1100) -> str:
    """Rows per pp rank, one box per action (colour by kind, faded for the rank's later stages), a time axis."""
    left, right, row_h = 70, 50, 34
    end = max((e for ev in events for _, e, *_ in ev), default=1.0) or 1.0
    scale = (width - left - right) / end
    y_axis = 10 + len(events) * row_h
    body = []
    for k in range(6):  # grid first, so the boxes cover it
        x = left + k * (width - left - right) / 5
        body += [
            f'<line x1="{x:.1f}" y1="4" x2="{x:.1f}" y2="{y_axis - 4}" stroke="#ddd"/>',
            _text(x, y_axis + 8, label_unit(k * end / 5), "middle"),
        ]
    for r, ev in enumerate(events):
        y = 6 + r * row_h
        body.append(_text(left - 6, y + 18, f"rank {r}", "end"))
        for s, e, stage, kind, mb in ev:
            faded = later_stage.get((r, stage), False)
            body += _action_box(
                left + s * scale, y, (e - s) * scale, stage, kind, mb, faded, f"{label_unit(s)}-{label_unit(e)}"
            )
    return _svg(width, y_axis + 14, body, "pipeline schedule timeline")


def pipeline_section(d: dict) -> str:
    if not d["stages"]:
        return "<h2>Pipeline</h2><p>no pipeline: the plan runs one SPMD program on the whole mesh</p>"
    sc = d["schedule"]
    head = (
        f"<h2>Pipeline</h2><p>schedule <b>{_esc(sc['name'])}</b>: {sc['num_stages']} stages on pp={sc['pp']} "
        f"({sc['stages_per_rank']} per rank), {sc['n_microbatches']} micro-batches, bubble "
        f"{sc['bubble_fraction'] * 100:.1f}%, pipeline {_ms(sc['pipeline_s'])}</p>"
    )
    st = sorted(d["stages"], key=lambda s: s["index"])
    first = {}
    for s in st:
        first.setdefault(s["pp_rank"], s["index"])
    later = {(s["pp_rank"], s["index"]): s["index"] != first[s["pp_rank"]] for s in st}
    events = pipeline_events(d)
    if events is None:  # draw the plan's own text timeline: slices, not seconds; stages as first/later
        events = _timeline_runs(sc.get("timeline", []))
        later = {(r, "later"): True for r in range(len(events))}
        width = max((len(r.split("|")[1]) for r in sc.get("timeline", []) if "|" in r), default=1)
        unit = lambda x: _ms(x * sc["pipeline_s"] / width)
    else:
        unit = _ms
    legend = "; ".join(f"{k} {v}" for k, v in _ACTION_NAME.items())
    note = f"<p class=note>{_esc(legend)}; faded: the rank's later stage; label: kind and micro-batch</p>"
    rows = [
        (s["index"], s["pp_rank"], ", ".join(s["clusters"]), f"{s['n_params'] / 1e6:.3f}M")
        + tuple(_ms(s["time"][k]) for k in ("F_s", "B_s", "W_s"))
        + (_gib(s["memory"]["rank_peak_bytes"]),)
        for s in st
    ]
    table = _table(["stage", "pp rank", "clusters", "params", "F", "B", "W", "rank peak"], rows, (0, 1, 3, 4, 5, 6, 7))
    return head + gantt(events, unit, later) + note + table


# ---- the page and the CLI -------------------------------------------------------------------------------------
def render_html(plan) -> str:
    """The report of `plan` (a Plan) as one self-contained HTML page."""
    d = plan.to_json()
    p = d["predicted"]
    title = f"autopar plan {plan.hash()}"
    header = (
        f"<h1>{_esc(title)}</h1><p>mesh [{_esc(_mesh_text(d))}], cluster {_esc(d['cluster'])}, predicted step "
        f"{_ms(p['step_s'])}, peak {_gib(p['peak_mem_bytes'])} per rank, solver {_esc(d['solver'].get('status'))}</p>"
    )
    sections = [cost_section(d), collectives_section(d), memory_section(d), pipeline_section(d), modules_section(d)]
    sections.append(  # the same plan as text: what `autopar plan` prints, for searching and copying
        f"<h2>Summary</h2><details><summary>plan.summary() as text</summary><pre>{_esc(plan.summary())}</pre></details>"
    )
    return (
        f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{_esc(title)}</title>"
        f"<style>{_CSS}</style></head><body>{header}{''.join(sections)}</body></html>\n"
    )


def add_arguments(parser) -> None:
    """The `autopar report` arguments: the plan file and the output path."""
    parser.add_argument("plan", metavar="PLAN.json", help="a plan saved by Plan.save() or `autopar plan --out`")
    parser.add_argument("-o", "--out", default="plan.html", help="where to write the HTML report (default plan.html)")


def main(args) -> int:
    """Load the plan (no planning), render it, write the file; returns the exit status."""
    from .plan import Plan  # torch comes with it; only a command that renders pays for it

    page = render_html(Plan.load(args.plan))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {args.out} ({len(page) / 1e3:.1f} kB)")
    return 0
