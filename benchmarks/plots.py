"""PNG plots of the benchmark rows (matplotlib, Agg): stacked compute / exposed comm / hidden comm per plan source for
every model x mesh, and planning time vs number of layers. Each figure carries the command and commit that made it
(footer text and PNG metadata)."""

from __future__ import annotations

import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ("autopar", "ddp", "fsdp2", "tp", "fsdp2_tp", "torchtitan")


def _footer(fig, header):
    fig.text(0.01, 0.005, "  ".join(header), fontsize=7, color="0.3", ha="left", va="bottom")


def _save(fig, path, header):
    fig.savefig(path, dpi=110, metadata={"Description": "; ".join(header), "Software": "benchmarks/plots.py"})
    plt.close(fig)
    return path


def plot_steps(rows, path, header) -> str:
    groups = {}
    for r in rows:
        if r["kind"] == "modeled":
            groups.setdefault((r["model"], r["mesh"], r["cluster"]), []).append(r)
    keys = list(groups)
    cols = 3
    nrows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows + 0.6), squeeze=False)
    measured = {(r["model"], r["mesh"], r["source"]): r for r in rows if r["kind"] == "measured"}
    star = None
    for ax, key in zip(axes.flat, keys):
        rs = sorted(groups[key], key=lambda r: ORDER.index(r["source"]) if r["source"] in ORDER else 99)
        names, comp, exp, hid, notes = [], [], [], [], []
        for r in rs:
            names.append(r["source"])
            if r["status"] == "ok" and r.get("modeled_step_s") is not None:
                comp.append(r["compute_s"] * 1e3)
                exp.append(r["exposed_comm_s"] * 1e3)
                hid.append(max(0.0, (r["comm_s"] - r["exposed_comm_s"]) * 1e3))
                notes.append("")
            else:
                comp.append(0.0)
                exp.append(0.0)
                hid.append(0.0)
                notes.append(r["status"])
        xs = range(len(names))
        ax.bar(xs, comp, color="#4C72B0", label="compute")
        ax.bar(xs, exp, bottom=comp, color="#C44E52", label="exposed comm")
        ax.bar(
            xs,
            hid,
            bottom=[c + e for c, e in zip(comp, exp)],
            color="#DD8452",
            alpha=0.45,
            label="comm hidden under compute",
        )
        top = max([c + e + h for c, e, h in zip(comp, exp, hid)] + [1e-9])
        for i, n in enumerate(notes):
            if n:
                ax.text(i, top * 0.05, n, rotation=90, ha="center", va="bottom", fontsize=8)
        meas = [
            (i, measured[(key[0], key[1], n)]["measured_step_s"] * 1e3)
            for i, n in enumerate(names)
            if measured.get((key[0], key[1], n), {}).get("measured_step_s") is not None
        ]
        if meas:  # measured steps on their own (right) axis: CPU timings dwarf the model
            ax2 = ax.twinx()
            ax2.plot([m[0] for m in meas], [m[1] for m in meas], "k*", ms=8, label="measured, 4 CPU ranks (right axis)")
            ax2.set_ylim(0, max(m[1] for m in meas) * 1.15)
            ax2.tick_params(axis="y", labelsize=7)
            ax2.set_ylabel("measured ms", fontsize=7)
            star = ax2
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{key[0]}  mesh {key[1]}  ({key[2]})", fontsize=9)
        ax.set_ylabel("modeled ms per step", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if star is not None:
        h2, l2 = star.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    _footer(fig, header)
    return _save(fig, path, header)


def plot_planning(rows, path, header, planning_json=os.path.join(HERE, "results", "planning.json")) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for cluster, color, marker in (("cpu-gloo", "#55A868", "s"), (None, "#4C72B0", "o")):
        pts = [
            (r["n_layers"], r["plan_s"], f"{r['model']} {r['mesh']}")
            for r in rows
            if r["kind"] == "modeled"
            and r["source"] == "autopar"
            and r.get("plan_s") is not None
            and r.get("n_layers")
            and (r["cluster"] == cluster) == (cluster is not None)
        ]
        if not pts:
            continue
        ax.scatter(
            [p[0] for p in pts],
            [p[1] for p in pts],
            color=color,
            marker=marker,
            label=f"autopar.plan, this run ({'CPU configurations' if cluster else 'at-scale configurations'})",
        )
        if cluster is None:
            for x, y, t in pts:
                ax.annotate(t, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if os.path.exists(planning_json):
        pj = json.load(open(planning_json))
        prs = sorted(pj["rows"], key=lambda r: r["layers"])
        ax.plot(
            [r["layers"] for r in prs],
            [r["cold_s"] for r in prs],
            "o-",
            color="#C44E52",
            label=f"bench_planning.py: Llama-3-8B shape, 8x8 (commit {pj['commit']})",
        )
    ax.axhline(5.0, color="0.5", ls="--", lw=1, label="goal for the 8B shape: 5 s")
    ax.set_xlabel("layers")
    ax.set_ylabel("planning time (s), capture included")
    ax.set_title("Planning time vs layers", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _footer(fig, header)
    return _save(fig, path, header)
