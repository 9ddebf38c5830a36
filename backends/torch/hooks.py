"""The hooks the torch backend installs on the user's module, beside fully_shard / parallelize_module: activation
checkpointing of a block, DDP-style gradient averaging in the plan's buckets, and the mean loss over the whole
batch. apply.py calls them; the code render.py prints imports them from here."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils.checkpoint import checkpoint

from autopar.strategies._torch_adapter import flatten_mesh


def checkpoint_block(block) -> None:
    """Recompute the block's forward in the backward (torch.utils.checkpoint, non-reentrant)."""
    forward = block.forward
    block.forward = lambda *a, **k: checkpoint(forward, *a, use_reentrant=False, **k)


def group_of(mesh, dims):
    """The process group of one collective over mesh dims `dims` (names): one dim's group, the default group for
    the whole mesh when it spans the world, else the flattened mesh's (created here: every rank calls apply)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    if len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return flatten_mesh(mesh, tuple(dims)).get_group()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bucket_buffers(model, mesh, buckets):
    """({"queued", "buckets"}, {id(param): (bucket, offset, numel)}): one flat buffer per bucket, its groups."""
    state, where, groups = {"queued": False, "buckets": []}, {}, {}
    for steps, fqns in buckets:
        params = [model.get_parameter(f) for f in fqns]
        sizes = [_local(p).numel() for p in params]
        for dims in steps:
            if dims not in groups:
                groups[dims] = group_of(mesh, dims)
        b = {
            "params": params,
            "groups": [groups[dims] for dims in steps],
            "arrived": set(),
            "work": None,
            "buf": torch.zeros(sum(sizes), dtype=_local(params[0]).dtype, device=_local(params[0]).device),
        }
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        for p, off, n in zip(params, offsets, sizes):
            where[id(p)] = (b, off, n)
        state["buckets"].append(b)
    return state, where


def reduce_grads_in_buckets(model, mesh, buckets, batch_shards):
    """DDP's gradient averaging in the given buckets. Autograd hands each parameter's gradient to a hook that
    copies it into its bucket's flat buffer; the bucket's first all_reduce starts (async) when its last gradient
    is in. A plain gradient then lives in its slice of the bucket (as with DDP's gradient_as_bucket_view: no
    second copy is held). At the end of the backward every bucket is waited for, its later steps run, and the sums
    are divided by the number of batch shards in place (copied back into DTensor gradients)."""
    state, where = _bucket_buffers(model, mesh, buckets)

    def launch(b):
        for p in b["params"]:  # a gradient that never came (unused parameter) counts as zeros
            if id(p) not in b["arrived"]:
                _, off, n = where[id(p)]
                b["buf"][off : off + n].zero_()
        b["work"] = dist.all_reduce(b["buf"], group=b["groups"][0], async_op=True)

    @torch.no_grad()
    def finish():
        state["queued"] = False
        for b in state["buckets"]:
            if not b["arrived"]:
                continue
            if b["work"] is None:
                launch(b)
            b["work"].wait()
            for group in b["groups"][1:]:
                dist.all_reduce(b["buf"], group=group)
            b["buf"].div_(batch_shards)
            for p in b["params"]:
                if id(p) not in b["arrived"]:
                    continue
                _, off, n = where[id(p)]
                g = _local(p.grad)
                if g.data_ptr() != b["buf"][off : off + n].data_ptr():  # not living in the bucket: copy back
                    g.copy_(b["buf"][off : off + n].view_as(g))
            b["arrived"], b["work"] = set(), None

    @torch.no_grad()
    def hook(p):
        b, off, n = where[id(p)]
        if getattr(p.grad, "placements", None) not in (None, getattr(p, "placements", None)):
            # a DTensor gradient placed otherwise than its parameter (tensor parallelism: Partial for a
            # SequenceParallel norm, Replicate for a vocab-sharded embedding): placed like the parameter now
            # (what the optimizer step would do), so the local gradient is the parameter's local shape
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        view = b["buf"][off : off + n]
        if view.data_ptr() != _local(p.grad).data_ptr():
            view.copy_(_local(p.grad).reshape(-1))
            if not hasattr(p.grad, "placements"):
                # a plain gradient then lives in the bucket (DDP's gradient_as_bucket_view): autograd's tensor is
                # freed now, not held beside its copy until the step ends; the average is written in place
                p.grad = view.view_as(p.grad)
        b["arrived"].add(id(p))
        if not state["queued"]:
            state["queued"] = True
            Variable._execution_engine.queue_callback(finish)
        if len(b["arrived"]) == len(b["params"]):
            launch(b)

    for b in state["buckets"]:
        for p in b["params"]:
            p.register_post_accumulate_grad_hook(hook)


def weigh_mean_loss(model, mesh, dims, labels_at, ignore_index, shards):
    """The loss over the whole batch, as on one device: each rank's mean over its batch shard weighted by its
    share of the counted targets (labels equal to ignore_index do not count), in the value the module returns and
    in the gradients (which FSDP2 / the gradient buckets then average over the `shards` batch shards). One
    all_reduce of (weighted loss, count) over the data-parallel mesh dims `dims` per step."""
    group = group_of(mesh, dims)

    def weigh(module, args, loss):
        if labels_at >= len(args) or not torch.is_tensor(args[labels_at]) or loss.numel() != 1:
            raise RuntimeError(
                f"autopar's lowered loss expects the labels as positional argument {labels_at} and a "
                f"scalar loss out (got {len(args)} arguments, output of shape {tuple(loss.shape)})"
            )
        value = loss.detach()
        value = value.to_local() if hasattr(value, "to_local") else value
        count = (args[labels_at] != ignore_index).sum().to(value.dtype)
        local = torch.where(count > 0, loss, torch.zeros_like(loss))  # a shard with no counted target adds 0
        pair = torch.stack([torch.where(count > 0, value, 0.0) * count, count])
        dist.all_reduce(pair, group=group)
        scaled = local * (count * shards / pair[1])
        return scaled + (pair[0] / pair[1] - scaled).detach()

    model.register_forward_hook(weigh)
