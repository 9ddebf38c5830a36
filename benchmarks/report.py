"""Result files of the benchmark harness: CSV (one row per model x mesh x plan source x kind), a markdown report
with the goals evaluated from the rows, and the plots. Every file states the command and the commit that made it."""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import sys

import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
HAND = ("ddp", "fsdp2", "tp", "fsdp2_tp", "torchtitan")
COLUMNS = [
    "model",
    "mesh",
    "source",
    "kind",
    "cluster",
    "status",
    "modeled_step_s",
    "compute_s",
    "comm_s",
    "exposed_comm_s",
    "objective_s",
    "measured_step_s",
    "cpu_s",
    "main_thread_cpu_s",
    "comm_bytes",
    "predicted_comm_bytes",
    "comm_bytes_match",
    "peak_mem_bytes",
    "predicted_peak_mem_bytes",
    "plan_s",
    "ratio_to_best_hand",
    "ratio_objective_to_best_hand",
    "measured_ratio_to_best_hand",
    "comm_by_kind",
    "predicted_by_kind",
    "n_layers",
    "world",
    "note",
]


commit = provenance.commit


def _ok(r, key):
    return r.get("status") == "ok" and r.get(key) is not None


def _group(rows):
    out = {}
    for r in rows:
        out.setdefault((r["model"], r["mesh"], r["kind"]), []).append(r)
    return out


def annotate(rows) -> None:
    """Fill the ratio and byte-match columns in place."""
    traces = _traced(rows)
    for (_, _, kind), rs in _group(rows).items():
        if kind == "measured":  # first the modeled figures a measured row takes (its ratios use them)
            modeled = {
                (r["mesh"], r["source"]): r for r in rows if r["kind"] == "modeled" and r["model"] == rs[0]["model"]
            }
            for r in rs:
                eng, by = _engine_prediction(r), "engine"
                if eng is None and f"{r['model']} {r['mesh']} {r['source']}" in traces:
                    eng, by = traces[f"{r['model']} {r['mesh']} {r['source']}"], "trace"
                    if "error" in eng:
                        _add_note(r, f"not traced: {eng['error']}")
                        eng = None
                if eng is not None:
                    r["predicted_comm_bytes"] = sum(v["bytes"] for v in eng.values())
                    r["predicted_collectives"], r["predicted_by"] = eng, by
                # autopar-torch lowers the same plan (same planner call: cluster cpu-gloo, same mesh and inputs)
                m = modeled.get((r["mesh"], "autopar" if r["source"] == "autopar-torch" else r["source"]))
                if m is not None and r.get("plan_hash") and m.get("plan_hash") and r["plan_hash"] != m["plan_hash"]:
                    _add_note(
                        r,
                        f"the ranks planned {r['plan_hash']}, the modeled row {m['plan_hash']}: predicted "
                        f"figures are the ranks' own",
                    )
                if r.get("predicted_comm_bytes") is None and m is not None and m.get("status") == "ok":
                    r["predicted_comm_bytes"] = m.get("predicted_comm_bytes")
                    r["predicted_peak_mem_bytes"] = m.get("predicted_peak_mem_bytes")
                    r["predicted_collectives"] = m.get("predicted_collectives")
                if m is not None and m.get("status") == "ok":
                    r.setdefault("modeled_step_s", m.get("modeled_step_s"))
                    r["plan_s"] = m.get("plan_s")
                if _ok(r, "comm_bytes") and r.get("predicted_comm_bytes") is not None:
                    a, b = r["comm_bytes"], r["predicted_comm_bytes"]
                    r["comm_bytes_match"] = (a == b == 0) or (b > 0 and abs(a - b) <= 0.01 * b)
                if r.get("comm") is not None:
                    r["comm_by_kind"] = _kinds(r["comm"])
                if r.get("predicted_collectives") is not None:
                    r["predicted_by_kind"] = _kinds(r["predicted_collectives"])
        for key, col in (
            ("modeled_step_s", "ratio_to_best_hand"),
            ("objective_s", "ratio_objective_to_best_hand"),
            ("measured_step_s", "measured_ratio_to_best_hand"),
        ):
            hand = [r[key] for r in rs if r["source"] in HAND and _ok(r, key)]
            best = min(hand) if hand else None
            for r in rs:
                if _ok(r, key) and best:
                    r[col] = r[key] / best


