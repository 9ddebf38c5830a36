"""The third-party suite's rank job: every zoo model (zoo.py) checked in one 4-rank gloo launch, and the records
benchmarks/models.py tabulates and tests/test_third_party_models.py asserts on. A plain module, no tests.

`job(names, variant, work, dims)` runs on each rank of a 2x2 mesh named `dims` (default ("dp", "tp"); ("dp", "cp")
runs the same checks with every sequence split on cp) (tests/_dist.py's launch). Per model, all ranks together:
  capture / plan   autopar.plan on the 2x2 mesh with tests/_clusters.SHAPES (sharding pays), on every rank;
  parallelize      autopar.parallelize with that plan (the ranks check they hold the same plan);
  step             3 AdamW steps of the parallel module next to a single-device copy, each step's collectives
                   counted (backends/spmd/comm.CollectiveCounter);
  compare          the first step's loss and every parameter's gradient, and every parameter (and floating
                   buffer) after the 3 steps, against the single device: |diff| <= 1e-6 + 1e-4 max|ref| per
                   tensor, DTensors compared as full tensors; at least one parameter sharded, at least one
                   collective in every step.
Each stage ends with the ranks exchanging their status (all_gather_object, under gloo's 60 s timeout), so a model
that fails on one rank fails on all of them at that stage and the launch goes on with the next model. After the
2x2 checks, the (8, 8) "h100" plans are split over the ranks (model i on rank i % world, timed; no collectives).

Dropout: each model runs in train() mode as built, dropout on. The one-device copy draws from torch's default
generator after torch.manual_seed(SEED) and the parallel module from its program's generator after
pm.program.manual_seed(SEED): the program draws every random tensor whole, in eager's order and memory layout, and
each rank keeps its piece, so the masks are one device's and the comparison is exact (issue 23 point 3).

Plans: the SHAPES cost model replicates every parameter of models this small (data parallel pays), so the 2x2 plan
pins the parameters FSDP-like on dp (`fsdp_pins`) and the planner chooses every other placement; planning a first
time without the pins would only find that again (it did on 28 of 33 models) at twice the planning time.

variant "as-is": the model as its users have it (keyword inputs with labels=, a ModelOutput with .loss).
variant "wrapped": a diagnostic for the contract work (issue 23 point 6): a model taking keyword inputs is wrapped
by hand (positional tensors in, `.loss` out), to see which stage fails after the input contract.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _clusters

from zoo import ZOO, loss_of  # noqa: E402

ATOL, RTOL = 1e-6, 1e-4  # |diff| <= ATOL + RTOL * max|ref|, per tensor
STEPS, LR = 3, 1e-3
SEED = 1234  # one device and the program draw their dropout masks after this seed
# AdamW's eps: with torch's 1e-8, a gradient that is zero analytically (a key projection's bias: softmax ignores
# it) but 1e-9-ish reduction-order noise in fp32 moves its parameter by +-lr on each side, a different sign per
# run (measured: 1.1e-4 on nn.TransformerEncoder's in_proj_bias against a 1.3e-6 tolerance). 1e-4 keeps such
# noise below 1e-8 and changes the update of the real gradients (1e-3 and up) by under 10%.
ADAM_EPS = 1e-4
# When the SHAPES plan replicates every parameter (data parallel pays on models this small), the model is planned
# again with its parameters pinned FSDP-like on the dp dim (Shard(0) where it divides),
# the planner choosing everything else (fsdp_pins), so the check covers sharded parameters (their gathers and gradient
# reduce-scatters). A memory budget under the replicated state would do it too, but made the MILP of 2-layer
# models hit its time limit (gpt2, opt: > 60 s) where the pinned plan takes ~1 s.
# The MILP's time limit for every plan here (autopar's default is 60 s): issue 23 wants each suite model planned in
# <= 10 s; 4 ranks share 2 cores in the launch. A plan past it fails at stage "plan" (SolverTimeLimitError).
PLAN_TIME_LIMIT_S = 30.0
# The status exchange between stages runs on its own gloo group with this timeout, so one rank planning longer than
# the others (past the mesh groups' 60 s) does not break it; the mesh's groups keep their 60 s.
STATUS_TIMEOUT_S = 900
_STATUS = {}  # "group": the status process group of this rank's launch
ROOTS = ("autopar", "passes", "backends")


class GroupBroken(RuntimeError):
    """The ranks could not exchange their status (a collective timed out): the rest of the launch is not run."""


class Wrapped(nn.Module):
    """A hand wrapper (the diagnostic variant): the model's tensor keyword inputs as positional inputs, its
    non-tensor ones (return_loss=True) fixed, the ModelOutput's .loss returned."""

    def __init__(self, model, kwargs):
        super().__init__()
        self.model = model
        self.names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.fixed = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

    def forward(self, *tensors):
        return loss_of(self.model(**dict(zip(self.names, tensors)), **self.fixed))


