"""The third-party model suite's table: every model of tests/third_party/zoo.py planned on a simulated (8, 8) h100
mesh (timed) and run by autopar.parallelize on a 2x2 gloo mesh against one device (tests/third_party/zoo_check.py:
loss, every gradient, 3 AdamW steps, collectives per step), in one 4-rank launch; writes
benchmarks/results/models.md (and the raw records as JSON next to it).

    python benchmarks/models.py                       # every zoo model, the model as users have it
    python benchmarks/models.py --models gpt2,llama   # a few
    python benchmarks/models.py --wrapped             # also the hand-wrapped diagnostic (positional in, .loss out)
    python benchmarks/models.py --dims dp,cp          # the mesh dims named (dp, cp): every sequence split on cp,
                                                      # planned on (8, 2); writes benchmarks/results/models_cp.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "third_party"))

import zoo_check as suite  # noqa: E402
from zoo import ZOO  # noqa: E402

import provenance  # noqa: E402

LAUNCH_TIMEOUT_S = 3000


def run(names, variant="as-is", timeout=LAUNCH_TIMEOUT_S, dims=suite.DIMS) -> tuple[list[dict], float]:
    """One 4-rank launch checking `names`; (merged records, wall seconds)."""
    t = time.perf_counter()
    recs, why = suite.run_suite(names, variant, tempfile.mkdtemp(prefix="models_"), timeout, dims)
    if why:
        print(why[-3000:], file=sys.stderr)
    return recs, time.perf_counter() - t


def _pl(p):
    if not p:
        return ""
    dims = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("sharded", "params"))
    return f"{p['sharded']}/{p['params']} sharded ({dims})"


def _split(rec, dim: str) -> str:
    """How the 2x2 plan splits the step's inputs on mesh dim `dim` (index 1) and how many collectives the first
    step ran there: '2/2 inputs S1, 14 collectives'."""
    ins = rec.get("inputs_2x2")
    if ins is None:
        return ""
    tally = {}
    for pl in ins:
        tally[pl[1]] = tally.get(pl[1], 0) + 1
    split = ", ".join(f"{n}/{len(ins)} {k}" for k, n in sorted(tally.items()))
    return f"inputs {split}; {rec.get('by_dim', {}).get(dim, 0)} collectives on {dim}"


def _esc(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def row(rec, dims=suite.DIMS) -> str:
    p8 = rec["plan8"]
    plan8 = f"{p8['plan_s']:.1f} s" if p8.get("ok") else f"fails ({p8.get('stage', '')})"
    coll = "/".join(map(str, rec.get("collectives", []))) or ""
    err = f"{rec['max_err']:.1e}" if "max_err" in rec else ""
    verdict = "**pass**" if rec["ok"] and p8.get("ok") else "fail"
    why = []
    if not p8.get("ok"):
        why.append(f"{_mesh(dims)} {p8.get('stage', '')}: {p8.get('error', '')}")
    if not rec["ok"]:
        why.append(f"2x2 {rec['stage']}: {rec['error']}")
    drop = "; ".join(
        x
        for x in (
            "dropout set to 0" if rec.get("dropout_off") else "",
            "params pinned FSDP on dp" if rec.get("forced") else "",
            rec.get("check_dtype", ""),
        )
        if x
    )
    extra = f" {_esc(_split(rec, dims[1]))} |" if _cp(dims) else ""
    return (
        f"| {rec['model']} | {_esc(rec.get('family', ''))} | {plan8} | {_pl(p8.get('placements'))} | "
        f"{_pl(rec.get('placements_2x2'))} | {coll} |{extra} {err} | {verdict} | {drop} | {_esc('; '.join(why))} |"
    )


def _cp(dims) -> bool:
    return dims[1].startswith("cp")


def _mesh(dims) -> str:
    return "x".join(map(str, suite.big_mesh(dims)))


def header(dims=suite.DIMS) -> str:
    m = _mesh(dims)
    cols = ["model", "covers", f"plan ({m} h100)", f"{m} placements", "2x2 placements", "collectives per step"]
    cols += ["sequence split (2x2)"] if _cp(dims) else []
    cols += ["max error", "result", "2x2 run", "reason"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def render(command, sections, commit_id, dims=suite.DIMS) -> str:
    out = [
        "# Third-party model suite\n",
        f"Made by `{command}` at {commit_id} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).\n",
        "Each model of `tests/third_party/zoo.py` (built small from its config, random weights): `autopar.plan` on "
        f'a simulated {suite.big_mesh(dims)} mesh named {dims} with cluster "h100" (timed inside the launch: 4 '
        "processes share the 2 cores, "
        "so times are up to ~2x a lone run), and `autopar.parallelize` on a 2x2 gloo mesh with the "
        "`tests/_clusters.py` SHAPES cluster (cheap collectives) against one device: the loss and every gradient of "
        "the first step, every parameter and floating buffer after 3 AdamW steps (lr 1e-3, eps 1e-4: see "
        "`ADAM_EPS` in tests/third_party/zoo_check.py), "
        "|diff| <= 1e-6 + 1e-4 max|ref| per tensor; at least one parameter sharded and one collective in each "
        "step (CollectiveCounter, forward + backward + optimizer step). Both run the model in train() mode as built, "
        "dropout on: one device draws its masks after torch.manual_seed(s), the parallel module after "
        "pm.program.manual_seed(s) (each random tensor drawn whole in eager's order and layout, each rank keeping "
        "its piece), so the comparison is exact. SHAPES alone replicates every parameter of models this small "
        "(data parallel pays), so the 2x2 plan pins the parameters FSDP-like on dp (`fsdp_pins` in "
        "tests/third_party/zoo_check.py) and the planner chooses every other placement. A model whose 2x2 run says "
        "float64 is checked in float64 (its float32 training is not reproducible to the tolerance even on one "
        "device: benchmarks/results/precision.md); its big-mesh plan is of the float32 model. The solver's time limit is 30 s for every plan (`PLAN_TIME_LIMIT_S`). Placements: "
        "parameters with a Shard on some mesh dim, of all, and how many on each dim. Max error: the largest "
        "|diff| over the loss, gradients, "
        "parameters and buffers. Stages: build, capture (recording the graph or the call's inputs), plan, "
        "parallelize, step, compare.\n",
    ]
    if _cp(dims):
        out.append(
            f"\nThe second mesh dim is named {dims[1]!r}: context parallel, by its name (no pin), so every token "
            "input of the step is split along the sequence there (Shard(1)) and the planner keeps each activation a "
            "sequence shard or gathers it where an op needs the whole sequence (attention's keys and values, a "
            "recurrence); the parameters are pinned FSDP on dp and replicated on cp. Sequence split: the step's "
            "inputs' placements on that dim and the first step's collectives there.\n"
        )
    for title, recs, wall in sections:
        passed = sum(1 for r in recs if r["ok"] and r["plan8"].get("ok"))
        out.append(f"\n## {title}\n\n{passed} of {len(recs)} pass; the launch took {wall:.0f} s.\n\n{header(dims)}")
        out.extend(row(r, dims) for r in recs)
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    ap.add_argument("--wrapped", action="store_true", help="also run the hand-wrapped diagnostic variant")
    ap.add_argument("--dims", default=",".join(suite.DIMS), help="the 2x2 mesh's dim names (dp,tp or dp,cp)")
    ap.add_argument("--out", default="", help="default benchmarks/results/models.md (models_cp.md for dp,cp)")
    a = ap.parse_args(argv)
    dims = tuple(a.dims.split(","))
    if len(dims) != 2:
        ap.error(f"--dims names the 2 dims of the 2x2 mesh, got {dims}")
    suffix = "" if dims == suite.DIMS else f"_{dims[1]}"
    a.out = a.out or str(ROOT / "benchmarks" / "results" / f"models{suffix}.md")
    names = [n for n in a.models.split(",") if n] or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        ap.error(f"unknown models {unknown}; the zoo has {sorted(ZOO)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sections = []
    recs, wall = run(names, dims=dims)
    sections.append(("The models as users have them", recs, wall))
    if a.wrapped:
        kw = [n for n in names if ZOO[n]()[2]]
        recs, wall = run(kw, "wrapped", dims=dims)
        sections.append(
            ("Diagnostic: keyword-input models wrapped by hand (positional tensors in, .loss out)", recs, wall)
        )
    command = "python benchmarks/models.py" + "".join(f" {x}" for x in (argv if argv is not None else sys.argv[1:]))
    text = render(command, sections, provenance.commit(), dims)
    Path(a.out).write_text(text)
    Path(a.out).with_suffix(".json").write_text(
        json.dumps([{"title": t, "records": r, "wall_s": w} for t, r, w in sections], indent=1, default=str)
    )
    print(text)


if __name__ == "__main__":
    main()