def _add_note(r, text: str) -> None:
    """Append "[text]" to a row's note once: a re-render annotates the rows it wrote again."""
    if f"[{text}]" not in (r.get("note") or ""):
        r["note"] = (r.get("note") or "") + f" [{text}]"


_MODELS: dict = {}


def _bench_path():
    """The benchmarks folder on sys.path (once), for its modules (hand_plans, hand_trace, bench_config)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)


def _traced(rs) -> dict:
    """The measured tp / fsdp2_tp / torchtitan rows' collectives traced on the fake process group (hand_trace.py)."""
    _bench_path()
    from hand_trace import TRACED, traced

    return traced(
        [
            (r["model"], r["mesh"], r["source"])
            for r in rs
            if r["source"] in TRACED and r.get("status") == "ok" and r["kind"] == "measured"
        ]
    )


def _engine_prediction(r) -> dict | None:
    """A measured hand row's collectives as torch's engines schedule them (hand_plans.hand_collectives: ddp and
    fsdp2), from the benchmark's model config; None for the other sources (and configs the harness does not
    define)."""
    if r.get("source") not in ("ddp", "fsdp2") or r.get("status") != "ok":
        return None
    _bench_path()
    from bench_config import MEASURED, QUICK_MEASURED, WORLD
    from hand_plans import hand_collectives

    cfg = {**MEASURED, **QUICK_MEASURED}.get(r["model"])
    if cfg is None:
        return None
    if r["model"] not in _MODELS:
        from autopar import models as M

        _MODELS[r["model"]] = M.build_model(cfg["name"], device="cpu", seed=0, **cfg["overrides"])
    return hand_collectives(r["source"], _MODELS[r["model"]], r.get("world") or WORLD)


def _kinds(d) -> str:
    return "; ".join(f"{k} x{v['count']} {v['bytes']}" for k, v in sorted(d.items())) or "none"


