"""The front door that runs a model: plan it (or take a finished Plan) and hand it to a backend. The backends are
imported on first use, so planning never loads them; they only run a plan, never make one: the graph parts the torch
backend asks for are planned here, and for inputs of new shapes the graph backend calls the planner this module
gives it."""

from __future__ import annotations

import torch

from . import api as _api
from .across_ranks import decided_once, plan_of, plan_text, planned_on_every_rank, planned_once
from .execution import finished, from_plan
from .plan import Plan
from .strategies.pins import overlay_pins
from .targets import engine_target


def parallelize(model, mesh, example_inputs=None, *, backend: str = "graph", plan: Plan | None = None, **kwargs):
    """A module that runs each training step of `model` SPMD on this rank of the DeviceMesh `mesh`: planned now
    (autopar.plan's options: cluster, memory_budget, force, ...), or `plan=autopar.Plan.load(path)`, a finished plan
    run as it is (no planning; the model is captured again and must give the plan's graph). Under a process group
    the mesh's first rank plans and the other ranks run its plan, their own options unused (autopar/across_ranks.py);
    a failure on any rank raises on every rank. The backends are imported on first use, so planning never loads
    them; they only run a plan, never make one.

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
    units, styles = options.pop("units", None), options.pop("styles", None)
    # the user's random state is left as it was; planned on the mesh's first rank (autopar/across_ranks.py)
    with torch.random.fork_rng(devices=spmd.rng_devices(mesh)), planned_on_every_rank(mesh):
        if planned is None:
            target = engine_target(kwargs.pop("target", "torch"))
            extra = {"example_kwargs": kw} if kw else {}
            planned = planned_once(
                mesh,
                lambda: _api.plan(model, mesh, args, target=target, return_state=True, **extra, **kwargs),
                lambda made: finished(model, args, kw, plan=made, loss_fn=kwargs.get("loss_fn")),
            )
        whole, state = planned if isinstance(planned, tuple) else (planned, None)
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
    not fit together, with its boundary pinned alone. No overlap: the graph backend runs each collective in place.
    Planned on the mesh's first rank; the other ranks capture each part and run its plan (the state is then the
    part's Executable)."""
    reqs = {r.key: r for r in requests.values()}
    if not reqs:
        return {}

    def receive(sent: dict) -> dict:
        out = {}
        for key, (text, how) in sent.items():
            made = plan_of(text)
            out[key] = (made, finished(reqs[key].module, reqs[key].args, plan=made), how)
        return out

    send = lambda made: {k: (plan_text(p), how) for k, (p, _, how) in made.items()}  # noqa: E731
    return decided_once(mesh, lambda: _solve_parts(reqs.values(), mesh, plan_kwargs), send, receive)


def _solve_parts(requests, mesh, plan_kwargs: dict) -> dict:
    opts = {k: v for k, v in plan_kwargs.items() if k not in ("force", "pin", "target")}
    opts["overlap"] = False
    out: dict = {}
    for req in requests:

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
        if plan is None and planned is None:  # planned on the mesh's first rank (autopar/across_ranks.py)
            opts = _graph_defaults(mesh, kwargs)
            loss_fn = opts.get("loss_fn")
            with planned_on_every_rank(mesh):
                planned = planned_once(
                    mesh,
                    lambda: _api.plan(
                        model, mesh, example_inputs, example_kwargs=example_kwargs, return_state=True, **opts
                    ),
                    lambda made: finished(model, example_inputs, example_kwargs, plan=made, loss_fn=loss_fn),
                )
                executable = finished(model, example_inputs, example_kwargs, planned=planned)
            replan = graph_planner(model, mesh, opts)
        else:  # a loaded plan runs as it is: no planner for new shapes
            replan = (
                graph_planner(model, mesh, _graph_defaults(mesh, {}))
                if planned is not None and planned[1] is not None
                else None
            )
            executable = finished(model, example_inputs, example_kwargs, plan=plan, planned=planned, **kwargs)
    return spmd.lower(model, mesh, executable, replan=replan, **options)


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
    kept for the other nodes, on the mesh's first rank alone (the others capture and run its plan, as at the first
    shapes); returns the new autopar.execution.Executable."""
    user_pin = plan_kwargs.get("pin")
    opts = {k: v for k, v in plan_kwargs.items() if k not in ("force", "pin")}

    def replan(args, kwargs, *, backward: bool, params: dict, buffers: dict):
        def buffer_pin(n):
            return dict(enumerate(buffers[n.target])) if n.kind == "buffer" and n.target in buffers else None

        made, state = planned_once(  # inside a step: every rank has agreed on the new shapes (backends/spmd/shapes.py)
            mesh,
            lambda: _api.plan(
                model,
                mesh,
                args,
                example_kwargs=kwargs,
                return_state=True,
                force=params,
                pin=overlay_pins(user_pin, buffer_pin),
                backward=backward,
                **opts,
            ),
            lambda made: finished(model, args, kwargs, plan=made, loss_fn=opts.get("loss_fn")),
        )
        return from_plan(made, state.graph)

    return replan
