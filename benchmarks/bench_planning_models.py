"""Planning time of small models (the toy models that once took a minute) and of the benchmark configurations,
with each plan's objective and hash, so a solver change can be checked for speed and for plan quality at once.

Each case: `autopar.plan(..., return_state=True)` timed with perf_counter (capture included), `--repeat` times in
this process (the median is reported), with the per-pass times of the median run and the MILP's size.

    python benchmarks/bench_planning_models.py [--only NAME ...] [--repeat 3] [--json out.json] [--md out.md]
    python benchmarks/bench_planning_models.py --zoo [NAME ...] [--json out.json]
    python benchmarks/bench_planning_models.py --zoo3d [NAME ...] [--json out.json] [--dims3d dp,cp,tp]

--zoo: the third-party suite (tests/third_party/zoo.py), each model in a process of its own (a lone run, imports
paid before the clock starts): its (8, 8) "h100" plan and its 2x2 SHAPES plan with the FSDP pins of
tests/third_party/zoo_check.py (overlap=False), as the suite plans them; wall and CPU seconds, the passes, the MILP's
size, objective and status. Written as the section "Third-party suite" of --md (the rest of the file is kept).
--zoo3d: the same models on a 3-D mesh, (dp_replicate, dp_shard, tp) = 2x2x2 under autopar.testing.TP_FRIENDLY (a
cost model on which tensor parallelism pays), no pins: dims named dp* are data parallel there
(autopar/strategies/data_parallel.py); written to results/planning_3d.md. With --dims3d dp,cp,tp: the mesh
(dp, cp, tp), the sequence split on cp by its name (autopar/strategies/context_parallel.py); written to
results/planning_3d_dp_cp.md.

Cases:
- llama-tiny 2x2 as `python -m autopar.examples.train` plans it (cpu-gloo cluster, fsdp+tp pinned), and with
  tests/_clusters.py SHAPES (a cost model on which sharding pays), unpinned;
- transformers LlamaForCausalLM / GPT2LMHeadModel, 2 layers, hidden 64, SHAPES, 2x2: wrapped in a module taking
  (input_ids, labels) and returning `.loss` (dropout 0, use_cache=False, a 4-D causal mask so transformers' mask
  code makes no data-dependent checks);
- the benchmark configurations as benchmarks/harness.py models them (cpu-gloo fp32 on 4 / 2x2; llama3-8b bf16 on
  an (8, 8) H100 mesh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import provenance  # noqa: E402


class LossOf(nn.Module):
    """(input_ids, labels) -> out.loss of a transformers causal LM, with a 4-D additive causal mask."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        T = input_ids.shape[1]
        mask = torch.full((T, T), float("-inf"), device=input_ids.device).triu(1)[None, None]
        return self.lm(input_ids=input_ids, attention_mask=mask.expand(input_ids.shape[0], 1, T, T), labels=labels).loss


def _hf(kind):
    import transformers as T

    torch.manual_seed(0)
    if kind == "llama":
        cfg = T.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attention_dropout=0.0,
            use_cache=False,
        )
        lm = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
        lm = T.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (2, 32))
    return LossOf(lm), (ids, ids.clone())


def _zoo(name, dtype, batch, seq, overrides, device):
    from autopar import models as M

    return (
        M.build_model(name, device=device, dtype=dtype, **overrides),
        M.example_inputs(name, batch=batch, seq=seq, device=device, **overrides),
    )


def _mesh(s):
    from autopar import MeshSpec

    shape = tuple(int(v) for v in s.split("x"))
    return MeshSpec(shape, ("dp",) if len(shape) == 1 else ("dp", "tp"))


