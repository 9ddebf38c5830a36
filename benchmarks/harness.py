"""autopar vs the plans experts write by hand (DDP, FSDP2 per block, Megatron-style TP(+SP), FSDP2 x TP, and
torchtitan 0.2.2's own Llama-3 plan), modeled and measured. One command writes every result file:

    python benchmarks/harness.py                 # full run, ~15 min on 2 quiet cores
    python benchmarks/harness.py --quick         # smoke run (tiny models, one mesh), ~2 min

For each model x mesh x plan source a row reports: the modeled step (compute / comm / exposed comm) under autopar's
cost model, with the hand plan expressed as forced parameter placements (`autopar.plan(force=...)`, activations
still chosen by the solver: the best execution of that hand layout, same cost model, same memory budget); and, on
the CPU configurations, the measured step (median of 15 interleaved steps after warm-up, 4 gloo ranks), comm
bytes per step by collective kind, peak memory per rank (benchmarks/measure.py), planning time and the ratio to the
best hand plan. Files: benchmarks/results/bench.csv, bench.md, bench_steps.png, bench_planning.png (+ bench_raw.json).

Bad input never drops a row: an unknown model, a mesh larger than the measured world, a hand plan that does not fit
the memory budget or does not exist for the model/mesh gets a row whose status and note say so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
RESULTS = os.path.join(HERE, "results")
SCRATCH = os.path.join(tempfile.gettempdir(), "autopar_bench")  # per-rank logs, partial results

import torch  # noqa: E402

from bench_config import (  # noqa: E402
    MEASURED,
    MEASURED_MESHES,
    QUICK_MEASURED,
    QUICK_MESHES,
    QUICK_SCALE,
    SCALE,  # noqa: E402
    SCALE_CLUSTER,
    WORLD,
    scale_batch,
)
from ranks import free_port  # noqa: E402
from hand_plans import HAND_SOURCES, NotApplicable, forced_placements, state_bytes_lower_bound  # noqa: E402

MODELED_SOURCES = ("autopar",) + HAND_SOURCES
MEASURED_SOURCES = ("autopar", "autopar-torch") + HAND_SOURCES


class DoesNotFit(ValueError):
    pass


def _mesh_spec(mesh: str):
    from autopar import MeshSpec

    shape = tuple(int(s) for s in mesh.split("x"))
    return MeshSpec(shape, ("dp",) if len(shape) == 1 else ("dp", "tp"))


def _base_row(key, mesh, source, kind, cluster) -> dict:
    return {"model": key, "mesh": mesh, "source": source, "kind": kind, "cluster": cluster, "status": "ok", "note": ""}


_TITAN: dict = {}


def titan_layout(mesh) -> dict | None:
    """torchtitan's placements for this mesh's layout (dp_shard = dp, tp = tp), read from parallelize_llama on a
    fake process group (benchmarks/titan.py); the rules are structural, so a small fake world stands for any."""
    from titan import titan_placements, titan_status

    tp = mesh.shape[1] if len(mesh.shape) == 2 else 1
    key = (2, tp if tp == 1 else 2)
    if key not in _TITAN:
        why = titan_status()
        _TITAN[key] = {"error": why} if why else titan_placements(*key)
    return _TITAN[key]


def modeled_rows(key, name, overrides, dtype, batch, seq, mesh_str, sources, cluster, budget=None) -> list[dict]:
    """One modeled row per source for model `name` on mesh `mesh_str` (planner + cost model; no hardware)."""
    import autopar
    from autopar import models as M
    from autopar.cost import TrainingPrecision, get_cluster

    try:
        mesh = _mesh_spec(mesh_str)
    except (ValueError, TypeError) as e:
        return [
            {**_base_row(key, mesh_str, s, "modeled", cluster), "status": "error", "note": f"bad mesh: {e}"}
            for s in sources
        ]
    try:
        model = M.build_model(name, device="meta", dtype=dtype, **overrides)
        x = M.example_inputs(name, batch=batch, seq=seq, device="meta", **overrides)
    except ValueError as e:
        return [{**_base_row(key, mesh_str, s, "modeled", cluster), "status": "error", "note": str(e)} for s in sources]
    cl = get_cluster(cluster)
    cap = budget if budget is not None else 0.9 * cl.device.mem_bytes
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
    prec = TrainingPrecision.mixed_bf16_adam() if low else TrainingPrecision.fp32_adam()
    n_layers = getattr(getattr(model, "cfg", None), "n_layers", None) or getattr(model, "n_layers", None)
    rows, done = [], {}
    for src in sources:
        row = _base_row(key, mesh_str, src, "modeled", cluster)
        row.update(n_layers=n_layers, batch=batch, seq=seq, world=mesh.size, budget_bytes=cap)
        rows.append(row)
        try:
            titan = None
            if src == "torchtitan" and name.startswith("llama3"):
                titan = titan_layout(mesh)
                if "error" in titan:
                    raise NotApplicable(titan["error"])
            notes = []
            force = (
                None if src == "autopar" else forced_placements(src, name, model, mesh.names, titan, mesh.shape, notes)
            )
            row["note"] = "; ".join(notes)
            if force is not None:
                need = state_bytes_lower_bound(model, force, mesh.shape, prec)
                if need > cap:
                    raise DoesNotFit(
                        f"model state alone (params + grads + optimizer, {prec.bytes_per_param} B/param "
                        f"at the forced placements) needs {need / 2**30:.1f} GiB per rank > budget "
                        f"{cap / 2**30:.1f} GiB"
                    )
            same = next((s for s, (f, _) in done.items() if f is not None and f == force), None)
            if same is not None:  # identical planner input -> identical plan (the planner is deterministic)
                plan, plan_s = done[same][1]
                row["note"] = "; ".join(notes + [f"same placements as {same}: plan reused"])
            else:
                t0 = time.perf_counter()
                plan = autopar.plan(model, mesh, x, cluster=cl, memory_budget=cap, force=force)
                plan_s = time.perf_counter() - t0
            done[src] = (force, (plan, plan_s))
            p = plan.predicted
            row.update(
                modeled_step_s=p["step_s"],
                compute_s=p["compute_s"],
                comm_s=p["comm_s"],
                exposed_comm_s=p["exposed_comm_s"],
                objective_s=plan.solver["objective"],
                predicted_comm_bytes=sum(v["bytes"] for v in p["collectives"].values()),
                predicted_collectives=p["collectives"],
                predicted_peak_mem_bytes=p["peak_mem_bytes"],
                plan_s=plan_s if src == "autopar" else None,
                model_s=plan_s,
                plan_hash=plan.hash(),
                params=plan.params,
                recompute_s=p.get("recompute_s", 0.0),
                pass_s=plan.timings,
            )
            if src == "torchtitan":
                row["note"] = (
                    row["note"] + "; " if row["note"] else ""
                ) + "placements read from torchtitan 0.2.2 parallelize_llama (fake process group)"
        except NotApplicable as e:
            row.update(status="n/a", note=str(e))
        except DoesNotFit as e:
            row.update(status="does not fit", note=str(e))
        except autopar.InfeasibleMemoryError as e:
            row.update(status="does not fit", note=f"planner: {str(e)[:400]}")
        except Exception as e:  # noqa: BLE001  (the row is kept and says what failed)
            row.update(status="error", note=f"{type(e).__name__}: {str(e)[:400]}")
        print(
            f"    {src:<11} {row['status']:<13} "
            + (
                f"step {row['modeled_step_s'] * 1e3:.2f} ms, planned in {row['model_s']:.1f} s"
                if row["status"] == "ok"
                else row["note"][:100]
            ),
            flush=True,
        )
    # which hand plan autopar's own plan equals, if any
    auto = next((r for r in rows if r["source"] == "autopar" and r["status"] == "ok"), None)
    if auto is not None:
        same = [r["source"] for r in rows if r["source"] != "autopar" and r.get("params") == auto["params"]]
        if same:
            auto["note"] = (auto["note"] + "; " if auto["note"] else "") + "same placements as " + ", ".join(same)
    return rows


# ---- measured -----------------------------------------------------------------------------------------------------


def measured_rows(key, meshes, sources, steps, warmup, launch_timeout, gloo_timeout=120.0) -> list[dict]:
    """Launch benchmarks/measure.py on WORLD gloo ranks for one model; relaunch without a source that crashed or
    hung the launch (its row says so). Rows for meshes that do not fit the world are marked, not run."""
    rows, run_meshes = [], []
    for m in meshes:
        try:
            n = math.prod(int(s) for s in m.split("x"))
        except ValueError:
            n = None
        if n is None or n != WORLD:
            why = (
                f"mesh {m!r} is not like 4 or 2x2"
                if n is None
                else f"mesh {m} has {n} ranks but the measured world has {WORLD} gloo ranks"
                + (" (mesh larger than the world)" if n > WORLD else "")
            )
            rows += [{**_base_row(key, m, s, "measured", "cpu-gloo"), "status": "error", "note": why} for s in sources]
        else:
            run_meshes.append(m)
    if not run_meshes:
        return rows
    os.makedirs(SCRATCH, exist_ok=True)
    out = os.path.join(SCRATCH, f"measure_{key}.json")
    excluded, crashed = [], {}
    for attempt in range(4):
        if os.path.exists(out):
            os.remove(out)
        port, procs, logs = free_port(), [], []
        env_base = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(WORLD),
        }
        cmd = [
            sys.executable,
            os.path.join(HERE, "measure.py"),
            "--model",
            key,
            "--meshes",
            *run_meshes,
            "--sources",
            *sources,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--timeout",
            str(gloo_timeout),
            "--out",
            out,
        ] + (["--exclude", *excluded] if excluded else [])
        for r in range(WORLD):
            log = open(os.path.join(SCRATCH, f"measure_{key}_rank{r}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env={**env_base, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT))
        deadline, hung = time.time() + launch_timeout, False
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                hung = True
        if hung:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for f in logs:
            f.close()
        data = json.load(open(out)) if os.path.exists(out) else {"rows": [], "progress": ""}
        if not hung and all(p.returncode == 0 for p in procs) and data.get("progress") == "done":
            got = data["rows"]
            break
        prog = data.get("progress", "")
        parts = prog.split(" ", 2)
        tail = _log_tail(key)
        if len(parts) < 2 or f"{parts[0]}:{parts[1]}" in excluded:
            got = data.get("rows", [])
            for m in run_meshes:
                for s in sources:
                    if not any(r["mesh"] == m and r["source"] == s for r in got) and (m, s) not in crashed:
                        crashed[(m, s)] = (
                            f"the launch failed before this row finished ({'hung' if hung else 'exit'}); log: {tail}"
                        )
            break
        m, s = parts[0], parts[1]
        crashed[(m, s)] = (
            f"{'hung (killed after the launch timeout)' if hung else 'crashed'} during "
            f"{parts[2] if len(parts) > 2 else '?'}; relaunched without it; log: {tail}"
        )
        excluded.append(f"{m}:{s}")
    else:
        got = []
    for r in got:
        rows.append({**_base_row(key, r["mesh"], r["source"], "measured", "cpu-gloo"), **r, "kind": "measured"})
    for (m, s), why in crashed.items():
        if not any(r["mesh"] == m and r["source"] == s for r in rows):
            rows.append({**_base_row(key, m, s, "measured", "cpu-gloo"), "status": "error", "note": why})
    return rows


def _log_tail(key, n=600) -> str:
    tails = []
    for r in range(WORLD):
        path = os.path.join(SCRATCH, f"measure_{key}_rank{r}.log")
        if os.path.exists(path):
            lines = [
                ln
                for ln in open(path, errors="replace").read().splitlines()
                if ln.strip() and "Warning" not in ln and "warn(" not in ln and "USDT" not in ln
            ]
            if lines:
                tails.append(f"rank {r}: " + " | ".join(lines[-4:]))
    return (" || ".join(tails))[-n:]


# ---- driver -------------------------------------------------------------------------------------------------------


def run(args) -> list[dict]:
    from autopar import models as M

    rows = []
    measured = dict(QUICK_MEASURED) if args.quick else dict(MEASURED)
    scale = list(QUICK_SCALE) if args.quick else list(SCALE)
    meshes = tuple(args.meshes) if args.meshes else (QUICK_MESHES if args.quick else MEASURED_MESHES)
    if args.models:
        known = {**MEASURED, **QUICK_MEASURED}
        measured = {}
        for k in args.models:
            if k in known:
                measured[k] = known[k]
            else:
                try:
                    M.get_config(k)
                    measured[k] = None  # a zoo model without a measured configuration
                except ValueError as e:
                    rows += [
                        {**_base_row(k, m, s, "measured", "cpu-gloo"), "status": "error", "note": f"unknown model: {e}"}
                        for m in meshes
                        for s in args.sources or ("autopar",)
                    ]
        scale = [c for c in scale if c["key"] in args.models]
    for key, cfg in measured.items():
        if cfg is None:
            rows += [
                {
                    **_base_row(key, m, "-", "measured", "cpu-gloo"),
                    "status": "error",
                    "note": f"no measured configuration for {key!r} in benchmarks/bench_config.py "
                    f"(known: {', '.join(MEASURED)})",
                }
                for m in meshes
            ]
            continue
        srcs = tuple(args.sources) if args.sources else MEASURED_SOURCES
        if args.only in (None, "cpu", "modeled-cpu"):
            for m in meshes:
                print(f"[modeled cpu-gloo] {key} {m}", flush=True)
                rows += modeled_rows(
                    key,
                    cfg["name"],
                    cfg["overrides"],
                    torch.float32,
                    cfg["batch"],
                    cfg["seq"],
                    m,
                    [s for s in srcs if s != "autopar-torch"],
                    "cpu-gloo",
                )
        if args.only in (None, "cpu", "measured"):
            print(f"[measured 4 x gloo] {key} {' '.join(meshes)}", flush=True)
            rows += measured_rows(key, meshes, srcs, args.steps, args.warmup, args.launch_timeout)
    if args.only in (None, "scale") and scale:
        srcs = tuple(args.sources) if args.sources else MODELED_SOURCES
        if "torchtitan" in srcs:  # read torchtitan's layouts once, here, for every worker
            for c in scale:
                if c["name"].startswith("llama3"):
                    titan_layout(_mesh_spec(c["mesh"]))
        jobs = max(1, min(args.jobs, len(scale)))
        print(f"[modeled {SCALE_CLUSTER}] {len(scale)} configurations, {jobs} planning process(es)", flush=True)
        if jobs == 1:
            for c in scale:
                rows += _scale_task(c, srcs, _TITAN)
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
                for rs in ex.map(_scale_task, scale, [srcs] * len(scale), [_TITAN] * len(scale)):
                    rows += rs
    return rows


def _scale_task(c, srcs, titan_cache) -> list[dict]:
    _TITAN.update(titan_cache)
    print(f"[modeled {SCALE_CLUSTER}] {c['key']} {c['mesh']}", flush=True)
    rows = modeled_rows(
        c["key"],
        c["name"],
        c["overrides"],
        torch.bfloat16,
        scale_batch(c["mesh"]),
        c["seq"],
        c["mesh"],
        srcs,
        SCALE_CLUSTER,
    )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny models, one mesh, 1 warm-up + 5 steps")
    ap.add_argument("--only", choices=("cpu", "measured", "modeled-cpu", "scale"), default=None)
    ap.add_argument("--models", nargs="+", help="model keys (default: every configured one)")
    ap.add_argument("--meshes", nargs="+", help="meshes of the CPU configurations (default: 4 2x2)")
    ap.add_argument("--sources", nargs="+", help=f"plan sources (default: {' '.join(MEASURED_SOURCES)})")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per source, median reported (default 15: on 2 cores a row's ratio moved by up "
        "to 0.13 between two runs with 5 steps, ~0.1 with 9; --quick 5)",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--launch-timeout", type=float, default=900.0, help="seconds per 4-rank launch")
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="planning processes for the modeled at-scale configurations (default: 2, or 1 core)",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench"), help="output prefix (.csv/.md/.png/_raw.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    args.steps = args.steps or (5 if args.quick else 15)
    if args.steps < 5:
        ap.error(f"--steps {args.steps}: the median needs at least 5 timed steps")
    if args.sources:
        bad = [s for s in args.sources if s not in MEASURED_SOURCES]
        if bad:
            ap.error(f"unknown plan source(s) {bad}; known: {', '.join(MEASURED_SOURCES)}")
    os.makedirs(RESULTS, exist_ok=True)
    t0 = time.perf_counter()
    rows = run(args)
    from report import write_all

    cmd = "python benchmarks/harness.py" + (
        "" if argv is None and len(sys.argv) == 1 else " " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    full = (
        not args.quick
        and args.out == os.path.join(RESULTS, "bench")
        and not (args.only or args.models or args.meshes or args.sources)
    )
    paths = write_all(rows, args.out, cmd, time.perf_counter() - t0, readme=full)
    print("\n".join(f"wrote {p}" for p in paths))
    return rows


if __name__ == "__main__":
    main()
