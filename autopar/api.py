"""Public entry points: `plan` (no GPUs needed) and, in backends, `parallelize`."""

from __future__ import annotations

import functools
import gc
from typing import NamedTuple

import torch
import torch.nn as nn

from . import feasibility
from .capture import capture
from .cost import ClusterSpec, TrainingPrecision, get_cluster
from .mesh import MeshSpec, as_mesh_spec
from .model_io import ModelIO
from .passes import PASSES, candidates, regions, stages
from .passes.alternatives import runner_ups
from .passes import float8 as f8
from .passes.precision import MIXED_BF16, choose
from .passmanager import PlanState, run_passes
from .targets import plan_for_target
from .plan import Plan
from .predict import build_plan
from .solver import InfeasibleMemoryError, SolverTimeLimitError
from .strategies import data_parallel as dp
from .strategies._torch_adapter import outside_local_tensor_mode
from .strategies.context_parallel import CP_PREFIX, cp_dims, cp_pin, keep_data_splits, pin_takes_dims
from .strategies.pins import overlay_pins


def _gc_paused(fn):
    """Planning builds ~10^5 small objects that all stay alive until the plan is returned; Python's cyclic
    collector would rescan them again and again for nothing (measured: 1.3 s of a 5 s plan of the 8B shape)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


@_gc_paused
def plan(
    model: nn.Module,
    mesh,
    example_inputs=None,
    *,
    example_kwargs: dict | None = None,
    cluster="h100",
    loss_fn=None,
    memory_budget: float | None = None,
    precision: TrainingPrecision | None = None,
    force: dict | None = None,
    replicate_ops=(),
    allow_replicate: bool = False,
    time_limit: float = 60.0,
    dump_after=(),
    return_state: bool = False,
    allow_bf16: bool = False,
    float8=None,
    allow_checkpointing: bool = True,
    pipeline=None,
    pin=None,
    overlap: bool = False,
    mip_rel_gap: float = 1e-3,
    output: str = "loss",
    backward: bool = True,
    target: str | None = None,
) -> Plan:
    """Plan how to run one training step of `model` on `mesh`.

    example_inputs / example_kwargs: one step's global inputs, called as `model(*example_inputs, **example_kwargs)`;
        example_inputs may be a dict of keyword inputs instead. Tensors are the step's inputs; other values
        (use_cache=False, None, ints) are constants of the plan. The loss is the output when it is a tensor, else
        `out.loss` (a ModelOutput), `out["loss"]` (a dict), `out[0]` (a tuple), or `loss_fn(out)` (autopar/model_io.py).
    mesh: a DeviceMesh, a MeshSpec, 'AxB', or a shape tuple (meshes you do not have are fine). A dim named cp* splits
        the sequences (context parallel) unless `pin` places it (autopar/strategies/context_parallel.py).
    cluster: a name from autopar.cost.CLUSTERS or a path to a calibrated cluster JSON.
    memory_budget: bytes per rank (default: 90% of the device's memory); one that no plan can meet fails before the
        solve with InfeasibleMemoryError, naming what would fit (autopar/feasibility.py).
    precision: bytes per parameter for params/grads/master/optimizer (default from the model's dtype, AdamW).
    force: {param FQN: placements per mesh dim, e.g. ("S0", "R")} to pin parameters.
    replicate_ops / allow_replicate: accept Replicate-only for ops without a placement rule.
    allow_bf16: let the planner choose FSDP2-style mixed precision (bf16 params, fp32 gradient reduction) for an
        fp32 model; both precisions are planned and the faster one that fits wins (passes/precision.py).
    float8: torchao-style float8 linears (passes/float8.py): None off, True / a dict of Float8Config fields forced, "auto".
    allow_checkpointing: let the planner checkpoint repeated blocks when memory-bound (passes/checkpointing.py).
    pin: callable(graph node) -> {mesh dim: placement} or {(mesh dim, output index): placement} or None (or an
        object with for_graph(graph) returning one): fixes nodes' outputs to price a hand plan (benchmarks/
        torchtitan_plan.py); with pipeline stages, on each stage's nodes (blocks numbered as in `force`).
    overlap: False (default): every collective is paid in full, step = compute + all comm (the graph executor runs
        them in program order), the MILP exact. True: parameter gathers and gradient reductions overlap compute
        (FSDP2's prefetch, DDP's buckets): step = compute + activation comm + what compute cannot hide, minimized by
        a Lagrangian and local search (exact by branch and bound on small models, else reported with its gap).
    mip_rel_gap: the MILP stops within this relative gap of the proven bound (default 0.1%; plan.solver reports
        objective, bound and gap); 0 proves optimality, which can take seconds longer.
    output: "loss" (default: the model returns its scalar loss) or "activation": the model is a part of a model,
        returning one tensor whose gradient comes from outside; its input gradients are outputs of the step
        (how backend="auto" runs the modules the engines cannot express, backends/torch/mixed.py).
    backward: False plans the forward alone (evaluation: no backward nodes, no gradients, no buckets).
    target: "torch" (PyTorch's engines) pins the nodes they compute otherwise and solves again; TorchTarget(data_dims)
        declares the dims they feed batch-sharded: pinned up front, one solve (autopar/targets.py). None: any backend.
    pipeline: "auto" (or a dict narrowing the search, see passes/stages.py) plans pipeline stages, submeshes,
        schedule and micro-batch count jointly with each stage's per-op plan; a mesh with a dim named "pp" does
        so too. The plan's `stages` and `schedule` are filled; `force` then names placements on the stage submesh.
    """
    if target is not None:  # what the target backend cannot run as planned, decided in autopar/targets.py
        kwargs = {k: v for k, v in locals().items() if k not in ("model", "mesh", "example_inputs", "target")}
        return plan_for_target(target, lambda **kw: plan(model, mesh, example_inputs, **kw), mesh, **kwargs)
    io = ModelIO.from_example(model, example_inputs, example_kwargs)  # bad arguments: named, before capture
    setup = _setup(model, mesh, cluster, precision, memory_budget)
    force, float8 = {k: tuple(v) for k, v in (force or {}).items()}, _float8(float8, setup.cluster)
    limits = dict(force=force, replicate_ops=replicate_ops, allow_replicate=allow_replicate, time_limit=time_limit)
    if output != "loss" and (pipeline or loss_fn is not None):
        raise ValueError(f"output={output!r} plans a part of a model: no pipeline, no loss_fn")
    if pipeline or "pp" in setup.mesh.names:
        req = (pipeline, loss_fn, float8)  # float8: _float8's request
        return _plan_pipeline(model, example_inputs, example_kwargs, return_state, req, setup, {**limits, "pin": pin})
    options = _options(model, setup.mesh, limits, mip_rel_gap, allow_checkpointing, pin, overlap)
    p, state = _plan_variants(model, io, setup, options, (loss_fn, output, backward), (allow_bf16, float8), dump_after)
    p.meta["loss_fn"] = loss_fn is not None  # the loss is computed outside the module (backends/torch/loss.py)
    return (p, state) if return_state else p


class _Setup(NamedTuple):
    mesh: MeshSpec
    cluster: ClusterSpec
    precision: TrainingPrecision
    budget: float  # bytes per rank


def _setup(model, mesh, cluster, precision, memory_budget) -> _Setup:
    """The mesh, the cluster, the training precision (default from the model's dtype, AdamW) and the budget per rank
    (default 90% of the device's memory)."""
    mesh = as_mesh_spec(mesh)
    cl = get_cluster(cluster)
    if precision is None:
        low = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
        precision = TrainingPrecision.mixed_bf16_adam() if low else TrainingPrecision.fp32_adam()
    budget = float(memory_budget) if memory_budget is not None else 0.9 * cl.device.mem_bytes
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive bytes per rank, got {memory_budget!r}")
    return _Setup(mesh, cl, precision, budget)


def _float8(value, cluster):
    """None (float8 off) or (mode "auto" | "force", the PlanState option, why the cluster cannot run it or None);
    forcing float8 on a cluster that cannot run it raises, naming the device."""
    if value is None or value is False:
        return None
    cfg = f8.Float8Config.of(value)
    why = f8.unsupported(cfg, cluster)
    if why and value != "auto":
        raise ValueError(f"float8 was forced but {why}")
    return ("auto" if value == "auto" else "force", cfg.option(), why)


def _plan_pipeline(model, example_inputs, example_kwargs, return_state, req, setup, limits) -> Plan:
    """Pipeline stages planned jointly with each stage's per-op plan (passes/stages.py). req: (pipeline options,
    loss_fn, the float8 request: _float8's)."""
    if return_state:
        raise ValueError("return_state=True is not available for pipeline plans (one PlanState per stage plan)")
    pipeline, loss_fn, float8 = req
    if float8 is not None and float8[0] == "auto":
        raise ValueError("float8='auto' is not available for pipeline plans: pass float8=True (or a dict) to force it")
    float8 = float8[1] if float8 else None
    mesh, cl, precision, budget = setup
    kwargs = dict(cluster=cl, precision=precision, budget=budget, loss_fn=loss_fn, options=pipeline or "auto")
    request = stages.StagesRequest(
        model, mesh, example_inputs, **kwargs, **limits, float8=float8, kwargs=example_kwargs
    )
    p = stages.run(request)
    if float8:
        note = "priced in every stage's intra-op plans (passes/float8.py)"
        p.meta["float8"] = {**float8, "pipeline": note, **p.meta.get("float8", {})}
    return p


def _options(model, mesh, limits, mip_rel_gap, allow_checkpointing, pin, overlap) -> dict:
    """The passes' options (PlanState.options), after checking that `force` names parameters of the model with
    one placement per mesh dim."""
    names = dict(model.named_parameters())
    for fqn, pl in limits["force"].items():
        if fqn not in names:
            raise ValueError(f"force names unknown parameter '{fqn}'")
        if len(pl) != mesh.ndim:
            raise ValueError(f"force['{fqn}'] = {pl} needs one placement per mesh dim {mesh.names}")
    return {
        "force": limits["force"],
        "replicate_ops": [str(o) for o in limits["replicate_ops"]],
        "allow_replicate": limits["allow_replicate"],
        "time_limit": limits["time_limit"],
        "mixed_precision": None,
        "float8": None,
        "mip_rel_gap": float(mip_rel_gap),
        "allow_checkpointing": allow_checkpointing,
        "pin": pin,
        "overlap": bool(overlap),
    }


def _variants(model, allow_bf16, float8) -> tuple[list, list]:
    """The precision variants to plan ({"mixed_precision", "float8"} options) and those the cluster cannot run
    ([(variant, why)]): the model as it is, FSDP2's bf16 mixed precision with allow_bf16 on an fp32 model, float8
    linears on each (forced) or on the last of them ("auto")."""
    mps = [None]
    if allow_bf16 and any(p.dtype == torch.float32 for p in model.parameters()):
        mps.append(MIXED_BF16)
    if float8 is None:
        return [{"mixed_precision": mp, "float8": None} for mp in mps], []
    mode, opt, why = float8
    if mode == "force":
        return [{"mixed_precision": mp, "float8": opt} for mp in mps], []
    plain = [{"mixed_precision": mp, "float8": None} for mp in mps]
    fast = {"mixed_precision": mps[-1], "float8": opt}
    return (plain, [(fast, why)]) if why else (plain + [fast], [])


def _plan_variants(model, io, setup, options, step, precisions, dump_after):
    """(plan, state): the model planned in each precision variant (`_variants`; precisions: (allow_bf16, the float8
    request)); the faster plan that fits wins (passes/precision.py `choose`). step: (loss_fn, output, backward)."""
    allow_bf16 = precisions[0]
    variants, infeasible = _variants(model, *precisions)
    results = []
    for v in variants:
        try:
            state = _plan_one(model, io, setup, {**options, **v}, step, allow_bf16, dump_after)
        except InfeasibleMemoryError as e:
            if len(variants) == 1:
                raise
            infeasible.append((v, e))
            continue
        results.append((v, state, build_plan(state)))
    if not results:
        raise infeasible[-1][1]
    _, state, p = choose(results, infeasible) if len(variants) + len(infeasible) > 1 else results[0]
    if state.extras.get("float8"):  # the converted GEMMs at the chosen placement: as float8, their casts, unconverted
        p.meta["float8"] = {**p.meta["float8"], **f8.breakdown(state)}
    p.meta["dumps"] = state.dumps if dump_after else {}
    why = feasibility.replicated_why(state, p)  # a plan that replicates everything: the figures that made it cheapest
    if why:
        p.meta["replicated_why"] = why
    p.meta["alternatives"] = runner_ups(state)  # each decision's runner-up, for `autopar explain`
    return p, state


# the passes that run before the memory bound: precision (its casts are part of the graph) and regions (the
# repeated blocks checkpointing may drop)
_BEFORE_BOUND = PASSES[: PASSES.index(regions) + 1]


def _many_dims_hint(names, shape) -> str:
    """What to try when a per-op plan over 3+ mesh dims runs out of time: its candidates multiply per free dim (a
    4-D activation has ~200 placements on 3 dims), where dims named dp* (batch) and cp* (sequence) are fixed for
    activations (_named_dims)."""
    big = [(nm, n) for nm, n in zip(names, shape) if n > 1]
    if len(big) < 3:
        return ""
    free = [nm for nm, _ in big if not nm.startswith(("dp", CP_PREFIX))]
    return (
        f"; a plan over {len(big)} mesh dims ({', '.join(f'{nm}={n}' for nm, n in big)}) with {len(free)} free of "
        f"them ({', '.join(free)}) is a large search: name data-parallel dims dp* (activations split by batch "
        "there) and context-parallel ones cp* (by sequence) to leave one free, which plans in seconds, or use "
        "pipeline='auto' on the flat ranks"
    )


def _named_dims(graph, names, shape, pin):
    """The mesh dims whose names give them a meaning where the user's pin places nothing on them: cp* splits the
    sequence (autopar/strategies/context_parallel.py) and, on a mesh of 3+ dims of size > 1, dp* the batch
    (autopar/strategies/data_parallel.py: free placements on every dim are too large a search there, _many_dims_hint).
    Returns (the pin with their input splits added, whether the cp dims are split, the data dims)."""
    dims = cp_dims(names, shape)
    cp = bool(dims) and not pin_takes_dims(pin, graph, dims)
    if cp:
        pin = cp_pin(graph, names, shape, pin)
    big = [d for d, n in enumerate(shape) if n > 1]
    data = dp.dp_dims(names, shape) if len(big) >= 3 else []
    data = [d for d in data if not pin_takes_dims(pin, graph, [d])]
    if data:
        pin = overlay_pins(dp.batch_pin(graph, names, shape, data), pin)
    return pin, cp, data


def _plan_one(model, io, setup, options, step, allow_bf16, dump_after) -> PlanState:
    """Capture one precision variant, check the memory lower bound (autopar/feasibility.py: no plan can fit fails
    here, in seconds, naming what would fit), then run the remaining passes; the solver's InfeasibleMemoryError gets
    the same lines of what would fit."""
    loss_fn, output, backward = step
    mp = options["mixed_precision"]
    with outside_local_tensor_mode():  # capture runs on meta tensors, never on simulated ranks' values
        graph = capture(
            model, io, loss_fn, param_dtype=torch.bfloat16 if mp else None, output=output, backward=backward
        )
    if hasattr(options["pin"], "for_graph"):  # a pin that needs the captured graph (autopar/targets.EnginePins)
        options = {**options, "pin": options["pin"].for_graph(graph)}
    names, shape = setup.mesh.names, setup.mesh.shape
    pin, cp, data = _named_dims(graph, names, shape, options["pin"])
    options = {**options, "pin": pin}
    state = PlanState(graph, *setup, options)
    run_passes(state, _BEFORE_BOUND, dump_after=dump_after)
    bound = feasibility.memory_bound(state, allow_bf16)
    feasibility.check(bound, setup.mesh)
    rest = [n for n in PASSES if n not in _BEFORE_BOUND]
    k = rest.index(candidates) + 1
    try:
        run_passes(state, rest[:k], dump_after=dump_after)
        dp.keep_batch_splits(state, data)  # activations stay batch shards on the data dims
        if cp:  # on a cp dim every activation is a sequence shard (or replicated / partial), not a head split
            keep_data_splits(state, [], dp.batch_rows(state.graph))
        run_passes(state, rest[k:], dump_after=dump_after)
    except InfeasibleMemoryError as e:
        feasibility.add_fixes(e, bound, setup.mesh, e.smallest_bytes)
        if data:
            e.args = (f"{e}\n{dp.searched_as_data(names, data)}",) + e.args[1:]
        raise
    except SolverTimeLimitError as e:
        hint = _many_dims_hint(names, shape)
        if not hint:
            raise
        raise SolverTimeLimitError(f"{e}{hint}") from e
    return state