def build(name, variant="as-is"):
    model, args, kwargs, notes = ZOO[name]()
    if variant == "wrapped" and kwargs:
        model = Wrapped(model, kwargs)
        args, kwargs = tuple(kwargs[k] for k in model.names), {}
    return model, tuple(args), dict(kwargs or {}), notes


def cast(model, args, kwargs, dtype):
    """The model's floating parameters and buffers and the floating tensor inputs in `dtype`."""

    def c(v):
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    return model.to(dtype), tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


def error_line(e: BaseException) -> str:
    """The exception's type and first line (with the next where the first ends in ':', as NoStrategyError's list of
    ops does), and the innermost frame of autopar's own code it passed through."""
    lines = str(e).strip().splitlines() or [""]
    first = (lines[0] + (" " + lines[1].strip() if lines[0].endswith(":") and len(lines) > 1 else ""))[:300]
    where = ""
    for fr in traceback.extract_tb(e.__traceback__):
        parts = fr.filename.replace("\\", "/").split("/")
        if any(r in parts for r in ROOTS) and "site-packages" not in parts:
            where = f" [{'/'.join(parts[-2:])}:{fr.lineno} {fr.name}]"
    return f"{type(e).__name__}: {first}{where}"


def plan_stage(e: BaseException) -> str:
    """'capture' when planning failed before the passes ran (recording the graph, or the call's inputs), else
    'plan'."""
    names = {fr.name for fr in traceback.extract_tb(e.__traceback__)}
    files = {os.path.basename(fr.filename) for fr in traceback.extract_tb(e.__traceback__)}
    if "run_passes" in names or "solve" in names:
        return "plan"
    return (
        "capture" if type(e).__name__ == "CaptureError" or "capture.py" in files or isinstance(e, TypeError) else "plan"
    )


def call_kwargs(kwargs):
    """Keyword inputs go to autopar as example_kwargs= (the API of issue 23 point 6) only when there are some."""
    return {"example_kwargs": kwargs} if kwargs else {}


DIMS = ("dp", "tp")  # the suite's mesh dim names; ("dp", "cp"): the same checks with the sequence split on cp


def placements_summary(params: dict, names=DIMS) -> dict:
    """How many parameters the plan shards on each mesh dim, of how many."""
    out = {"params": len(params)}
    for d, n in enumerate(names):
        out[n] = sum(1 for pl in params.values() if d < len(pl) and str(pl[d]).startswith("S"))
    out["sharded"] = sum(1 for pl in params.values() if any(str(p).startswith("S") for p in pl))
    return out


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(a, b):
    """(max |a - b|, tolerance, ok) of one tensor against its reference b."""
    a, b = _full(a).detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf"), 0.0, False
    err = (a - b).abs().max().item() if a.numel() else 0.0
    tol = ATOL + RTOL * (b.abs().max().item() if b.numel() else 0.0)
    return err, tol, err <= tol


class Checker:
    """Collects the comparisons of one model: the worst error relative to its tolerance, and what failed."""

    def __init__(self):
        self.max_err, self.worst, self.failures = 0.0, 0.0, []

    def check(self, what, a, b):
        err, tol, ok = _close(a, b)
        self.max_err = max(self.max_err, err)
        self.worst = max(self.worst, err / tol if tol else float("inf"))
        if not ok:
            self.failures.append(f"{what}: |diff| {err:.3g} > tol {tol:.3g}")