def cases():
    """name -> () -> (model, inputs, mesh, plan kwargs)."""
    from _clusters import SHAPES
    from autopar.testing import fsdp_tp_force
    from bench_config import MEASURED, SCALE_CLUSTER, scale_batch

    def tiny_train():
        m, x = _zoo("llama-tiny", torch.float32, None, None, {}, "cpu")
        return m, x, _mesh("2x2"), dict(cluster="cpu-gloo", force=fsdp_tp_force(m, (2, 2)))

    out = {
        "llama-tiny 2x2 train.py (cpu-gloo, fsdp+tp)": tiny_train,
        "llama-tiny 2x2 SHAPES": lambda: (
            *_zoo("llama-tiny", torch.float32, None, None, {}, "cpu"),
            _mesh("2x2"),
            dict(cluster=SHAPES),
        ),
        "hf-llama 2L h64 2x2 SHAPES": lambda: (*_hf("llama"), _mesh("2x2"), dict(cluster=SHAPES)),
        "hf-gpt2 2L h64 2x2 SHAPES": lambda: (*_hf("gpt2"), _mesh("2x2"), dict(cluster=SHAPES)),
    }
    for key, mesh in (
        ("llama3-debug", "2x2"),
        ("gpt2-smallish", "4"),
        ("moe-debug", "4"),
        ("moe-debug", "2x2"),
        ("mlp-heavy", "2x2"),
    ):
        c = MEASURED[key]
        out[f"{key} {mesh} cpu-gloo"] = lambda c=c, mesh=mesh: (
            *_zoo(c["name"], torch.float32, c["batch"], c["seq"], c["overrides"], "meta"),
            _mesh(mesh),
            dict(cluster="cpu-gloo"),
        )
    out["llama3-8b 8x8 h100"] = lambda: (
        *_zoo("llama3-8b", torch.bfloat16, scale_batch("8x8"), 8192, {}, "meta"),
        _mesh("8x8"),
        dict(cluster=SCALE_CLUSTER),
    )
    return out


