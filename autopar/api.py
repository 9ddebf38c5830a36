"""Public entry points: `plan` (no GPUs needed) and, in backends, `parallelize`."""
from __future__ import annotations

import torch
import torch.nn as nn

from .capture import capture
from .cost import TrainingPrecision, get_cluster
from .mesh import as_mesh_spec
from .pipeline import PASSES, PlanState, run_passes
from .plan import Plan
from .predict import build_plan


def plan(model: nn.Module, mesh, example_inputs, *, cluster="h100", loss_fn=None, memory_budget: float | None = None,
         precision: TrainingPrecision | None = None, force: dict | None = None, replicate_ops=(),
         allow_replicate: bool = False, time_limit: float = 60.0, dump_after=(), return_state: bool = False) -> Plan:
    """Plan how to run one training step of `model` on `mesh`.

    mesh: a DeviceMesh, a MeshSpec, 'AxB', or a shape tuple (meshes you do not have are fine).
    cluster: a name from autopar.cost.CLUSTERS or a path to a calibrated cluster JSON.
    memory_budget: bytes per rank (default: 90% of the device's memory).
    precision: bytes per parameter for params/grads/master/optimizer (default from the model's dtype, AdamW).
    force: {param FQN: placements per mesh dim, e.g. ("S0", "R")} to pin parameters.
    replicate_ops / allow_replicate: accept Replicate-only for ops without a placement rule.
    """
    mesh = as_mesh_spec(mesh)
    cl = get_cluster(cluster)
    if precision is None:
        low = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
        precision = TrainingPrecision.mixed_bf16_adam() if low else TrainingPrecision.fp32_adam()
    budget = float(memory_budget) if memory_budget is not None else 0.9 * cl.device.mem_bytes
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive bytes per rank, got {memory_budget!r}")
    force = {k: tuple(v) for k, v in (force or {}).items()}
    names = dict(model.named_parameters())
    for fqn, pl in force.items():
        if fqn not in names:
            raise ValueError(f"force names unknown parameter '{fqn}'")
        if len(pl) != mesh.ndim:
            raise ValueError(f"force['{fqn}'] = {pl} needs one placement per mesh dim {mesh.names}")
    graph = capture(model, tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,),
                    loss_fn)
    state = PlanState(graph, mesh, cl, precision, budget,
                      {"force": force, "replicate_ops": [str(o) for o in replicate_ops],
                       "allow_replicate": allow_replicate, "time_limit": time_limit})
    run_passes(state, PASSES, dump_after=dump_after)
    p = build_plan(state)
    p.meta["dumps"] = state.dumps if dump_after else {}
    return (p, state) if return_state else p