def _agree(err: str | None):
    """Every rank's status of this stage; the first failing rank's (rank, error) or None."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(got, err, group=_STATUS.get("group"))
    except Exception as e:  # a rank is stuck in a collective or gone
        raise GroupBroken(error_line(e)) from e
    bad = [(r, g) for r, g in enumerate(got) if g]
    if not bad:
        return None
    ranks = "" if len(bad) == len(got) else f" (on ranks {[r for r, _ in bad]} only)"
    return bad[0][1] + ranks


def _gather(value) -> list:
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(got, value, group=_STATUS.get("group"))
    except Exception as e:
        raise GroupBroken(error_line(e)) from e
    return got


def _run_stage(rec, stage, fn):
    """Run fn() on this rank, then agree with the others; False (rec filled) when any rank failed."""
    err, out = None, None
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # recorded, then agreed on: the other ranks stop this model at the same stage
        err = (plan_stage(e) if stage == "plan" else stage) + ": " + error_line(e)
    rec.setdefault("times", {})[stage] = round(time.perf_counter() - t, 2)
    bad = _agree(err)
    if bad is not None:
        rec["stage"], rec["error"] = bad.split(": ", 1)
        return False, None
    return True, out


def check_model(name, variant, mesh, cluster) -> dict:
    """The 2x2 check of one model on every rank (see the module docstring)."""
    import autopar
    from autopar.backends.counter import CollectiveCounter

    rec = {"model": name, "variant": variant, "stage": "", "error": "", "ok": False}
    t0 = time.perf_counter()
    ok, built = _run_stage(rec, "build", lambda: build(name, variant))
    if not ok:
        return rec
    model, args, kwargs, notes = built
    if notes.get("check_dtype") is not None:  # see zoo.py: one device's float32 is itself too noisy
        model, args, kwargs = cast(model, args, kwargs, notes["check_dtype"])
        rec["check_dtype"] = str(notes["check_dtype"]).replace("torch.", "")
    rec["family"], rec["dropout"] = notes["family"], notes["dropout"]
    rec["dropout_off"] = []
    ref = copy.deepcopy(model)
    ok, planned = _run_stage(rec, "plan", lambda: _plan_2x2(model, mesh, args, kwargs, cluster, rec))
    if not ok:
        return rec
    hashes = _gather(planned[0].hash())
    if len(set(hashes)) > 1:  # found under the time limit on some ranks only: parallelize would not agree
        rec["stage"], rec["error"] = "plan", f"the ranks planned differently (plan hashes {hashes})"
        return rec
    rec["placements_2x2"] = placements_summary(planned[0].params, tuple(mesh.mesh_dim_names))
    rec["inputs_2x2"] = [n["placement"]["out"][0] for n in planned[0].nodes if n["kind"] == "input"]
    ok, pm = _run_stage(
        rec, "parallelize", lambda: autopar.parallelize(model, mesh, args, planned=planned, **call_kwargs(kwargs))
    )
    if not ok:
        return rec
    chk = Checker()
    ok, _ = _run_stage(rec, "step", lambda: _train(pm, ref, args, kwargs, chk, rec, CollectiveCounter))
    if not ok:
        return rec
    rec["max_err"], rec["worst_ratio"] = chk.max_err, chk.worst
    problems = list(chk.failures)
    if rec["placements_2x2"]["sharded"] == 0:
        problems.insert(0, "no parameter sharded")
    if min(rec["collectives"]) == 0:
        problems.insert(0, f"a step without collectives ({rec['collectives']})")
    if problems:
        rec["stage"], rec["error"] = "compare", f"{len(problems)} problems; first: {problems[0]}"
        rec["problems"] = problems[:8]
    else:
        rec["ok"] = True
    rec["check_s"] = round(time.perf_counter() - t0, 2)
    return rec


def fsdp_pins(model, mesh_shape) -> dict:
    """Every parameter Shard(0) on mesh dim 0 where that divides it, replicated elsewhere and for 0-d parameters
    (CLIP's logit_scale; autopar.testing.fsdp_force indexes shape[0] of those and raises IndexError)."""
    out = {}
    for k, p in model.named_parameters():
        pl = ["R"] * len(mesh_shape)
        if p.ndim and p.shape[0] % mesh_shape[0] == 0:
            pl[0] = "S0"
        out[k] = tuple(pl)
    return out


def _plan_2x2(model, mesh, args, kwargs, cluster, rec):
    """The 2x2 plan under `cluster` with the parameters pinned FSDP-like on dp (see the module docstring)."""
    import autopar

    rec["forced"] = "parameters pinned FSDP on dp (SHAPES alone replicates them on models this small)"
    return autopar.plan(
        model,
        mesh,
        example_inputs=args,
        cluster=cluster,
        overlap=False,
        return_state=True,
        force=fsdp_pins(model, tuple(mesh.shape)),
        time_limit=PLAN_TIME_LIMIT_S,
        **call_kwargs(kwargs),
    )


def _train(pm, ref, args, kwargs, chk, rec, CollectiveCounter):
    """STEPS AdamW steps of pm and the single-device ref; the first step's loss and gradients and the final
    parameters and buffers compared; collectives of every step counted."""
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS)
    named, ref_named = dict(pm.named_parameters()), dict(ref.named_parameters())
    missing = sorted(set(ref_named) - set(named))
    if missing:
        raise KeyError(f"the parallel module has no parameter {missing[0]} ({len(missing)} missing)")
    rec["collectives"], rec["losses"] = [], []
    torch.manual_seed(SEED)  # one device's dropout masks ...
    pm.program.manual_seed(SEED)  # ... are the ones the program draws whole and slices
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        counter = CollectiveCounter(pm.program.mesh)
        with counter:
            loss = loss_of(pm(*args, **kwargs))
            loss.backward()
        ref_loss = loss_of(ref(*args, **kwargs))
        ref_loss.backward()
        rec["losses"].append([_full(loss).item(), ref_loss.item()])
        if s == 0:
            chk.check("loss", loss, ref_loss)
            for k, p in ref_named.items():
                g = named[k].grad
                if p.grad is None and g is None:
                    continue
                if g is None or p.grad is None:
                    chk.failures.append(f"grad {k}: {'missing' if g is None else 'not on one device'}")
                    continue
                chk.check(f"grad {k}", g, p.grad)
        with counter:
            opt.step()
        ref_opt.step()
        rec["collectives"].append(len(counter.collectives()))
        if s == 0:  # the first step's collectives per mesh dim (kind, dim, bytes): what each dim moved
            names = pm.program.mesh.mesh_dim_names or ()
            by = [names[d] if isinstance(d, int) else str(d) for _, d, _ in counter.collectives()]
            rec["by_dim"] = {d: by.count(d) for d in sorted(set(by))}
    for k, p in ref_named.items():
        chk.check(f"param {k} after {STEPS} steps", named[k], p)
    pm_buffers = dict(pm.named_buffers())
    for k, b in ref.named_buffers():
        if b.is_floating_point() or k.endswith("num_batches_tracked"):
            if k not in pm_buffers:
                chk.failures.append(f"buffer {k}: missing in the parallel module")
            else:
                chk.check(f"buffer {k} after {STEPS} steps", pm_buffers[k].to(b.dtype), b)


