"""Plan hashes of the benchmark configurations: the check that a restructuring changed no plan, prediction or
collective count (issue 25).

Plans every configuration below with the public API only (autopar.plan, autopar.MeshSpec, autopar.models, the
Plan's fields and methods, autopar.testing's clusters and pins), so the same script runs on the code before and
after a restructuring, and writes one
JSON line per configuration: its name, Plan.hash(), the predicted step time and memory (6 significant digits),
the collectives per (kind, mesh dim) with their bytes, the solver's status and objective, and for pipeline plans
the schedule and what each stage holds.

    python benchmarks/plan_hashes.py --out benchmarks/results/plan_hashes_before.jsonl [--only SUBSTR ...]
    python benchmarks/plan_hashes.py --compare OLD.jsonl NEW.jsonl      # prints differences, exit 1 on any

The configurations: the measured CPU benchmark (benchmarks/bench_config.py MEASURED on 4 and 2x2, cpu-gloo fp32),
the small-model cases of bench_planning_models.py (llama-tiny as autopar.examples.train plans it, the SHAPES
cost model, 2-layer transformers Llama/GPT-2), the modeled scale configurations (bench_config.py SCALE, h100 bf16),
torchtitan's own Llama-3 8B (bench_titan_plan.py, 32 layers), and pipeline plans (tests/test_stages.py and
test_pipeline_dist.py's tiny cases, bench_scale.py's 405B search and published layouts). A configuration that
fails to plan is a line with the error's type (compared) and message (not compared); `plan_s` (wall seconds) is
not compared either. Plan.hash() covers a pipeline plan's stages and schedule too (since 2026-12-07: a pipeline
plan's hash differs from older files' for that reason alone; the `stages` record compares the rest). Every plan runs with time_limit=TIME_LIMIT_S, so a loaded machine cannot change a plan by cutting a
solve short. The whole set plans in about 5 minutes on one idle core.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from autopar.testing import SHAPES, TP_FRIENDLY, fsdp_tp_force

NOT_COMPARED = ("plan_s", "message")  # wall time; an error's wording (the error's type is compared)
# Every plan gets this solver time limit (autopar.plan's default is 60 s): on a loaded machine a solve that hits
# the limit returns another plan, or none, which would read as a change of the code.
TIME_LIMIT_S = 900.0
SIG = 6  # significant digits of the compared floats: the predictions are sums whose last bits follow op order
PREDICTED = ("step_s", "compute_s", "comm_s", "exposed_comm_s", "peak_mem_bytes", "state_mem_bytes", "act_peak_bytes")


def zoo(name, *, dtype=torch.float32, batch=None, seq=None, device="meta", **over):
    from autopar import models

    m = models.build_model(name, device=device, dtype=dtype, **over)
    return m, models.example_inputs(name, batch=batch, seq=seq, device=device, **over)


def hf_model(kind):
    """bench_planning_models.py's transformers case: 2 layers, hidden 64, (input_ids, labels) -> loss."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_planning_models import _hf

    return _hf(kind)


def titan_8b(n_layers=32, batch=8, seq=2048):
    """bench_titan_plan.py: torchtitan's Llama-3 8B on meta, bf16, with its trainer's cross-entropy loss."""
    import dataclasses

    import torch.nn as nn
    import torch.nn.functional as F
    from torchtitan.models.llama3 import Transformer, llama3_args

    class TitanLoss(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens, labels):
            logits = self.model(tokens)
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    args = dataclasses.replace(llama3_args["8B"], n_layers=n_layers)
    with torch.device("meta"):
        m = Transformer(args).to(torch.bfloat16)
    tok = torch.randint(0, args.vocab_size, (batch, seq), device="meta")
    return TitanLoss(m), (tok, tok.clone())


# ---- the configurations ---------------------------------------------------------------------------------------
def _mesh(shape, names=None):
    from autopar import MeshSpec

    shape = tuple(shape)
    return MeshSpec(shape, names or (("dp",) if len(shape) == 1 else ("dp", "tp")))


