"""The front door that runs a model: plan it (or take a finished Plan) and hand it to a backend. The backends are
imported on first use, so planning never loads them; they only run a plan, never make one: the graph parts the torch
backend asks for are planned here, and for inputs of new shapes the graph backend calls the planner this module
gives it."""

from __future__ import annotations

import contextlib

import torch

from . import api as _api
from .execution import finished, from_plan
from .plan import Plan
from .strategies.pins import overlay_pins
from .targets import engine_target


def parallelize(model, mesh, example_inputs=None, *, backend: str = "graph", plan: Plan | None = None, **kwargs):
    """A module that runs each training step of `model` SPMD on this rank of the DeviceMesh `mesh`: planned now
    (autopar.plan's options: cluster, memory_budget, force, ...), or `plan=autopar.Plan.load(path)`, a finished plan
    run as it is (no planning; the model is captured again and must give the plan's graph). The backends are
    imported on first use, so planning never loads them; they only run a plan, never make one.

    backend: "graph" (autopar's SPMD executor, backends/spmd: any plan; options attention, assume_identical,
    check_replicas, compile, see autopar.backends.spmd.lower; `planned=(plan, state)` runs a plan made with
    autopar.plan(..., return_state=True)), "torch" (the user's own module, parallelized in place by fully_shard /
    parallelize_module; EngineLoweringError when the plan does not fit them), "mixed" (the torch engines for what
    they express, the graph backend for the modules they cannot) or "auto" (the torch engines when they express the
    plan; else "mixed" where the cost model predicts it no slower than the graph backend, else the graph backend).
    The torch backends plan with target="torch" (autopar/targets.py: the nodes the engines compute otherwise are
    pinned, a second solve where the free plan needs it); target=autopar.TorchTarget(data_dims=("dp",)) declares
    the dims they feed batch-sharded, so the pins are known up front and the model is solved once. The result's
    `.autopar_dump` says which part went where and why. See autopar.backends.torch."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" in names or (plan is not None and plan.stages):  # a schedule steps forward and backward together
        raise ValueError(
            f"{'mesh dim pp' if 'pp' in names else 'the plan'} makes pipeline stages, which parallelize does not run "
            f"(a pipeline schedule runs forward and backward in one step): plan = autopar.plan(model, mesh, ...), "
            f"then runner = autopar.backends.pipelining.PipelineRunner(model, plan, mesh) and runner.step(x, y) (or "
            f"runner.step_model(**batch) for a plan made from keyword inputs)"
        )
    if backend == "graph":
        return _parallelize_graph(model, mesh, example_inputs, plan, kwargs)
    if backend in ("torch", "mixed", "auto"):
        return _parallelize_torch(model, mesh, example_inputs, backend, plan, kwargs)
    raise ValueError(f"backend must be 'graph', 'torch', 'mixed' or 'auto', got {backend!r}")


def _parallelize_torch(model, mesh, example_inputs, backend, plan, kwargs):
    """Plan for target="torch" (or take the finished plan), let the torch backend say what it does with it, plan
    the graph parts it asks for (backend "mixed" / "auto"), then hand it all over: the backend never plans."""
    from .backends import spmd
    from .backends import torch as torch_backend

    options = {k: kwargs.pop(k) for k in torch_backend.OPTIONS if k in kwargs}
    args, kw = _split_inputs(example_inputs, kwargs)
    kwargs.setdefault("cluster", "cpu-gloo" if mesh.device_type == "cpu" else "h100")  # also the parts'
    planned = kwargs.pop("planned", plan)
    with torch.random.fork_rng(devices=spmd.rng_devices(mesh)):  # the user's random state is left as it was
        if planned is None:
            target = engine_target(kwargs.pop("target", "torch"))
            extra = {"example_kwargs": kw} if kw else {}
            with planned_on_every_rank(mesh):
                planned = _api.plan(model, mesh, args, target=target, return_state=True, **extra, **kwargs)
        whole, state = planned if isinstance(planned, tuple) else (planned, None)
        units, styles = options.pop("units", None), options.pop("styles", None)
        split = torch_backend.split_plan(
            model,
            whole,
            args,
            backend=backend,
            state=state,
            example_kwargs=kw,
            force=kwargs.get("force"),
            units=units,
            styles=styles,
        )
        parts = _plan_parts(split.requests, mesh, kwargs)
    return torch_backend.parallelize(
        model, mesh, args, split, parts, cluster=kwargs["cluster"], example_kwargs=kw, **options
    )


def _plan_parts(requests: dict, mesh, plan_kwargs: dict) -> dict:
    """{request key: (plan, state, how)}: each graph part the torch backend asks for (one request per distinct
    part) planned on `mesh` at the whole plan's placements inside it and its boundary pinned, or, where those do
    not fit together, with its boundary pinned alone. No overlap: the graph backend runs each collective in place."""
    opts = {k: v for k, v in plan_kwargs.items() if k not in ("force", "pin", "target")}
    opts["overlap"] = False
    out: dict = {}
    for req in {id(r): r for r in requests.values()}.values():

        def solve(pins, req=req):
            pin = lambda n: pins.get(n.name)  # noqa: E731
            return _api.plan(
                req.module, mesh, req.args, output="activation", force=req.force, return_state=True, pin=pin, **opts
            )

        try:
            made, state = solve(req.pins)
            how = f"the plan's placements on {req.kept} of {req.ops} ops, its boundary pinned"
        except ValueError as e:
            made, state = solve(req.boundary_pins)
            how = f"planned alone (the plan's placements do not fit its boundary: {str(e)[:160]})"
        out[req.key] = (made, state, how)
    return out


def _split_inputs(example_inputs, plan_kwargs):
    """(positional inputs, keyword inputs or None). Keyword inputs (autopar/model_io.py) plan like positional
    ones; the engines run the user's own module, which takes them itself; the graph parts of "mixed" are split by
    positional calls, so keyword inputs skip them."""
    kw = plan_kwargs.pop("example_kwargs", None)
    if isinstance(example_inputs, dict):
        example_inputs, kw = (), {**example_inputs, **(kw or {})}
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return args, kw


def _parallelize_graph(model, mesh, example_inputs, plan, kwargs):
    """Plan (or take the finished plan), then hand the graph backend the Executable (autopar/execution.py) and a
    planner for new shapes: the front door plans, the backend only runs."""
    from .backends import spmd

    options = {k: kwargs.pop(k) for k in spmd.OPTIONS if k in kwargs}
    example_kwargs, planned = kwargs.pop("example_kwargs", None), kwargs.pop("planned", None)
    spmd.check_call(model, mesh, example_inputs, example_kwargs, options.get("compile", False))
    with torch.random.fork_rng(devices=spmd.rng_devices(mesh)):  # the user's random state is left as it was
        replan = None  # a loaded plan runs as it is: no planner for new shapes
        if plan is None and planned is None:
            opts = _graph_defaults(mesh, kwargs)
            with planned_on_every_rank(mesh):
                planned = _api.plan(
                    model, mesh, example_inputs, example_kwargs=example_kwargs, return_state=True, **opts
                )
            kwargs = {}
            replan = graph_planner(model, mesh, opts)
        elif planned is not None and planned[1] is not None:
            replan = graph_planner(model, mesh, _graph_defaults(mesh, {}))
        executable = finished(model, example_inputs, example_kwargs, plan=plan, planned=planned, **kwargs)
    return spmd.lower(model, mesh, executable, replan=replan, **options)


class PlanningFailedError(RuntimeError):
    """Planning raised on another rank: this rank's plan is not run (its collectives would wait for that rank)."""