def run_case(build, repeat):
    import autopar

    runs = []
    for _ in range(repeat):
        model, x, mesh, kw = build()
        t, c = time.perf_counter(), time.process_time()
        plan, state = autopar.plan(model, mesh, x, return_state=True, **kw)
        runs.append((time.perf_counter() - t, plan, state, time.process_time() - c))
    runs.sort(key=lambda r: r[0])
    s, plan, state, cpu = runs[len(runs) // 2]
    timings = state.timings.items() if isinstance(state.timings, dict) else state.timings
    return {
        "plan_s": s,
        "all_s": [r[0] for r in runs],
        "cpu_s": cpu,
        "passes": {k: round(v, 3) for k, v in timings},
        "objective": plan.solver["objective"],
        "gap": plan.solver.get("gap"),
        "status": plan.solver.get("status"),
        "vars": plan.solver.get("n_vars"),
        "rows": plan.solver.get("n_constraints"),
        "hash": plan.hash(),
        "nodes": len(plan.nodes),
    }


def markdown(rows, cmd) -> str:
    commit = provenance.commit()
    lines = [
        "# Planning time of small models and the benchmark configurations",
        "",
        f"command: `{cmd}`  commit: `{commit}`  machine: {os.cpu_count()} cores shared with other "
        "jobs (plan: wall-clock median of the runs, capture included; CPU: this process's CPU seconds in "
        "that run, less sensitive to the machine's load)",
        "",
        "| case | plan (s) | runs (s) | CPU (s) | solve (s) | costs (s) | candidates (s) | MILP vars / rows "
        "| objective (s) | solver | plan hash |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:120]} ||||||||||")
            continue
        p = r["passes"]
        lines.append(
            f"| {name} | {r['plan_s']:.2f} | {' '.join(f'{v:.2f}' for v in r['all_s'])} | "
            f"{r['cpu_s']:.2f} | {p.get('solve', 0):.2f} | {p.get('costs', 0):.2f} | "
            f"{p.get('candidates', 0):.2f} | "
            f"{r['vars']} / {r['rows']} | {r['objective']:.6g} | {r['status']} | `{r['hash'][:12]}` |"
        )
    return "\n".join(lines) + "\n"


ZOO_SECTION = "## Third-party suite"
DP3 = ("dp_replicate", "dp_shard", "tp")


MESHES = {"8x8": ((8, 8), ("dp", "tp")), "2x2": ((2, 2), ("dp", "tp")), "2x2x2": ((2, 2, 2), DP3)}


def mesh_of(which: str) -> tuple:
    """(shape, names) of a mesh key: one of MESHES, or "2x2x2:<names>" (a 2x2x2 mesh with those dim names)."""
    if which in MESHES:
        return MESHES[which]
    key, names = which.split(":")
    return MESHES[key][0], tuple(names.split(","))


def zoo_child(name, meshes=("8x8", "2x2")) -> dict:
    """In a fresh process: model `name`'s 8x8 h100 plan and 2x2 SHAPES plan (fsdp pins), or its 2x2x2 TP_FRIENDLY
    plan, each timed."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "third_party"))
    import autopar
    import zoo_check
    from _clusters import SHAPES, TP_FRIENDLY

    out = {}
    for which in meshes:
        model, args, kwargs, _ = zoo_check.build(name)
        mesh = autopar.MeshSpec(*mesh_of(which))
        if which == "8x8":
            kw = dict(cluster="h100")
        elif which.startswith("2x2x2"):
            kw = dict(cluster=TP_FRIENDLY, overlap=False)
        else:
            kw = dict(cluster=SHAPES, overlap=False, force=zoo_check.fsdp_pins(model, (2, 2)))
        t, c = time.perf_counter(), time.process_time()
        try:
            plan, state = autopar.plan(
                model,
                mesh,
                example_inputs=args,
                return_state=True,
                time_limit=zoo_check.PLAN_TIME_LIMIT_S,
                **kw,
                **zoo_check.call_kwargs(kwargs),
            )
        except Exception as e:  # a model that cannot plan is a row saying why
            out[which] = {"error": zoo_check.error_line(e)}
            continue
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        passes = dict(state.timings)
        out[which] = {
            "plan_s": wall,
            "cpu_s": cpu,
            "capture_s": wall - sum(passes.values()),
            "passes": {k: round(v, 3) for k, v in passes.items()},
            "objective": plan.solver["objective"],
            "status": plan.solver.get("status"),
            "vars": plan.solver.get("n_vars"),
            "rows": plan.solver.get("n_constraints"),
            "hash": plan.hash(),
        }
    return out


def run_zoo(names, timeout=900, meshes=("8x8", "2x2")) -> dict:
    """Each model's zoo_child in a process of its own; {name: {"8x8": ..., "2x2": ...}}."""
    rows = {}
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--zoo-child", name, *meshes]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            rows[name] = json.loads(line[-1]) if line else {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
        except subprocess.TimeoutExpired:
            rows[name] = {"error": f"no result within {timeout} s"}
        for which, r in rows[name].items() if "error" not in rows[name] else ():
            print(
                f"{name} {which}: "
                + (
                    r["error"]
                    if "error" in r
                    else f"{r['plan_s']:.2f} s (CPU {r['cpu_s']:.2f} s), objective {r['objective']:.6g}, {r['vars']} vars, "
                    f"{r['status']}"
                ),
                flush=True,
            )
        if "error" in rows[name]:
            print(f"{name}: {rows[name]['error']}", flush=True)
    return rows


def zoo_markdown(rows, cmd) -> str:
    commit = provenance.commit()
    lines = [
        ZOO_SECTION,
        "",
        f"command: `{cmd}`  commit: `{commit}`  machine: {os.cpu_count()} cores shared with "
        "other jobs. Each model in a process of its own: the (8, 8) h100 plan, then the 2x2 SHAPES plan with "
        "the suite's FSDP pins (tests/third_party/zoo_check.py). plan: wall seconds, capture included; CPU: "
        "this process's CPU seconds (less sensitive to the machine's load); solve: the solve pass (dominance, "
        "MILP build, HiGHS).",
        "",
        "| model | 8x8 plan (s) | 8x8 CPU (s) | 8x8 solve (s) | 8x8 vars | 8x8 objective (s) | 2x2 plan (s) | "
        "2x2 CPU (s) | 2x2 solve (s) | 2x2 vars | 2x2 objective (s) | 2x2 solver |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        cells = []
        for which in ("8x8", "2x2"):
            x = r.get(which, r)
            if "error" in x:
                cells.append(f"error: {x['error'][:80]} |||||")
                if which == "2x2":
                    cells[-1] = cells[-1][:-1]
                continue
            cells.append(
                f"{x['plan_s']:.2f} | {x['cpu_s']:.2f} | {x['passes'].get('solve', 0):.2f} | {x['vars']} | "
                f"{x['objective']:.6g}" + (f" | {x['status']}" if which == "2x2" else "")
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def zoo3d_markdown(rows, cmd, which="2x2x2") -> str:
    commit = provenance.commit()
    names = mesh_of(which)[1]
    cp = ", the cp* dims split the sequence (autopar/strategies/context_parallel.py)"
    meaning = (
        "the dp* dims are data parallel (autopar/strategies/data_parallel.py)"
        + (cp if any(n.startswith("cp") for n in names) else "")
        + ", tp is the solver's"
    )
    ok = sorted(r[which]["plan_s"] for r in rows.values() if "plan_s" in r.get(which, {}))
    lines = [
        "# Planning the third-party suite on a 3-D mesh",
        "",
        f"command: `{cmd}`  commit: `{commit}`  machine: {os.cpu_count()} cores shared with other jobs. Each model "
        f"of tests/third_party/zoo.py in a process of its own, planned on {names} = 2x2x2 under TP_FRIENDLY "
        f"(autopar/testing.py), no pins: {meaning}. plan: wall seconds, capture included; solve: the solve pass.",
        "",
        f"{len(ok)} of {len(rows)} planned; median {ok[len(ok) // 2] if ok else 0:.1f} s, longest "
        f"{ok[-1] if ok else 0:.1f} s.",
        "",
        "| model | plan (s) | CPU (s) | solve (s) | vars | objective (s) | solver |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        x = r.get(which, r)
        if "error" in x:
            lines.append(f"| {name} | error: {x['error'][:160]} ||||||")
            continue
        lines.append(
            f"| {name} | {x['plan_s']:.2f} | {x['cpu_s']:.2f} | {x['passes'].get('solve', 0):.2f} | {x['vars']} | "
            f"{x['objective']:.6g} | {x['status']} |"
        )
    return "\n".join(lines) + "\n"


def _write_zoo_section(path, text) -> None:
    old = open(path).read() if os.path.exists(path) else ""
    keep = old.split(ZOO_SECTION)[0].rstrip()
    with open(path, "w") as f:
        f.write((keep + "\n\n" if keep else "") + text)


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--zoo-child"]:
        print(json.dumps(zoo_child(sys.argv[2], tuple(sys.argv[3:]) or ("8x8", "2x2"))), flush=True)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="substrings of case names")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=os.path.join(HERE, "results", "planning_models.md"))
    ap.add_argument("--zoo", nargs="*", default=None, help="the third-party suite (all models, or these)")
    ap.add_argument("--zoo3d", nargs="*", default=None, help="the third-party suite on a 2x2x2 mesh")
    ap.add_argument("--dims3d", default=",".join(DP3), help="--zoo3d's mesh dim names (default %(default)s)")
    args = ap.parse_args(argv)
    cmd = "python benchmarks/bench_planning_models.py " + " ".join(argv or sys.argv[1:])
    picked = args.zoo3d if args.zoo3d is not None else args.zoo
    if picked is not None:  # the third-party suite: on (8, 8) and 2x2, or (--zoo3d) on 2x2x2
        sys.path.insert(0, os.path.join(ROOT, "tests", "third_party"))
        from zoo import ZOO

        three = args.zoo3d is not None
        which = "2x2x2" if tuple(args.dims3d.split(",")) == DP3 else f"2x2x2:{args.dims3d}"
        kw = dict(timeout=300, meshes=(which,)) if three else {}
        rows = run_zoo(picked or list(ZOO), **kw)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if three and not picked:
            suffix = "" if which == "2x2x2" else "_" + "_".join(n for n in args.dims3d.split(",") if n != "tp")
            with open(os.path.join(HERE, "results", f"planning_3d{suffix}.md"), "w") as f:
                f.write(zoo3d_markdown(rows, cmd, which))
        elif args.md and not picked:
            _write_zoo_section(args.md, zoo_markdown(rows, cmd))
        return 0
    rows = {}
    for name, build in cases().items():
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            rows[name] = r = run_case(build, args.repeat)
        except Exception as e:  # a case that cannot plan is a row saying why, not a lost table
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {rows[name]['error'][:300]}", flush=True)
            continue
        runs = " ".join(f"{v:.2f}" for v in r["all_s"])
        print(
            f"{name}: {r['plan_s']:.2f} s (runs {runs}; CPU {r['cpu_s']:.2f} s), objective "
            f"{r['objective']:.6g}, {r['vars']} vars, hash {r['hash'][:12]}, passes {r['passes']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.md and not args.only:
        with open(args.md, "w") as f:
            f.write(markdown(rows, "python benchmarks/bench_planning_models.py " + " ".join(argv or sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