def configs() -> dict:
    """name -> () -> (model, inputs, mesh, plan kwargs)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_config import MEASURED, SCALE, SCALE_CLUSTER, scale_batch

    out = {}
    for key, c in MEASURED.items():
        for mesh in ((4,), (2, 2)):
            out[f"measured {key} {'x'.join(map(str, mesh))} cpu-gloo"] = lambda c=c, mesh=mesh: (
                *zoo(c["name"], batch=c["batch"], seq=c["seq"], **c["overrides"]),
                _mesh(mesh),
                dict(cluster="cpu-gloo"),
            )

    def train_example():
        m, x = zoo("llama-tiny")
        return m, x, _mesh((2, 2)), dict(cluster="cpu-gloo", force=fsdp_tp_force(m, (2, 2)))

    out["llama-tiny 2x2 train.py (cpu-gloo, fsdp+tp)"] = train_example
    out["llama-tiny 2x2 SHAPES"] = lambda: (*zoo("llama-tiny"), _mesh((2, 2)), dict(cluster=SHAPES))
    for kind in ("llama", "gpt2"):
        out[f"hf-{kind} 2L h64 2x2 SHAPES"] = lambda kind=kind: (
            *hf_model(kind),
            _mesh((2, 2)),
            dict(cluster=SHAPES),
        )
    for c in SCALE:
        mesh = tuple(int(s) for s in c["mesh"].split("x"))
        out[f"scale {c['key']} {c['mesh']} {SCALE_CLUSTER}"] = lambda c=c, mesh=mesh: (
            *zoo(c["name"], dtype=torch.bfloat16, batch=scale_batch(c["mesh"]), seq=c["seq"], **c["overrides"]),
            _mesh(mesh),
            dict(cluster=SCALE_CLUSTER),
        )
    out["torchtitan llama3 8B 32L 8x8 h100"] = lambda: (*titan_8b(), _mesh((8, 8)), dict(cluster="h100"))
    out.update(pipeline_configs())
    return out


def pipeline_configs() -> dict:
    tiny4 = dict(n_layers=4)
    out = {
        "pipeline llama-tiny 2x2(pp,dp) 1F1B|Interleaved1F1B h100": lambda: (
            *zoo("llama-tiny", batch=8, **tiny4),
            _mesh((2, 2), ("pp", "dp")),
            dict(cluster="h100", pipeline={"schedules": ["1F1B", "Interleaved1F1B"]}),
        ),
        "pipeline llama-tiny 4 auto h100": lambda: (
            *zoo("llama-tiny", batch=8, **tiny4),
            (4,),
            dict(cluster="h100", pipeline={"max_microbatch_options": 1}),
        ),
        "pipeline llama-tiny 2(pp) DualPipeV h100": lambda: (
            *zoo("llama-tiny", batch=8, seq=32, **tiny4),
            _mesh((2,), ("pp",)),
            dict(cluster="h100", pipeline={"schedules": ["DualPipeV"]}),
        ),
        "pipeline llama-tiny 2x2(pp,tp) GPipe tp-friendly": lambda: (
            *zoo("llama-tiny", batch=8, seq=8, **tiny4),
            _mesh((2, 2), ("pp", "tp")),
            dict(cluster=TP_FRIENDLY, pipeline={"schedules": ["GPipe"], "n_microbatches": [2]}),
        ),
        "pipeline llama3-8b 8L 4(pp) 1F1B h100": lambda: (
            *zoo("llama3-8b", dtype=torch.bfloat16, batch=8, seq=1024, n_layers=8),
            _mesh((4,), ("pp",)),
            dict(cluster="h100", pipeline={"schedules": ["1F1B"]}),
        ),
        "pipeline llama3-405b 16384 auto h100": lambda: (
            *zoo("llama3-405b", dtype=torch.bfloat16, batch=2048, seq=8192),
            (16384,),
            dict(cluster="h100", pipeline="auto"),
        ),
        "pipeline llama3-405b 16x128x8 published 1F1B h100": lambda: (
            *zoo("llama3-405b", dtype=torch.bfloat16, batch=2048, seq=8192),
            _mesh((16, 128, 8), ("pp", "dp", "tp")),
            dict(
                cluster="h100",
                pipeline=dict(layers_per_stage=[7] + [8] * 14 + [7], schedules=["1F1B"], n_microbatches=[16]),
            ),
        ),
        "pipeline llama3-70b 1x32x8 torchtitan layout h100": lambda: (
            *zoo("llama3-70b", dtype=torch.bfloat16, batch=256, seq=8192),
            _mesh((1, 32, 8), ("pp", "dp", "tp")),
            dict(
                cluster="h100",
                pipeline=dict(layers_per_stage=[80], schedules=["GPipe"], n_microbatches=[1], recompute="all"),
            ),
        ),
    }
    return out


# ---- one plan's record ------------------------------------------------------------------------------------------
def sig(v, digits=SIG):
    """A float rounded to `digits` significant digits (ints, None and strings unchanged)."""
    if not isinstance(v, float) or v == 0 or not math.isfinite(v):
        return v
    return round(v, digits - 1 - int(math.floor(math.log10(abs(v)))))


def _dim_key(d) -> str:
    return "+".join(map(str, d)) if isinstance(d, (tuple, list)) else str(d)


def collectives(plan) -> dict:
    """'kind@mesh dim' -> [count, bytes] over one step's planned collectives."""
    out = {}
    for kind, dim, nbytes in plan.collectives():
        c = out.setdefault(f"{kind}@{_dim_key(dim)}", [0, 0])
        c[0] += 1
        c[1] += int(nbytes)
    return dict(sorted(out.items()))


