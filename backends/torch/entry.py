"""The torch backend's entry points: `lower` (a finished Plan onto the user's module, no planning), `render` (the
same lowering as code for people), and `parallelize`, behind autopar.parallelize(backend="torch" | "mixed" |
"auto"): the plan (planned for target="torch" when none is given), then the engines, the engines with graph parts
(mixed.py) or the whole model on the graph backend, in that order of preference."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import loss_parallel

from autopar.targets import TorchTarget

from .apply import apply
from .collectives import engine_collectives, engine_step_time
from .graph_backend import _device, _rng_devices, parallelize_graph, prepare_engine_model
from .lowering import EngineLoweringError, TorchLowering
from .mixed import choose_parts, install_parts, plan_parts
from .recognize import recognize


def _expressible(low: TorchLowering, what: str) -> TorchLowering:
    if not low.expressible:
        raise EngineLoweringError(
            f"the plan cannot be {what} fully_shard / parallelize_module:\n"
            + "\n".join(f"  {part}: {why}" for part, why in low.reasons)
        )
    return low


def lower(model: nn.Module, plan, mesh, *, units=None, styles=None, compile_blocks=None) -> nn.Module:
    """Parallelize `model` in place with fully_shard / parallelize_module as `plan` says (recognize.py, then
    apply.py); never plans. Raises EngineLoweringError (listing every reason) when the plan is not expressible.
    compile_blocks: torch.compile keyword arguments to compile each repeated block in place (torchtitan's order:
    after tensor parallelism and checkpointing, before FSDP). Returns the same module."""
    low = _expressible(recognize(plan, model, units=units, styles=styles), "lowered to")
    return apply(model, mesh, low, compile_blocks)


def render(plan, model: nn.Module | None = None, *, units=None, styles=None) -> str:
    """The plan as the Python a user would have written (parallelize_plan dict, fully_shard units, apply()), the
    steps `lower` applies; printable, importable, editable. EngineLoweringError when the engines cannot express it."""
    return _expressible(recognize(plan, model, units=units, styles=styles), "written as").code()


def train_context(model) -> contextlib.AbstractContextManager:
    """Wrap forward AND backward of a lowered model in this (loss_parallel when the plan shards the loss)."""
    low = getattr(model, "_autopar_lowering", None)
    if low is not None and low.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()


def local_inputs(model_or_lowering, mesh, *inputs):
    """This rank's piece of the global inputs: sharded on the data dims (batch), whole on the others."""
    low = getattr(model_or_lowering, "_autopar_lowering", model_or_lowering)
    out = []
    for x, pl in zip(inputs, low.input_placements):
        for d, p in enumerate(pl):
            if p[0] == "S":
                x = x.chunk(mesh.size(d), dim=int(p[1:]))[mesh.get_local_rank(d)]
        out.append(x)
    return tuple(out)


def parallelize(
    model: nn.Module,
    mesh,
    example_inputs,
    *,
    backend: str = "torch",
    units=None,
    styles=None,
    planned=None,
    planner=None,
    compile_blocks=None,
    assume_identical: bool = False,
    check_replicas: bool = True,
    **plan_kwargs,
):
    """Plan `model` for `mesh` with `planner` (autopar.plan, which the front door autopar.parallelize gives;
    target="torch"), unless `planned` gives the Plan or (Plan, PlanState), and lower it: backend "torch" (the user's own module, parallelized in place by the engines;
    EngineLoweringError if the plan does not fit them), "mixed" (the engines for what they express, the graph
    backend for the modules they cannot, mixed.py; the whole model on the graph backend when no such split exists)
    or "auto" ("mixed", but a split is kept only when the cost model predicts it no slower than the graph backend
    running the whole plan). The dump says which part went where and why. compile_blocks: as in `lower`.
    assume_identical / check_replicas: as autopar.backends.spmd.module.parallelize (rank 0's parameters and buffers are
    broadcast before the engines shard them, `model.autopar_init_comm`; a replica checksum before the first step).
    The user's RNG state is left as it was; `model.autopar_rng_seed` is rank 0's torch.initial_seed()."""
    if backend not in ("torch", "mixed", "auto"):
        raise ValueError(f"backend must be 'torch', 'mixed' or 'auto' here, got {backend!r}")
    options = dict(units=units, styles=styles, compile_blocks=compile_blocks, planner=planner)
    options.update(assume_identical=assume_identical, check_replicas=check_replicas)
    with torch.random.fork_rng(devices=_rng_devices(mesh)):
        return _parallelize(model, mesh, example_inputs, backend, planned, options, plan_kwargs)


def _split_inputs(example_inputs, plan_kwargs):
    """(positional inputs, keyword inputs or None). Keyword inputs (autopar/model_io.py) plan like positional
    ones; the engines run the user's own module, which takes them itself; the graph parts of "mixed" are split by
    positional calls, so keyword inputs skip them."""
    kw = plan_kwargs.pop("example_kwargs", None)
    if isinstance(example_inputs, dict):
        example_inputs, kw = (), {**example_inputs, **(kw or {})}
    ex = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return ex, kw


def _engine_target(target):
    """The planner's target for the engines: "torch" (the free plan's data dims decide, one or two solves) or an
    autopar.TorchTarget declaring them (one solve with the engines' pins decided up front, autopar/targets.py).
    Anything else would plan for what the engines do not run, so it is refused here, before planning."""
    if target == "torch" or isinstance(target, TorchTarget):
        return target
    raise ValueError(f"the torch backend plans for target='torch' or an autopar.TorchTarget, got {target!r}")