@contextlib.contextmanager
def planned_on_every_rank(mesh):
    """Each rank plans on its own, and the solver's time limit is wall-clock: under load one rank may time out (or
    fail otherwise) where the others find a plan and go on into the first collective, waiting there for it until
    the process group's timeout. So after planning every rank says whether it succeeded (an all_reduce per dim of the
    mesh); where some rank failed, the failed ranks raise their own error and every other rank raises
    PlanningFailedError naming them, at once. Nothing is exchanged without a process group of several ranks, or
    under the fake one (LocalTensorMode: one process plans for all)."""
    import torch.distributed as dist

    if (
        not dist.is_available()
        or not dist.is_initialized()
        or dist.get_world_size() == 1
        or dist.get_backend() == "fake"
    ):
        yield
        return
    failed = None
    try:
        yield
    except Exception as e:  # every rank must reach the exchange below, this one too
        failed = e
    device = (
        torch.device("cpu")
        if mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.cuda.current_device())
    )
    status = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    status[dist.get_rank()] = int(failed is not None)
    for d in range(mesh.ndim):  # over the mesh's ranks only (dim by dim: the sum reaches every rank of the mesh)
        dist.all_reduce(status, group=mesh.get_group(d))
    bad = [r for r, v in enumerate(status.tolist()) if v]
    if failed is not None:
        raise failed
    if bad:
        raise PlanningFailedError(
            f"planning failed on ranks {bad} (their error says why; a solver time limit can run out on a loaded "
            f"rank and not on others: raise time_limit=, or plan once with autopar.plan and pass plan= / planned= "
            f"on every rank); rank {dist.get_rank()} found a plan but does not run it alone"
        )


def _graph_defaults(mesh, plan_kwargs: dict) -> dict:
    """The graph backend's planning defaults: its cluster, and no overlap (it runs each collective in place)."""
    out = dict(plan_kwargs)
    out.setdefault("cluster", "cpu-gloo" if mesh.device_type == "cpu" else "h100")
    out.setdefault("overlap", False)
    return out


def graph_planner(model, mesh, plan_kwargs: dict):
    """The callback the graph backend calls for inputs of new shapes (or a new mode): `replan(args, kwargs, *,
    backward, params, buffers)` plans them with each parameter forced to `params[fqn]` and each buffer pinned to
    `buffers[fqn]` (the first plan's placements: the optimizer state and state_dict never move), the user's own pin
    kept for the other nodes; returns the new autopar.execution.Executable."""
    user_pin = plan_kwargs.get("pin")
    opts = {k: v for k, v in plan_kwargs.items() if k not in ("force", "pin")}

    def replan(args, kwargs, *, backward: bool, params: dict, buffers: dict):
        def buffer_pin(n):
            return dict(enumerate(buffers[n.target])) if n.kind == "buffer" and n.target in buffers else None

        made, state = _api.plan(
            model,
            mesh,
            args,
            example_kwargs=kwargs,
            return_state=True,
            force=params,
            pin=overlay_pins(user_pin, buffer_pin),
            backward=backward,
            **opts,
        )
        return from_plan(made, state.graph)

    return replan