def stages(plan) -> dict | None:
    if not plan.stages:
        return None
    sc = plan.schedule
    return {
        "schedule": sc.get("name"),
        "pp": sc.get("pp"),
        "n_microbatches": sc.get("n_microbatches"),
        "stages_per_rank": sc.get("stages_per_rank"),
        "stage_mesh": [list(sc.get("stage_mesh_shape", [])), list(sc.get("stage_mesh_names", []))],
        "stages": [
            {
                "index": st["index"],
                "pp_rank": st["pp_rank"],
                "clusters": list(st["clusters"]),
                "n_params": len(st.get("params", [])),
                "recompute_blocks": st.get("recompute_blocks"),
                "step_s": sig(float(st["time"]["per_microbatch_s"])) if "per_microbatch_s" in st["time"] else None,
            }
            for st in plan.stages
        ],
    }


def record(name, plan, seconds) -> dict:
    return {
        "name": name,
        "hash": plan.hash(),
        "mesh": [list(plan.mesh_shape), list(plan.mesh_names)],
        "predicted": {k: sig(float(plan.predicted[k])) for k in PREDICTED if k in plan.predicted},
        "collectives": collectives(plan),
        "solver": {"status": plan.solver.get("status"), "objective": sig(float(plan.solver["objective"]))},
        "stages": stages(plan),
        "plan_s": round(seconds, 2),
    }


def run(names, out_path) -> int:
    import autopar

    built = configs()
    todo = [n for n in built if not names or any(s in n for s in names)]
    failed, t0 = 0, time.perf_counter()
    with open(out_path, "w") as f:
        for name in todo:
            t = time.perf_counter()
            try:
                model, x, mesh, kw = built[name]()
                plan = autopar.plan(model, mesh, x, time_limit=TIME_LIMIT_S, **kw)
                rec = record(name, plan, time.perf_counter() - t)
            except Exception as e:  # a configuration that cannot plan is a line saying why: that too is compared
                failed += 1
                text = str(e).splitlines()[0][:300] if str(e) else ""
                rec = {"name": name, "error": type(e).__name__, "message": text}
                rec["plan_s"] = round(time.perf_counter() - t, 2)
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            print(
                f"{rec['plan_s']:7.2f} s  {name}: {rec.get('hash') or rec['error'] + ': ' + rec['message']}", flush=True
            )
    print(f"{len(todo)} configurations ({failed} failed to plan) in {time.perf_counter() - t0:.1f} s -> {out_path}")
    return 0


# ---- comparison -------------------------------------------------------------------------------------------------
def load(path) -> dict:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip() and not line.startswith("#")]
    return {r["name"]: r for r in rows}


def differences(old: dict, new: dict, path="") -> list[str]:
    """Every leaf that differs between two records, as 'path: old -> new' (NOT_COMPARED keys left out)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            if k in NOT_COMPARED:
                continue
            out += differences(old.get(k, "<missing>"), new.get(k, "<missing>"), f"{path}.{k}" if path else k)
        return out
    return [] if old == new else [f"{path}: {json.dumps(old)} -> {json.dumps(new)}"]


def compare(old_path, new_path, allow_missing=False) -> int:
    old, new = load(old_path), load(new_path)
    bad = 0
    for name in list(old) + [n for n in new if n not in old]:
        if name not in new or name not in old:
            where = new_path if name not in new else old_path
            print(f"{'note' if allow_missing else 'DIFF'} {name}: not in {where}")
            bad += not allow_missing
            continue
        diffs = differences(old[name], new[name])
        bad += bool(diffs)
        for d in diffs:
            print(f"DIFF {name}: {d}")
    same = sum(1 for n in old if n in new and not differences(old[n], new[n]))
    print(f"{same} of {len(old)} configurations identical; {bad} differ")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write one JSON line per configuration here")
    ap.add_argument("--only", nargs="*", help="plan only the configurations whose name contains one of these")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="print differences; exit 1 on any")
    ap.add_argument("--allow-missing", action="store_true", help="with --compare: a configuration in one file only")
    ap.add_argument("--list", action="store_true", help="print the configuration names")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare, allow_missing=args.allow_missing)
    if args.list:
        print("\n".join(configs()))
        return 0
    if not args.out:
        ap.error("give --out FILE, --compare OLD NEW or --list")
    return run(args.only, args.out)


if __name__ == "__main__":
    sys.exit(main())
