"""The HTML report (autopar/report.py): its content for a flat plan and a pipeline plan (modules, collectives, the
SVG plots, the Gantt of the schedule), `main` rendering a saved plan without planning, and the page opened in a real
headless Chromium whose screenshot shows the plots. Planning only (meta tensors, a simulated mesh)."""

from __future__ import annotations

import argparse
import copy
import html
import os
import re
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

import autopar
from autopar import models, report
from autopar.mesh import MeshSpec
from _clusters import TP_FRIENDLY

# slow compute and bandwidth-bound links: llama-tiny at 8 tokens a row shards its Linears over tp and its batch over
# dp, so the report has placements of every kind and collectives on both mesh dims (as tests/test_pipeline_dist.py)
CLUSTER = TP_FRIENDLY
SCREEN = (1200, 1600)


@pytest.fixture(scope="module")
def flat_plan():
    m = models.build_model("llama-tiny", device="meta", n_layers=2)
    x = models.example_inputs("llama-tiny", batch=4, seq=8, device="meta", n_layers=2)
    return autopar.plan(m, MeshSpec((2, 2), ("dp", "tp")), x, cluster=CLUSTER)


@pytest.fixture(scope="module")
def pipe_plan():
    """4 stages, 2 per pp rank (Interleaved1F1B), each on a tp=2 submesh."""
    m = models.build_model("llama-tiny", device="meta", n_layers=4)
    x = models.example_inputs("llama-tiny", batch=4, seq=8, device="meta", n_layers=4)
    pipeline = {"schedules": ["Interleaved1F1B"], "n_microbatches": [2]}
    return autopar.plan(m, MeshSpec((2, 2), ("pp", "tp")), x, cluster=CLUSTER, pipeline=pipeline)


def _cells(page: str, heading: str) -> list[list[str]]:
    """The rows (cell texts) of the first table after `heading` in the page."""
    at = page.index(f"<h2>{heading}</h2>")
    table = page[at : page.index("</table>", at)]
    return [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)] for row in table.split("<tr>")[2:]]


def test_flat_report_lists_modules_collectives_and_plots(flat_plan):
    plan = flat_plan
    page = report.render_html(plan)
    assert page.startswith("<!DOCTYPE html>") and plan.hash() in page
    assert not re.search(r"<script|<link|src=|https?://", page)  # self-contained: nothing fetched, nothing run
    # every module that owns a parameter has a row with that parameter's placement in the plan's notation
    rows = {r[0]: r for r in report.module_rows(plan.to_json())}
    for fqn, pl in plan.params.items():
        mod, _, leaf = fqn.rpartition(".")
        assert f"{leaf} [{','.join(pl)}]" in rows[mod][3], (fqn, rows[mod])
    assert any("S0" in r[3] for r in rows.values()) and any("S1" in r[3] for r in rows.values())
    ops = sum(1 for n in plan.nodes if n["kind"] == "op")
    assert sum(r[1] + r[2] for r in rows.values()) == ops  # every op counted once, under its module
    # collectives: the per-step table is the plan's prediction; per kind and mesh dim they add up to the plan's list
    step = _cells(page, "Collectives")
    assert {r[0]: int(r[1]) for r in step} == {k: v["count"] for k, v in plan.predicted["collectives"].items()}
    by_dim = report.collective_rows(plan.to_json())
    assert sum(c for *_, c, _ in by_dim) == len(plan.collectives())
    assert {m for _, m, _, _ in by_dim} >= {"dp", "tp"}
    table = _cells(page, "Placements per module")
    assert [r[0] for r in table] == [r[0] for r in report.fold_layers(list(rows.values()))]
    assert "layers.*.attention.wq (x2)" in [r[0] for r in table]  # two layers placed alike: one row
    assert page.count("<svg") == 4  # step, comm, collectives, memory
    assert "no pipeline" in page and "<title>predicted step: compute" in page
    assert html.escape(plan.summary().splitlines()[1]) in page  # the text summary, folded away at the end


def test_fold_layers_keeps_a_layer_placed_differently():
    rows = [
        ["h.0.mlp", 4, 8, "weight [S0]", "[S1] x1", 0, "0"],
        ["h.1.mlp", 0, 0, "weight [S0]", "-", 0, "1"],  # not in a pipeline plan's representative graph
        ["h.2.mlp", 4, 8, "weight [S0]", "[S1] x1", 0, "1"],
        ["h.0.attn", 4, 8, "weight [S0]", "[S1] x1", 0, "0"],
        ["h.1.attn", 4, 8, "weight [R]", "[R] x1", 0, "1"],
    ]
    assert report.fold_layers(rows) == [["h.*.mlp (x3)", 4, 8, "weight [S0]", "[S1] x1", 0, "0,1"]] + rows[3:]


