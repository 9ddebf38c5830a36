"""Pipeline parallelism on the third-party zoo: every model of tests/third_party/zoo.py planned with a "pp" mesh dim
of 2 (autopar.plan with its keyword inputs, the schedule pinned, stage cuts and micro-batches the planner's) and
run by PipelineRunner.step_model on 2 gloo ranks against one device, as tests/test_pipeline_models_dist.py checks
its cases (`_rank_cases`: the loss of the last stage, every gradient within 1e-6 + 1e-4 max|ref|, a batch of
another shape refused on every rank). What the runtime cannot carry is refused from the plan (forward_stage's
check_plan, batch_split's check_batch_norm) before any rank starts, naming the block or module; writes
benchmarks/results/pipeline_models.md (and the raw records as JSON next to it).

    python benchmarks/pipeline_models.py                       # every zoo model, 1F1B
    python benchmarks/pipeline_models.py --models llama,bloom --schedule GPipe
    python benchmarks/pipeline_models.py --float8   # float8 linears (writes pipeline_models_float8.md)

With --float8 every plan is made with float8=True and a model passes when its step runs with float8 GEMMs and its
loss is within 2% of one device's fp32 loss (the gradients are float8's, not fp32's: `worst` is then a
measurement, not a criterion; that the stages compute the float8 math exactly is tests/test_pipeline_float8_dist.py).

A rank that fails mid-step ends its launch: the launch starts again from the next model (the failed one's error is
the rank's last line), so one crash costs one model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [
    str(ROOT / "tests"),
    str(ROOT / "tests" / "third_party"),
    str(ROOT / "benchmarks"),
]  # ranks run tests/_dist.py

import test_pipeline_models_dist as T  # noqa: E402
from _dist import launch  # noqa: E402

import provenance  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "pipeline_models.md"
LAUNCH_TIMEOUT_S = 1800
FLOAT8_LOSS_TOL = 0.02  # --float8: the loss against one device's fp32 one
FLOAT8 = False  # set by --float8


def _plan_saved(name: str, schedule: str, tmp: Path, by_name: bool = False) -> dict:
    """The case as tests/test_pipeline_models_dist.py's _plans makes it, for positional models as well (by_name:
    their inputs bound to the forward's parameter names, the plan made from keyword inputs)."""

    import autopar

    model, args, kwargs = (_by_name if by_name else _MODEL)(name)
    mesh, cluster, force, opts = T._layout(model, 2, None)
    plan = autopar.plan(
        model, mesh, args, example_kwargs=kwargs or None, cluster=cluster, force=force,
        pipeline={"schedules": [schedule], **opts}, **({"float8": True} if FLOAT8 else {}),
    )  # fmt: skip
    path = tmp / f"plan_{name}_{schedule}.json"
    plan.save(path)
    keyword = bool(plan.meta.get("keyword_inputs"))
    return {
        "name": name,
        "schedule": schedule,
        "path": str(path),
        "inside": None,
        "keyword": keyword,
        "by_name": by_name,
    }


def _by_name(name: str):
    """T._model with the inputs bound to the forward's parameter names (a by_name case's ranks call it so)."""
    import inspect

    model, args, kwargs = _MODEL(name)
    return model, (), dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)


def _random_forward(name: str) -> bool:
    """Whether the model's training forward draws random numbers that dropout-off leaves on (PhiMoE's sparsemixer
    samples its experts): one device's loss changes with the seed, so the comparison runs both in eval()."""
    import torch
    import zoo

    model, args, kwargs = _MODEL(name)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            losses.append(float(zoo.loss_of(model(*args, **kwargs))))
    return losses[0] != losses[1]


def _in_eval(name: str):
    model, args, kwargs = _MODEL(name)
    return model.eval(), args, kwargs


_MODEL = T._model


