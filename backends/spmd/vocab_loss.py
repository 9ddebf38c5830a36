"""The cross-entropy ops on class-sharded logits (autopar/strategies/vocab_parallel.py), on DTensors in and out.

Each runs on this rank's local shard and reduces one value per row over the mesh dims that shard the class dim:
log_softmax as torch's loss_parallel computes it (torch/distributed/tensor/parallel/loss.py `_log_softmax`: the
row max all-reduced with MAX, the row sum of exp with SUM, in the same temporaries); its backward as
torch._decomp's `_log_softmax_backward_data` with the row sum of the gradient all-reduced; nll_loss forward and
backward exactly per op (not torch's fused pair): each rank picks, or writes the gradient of, the targets among its
own classes, so the forward's loss is a partial sum and the backward needs no collective. Every rank learns which
classes it holds by cutting the global class indices as the placement cuts the logits (nested shards included).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.strategies._torch_adapter import local_of, make_dtensor, per_rank

from .comm import _fn, _wait, group_name, redistribute_local
from .interpreter import _global_stride

aten = torch.ops.aten


def _class_dims(x: DTensor, d: int) -> list[int]:
    return [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == d]


def _all_reduce(t: torch.Tensor, op: str, mesh, dims) -> torch.Tensor:
    for m in dims:
        t = _wait(_fn.all_reduce(per_rank(t).contiguous(), op, group_name(mesh, m)), always=True)
    return t


def _like(x: DTensor, local: torch.Tensor, placements=None, shape=None) -> DTensor:
    shape = tuple(x.shape) if shape is None else shape
    pls = x.placements if placements is None else placements
    return make_dtensor(local, x.device_mesh, pls, shape, _global_stride(local, shape))


def log_softmax(x: DTensor, dim: int, half_to_float: bool) -> DTensor:
    d = dim % x.ndim
    loc = local_of(x)
    dtype = torch.float64 if loc.dtype == torch.float64 else torch.float32
    xf = loc.to(dtype)
    top = _all_reduce(torch.amax(xf, d, keepdim=True), "max", x.device_mesh, _class_dims(x, d))
    shifted = xf - top
    sumexp = _all_reduce(torch.sum(torch.exp(shifted), d, keepdim=True), "sum", x.device_mesh, _class_dims(x, d))
    out = shifted - torch.log(sumexp)
    return _like(x, out if half_to_float else out.to(loc.dtype))


def log_softmax_backward(grad: DTensor, out: DTensor, dim: int, input_dtype) -> DTensor:
    d = dim % grad.ndim
    g = local_of(grad)
    rows = _all_reduce(torch.sum(g, d, keepdim=True), "sum", grad.device_mesh, _class_dims(grad, d))
    res = g - torch.exp(local_of(out)) * rows
    return _like(grad, res if res.dtype == input_dtype else res.to(input_dtype))


def _own_targets(x: DTensor, target: torch.Tensor, ignore_index: int):
    """(this rank's column of each row's target, whether this rank holds it, whether the row counts): the class
    indices 0..C-1 cut as x's placements cut its class dim give this rank's first class and how many it holds."""
    mesh, n_cls = x.device_mesh, x.shape[1]
    src = ("R",) * mesh.ndim
    dst = tuple("S0" if isinstance(p, Shard) and p.dim == 1 else "R" for p in x.placements)
    ids = redistribute_local(per_rank(torch.arange(n_cls, device=target.device)), src, dst, mesh)
    first, count = ids[0], local_of(x).shape[1]
    counts = target != ignore_index
    mine = counts & (target >= first) & (target < first + count)
    return torch.where(mine, target - first, 0), mine, counts


def _local(v) -> torch.Tensor:
    return local_of(v) if isinstance(v, DTensor) else v


def _row_placements(x: DTensor, summed: bool) -> tuple:
    """(the loss's, the total weight's) placements per mesh dim: the class-sharding dims leave the loss a partial
    sum (each rank picked its own targets) and the count whole; a batch-sharding dim leaves a summed loss and the
    count partial sums, an unreduced loss a batch shard."""
    loss, count = [], []
    for p in x.placements:
        cls, batch = isinstance(p, Shard) and p.dim == 1, isinstance(p, Shard) and p.dim == 0
        loss.append(Partial() if cls or (batch and summed) else Shard(0) if batch else Replicate())
        count.append(Partial() if batch and summed else Replicate())
    return tuple(loss), tuple(count)


def nll_loss_forward(x: DTensor, target, weight, reduction: int, ignore_index: int):
    loc, t = local_of(x), _local(target)
    col, mine, counts = _own_targets(x, t, ignore_index)
    picked = torch.gather(loc, 1, col.unsqueeze(1)).squeeze(1)
    loss = torch.where(mine, -picked, torch.zeros((), dtype=loc.dtype, device=loc.device))
    summed = reduction != 0
    loss_pl, count_pl = _row_placements(x, summed)
    out = _like(x, loss.sum() if summed else loss, loss_pl, () if summed else (x.shape[0],))
    total = counts.sum().to(loc.dtype) if summed else loc.new_zeros(())
    return out, _like(x, total, count_pl, ())


def nll_loss_backward(grad_out, x: DTensor, target, weight, reduction: int, ignore_index: int, total_weight):
    loc, t = local_of(x), _local(target)
    g = _local(grad_out)
    if reduction == 1:
        g = g / _local(total_weight)
    col, mine, _ = _own_targets(x, t, ignore_index)
    value = torch.where(mine, -g.expand(mine.shape) if g.dim() == 0 else -g, torch.zeros((), dtype=loc.dtype))
    res = torch.zeros_like(loc).scatter_(1, col.unsqueeze(1), value.to(loc.dtype).unsqueeze(1))
    return _like(x, res)


IMPL = {
    aten._log_softmax.default: log_softmax,
    aten._log_softmax_backward_data.default: log_softmax_backward,
    aten.nll_loss_forward.default: nll_loss_forward,
    aten.nll_loss_backward.default: nll_loss_backward,
}