def test_pipeline_report_draws_the_schedule(pipe_plan):
    plan = pipe_plan
    d = plan.to_json()
    sc = plan.schedule
    events = report.pipeline_events(d)
    assert events is not None  # the re-simulation reproduces the plan's own timeline
    assert len(events) == sc["pp"]
    assert sum(len(ev) for ev in events) == 2 * sc["num_stages"] * sc["n_microbatches"]  # one F and one B each
    assert max(e for ev in events for _, e, *_ in ev) == pytest.approx(sc["pipeline_s"])
    page = report.render_html(plan)
    assert "no pipeline" not in page and f"schedule <b>{sc['name']}</b>" in page
    gantt = page[page.index('aria-label="pipeline schedule timeline"') :]
    gantt = gantt[: gantt.index("</svg>")]
    assert len(re.findall(r"<title>stage \d (forward|backward) micro-batch \d", gantt)) == sum(map(len, events))
    assert 'fill-opacity="0.5"' in gantt  # the ranks' second stages are drawn faded
    stages = _cells(page, "Pipeline")
    assert [int(r[0]) for r in stages] == list(range(sc["num_stages"]))
    held = {r[0]: r[-1] for r in report.module_rows(d)}
    assert held["layers.3.attention.wq"] == "3" and held["tok_embeddings"] == "0"


def test_pipeline_report_falls_back_to_the_text_timeline(pipe_plan):
    """A plan whose timeline the re-simulation does not reproduce (here: edited) is drawn from its own text rows:
    one box per run of equal characters, idle slices left empty."""
    plan = copy.deepcopy(pipe_plan)
    rows = plan.schedule["timeline"]
    rows[0] = rows[0].replace("F", "B", 1)
    assert report.pipeline_events(plan.to_json()) is None
    gantt = report.render_html(plan).split('aria-label="pipeline schedule timeline"')[1].split("</svg>")[0]
    runs = sum(len(re.findall(r"([A-Za-z])\1*", r.split("|")[1])) for r in rows)
    assert len(re.findall(r"<title>the rank&#x27;s (first|later) stage", gantt)) == runs


def test_main_renders_a_saved_plan_without_planning(flat_plan, tmp_path, monkeypatch):
    path, out = tmp_path / "plan.json", tmp_path / "plan.html"
    flat_plan.save(path)

    def no_planning(*a, **k):
        raise AssertionError("the report must not plan")

    monkeypatch.setattr(autopar, "plan", no_planning)
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    assert report.main(parser.parse_args([str(path), "-o", str(out)])) == 0
    assert out.read_text() == report.render_html(autopar.Plan.load(path))


# ---- the page in a real browser -------------------------------------------------------------------------------
def read_png(path) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes) as an (h, w, channels) uint8 array."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunks.setdefault(kind, []).append(data[pos + 8 : pos + 8 + n])
        pos += 12 + n
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and color in (2, 6) and not interlace, (depth, color, interlace)
    ch = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(h, 1 + w * ch)
    out = np.zeros((h, w * ch), np.int32)
    prev = np.zeros(w * ch, np.int32)
    for y in range(h):
        out[y] = prev = _unfilter(raw[y, 0], raw[y, 1:].astype(np.int32), prev, ch)
    return out.reshape(h, w, ch).astype(np.uint8)


def _unfilter(kind: int, line: np.ndarray, up: np.ndarray, ch: int) -> np.ndarray:
    """Undo one scanline's PNG filter (RFC 2083 6.3): None, Sub, Up vectorized; Average, Paeth pixel by pixel."""
    if kind == 0:
        return line
    if kind == 2:
        return (line + up) & 255
    if kind == 1:
        return np.cumsum(line.reshape(-1, ch), axis=0).reshape(-1) & 255
    cur, up = line.tolist(), up.tolist()  # plain ints: numpy scalars are slow one at a time
    for i in range(len(cur)):
        a = cur[i - ch] if i >= ch else 0
        b, c = up[i], (up[i - ch] if i >= ch else 0)
        if kind == 3:
            cur[i] = (cur[i] + (a + b) // 2) & 255
        else:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return np.array(cur, np.int32)


def _chromium() -> str:
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    if exe is None:
        pytest.fail(
            "Chromium is not installed: the HTML report is checked in a real headless browser. "
            "Install it with `apt-get install -y chromium` (.ci/run does this when it is missing)."
        )
    return exe


def test_report_renders_in_headless_chromium(pipe_plan, tmp_path):
    page, shot = tmp_path / "plan.html", tmp_path / "plan.png"
    page.write_text(report.render_html(pipe_plan))
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    cmd += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    cmd += [f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=%d,%d" % SCREEN]
    run = subprocess.run(cmd + [page.as_uri()], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and shot.exists(), f"chromium failed ({run.returncode}):\n{run.stderr[-3000:]}"
    img = read_png(shot)[..., :3]
    assert img.shape[:2] == SCREEN[::-1]
    ink = np.any(img < 240, axis=-1).mean()
    assert 0.03 < ink < 0.6, f"{ink:.1%} of the screenshot is not white: blank or unstyled"
    # the SVG plots were drawn: forward boxes (#4c78a8) and backward boxes (#e45756) of the Gantt, the bubble (#bab0ac)
    for rgb in ((0x4C, 0x78, 0xA8), (0xE4, 0x57, 0x56), (0xBA, 0xB0, 0xAC)):
        assert np.all(img == rgb, axis=-1).sum() > 500, f"no area of colour #{bytes(rgb).hex()} in the screenshot"
    if os.environ.get("AUTOPAR_REPORT_SHOT"):  # keep the screenshot to look at
        shutil.copy(shot, os.environ["AUTOPAR_REPORT_SHOT"])
