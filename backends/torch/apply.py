"""A recognized TorchLowering applied to the user's module with PyTorch's own calls, in torchtitan's order (its
float8 converter, then parallelize_llama): float8 linears, tensor parallelism, activation checkpointing,
torch.compile of each block, FSDP2, then the hooks the plan needs beside them (gradient buckets for replicated
parameters, the whole batch's mean loss). render.py prints the same steps as code for people; nothing here is
generated or executed from text."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from autopar.strategies._torch_adapter import flatten_mesh

from .. import float8_linear
from .hooks import checkpoint_block, reduce_grads_in_buckets, weigh_mean_loss
from .lowering import EngineLoweringError, TorchLowering


def check_mesh(mesh, low: TorchLowering) -> None:
    if tuple(mesh.shape) != tuple(low.mesh_shape):
        raise EngineLoweringError(f"the plan is for mesh {low.mesh_shape} but the mesh is {tuple(mesh.shape)}")
    names = tuple(mesh.mesh_dim_names or ())
    if names != tuple(low.mesh_names):
        raise EngineLoweringError(f"the plan names mesh dims {low.mesh_names} but the DeviceMesh has {names}")


def apply_float8(model: nn.Module, mesh, low: TorchLowering) -> None:
    """The plan's float8 linears converted (torchao's tensorwise Float8Linear math), before the styles wrap them."""
    if low.float8:
        float8_linear.probe(mesh.device_type)
        float8_linear.convert(model, low.float8)


def apply_tp(model: nn.Module, mesh, low: TorchLowering) -> None:
    """parallelize_module on the tensor-parallel mesh dim with the recognized ParallelStyle of each module."""
    if low.tp_dim is None:
        return
    plan = {fqn: style.build() for fqn, style in low.styles.items()}
    parallelize_module(model, mesh[low.mesh_names[low.tp_dim]], plan)


def apply_ac(model: nn.Module, low: TorchLowering) -> None:
    """Activation checkpointing around the blocks the planner chose."""
    for fqn in low.checkpoint:
        checkpoint_block(model.get_submodule(fqn))


def apply_compile(model: nn.Module, low: TorchLowering, compile_blocks: dict | None) -> None:
    """torch.compile of each repeated block in place (after TP and checkpointing, before FSDP)."""
    if compile_blocks is None:
        return
    for fqn in low.block_fqns:
        model.get_submodule(fqn).compile(**compile_blocks)


def data_mesh(mesh, low: TorchLowering):
    """The mesh FSDP2 shards over: one data dim, (replicate, shard) for HSDP, or two shard dims flattened."""
    names = low.mesh_names
    if len(low.shard_dims) > 1:
        return flatten_mesh(mesh, tuple(names[d] for d in low.shard_dims))
    dims = low.replicate_dims + low.shard_dims
    return mesh[names[dims[0]]] if len(dims) == 1 else mesh[tuple(names[d] for d in dims)]


def apply_fsdp(model: nn.Module, mesh, low: TorchLowering) -> None:
    """fully_shard on every unit, root last; replicated parameters and the graph parts' are ignored."""
    if not low.units:
        return
    mp = low.mixed_precision
    policy = (
        MixedPrecisionPolicy(
            param_dtype=getattr(torch, mp["param_dtype"]), reduce_dtype=getattr(torch, mp["reduce_dtype"])
        )
        if mp
        else MixedPrecisionPolicy()
    )
    shard_dims = {f: k for u in low.units for f, k in u.shard_dims.items()}
    ignored = {model.get_parameter(f) for f in low.replicated_grads + low.part_params}
    place = lambda p: next((Shard(k) for f, k in shard_dims.items() if model.get_parameter(f) is p), None)
    dp_mesh = data_mesh(mesh, low)
    for u in low.units:
        fully_shard(
            model.get_submodule(u.fqn),
            mesh=dp_mesh,
            mp_policy=policy,
            ignored_params=ignored or None,
            shard_placement_fn=place if shard_dims else None,
            reshard_after_forward=u.reshard_after_forward,
        )


def bucket_steps(low: TorchLowering) -> list:
    """[(steps as tuples of mesh dim names, parameter FQNs)] of the gradient buckets."""
    return [([tuple(low.mesh_names[d] for d in s) for s in b.steps], list(b.params)) for b in low.grad_buckets]


def apply_hooks(model: nn.Module, mesh, low: TorchLowering) -> None:
    """The gradient-bucket hook of the replicated parameters and the loss hook, where the plan needs them."""
    data = low.replicate_dims + low.shard_dims
    if low.replicated_grads and data:
        reduce_grads_in_buckets(model, mesh, bucket_steps(low), low.batch_shards)
    ml = low.mean_loss
    if ml:
        dims = tuple(low.mesh_names[d] for d in data)
        weigh_mean_loss(model, mesh, dims, ml["labels"], ml["ignore_index"], ml["shards"])


def apply(model: nn.Module, mesh, low: TorchLowering, compile_blocks: dict | None = None) -> nn.Module:
    """Parallelize `model` in place as `low` says, in the visible order of the steps above."""
    check_mesh(mesh, low)
    apply_float8(model, mesh, low)
    apply_tp(model, mesh, low)
    apply_ac(model, low)
    apply_compile(model, low, compile_blocks)
    apply_fsdp(model, mesh, low)
    apply_hooks(model, mesh, low)
    model._autopar_lowering = low
    return model