def big_mesh(dims=DIMS) -> tuple:
    """The simulated mesh of the timed plan: (8, 8) with a tensor-parallel second dim; (8, 2) with a cp one (the
    zoo's short sequences divide over 2 ranks, as on the 2x2 check, not all over 8)."""
    return (8, 2) if dims[1].startswith("cp") else (8, 8)


def plan_8x8(name, variant="as-is", dims=DIMS) -> dict:
    """autopar.plan of the model as built (dropout on) on a simulated big_mesh(dims) h100 mesh, timed."""
    import autopar

    rec = {"model": name}
    try:
        model, args, kwargs, _ = build(name, variant)
        t = time.perf_counter()
        plan = autopar.plan(
            model,
            autopar.MeshSpec(big_mesh(dims), tuple(dims)),
            example_inputs=args,
            cluster="h100",
            time_limit=PLAN_TIME_LIMIT_S,
            **call_kwargs(kwargs),
        )
        rec["plan_s"] = round(time.perf_counter() - t, 2)
        rec["placements"] = placements_summary(plan.params, dims)
        rec["ok"] = True
    except Exception as e:
        rec.update(ok=False, stage=plan_stage(e), error=error_line(e))
    return rec


def _claim(work: str, i: int) -> bool:
    """Take model i's (8, 8) plan for this rank, unless another rank took it first (a file created exclusively)."""
    try:
        os.close(os.open(os.path.join(work, f"plan8_{i}.claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _wait_for_all(work: str, rank: int, world: int, timeout: float = 3000.0) -> None:
    """Wait (polling files, no collective) until every rank has finished its plans: the launcher's closing barrier
    then meets ranks that are all there, not one still planning past gloo's 60 s timeout."""
    open(os.path.join(work, f"done_{rank}"), "w").close()
    end = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(work, f"done_{r}")) for r in range(world)):
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank}: the other ranks did not finish their (8, 8) plans in {timeout} s")
        time.sleep(0.5)


