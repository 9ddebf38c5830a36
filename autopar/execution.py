"""What the graph backend runs: a Plan and the captured graph it was made on, with the plan's decisions in the
executor's terms (`Executable`), rebuilt from the Plan alone.

The graph backend (backends/spmd) never plans. `autopar.parallelize` (the front door) hands it an Executable made
here (`from_plan`) in one of three ways, so what runs is always what the Plan says:
  - planned now by the front door (autopar/__init__.py): `autopar.plan(..., return_state=True)`, then the plan and
    the state's graph;
  - `planned=(plan, state)`: the same, planned earlier;
  - `plan=Plan.load(path)`: the model is captured again (capture is not planning: no candidates, costs or solve)
    with the options the plan records, and the captured graph must repeat the plan's node for node.
This module plans nothing (it is below the planner's front door); for a call with new input shapes the backend
calls the front door's callback (autopar.graph_planner), which plans those shapes with every parameter and buffer
kept where the first plan put them; a loaded plan comes without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .capture import capture
from .graph import Graph
from .mixed_precision import cast_gradients, retype_float8
from .model_io import ModelIO
from .plan import Plan, graph_signature
from .strategies import Strategy
from .strategies._torch_adapter import outside_local_tensor_mode


class PlanLoadError(ValueError):
    """A saved plan that cannot run on this model (another graph, missing records, an option it needs)."""


@dataclass(frozen=True)
class Executable:
    """A Plan with its graph, in the executor's terms (the attribute names of the planner's PlanState)."""

    plan: Plan
    graph: Graph
    placement: tuple  # per node: its Strategy (output and input placements)
    redistributes: dict  # (consumer node, input index | "opt" | "loss" | "state") -> (src, dst, collectives)
    shares: dict  # (consumer, input) -> (consumer, input) whose redistribute of the same value it reuses
    coalesced: dict  # (consumer, input) -> (consumer, input) whose all_reduce also carries this input
    fw_order: tuple | None  # forward op nodes in order of execution (a loss-tail group reorders them)


def from_plan(plan: Plan, graph: Graph) -> Executable:
    """The Executable of `plan` on `graph`; PlanLoadError when the graph is not the plan's."""
    check_graph(plan, graph)
    ex = plan.execution
    if not ex:
        raise PlanLoadError(
            "the plan has no execution record (saved by an older autopar): plan again and save it to run it"
        )
    placement = tuple(
        Strategy(
            tuple(tuple(p) if p is not None else None for p in r["placement"]["out"]),
            tuple(tuple(p) for p in r["placement"]["ins"]),
        )
        for r in plan.nodes
    )
    red = {(x.consumer, x.input): (x.src, x.dst, x.collectives) for x in plan.redistribute_records()}
    pairs = lambda rows: {(a, b): (c, d) for a, b, c, d in rows}
    order = ex.get("fw_order")
    return Executable(plan, graph, placement, red, pairs(ex["shares"]), pairs(ex["coalesced"]), _opt_tuple(order))


def _opt_tuple(x):
    return tuple(x) if x else None


def check_graph(plan: Plan, graph: Graph) -> None:
    """The captured graph must be the one the plan was made on, node for node; else PlanLoadError naming the first
    node that differs (another model, other shapes or dtypes, another torch version's decomposition)."""
    want, got = plan.graph_signature(), graph_signature(graph)
    if want == got:
        return
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            n = graph.nodes[i]
            raise PlanLoadError(
                f"the model's captured graph differs from the plan's at node {i} ({n.name}, module "
                f"'{n.module or '<root>'}'): the plan has {_show(a)}, the model gives {_show(b)}; the plan was "
                f"made for another model, input shapes or dtypes"
            )
    raise PlanLoadError(f"the plan has {len(want)} graph nodes but the model's captured graph has {len(got)}")


def _show(sig) -> str:
    kind, target, phase, shapes, dtypes, _ = sig
    return f"{kind} {target} ({phase}) -> {list(shapes)} {list(dtypes)}"


def capture_for(plan: Plan, model, example_inputs, example_kwargs=None, loss_fn=None) -> Graph:
    """Capture `model` again as the plan's graph was captured (output kind, forward only or not)."""
    cap = (plan.execution or {}).get("capture")
    if cap is None:
        raise PlanLoadError("the plan has no execution record (saved by an older autopar): plan again and save it")
    if plan.stages:
        raise PlanLoadError("a pipeline plan runs on the pipelining backend, not on the graph backend")
    if plan.meta.get("loss_fn") and loss_fn is None:
        raise PlanLoadError("the plan was made with a loss_fn: pass the same loss_fn= to run it")
    param_dtype, reduce_dtype = _precision(plan, cap)
    io = ModelIO.from_example(model, example_inputs, example_kwargs)
    with outside_local_tensor_mode():  # capture runs on meta tensors, never on simulated ranks' values
        g = capture(model, io, loss_fn, param_dtype=param_dtype, output=cap["output"], backward=cap["backward"])
    if reduce_dtype is not None:
        cast_gradients(g, reduce_dtype)  # the planner's precision pass rewrote its graph so too
    f8 = plan.meta.get("float8") or {}
    if f8.get("weight_casts"):  # and its float8 pass retyped the weights it gathers in float8
        if "gathered_views" not in f8:
            raise PlanLoadError(
                "the plan gathers weights in float8 but records no gathered views (saved by an older autopar): plan "
                "again and save it to run it"
            )
        retype_float8(g, f8["gathered_views"])
    return g


def _precision(plan: Plan, cap: dict) -> tuple:
    """(param dtype, gradient reduce dtype) of a mixed-precision plan's capture, (None, None) for a plan that
    computes in the model's own dtypes."""
    if cap["param_dtype"] is None:
        return None, None
    reduce = cap.get("reduce_dtype") or (plan.meta.get("mixed_precision") or {}).get("reduce_dtype")
    if reduce is None:
        raise PlanLoadError(
            f"the plan computes with {cap['param_dtype']} parameters but records no gradient reduce dtype "
            f"(saved by an older autopar): plan again and save it to run it"
        )
    return _torch_dtype(cap["param_dtype"]), _torch_dtype(reduce)


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PlanLoadError(f"the plan names an unknown dtype {name!r}")
    return dt


def finished(model, example_inputs, example_kwargs=None, *, plan=None, planned=None, **plan_kwargs) -> Executable:
    """The Executable of a plan made before: `planned=(plan, state)` (its graph from the state) or a loaded
    `plan=` (captured again; `planned=(plan, None)` is one too). Nothing is planned here."""
    if planned is not None and planned[1] is None:  # a finished plan without its PlanState (a loaded one)
        plan, planned = planned[0], None
    if plan is not None:
        if planned is not None or set(plan_kwargs) - {"loss_fn"}:
            raise TypeError(f"plan=... runs a finished plan: no planned= or plan options ({sorted(plan_kwargs)})")
        graph = capture_for(plan, model, example_inputs, example_kwargs, plan_kwargs.get("loss_fn"))
        return from_plan(plan, graph)
    if planned is None:
        raise TypeError("a finished plan is needed: plan=Plan.load(path) or planned=(plan, state)")
    if plan_kwargs:
        raise TypeError(f"planned=... given together with plan options {sorted(plan_kwargs)}")
    made, state = planned
    if state.graph.io is None:  # a graph captured before the model contract existed: positional inputs only
        state.graph.io = ModelIO.from_example(model, example_inputs, example_kwargs)
    return from_plan(made, state.graph)


__all__ = ["Executable", "PlanLoadError", "from_plan", "check_graph", "capture_for", "finished"]