def _parallelize(model, mesh, example_inputs, backend, planned, options, plan_kwargs):
    ex, kw = _split_inputs(example_inputs, plan_kwargs)
    plan_kwargs.setdefault("cluster", "cpu-gloo" if mesh.device_type == "cpu" else "h100")  # also the parts'
    if planned is None:
        if options["planner"] is None:
            raise ValueError("the torch backend runs a finished plan: pass planned=, or call autopar.parallelize")
        extra = {"example_kwargs": kw} if kw else {}
        target = _engine_target(plan_kwargs.pop("target", "torch"))
        planned = options["planner"](model, mesh, ex, target=target, return_state=True, **extra, **plan_kwargs)
    plan, state = planned if isinstance(planned, tuple) else (planned, None)
    low = recognize(plan, model, units=options["units"], styles=options["styles"])
    if plan.meta.get("engine_replan"):
        low.notes.insert(0, plan.meta["engine_replan"])
    if low.expressible:
        return _run_on_engines(model, mesh, plan, low, "torch", options)
    if backend == "torch":
        raise EngineLoweringError(
            "the plan cannot be lowered to fully_shard / parallelize_module (use "
            "backend='auto', 'mixed' or 'graph'):\n" + "\n".join(f"  {part}: {why}" for part, why in low.reasons)
        )
    mixed, why = (
        _mixed(model, mesh, ex, plan, low, options, plan_kwargs)
        if not kw
        else (None, "keyword inputs: graph parts are split off positional calls only")
    )
    if mixed is not None and backend == "auto":  # the faster of the two by the cost model
        mixed, why = _faster_than_graph(plan, mixed, plan_kwargs["cluster"])
    if mixed is not None:
        return _run_on_engines(model, mesh, plan, mixed, "torch + graph parts", options)
    pm = parallelize_graph(
        model,
        mesh,
        ex,
        example_kwargs=kw,
        planned=(plan, state),
        assume_identical=options["assume_identical"],
        check_replicas=options["check_replicas"],
    )
    low.notes.append(f"the whole model runs on the graph backend: {why}")
    pm.autopar_dump, pm.autopar_fallback = _dump(plan, low, "graph"), why
    return pm


def _run_on_engines(model, mesh, plan, low, backend, options):
    """Rank 0's parameters on every rank, then the engines (and the graph parts, if any) on the model."""
    init = prepare_engine_model(model, mesh, _device(mesh), options["assume_identical"], options["check_replicas"])
    apply(model, mesh, low, options["compile_blocks"])
    if low.parts:
        install_parts(model, mesh, low, _device(mesh))
    model._autopar_plan = plan
    model.autopar_dump = _dump(plan, low, backend, init)
    return model


def _faster_than_graph(plan, mixed, cluster):
    """(mixed, None) when the split is predicted no slower than the graph backend running the plan, else
    (None, why)."""
    t_mixed, t_graph = engine_step_time(plan, mixed, cluster), plan.predicted["step_s"]
    if t_mixed <= t_graph:
        return mixed, None
    return None, (
        f"the engines with graph parts for {', '.join(sorted(mixed.parts))} are predicted "
        f"slower ({t_mixed * 1e3:.2f} ms a step: their collectives) than the graph backend "
        f"running the plan ({t_graph * 1e3:.2f} ms)"
    )


def _mixed(model, mesh, ex, plan, low, options, plan_kwargs):
    """(the lowering with graph parts, None) when every reason names a module that can run as a part on the
    graph backend while the engines run the rest (mixed.py); (None, why not) otherwise."""
    try:
        chosen, calls = choose_parts(plan, low, model, ex, recognize)
    except Exception as e:  # noqa: BLE001 (e.g. a forward that cannot run on meta tensors: recorded, not fatal)
        return None, f"the modules the engines cannot express were not split off ({type(e).__name__}: {e})"
    if chosen is None:
        return None, calls
    mixed = recognize(plan, model, units=options["units"], styles=options["styles"], parts=list(chosen))
    if not mixed.expressible:
        return None, "with " + ", ".join(
            chosen
        ) + " on the graph backend the engines still cannot express " + "; ".join(f"{p}: {w}" for p, w in mixed.reasons)
    if mixed.tp_dim is not None and any(st.cls == "SequenceParallel" for st in mixed.styles.values()):
        return None, "a part's inputs would be sequence-sharded on the tensor-parallel dim (SequenceParallel)"
    kw = {k: v for k, v in plan_kwargs.items() if k != "force"}
    plan_parts(plan, model, mesh, mixed, chosen, calls, options["planner"], force=plan_kwargs.get("force"), **kw)
    return mixed, None


def _compare_collectives(plan, low) -> None:
    """A note when what the engines issue (engine_collectives) differs from the plan's own prediction."""
    mine, _ = engine_collectives(plan, low)
    planned = plan.collectives()
    a, b = sum(x[2] for x in mine), sum(x[2] for x in planned)
    if (len(mine), a) != (len(planned), b):
        low.notes.append(
            f"the engines issue {len(mine)} collectives, {a:,d} B a step, where the plan predicts "
            f"{len(planned)}, {b:,d} B (see the notes above; autograd runs the backward as the "
            f"forward's mirror, not the plan's own backward placements"
            + ("; the graph parts run their own plans" if low.parts else "")
            + ")"
        )


def _dump(plan, low, backend, init: str = "") -> str:
    if backend != "graph":
        _compare_collectives(plan, low)
    head = f"backend: {backend}" + (
        ""
        if backend == "torch"
        else " (the torch engines for the rest, the graph backend for the modules marked '-> graph')"
        if low.parts
        else " (fallback: the torch engines cannot express the parts marked '-> graph')"
    )
    return head + "\n" + (init + "\n" if init else "") + low.report() + "\n" + plan.summary()