def _positional_case(cases: list) -> dict:
    """One rank of a model called as model(x, target) -> loss: `runner.step(x, target)`, the loss on the last
    stage's rank and every local gradient against one device (tests/test_pipeline_dist.py's positional path)."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import Plan
    from autopar.backends.pipelining.runtime import PipelineRunner, PipelineShapeError

    case = cases[0]
    plan = Plan.load(case["path"])
    model, args, _ = T._model(case["name"])
    ref = copy.deepcopy(model)
    x, y = args
    runner = PipelineRunner(model, plan, init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=("pp",)))
    loss = runner.step(x if runner.is_first else None, y if runner.is_last else None)
    ref(x, y).backward()
    grads, worst = dict(ref.named_parameters(remove_duplicate=False)), 0.0
    for n, p in runner.named_parameters():
        want = grads[n].grad
        tol = T.TOL_ABS + T.TOL_REL * float(want.abs().max())
        worst = max(worst, float((p.grad - want).abs().max()) / tol)
    try:
        wide = lambda v: torch.cat([v, v], 1) if v.dim() >= 2 else v
        runner.step(wide(x) if runner.is_first else None, wide(y) if runner.is_last else None)
        err = "no error"
    except PipelineShapeError as e:
        err = f"PipelineShapeError: {e}"
    got = {"loss": None if loss is None else float(loss), "loss_ref": float(ref(x, y)), "worst": worst}
    return {"cases": [{**got, "shape_error": err}]}


def _first_cause(errors: list) -> str:
    """The error that ended a step: not a peer's "Connection closed" when the failing rank's own is there."""
    own = [e for e in errors if "Connection closed by peer" not in e]
    return (own or errors or ["no result"])[0]


def plan_case(name: str, schedule: str, tmp: Path) -> dict:
    """The model's pipeline plan saved for the ranks, or the stage and one-line error that stopped it."""
    import zoo

    from autopar import Plan
    from autopar.backends.pipelining.batch_split import check_batch_norm
    from autopar.backends.pipelining.forward_stage import check_chain, check_plan

    rec = {"model": name, "schedule": schedule, "family": ""}
    t = time.perf_counter()
    try:
        rec["family"] = zoo.ZOO[name]()[3].get("family", "")
        case = _plan_saved(name, schedule, tmp)
        rec["plan_s"] = time.perf_counter() - t
        plan = Plan.load(case["path"])
        prefix = plan.schedule["layer_prefix"] + "."
        rec["stages"] = [sum(1 for f in st["modules"] if f.startswith(prefix)) for st in plan.stages]
        rec["micro"] = plan.schedule["n_microbatches"]
        if FLOAT8:
            rec["float8_linears"] = len(plan.meta["float8"]["linears"])
        check_batch_norm(T._model(name)[0], plan)
        try:
            check_plan(plan)
            if not case["keyword"]:
                check_chain(plan)
        except NotImplementedError as e:  # what the error says to do: plan by name, run step_model
            if case["keyword"] or "example_kwargs=" not in str(e):
                raise
            rec["note"] = "planned again with example_kwargs= (" + str(e).split(":")[0] + ")"
            case = _plan_saved(name, schedule, tmp, by_name=True)
            check_plan(Plan.load(case["path"]))
        if _random_forward(name):
            rec["note"] = "its training forward is random (the loss changes with the seed): compared in eval()"
            case["eval"] = True
        rec["case"] = case
    except Exception as e:  # noqa: BLE001 - each model's own failure is the result
        rec["stage"] = "plan" if "plan_s" not in rec else "refused"
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
    return rec


def rank_cases(cases: list, out_dir: str) -> dict:
    """One rank: each case as the test runs it, its result appended to rank<r>.jsonl as it ends."""
    import torch.distributed as dist

    path = Path(out_dir) / f"rank{dist.get_rank()}.jsonl"
    for case in cases:
        try:
            T._model = _by_name if case["by_name"] else _in_eval if case.get("eval") else _MODEL
            got = (T._rank_cases if case["keyword"] else _positional_case)([case])["cases"][0]
            line = {"name": case["name"], **{k: got[k] for k in ("loss", "loss_ref", "worst", "shape_error")}}
        except Exception as e:
            line = {"name": case["name"], "error": f"{type(e).__name__}: {e}"[:400], "tb": traceback.format_exc()}
            with path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            raise
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
    return {"rank": dist.get_rank()}


def run_cases(cases: list, tmp: Path) -> dict:
    """{model: [rank 0 line, rank 1 line]}, relaunching after a failed model from the one after it."""
    done, todo = {}, list(cases)
    while todo:
        out = Path(tempfile.mkdtemp(dir=tmp))
        try:
            launch(rank_cases, 2, [todo, str(out)], tmp, timeout=LAUNCH_TIMEOUT_S)
        except BaseException as e:  # a failed rank: the lines written so far say how far it got
            failure = str(e)[-600:]
        else:
            failure = None
        lines = [
            [json.loads(x) for x in (out / f"rank{r}.jsonl").read_text().splitlines()]
            if (out / f"rank{r}.jsonl").exists()
            else []
            for r in range(2)
        ]
        n = min(len(x) for x in lines)
        for i in range(n):
            done[todo[i]["name"]] = [lines[0][i], lines[1][i]]
        if failure is None and n == len(todo):
            break
        if n and any("error" in x[n - 1] for x in lines):  # the last case both ranks ended is the failed one
            todo = todo[n:]
            continue
        bad = todo[n]["name"]
        errs = [x[n]["error"] for x in lines if len(x) > n and "error" in x[n]]
        done[bad] = [{"name": bad, "error": _first_cause(errs + [failure or "no result"])}] * 2
        todo = todo[n + 1 :]
    return done