def write_csv(rows, path, header):
    with open(path, "w", newline="") as f:
        for h in header:
            f.write(f"# {h}\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt_csv(r.get(k)) for k in COLUMNS})


def _fmt_csv(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    if v is None:
        return ""
    return v


def _ms(v):
    return "" if v is None else f"{v * 1e3:.1f}" if v >= 0.1 else f"{v * 1e3:.3g}"


def _mb(v):
    return "" if v is None else f"{v / 1e6:.2f}" if v < 1e11 else f"{v / 1e9:,.0f}e3"


def _gib(v):
    return "" if v is None else f"{v / 2**30:.3f}" if v < 2**30 else f"{v / 2**30:.1f}"


def _x(v):
    return "" if v is None else f"{v:.3f}"


def _status(r):
    return "ok" if r["status"] == "ok" else f"**{r['status']}**"


def table_modeled(rows) -> list[str]:
    out = [
        "| model | mesh | source | status | modeled step ms | compute ms | comm ms | exposed ms | objective ms | "
        "pred. comm MB | pred. peak GiB | plan s | ratio (step) | ratio (objective) | note |",
        "|" + "---|" * 15,
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['mesh']} | {r['source']} | {_status(r)} | {_ms(r.get('modeled_step_s'))} | "
            f"{_ms(r.get('compute_s'))} | {_ms(r.get('comm_s'))} | {_ms(r.get('exposed_comm_s'))} | "
            f"{_ms(r.get('objective_s'))} | {_mb(r.get('predicted_comm_bytes'))} | "
            f"{_gib(r.get('predicted_peak_mem_bytes'))} | {_x(r.get('plan_s'))} | "
            f"{_x(r.get('ratio_to_best_hand'))} | {_x(r.get('ratio_objective_to_best_hand'))} | "
            f"{_short(r.get('note'))} |"
        )
    return out


def table_measured(rows) -> list[str]:
    out = [
        "| model | mesh | source | status | measured step ms (median) | ratio to best hand | CPU ms, all ranks "
        "(main threads) | comm MB measured | comm MB predicted | bytes match (+-1%) | peak MiB measured | "
        "peak MiB predicted | collectives measured / predicted (kind xcount bytes) | note |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        pm = r.get("peak_mem_bytes")
        pp = r.get("predicted_peak_mem_bytes")
        match = r.get("comm_bytes_match")
        out.append(
            f"| {r['model']} | {r['mesh']} | {r['source']} | {_status(r)} | {_ms(r.get('measured_step_s'))} | "
            f"{_x(r.get('measured_ratio_to_best_hand'))} | {_cpu(r)} | {_mb(r.get('comm_bytes'))} | "
            f"{_mb(r.get('predicted_comm_bytes'))} | {'' if match is None else 'yes' if match else '**no**'} | "
            f"{'' if pm is None else f'{pm / 2**20:.1f}'} | {'' if pp is None else f'{pp / 2**20:.1f}'} | "
            f"{r.get('comm_by_kind', '')} / {r.get('predicted_by_kind', '')} | {_short(r.get('note'))} |"
        )
    return out


def _cpu(r) -> str:
    c, m = r.get("cpu_s"), r.get("main_thread_cpu_s")
    return "" if c is None else f"{c * 1e3:.0f} ({m * 1e3:.0f})"


def _short(s, n=220):
    s = (s or "").replace("|", "/").replace("\n", " ")
    return s if len(s) <= n else s[:n] + "..."


# ---- goals --------------------------------------------------------------------------------------------------------

DETAIL = "\x00"  # goal text after this marker is left out of the README's compact version


def goals(rows, planning_json=os.path.join(RESULTS, "planning.json"), compact=False) -> list[str]:
    out = _goals(rows, planning_json)
    return [
        g.split(DETAIL)[0] + (" (details: benchmarks/results/bench.md)" if DETAIL in g else "")
        if compact
        else g.replace(DETAIL, "")
        for g in out
    ]


def _goals(rows, planning_json) -> list[str]:
    lines = []
    # 1. modeled autopar <= 1.00x best hand on every config; <= 0.95x on at least one family
    mod = [r for r in rows if r["kind"] == "modeled" and r["source"] == "autopar"]
    compared, miss, nohand, failed, best_fam = [], [], [], [], {}
    for r in mod:
        where = f"{r['model']} {r['mesh']} ({r['cluster']})"
        if r["status"] != "ok":
            failed.append(f"{where}: autopar {r['status']}: {_short(r.get('note'), 120)}")
        elif r.get("ratio_to_best_hand") is None:
            nohand.append(where)
        else:
            compared.append(r)
            fam = r["model"].split("-")[0]
            best_fam[fam] = min(best_fam.get(fam, 9e9), r["ratio_to_best_hand"])
            if r["ratio_to_best_hand"] > 1.0 + 1e-9:
                miss.append(
                    f"{where}: {r['ratio_to_best_hand']:.4f}x (by the solver's objective "
                    f"{r.get('ratio_objective_to_best_hand') or float('nan'):.4f}x)"
                )
    worst_obj = max((r.get("ratio_objective_to_best_hand") or 0 for r in compared), default=None)
    lines.append(
        f"1. Modeled step time of autopar <= 1.00x the best hand plan on every row: "
        f"{'MET' if compared and not miss and not failed else 'MISSED'}: "
        f"{len(compared) - len(miss)}/{len(compared)} configurations at <= 1.00x"
        + (f"; misses: {'; '.join(miss)}" if miss else "")
        + (f"; autopar fits where no hand plan does: {', '.join(nohand)}" if nohand else "")
        + (f"; autopar failed: {'; '.join(failed)}" if failed else "")
        + (
            f". By the solver's objective (compute + all comm, no overlap: what it minimizes) the worst "
            f"ratio is {worst_obj:.4f}x"
            if worst_obj is not None
            else ""
        )
    )
    fam_ok = {f: v for f, v in best_fam.items() if v <= 0.95}
    lines.append(
        f"2. <= 0.95x on at least one model family: {'MET' if fam_ok else 'MISSED'} (best ratio per family: "
        + ", ".join(f"{f} {v:.3f}x" for f, v in sorted(best_fam.items()))
        + ")"
    )
    # 3. measured comm bytes <= hand's at equal memory
    meas = [r for r in rows if r["kind"] == "measured"]
    res3, fail3 = [], []
    for (model, mesh, _), rs in _group(meas).items():
        a = next(
            (r for r in rs if r["source"] == "autopar" and _ok(r, "comm_bytes") and _ok(r, "peak_mem_bytes")), None
        )
        if a is None:
            res3.append(f"{model} {mesh}: autopar not measured")
            fail3.append(model)
            continue
        for h in rs:
            if h["source"] not in HAND or not (_ok(h, "comm_bytes") and _ok(h, "peak_mem_bytes")):
                continue
            if h["peak_mem_bytes"] >= a["peak_mem_bytes"]:
                ok = a["comm_bytes"] <= h["comm_bytes"]
                mine, theirs, unit = f"{a['comm_bytes'] / 1e6:.2f}", f"{h['comm_bytes'] / 1e6:.2f}", "MB"
                if mine == theirs and a["comm_bytes"] != h["comm_bytes"]:  # a few bytes apart: say how many
                    mine, theirs, unit = f"{int(a['comm_bytes']):,d}", f"{int(h['comm_bytes']):,d}", "bytes"
                res3.append(f"{model} {mesh} vs {h['source']}: {mine} <= {theirs} {unit} {'ok' if ok else 'MISSED'}")
                if not ok:
                    fail3.append(model)
    miss3 = [x for x in res3 if x.endswith("MISSED") or "not measured" in x]
    verdict3 = (
        "MET"
        if not fail3 and res3
        else "MISSED"
        if fail3
        else "NOT COMPARABLE (every measured hand plan uses less memory than autopar)"
    )
    lines.append(
        "3. Measured comm bytes <= every hand plan that uses at least as much peak memory (equal or more "
        f"memory than autopar): {verdict3}: "
        f"{len(res3) - len(miss3)}/{len(res3)} comparisons hold"
        + (f"; misses: {'; '.join(miss3)}" if miss3 else "")
        + DETAIL
        + ("; all: " + "; ".join(res3) if res3 else "")
    )
    # 4. measured step within 1.10x of the best hand plan (and of the hand plan with the same placements)
    res4, fail4, unlowered, torch4 = [], False, [], []
    for (model, mesh, _), rs in _group(meas).items():
        for src in ("autopar", "autopar-torch"):
            a = next((r for r in rs if r["source"] == src), None)
            if a is None:
                continue
            if a.get("measured_ratio_to_best_hand") is None:
                if src == "autopar":
                    res4.append(f"{model} {mesh} {src}: not measured ({a['status']})")
                    fail4 = True
                else:
                    unlowered.append(f"{model} {mesh}")
                continue
            ok = a["measured_ratio_to_best_hand"] <= 1.10
            fail4 = fail4 or (src == "autopar" and not ok)
            if src == "autopar-torch":
                torch4.append(ok)
            same = _same_layout(rows, model, mesh)
            extra = "".join(
                f" (vs {h['source']}, the hand plan with the same placements: "
                f"{a['measured_step_s'] / h['measured_step_s']:.2f}x)"
                for h in rs
                if h["source"] in same and _ok(h, "measured_step_s")
            )
            res4.append(
                f"{model} {mesh} {src}: {a['measured_ratio_to_best_hand']:.2f}x {'ok' if ok else 'MISSED'}" + extra
            )
    lines.append(
        f"4. Measured step time on 4 CPU ranks within 1.10x of the best hand plan: "
        f"{'MET' if not fail4 and res4 else 'MISSED'} for autopar's rows (its plan on its graph executor, "
        f"`autopar.parallelize`'s default backend)"
        + (f"; autopar-torch rows (backend='auto'): {sum(torch4)}/{len(torch4)} within 1.10x" if torch4 else "")
        + "; "
        + "; ".join(res4)
        + (
            f"; autopar-torch (backend='auto': the plan lowered to torch's engines, graph parts where they "
            f"cannot) not run on {', '.join(unlowered)}: backend='auto' runs the whole model on the graph "
            f"backend there, as the autopar row (the engines express no part alone, or that split is predicted "
            f"slower than the graph backend; reason in the row)"
            if unlowered
            else ""
        )
    )
    # 5. planning time for the 8B shape
    p8 = None
    if os.path.exists(planning_json):
        pj = json.load(open(planning_json))
        p8 = next((r for r in pj["rows"] if r["layers"] == 32), None)
    here = [r for r in mod if r["model"] == "llama3-8b" and r.get("plan_s") is not None]
    txt = (
        f"benchmarks/results/planning.md (commit {pj['commit']}): {p8['cold_s']:.2f} s cold"
        if p8
        else "benchmarks/results/planning.json has no 32-layer row"
    )
    if here:
        txt += "; this run: " + ", ".join(f"{r['mesh']} {r['plan_s']:.2f} s" for r in here)
    met = p8 is not None and p8["cold_s"] <= 5
    lines.append(
        f"5. Planning time for the 8B shape <= 5 s (bench_planning.py's 32-layer cold plan): "
        f"{'MET' if met else 'MISSED'} ({txt})"
    )
    # 6. measured bytes == predicted (+-1%)
    res6 = [r for r in meas if r.get("comm_bytes_match") is not None]
    auto6 = [r for r in res6 if r["source"] == "autopar"]
    torch6 = [r for r in res6 if r["source"] == "autopar-torch"]
    hand6 = [r for r in res6 if not r["source"].startswith("autopar") and r.get("predicted_by") is None]
    eng6 = [r for r in res6 if r.get("predicted_by") == "engine"]
    trace6 = [r for r in res6 if r.get("predicted_by") == "trace"]

    def _miss(rs):
        return [
            f"{r['model']} {r['mesh']} {r['source']}: measured {r['comm_bytes'] / 1e6:.3f} MB vs predicted "
            f"{r['predicted_comm_bytes'] / 1e6:.3f} MB"
            for r in rs
            if not r["comm_bytes_match"]
        ]

    bad_a, bad_t, bad_h, bad_e, bad_r = _miss(auto6), _miss(torch6), _miss(hand6), _miss(eng6), _miss(trace6)
    lines.append(
        f"6. Measured comm bytes per step == predicted (+-1%): autopar's rows (its plan, run by its "
        f"executor) {len(auto6) - len(bad_a)}/{len(auto6)} -> {'MET' if auto6 and not bad_a else 'MISSED'}"
        + (f" (misses: {'; '.join(bad_a)})" if bad_a else "")
        + (
            f"; autopar-torch rows (backend='auto': the plan lowered to torch's engines, and where a module "
            f"needs what they cannot express, that module on the graph backend with its own plan; predicted "
            f"as the engines' collectives (backends/torch/collectives.py) + the parts' plans; where autopar's plan "
            f"gathers the "
            f"loss input or a gradient's backward input over the data dims, which the engines cannot, "
            f"backend='torch' re-plans with those nodes partial there: autopar/targets.py) "
            f"{len(torch6) - len(bad_t)}/{len(torch6)} equal to that prediction"
            + (f" (differ: {'; '.join(bad_t)})" if bad_t else "")
            if torch6
            else ""
        )
        + (
            f"; ddp and fsdp2 rows, predicted as torch's engines schedule them (hand_plans."
            f"hand_collectives, from the parameters alone) {len(eng6) - len(bad_e)}/{len(eng6)} -> "
            f"{'MET' if not bad_e else 'MISSED'}" + (f" (misses: {'; '.join(bad_e)})" if bad_e else "")
            if eng6
            else ""
        )
        + (
            f"; tp, fsdp2_tp and torchtitan rows, predicted by tracing the same hand plan on the fake "
            f"process group (hand_trace.py: one process, no data moved) {len(trace6) - len(bad_r)}/"
            f"{len(trace6)} -> {'MET' if not bad_r else 'MISSED'}" + (f" (misses: {'; '.join(bad_r)})" if bad_r else "")
            if trace6
            else ""
        )
        + (
            f"; hand rows without a prediction of torch's schedule {len(hand6) - len(bad_h)}/{len(hand6)} "
            "(their 'predicted' is autopar's cost model of the best execution of the hand plan's parameter "
            "layout, with activations chosen by the solver)" + (f" (differ: {'; '.join(bad_h)})" if bad_h else "")
            if hand6
            else ""
        )
        + DETAIL
    )
    return lines


def headline(rows) -> list[str]:
    """One line per model x mesh: autopar vs the best hand plan, modeled and (CPU) measured."""
    out = [
        "| model | mesh | cost model | best hand plan (modeled) | autopar / best hand, modeled step | "
        "autopar / best hand, measured step (4 CPU ranks) | autopar measured bytes = predicted | autopar plan s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, mesh, kind), rs in _group(rows).items():
        if kind != "modeled":
            continue
        a = next((r for r in rs if r["source"] == "autopar"), None)
        hand = [r for r in rs if r["source"] in HAND and _ok(r, "modeled_step_s")]
        best = min(hand, key=lambda r: r["modeled_step_s"]) if hand else None
        meas = next(
            (
                r
                for r in rows
                if r["kind"] == "measured" and r["model"] == model and r["mesh"] == mesh and r["source"] == "autopar"
            ),
            None,
        )
        if a is None:
            continue
        ratio = (
            f"{a['ratio_to_best_hand']:.3f}x"
            if a.get("ratio_to_best_hand") is not None
            else a["status"]
            if a["status"] != "ok"
            else "no hand plan fits"
        )
        mratio = (
            ""
            if meas is None
            else (
                f"{meas['measured_ratio_to_best_hand']:.2f}x"
                if meas.get("measured_ratio_to_best_hand") is not None
                else f"{meas['status']}: {_short(meas.get('note'), 60)}"
            )
        )
        match = (
            ""
            if meas is None or meas.get("comm_bytes_match") is None
            else (
                f"{'yes' if meas['comm_bytes_match'] else 'no'} ({meas['comm_bytes'] / 1e6:.2f} vs "
                f"{meas['predicted_comm_bytes'] / 1e6:.2f} MB)"
            )
        )
        besttxt = f"{best['source']} {_ms(best['modeled_step_s'])} ms" if best else "none fits"
        out.append(
            f"| {model} | {mesh} | {a['cluster']} | {besttxt} | {ratio} | {mratio} | {match} | {_x(a.get('plan_s'))} |"
        )
    return out


def update_readme(lines, command, c, readme=os.path.join(os.path.dirname(HERE), "README.md")) -> bool:
    """Replace the block between the bench headline markers in README.md (if the markers are there)."""
    start, end = "<!-- bench:headline:start -->", "<!-- bench:headline:end -->"
    if not os.path.exists(readme):
        return False
    text = open(readme).read()
    if start not in text or end not in text:
        return False
    body = "\n".join([start, f"_From benchmarks/results/bench.md: `{command}` at commit `{c}`._", ""] + lines + [end])
    text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    with open(readme, "w") as f:
        f.write(text)
    return True


def _same_layout(rows, model, mesh) -> list[str]:
    """Hand sources whose modeled parameter placements equal autopar's on this model and mesh."""
    mod = {r["source"]: r for r in rows if r["kind"] == "modeled" and r["model"] == model and r["mesh"] == mesh}
    a = mod.get("autopar")
    key = lambda r: r.get("params_hash") or (params_hash(r["params"]) if r.get("params") else None)
    if a is None or key(a) is None:
        return []
    return [s for s, r in mod.items() if s in HAND and key(r) == key(a)]


def params_hash(params: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps({k: list(v) for k, v in params.items()}, sort_keys=True).encode()).hexdigest()[:16]


def write_all(rows, prefix, command, seconds, readme=False) -> list[str]:
    annotate(rows)
    c = commit()
    header = [f"command: {command}", f"commit: {c}", f"wall time: {seconds:.0f} s"]
    paths = []
    write_csv(rows, prefix + ".csv", header)
    paths.append(prefix + ".csv")
    for r in rows:  # placements: a hash is enough for "same layout" (keeps the file small)
        if r.get("params") is not None:
            r["params_hash"] = params_hash(r.pop("params"))
    with open(prefix + "_raw.json", "w") as f:
        json.dump({"command": command, "commit": c, "seconds": seconds, "rows": rows}, f, indent=1, default=str)
    paths.append(prefix + "_raw.json")
    mod = [r for r in rows if r["kind"] == "modeled"]
    meas = [r for r in rows if r["kind"] == "measured"]
    md = (
        [
            "# autopar vs hand-written plans",
            "",
            f"command: `{command}`  commit: `{c}`  wall time: {seconds:.0f} s",
            "",
            "## Goals (evaluated from the rows below)",
            "",
        ]
        + goals(rows)
        + [""]
    )
    md += ["## Headline", ""] + headline(rows) + [""]
    md += [
        "## Measured: 4 gloo ranks on this CPU (fp32, AdamW)",
        "",
        "Median of the timed steps (interleaved across sources in one launch; step time = slowest rank). "
        "CPU ms: the CPU time of a timed step summed over the 4 ranks (median), gloo's threads included, and in "
        "parentheses the ranks' main threads only; with 4 ranks on 2 cores the step time follows it. "
        "Comm bytes are counted per step from the collectives issued (plan convention: all_gather output, "
        "reduce_scatter input, all_reduce size). Peak = model state at step start (parameters, optimizer state, "
        "buffers, and the gradient buckets an engine keeps between steps: DDP's reducer, autopar-torch's "
        "gradient hook, autopar's executor) + allocation peak during the step (torch.profiler), max over ranks. 'predicted': for autopar's rows, its plan (run by its graph "
        "executor, `autopar.parallelize`); for hand rows, comm: torch's own schedule of the hand plan (ddp, fsdp2: "
        "hand_plans.hand_collectives, rules from the parameters; tp, fsdp2_tp, torchtitan: the same hand plan "
        "traced on the fake process group, benchmarks/hand_trace.py), peak memory: autopar's cost model of the "
        "best execution of the hand plan's parameter layout (activations chosen by the solver). "
        "autopar-torch is `autopar.parallelize(..., backend='auto')`: autopar's plan lowered to fully_shard / "
        "parallelize_module (backends/torch/), with the modules the engines cannot express run by the graph "
        "backend (backends/torch/mixed.py); n/a where that leaves the whole model to the graph backend. "
        "Every source computes one device's gradient of the mean loss: the hand plans and torchtitan normalize "
        "it as torchtitan 0.2.2's train_step does (each rank's summed loss over the global count of valid labels, "
        "that count all-reduced over the data-parallel ranks before the forward: 8 bytes; "
        "benchmarks/hand_plans.py), autopar by its plan (its graph executor returns the global loss). "
        "moe-debug's router aux loss (per layer, the product of the experts' load and mean probability over the "
        "tokens) is the model's in every source: the hand plans that split the batch all-reduce each layer's "
        "load and mean probability over the data-parallel ranks, every layer's in one all_reduce after the last "
        "layer (hand_plans.global_router_means: 64 bytes a layer); autopar all-reduces them in one collective at "
        "the end of the forward too, with the loss's sum and count (autopar/loss_tail.py).",
        "",
    ]
    md += table_measured(meas) + [""]
    md += [
        "## Modeled (autopar's cost model; hand plans as forced parameter placements)",
        "",
        "modeled step = compute + exposed comm (param/grad comm overlaps compute); objective = what the solver "
        "minimizes (compute + all comm, no overlap). Ratios are to the best hand plan that fits. A hand row "
        "is the hand plan's parameter placements forced (`autopar.plan(force=...)`) with everything else (activation "
        "placements, checkpointing) chosen by the same solver: the best execution of that layout under this cost "
        "model and memory budget, an optimistic stand-in for the hand plan. DDP / TP rows whose model state alone "
        "exceeds the budget are marked 'does not fit' without planning. An FSDP shard that does not divide its "
        "dim evenly (FSDP2 pads it) is moved to a dim that does (noted in the row).",
        "",
    ]
    md += table_modeled(mod) + [""]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    paths.append(prefix + ".md")
    if readme and update_readme(headline(rows) + [""] + goals(rows, compact=True), command, c):
        paths.append("README.md (headline block)")
    try:
        from plots import plot_planning, plot_steps

        paths.append(plot_steps(rows, prefix + "_steps.png", header))
        paths.append(plot_planning(rows, prefix + "_planning.png", header))
    except Exception as e:  # noqa: BLE001  (the tables are written; say why a plot is missing)
        print(f"plots not written: {type(e).__name__}: {e}")
    return paths


def median(xs):
    return statistics.median(xs) if xs else None


def main(argv=None):
    """Re-render the tables, goals and plots from a raw JSON of an earlier run (keeps its command and commit)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("raw", help="a bench_raw.json written by benchmarks/harness.py")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench"))
    ap.add_argument("--readme", action="store_true", help="also refresh the headline block of README.md")
    args = ap.parse_args(argv)
    d = json.load(open(args.raw))
    rows = d["rows"]
    for r in rows:  # recomputed by annotate
        for k in (
            "ratio_to_best_hand",
            "ratio_objective_to_best_hand",
            "measured_ratio_to_best_hand",
            "comm_bytes_match",
        ):
            r.pop(k, None)
        if r.get("note"):  # the bracketed notes annotate adds (stacked by re-renders before 2026-12)
            r["note"] = re.sub(r" \[(the ranks planned|not traced:)[^\]]*\]", "", r["note"])
    global commit
    run_commit, now = d["commit"], commit()
    commit = lambda: run_commit  # noqa: E731  (the files state the commit of the run, not of today)
    note = "  (tables and plots re-rendered by: "
    cmd = f"{d['command'].split(note)[0]}{note}python benchmarks/report.py {' '.join(argv or sys.argv[1:])} at {now})"
    paths = write_all(rows, args.out, cmd, d.get("seconds", 0.0), readme=args.readme)
    print("\n".join(f"wrote {p}" for p in paths))


if __name__ == "__main__":
    main()
