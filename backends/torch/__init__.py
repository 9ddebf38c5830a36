"""The torch backend: a finished Plan lowered onto the user's own eager module with PyTorch's engines (FSDP2
fully_shard, tensor parallelism by parallelize_module, activation checkpointing, torch.compile), in torchtitan's
order: recognize.py (Plan -> TorchLowering, or the reasons it cannot be), apply.py (apply_float8, apply_tp,
apply_ac, apply_compile, apply_fsdp, then the gradient and loss hooks), source.py (the same steps printed as code).

    model = autopar.backends.torch.lower(model, plan, mesh)      # the one lowering entry; never plans
    print(autopar.backends.torch.render(plan, model))             # the equivalent code, for people

Plan with `autopar.plan(..., target="torch")` (autopar/targets.py) so the plan is one the engines run as planned.
autopar.parallelize(backend="torch" | "mixed" | "auto") plans, calls `split_plan` (what the engines run, and the graph
parts they need planned: the front door plans them), then `parallelize`; neither plans."""

from .lowering import EngineLoweringError, TorchLowering
from .entry import OPTIONS, Split, local_inputs, lower, parallelize, render, split_plan, train_context

__all__ = [
    "OPTIONS",
    "EngineLoweringError",
    "Split",
    "TorchLowering",
    "local_inputs",
    "lower",
    "parallelize",
    "render",
    "split_plan",
    "train_context",
]