def verdict(rec: dict, ranks: list | None) -> None:
    if ranks is None:
        return
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        rec.update(stage="step", error=_first_cause(errors).splitlines()[0])
        return
    loss = next((r for r in ranks if r["loss"] is not None), None)
    rec["worst"] = max(r["worst"] for r in ranks)
    tol = FLOAT8_LOSS_TOL if FLOAT8 else 1e-5
    ok_loss = loss is not None and abs(loss["loss"] - loss["loss_ref"]) <= tol * abs(loss["loss_ref"])
    ok_shape = all("PipelineShapeError" in r["shape_error"] for r in ranks)
    if not (ok_loss and (FLOAT8 or rec["worst"] <= 1.0) and ok_shape):
        rec.update(stage="compare", error=f"loss {loss and loss['loss']} vs {loss and loss['loss_ref']}; "
                   f"worst gradient {rec['worst']:.2f} of the tolerance; shape check {ok_shape}")  # fmt: skip
    else:
        rec["ok"] = True


def render(recs: list, command: str, wall: float) -> str:
    passed = sum(1 for r in recs if r.get("ok"))
    refused = sum(1 for r in recs if r.get("stage") == "refused")
    f8 = (
        "With float8=True: a model passes when its step runs with the plan's float8 linears (`linears`: how many) "
        f"and its loss is within {FLOAT8_LOSS_TOL:.0%} of one device's fp32 loss; `worst` is the float8 gradients' "
        "largest difference from fp32 in units of that tolerance (a measurement here, not a criterion).\n"
    )
    lines = [
        "# Pipeline parallelism on the third-party zoo" + (", float8 linears" if FLOAT8 else "") + "\n",
        f"Made by `{command}` at {provenance.commit()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s).\n",
        "Each model of `tests/third_party/zoo.py` (built small, random weights, dropout off) planned by "
        "`autopar.plan` on a (2,) mesh named pp (cluster h100, keyword inputs, the schedule pinned; stage cuts and "
        "micro-batches the planner's) and run by `PipelineRunner.step_model` on 2 gloo ranks against one device: "
        "the loss on the last stage's rank, every gradient within 1e-6 + 1e-4 max|ref| (worst: the largest "
        "|diff| as a fraction of that), and a batch of twice the sequence refused on both ranks (PipelineShapeError). "
        "Refused: what the runtime cannot carry, said from the plan before any rank starts.\n",
        *([f8] if FLOAT8 else []),
        f"{passed} of {len(recs)} pass, {refused} refused from the plan, "
        f"{len(recs) - passed - refused} fail at planning or at the step.\n",
        "| model | covers | plan s (wall) | blocks per stage | micro-batches | "
        + ("linears | " if FLOAT8 else "")
        + "worst | result | reason |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if FLOAT8 else ""),
    ]
    for r in recs:
        result = "**pass**" if r.get("ok") else r.get("stage", "fail")
        worst = f"{r['worst']:.3f}" if "worst" in r else ""
        plan_s = f"{r['plan_s']:.1f}" if "plan_s" in r else ""
        why = (r.get("error", "") or r.get("note", "")).replace("|", "\\|")
        lines.append(
            f"| {r['model']} | {r['family']} | {plan_s} | {r.get('stages', '')} | {r.get('micro', '')} | "
            + (f"{r.get('float8_linears', '')} | " if FLOAT8 else "")
            + f"{worst} | {result} | {why} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    ap.add_argument("--schedule", default="1F1B", help="torch.distributed.pipelining schedule (default 1F1B)")
    ap.add_argument("--out", default=None, help="the results file (default benchmarks/results/pipeline_models.md)")
    ap.add_argument("--float8", action="store_true", help="plan with float8=True (see the module docstring)")
    a = ap.parse_args(argv)
    global FLOAT8
    FLOAT8 = a.float8
    a.out = a.out or str(OUT.with_name("pipeline_models_float8.md") if FLOAT8 else OUT)
    import zoo

    names = [n for n in a.models.split(",") if n] or list(zoo.ZOO)
    t, tmp = time.perf_counter(), Path(tempfile.mkdtemp(prefix="pp_models_"))
    recs = [plan_case(n, a.schedule, tmp) for n in names]
    ran = run_cases([r["case"] for r in recs if "case" in r], tmp)
    for r in recs:
        verdict(r, ran.get(r["model"]))
        r.pop("case", None)
    command = "python benchmarks/pipeline_models.py" + "".join(f" {x}" for x in (argv or sys.argv[1:]))
    Path(a.out).write_text(render(recs, command, time.perf_counter() - t))
    Path(a.out).with_suffix(".json").write_text(json.dumps(recs, indent=1))
    print(f"{sum(1 for r in recs if r.get('ok'))} of {len(recs)} pass; wrote {a.out}")


if __name__ == "__main__":
    main()