def _save(work: str, rank: int, out: dict) -> None:
    """This rank's records so far (read back by benchmarks/models.py when a launch fails part-way)."""
    path = os.path.join(work, f"partial_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def job(names, variant="as-is", work=None, dims=DIMS):
    """One rank of the suite's launch: the 2x2 check of every model in turn on a mesh named `dims`, then the
    big_mesh plans taken from a shared queue of files in `work` (a folder all ranks see; each plan once, on
    whichever rank is free). Returns {"checks": [...], "plans": [...]}."""
    from datetime import timedelta
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from _clusters import SHAPES

    _STATUS["group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=STATUS_TIMEOUT_S))
    dims = tuple(dims)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    rank, world = dist.get_rank(), dist.get_world_size()
    work = work or os.environ.get("TMPDIR", "/tmp")
    out, broken = {"rank": rank, "checks": [], "plans": []}, None
    for name in names:
        if broken:
            out["checks"].append({"model": name, "variant": variant, "ok": False, "stage": "not run", "error": broken})
            continue
        try:
            out["checks"].append(check_model(name, variant, mesh, SHAPES))
            if out["checks"][-1]["stage"] in ("parallelize", "step"):  # a collective may have timed out:
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)  # fresh groups
        except GroupBroken as e:
            broken = f"the ranks stopped agreeing at an earlier model: {e}"
            out["checks"].append({"model": name, "variant": variant, "ok": False, "stage": "agree", "error": str(e)})
        _save(work, rank, out)
    for i, n in enumerate(names):
        if _claim(work, i):
            out["plans"].append(plan_8x8(n, variant, dims))
            _save(work, rank, out)
    _wait_for_all(work, rank, world)
    return out


def preload():
    """What every rank imports, imported once before the ranks are forked (forked.py): autopar, its executor and
    the zoo's libraries."""
    import autopar  # noqa: F401
    import autopar.backends.spmd.comm  # noqa: F401
    import autopar.backends.spmd.module  # noqa: F401
    import autopar.testing  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import _clusters  # noqa: F401
    import zoo

    zoo.preload()


def _launch(names, variant, tmp, timeout, dims=DIMS) -> tuple[list[dict], str]:
    """One 4-rank launch of `job` over `names` (forked.py: imports once, 4 forked ranks): (the ranks' results,
    '' or why the launch failed). A launch that fails part-way still gives the records the ranks saved."""
    import tempfile
    import forked

    work = tempfile.mkdtemp(prefix="work_", dir=tmp)
    results, why = forked.launch(
        os.path.abspath(__file__),
        "job",
        4,
        [list(names), variant, work, list(dims)],
        tempfile.mkdtemp(prefix="ranks_", dir=tmp),
        timeout,
    )
    if why:
        for r in range(4):
            p = os.path.join(work, f"partial_{r}.json")
            if results[r] is None:
                results[r] = json.load(open(p)) if os.path.exists(p) else {"rank": r, "checks": [], "plans": []}
    return results, why


def _finished(results) -> list[dict]:
    """Rank 0's checks of the models the launch really ran (not those skipped after the group broke)."""
    return [c for c in results[0]["checks"] if c["stage"] not in ("agree", "not run")]


RELAUNCH_MIN_S = 120  # a relaunch needs at least this much of the launch's time budget left


def run_suite(names, variant, tmp, timeout, dims=DIMS) -> tuple[list[dict], str]:
    """The launch of `job` over `names`: (merged records, '' or why a launch failed).

    A rank that dies mid-model (a native crash: CI lost a rank so at llama, and at pegasus once before, neither
    reproduced in later launches) breaks the gloo group, and every model after it would fail unrun. The models
    from the one the launch was on are then launched once more, in the time left: each is checked in full again
    and passes only on its own merits; `why` keeps the first launch's logs (test_launch_ran_every_model reports
    them). A model whose rank crashes in the relaunch too fails, at stage "launch"."""
    t0 = time.monotonic()
    results, why = _launch(names, variant, tmp, timeout, dims)
    done = _finished(results)
    rest = [n for n in names if n not in {c["model"] for c in done}]
    left = timeout - (time.monotonic() - t0)
    if why and rest and left >= RELAUNCH_MIN_S:
        again, why2 = _launch(rest, variant, tmp, left, dims)
        why = f"{why}\n==== relaunched for {len(rest)} models from {rest[0]} ====\n{why2}"
        plans = [p for r in results for p in r["plans"]]
        results = [{**a, "checks": (done if k == 0 else []) + a["checks"]} for k, a in enumerate(again)]
        results[0]["plans"] = plans + results[0]["plans"]
        done = _finished(results)
    seen = {c["model"] for c in done}
    results[0]["checks"] = done + [
        {"model": n, "variant": variant, "ok": False, "stage": "launch", "error": why.splitlines()[0]}
        for n in names
        if n not in seen
    ]
    return merge(results), why


def merge(results: list[dict]) -> list[dict]:
    """The ranks' results as one record per model: rank 0's check, and the (8, 8) plan from whichever rank ran it."""
    plans = {p["model"]: p for r in results for p in r["plans"]}
    out = []
    for rec in results[0]["checks"]:
        out.append({**rec, "plan8": plans.get(rec["model"], {"ok": False, "stage": "not run", "error": ""})})
    return out
