"""The torch backend's entry points: `lower` (a finished Plan onto the user's module, no planning), `render` (the
same lowering as code for people), and, behind autopar.parallelize(backend="torch" | "mixed" | "auto"), `split_plan`
(what the engines run of a finished plan, and the graph parts they need planned, which the front door plans) and
`parallelize` (the engines, the engines with graph parts (mixed.py) or the whole model on the graph backend, in that
order of preference). None of them plans."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import loss_parallel

from .apply import apply
from .collectives import engine_collectives, engine_step_time
from .graph_backend import _device, _rng_devices, parallelize_graph, prepare_engine_model
from .lowering import EngineLoweringError, TorchLowering
from .mixed import attach_parts, choose_parts, install_parts, part_requests
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


OPTIONS = ("units", "styles", "compile_blocks", "assume_identical", "check_replicas")  # not the planner's


@dataclass
class Split:
    """What the torch backend does with a finished plan, decided before anything runs and without planning: the
    engines alone (`low` expressible), the engines with graph parts (`mixed`, whose parts the front door plans from
    `requests`: {module FQN: mixed.PartRequest}), or the whole model on the graph backend (`why`)."""

    plan: object
    state: object
    low: TorchLowering
    backend: str  # "torch", "mixed" or "auto"
    mixed: TorchLowering | None = None
    chosen: dict = field(default_factory=dict)  # {part FQN: the engines' reasons}
    requests: dict = field(default_factory=dict)
    why: str | None = None


def split_plan(
    model,
    plan,
    example_inputs,
    *,
    backend="torch",
    state=None,
    example_kwargs=None,
    force=None,
    units=None,
    styles=None,
) -> Split:
    """Recognize `plan` on the user's module and, for backend "mixed" / "auto" when the engines cannot express
    it, choose the modules to run on the graph backend (mixed.py) and state what each needs planned. Never plans;
    EngineLoweringError for backend "torch" when the engines cannot express the plan."""
    if backend not in ("torch", "mixed", "auto"):
        raise ValueError(f"backend must be 'torch', 'mixed' or 'auto' here, got {backend!r}")
    low = recognize(plan, model, units=units, styles=styles)
    if plan.meta.get("engine_replan"):
        low.notes.insert(0, plan.meta["engine_replan"])
    out = Split(plan, state, low, backend)
    if low.expressible:
        return out
    if backend == "torch":
        raise EngineLoweringError(
            "the plan cannot be lowered to fully_shard / parallelize_module (use "
            "backend='auto', 'mixed' or 'graph'):\n" + "\n".join(f"  {part}: {why}" for part, why in low.reasons)
        )
    if example_kwargs:
        out.why = "keyword inputs: graph parts are split off positional calls only"
        return out
    ex = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    out.mixed, out.chosen, calls, out.why = _mixed(model, ex, plan, low, units, styles)
    if out.mixed is not None:
        out.requests = part_requests(plan, model, out.mixed, out.chosen, calls, force)
    return out


def parallelize(
    model,
    mesh,
    example_inputs,
    split: Split,
    parts=None,
    *,
    cluster,
    example_kwargs=None,
    compile_blocks=None,
    assume_identical: bool = False,
    check_replicas: bool = True,
):
    """Run `split` (from `split_plan`) on `model`: the engines, the engines with the graph parts (`parts`: {request
    key: (plan, state, how)}, the requests planned by the front door), or the whole model on the graph backend.
    backend "auto" keeps the parts only where the cost model predicts them no slower than the graph backend
    running the whole plan. Never plans. assume_identical / check_replicas: as autopar.backends.spmd.module.
    parallelize (rank 0's parameters and buffers are broadcast before the engines shard them,
    `model.autopar_init_comm`; a replica checksum before the first step). The user's RNG state is left as it
    was; `model.autopar_rng_seed` is rank 0's torch.initial_seed(). The dump says which part went where and why."""
    options = dict(compile_blocks=compile_blocks, assume_identical=assume_identical, check_replicas=check_replicas)
    plan, low, mixed, why = split.plan, split.low, split.mixed, split.why
    with torch.random.fork_rng(devices=_rng_devices(mesh)):
        if low.expressible:
            return _run_on_engines(model, mesh, plan, low, "torch", options)
        if mixed is not None:
            attach_parts(mixed, split.chosen, split.requests, parts or {})
            if split.backend == "auto":  # the faster of the two by the cost model
                mixed, why = _faster_than_graph(plan, mixed, cluster)
        if mixed is not None:
            return _run_on_engines(model, mesh, plan, mixed, "torch + graph parts", options)
        ex = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        pm = parallelize_graph(
            model,
            mesh,
            ex,
            example_kwargs=example_kwargs,
            planned=(plan, split.state),
            assume_identical=assume_identical,
            check_replicas=check_replicas,
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


def _mixed(model, ex, plan, low, units, styles):
    """(the lowering with graph parts, {part FQN: reasons}, their calls, None) when every reason names a module that can run as
    a part on the graph backend while the engines run the rest (mixed.py); (None, {}, {}, why not) otherwise."""
    try:
        chosen, calls = choose_parts(plan, low, model, ex, recognize)
    except Exception as e:  # noqa: BLE001 (e.g. a forward that cannot run on meta tensors: recorded, not fatal)
        return None, {}, {}, f"the modules the engines cannot express were not split off ({type(e).__name__}: {e})"
    if chosen is None:
        return None, {}, {}, calls
    mixed = recognize(plan, model, units=units, styles=styles, parts=list(chosen))
    if not mixed.expressible:
        return (
            None,
            {},
            {},
            "with "
            + ", ".join(chosen)
            + " on the graph backend the engines still cannot express "
            + "; ".join(f"{p}: {w}" for p, w in mixed.reasons),
        )
    if mixed.tp_dim is not None and any(st.cls == "SequenceParallel" for st in mixed.styles.values()):
        return None, {}, {}, "a part's inputs would be sequence-sharded on the tensor-parallel dim (SequenceParallel)"
    return mixed, chosen, calls, None


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
