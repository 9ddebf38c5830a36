"""Cross-entropy on class-sharded logits (vocab parallelism: Megatron-LM's vocab-parallel cross entropy, torch's
`loss_parallel`): the loss ops keep the logits sharded along the class dim instead of gathering or all-to-all-ing
them, at the price of small all_reduces of one value per row inside the ops.

Per mesh dim on which every tensor of a candidate strategy is replicated, these ops may also shard the class dim:
  _log_softmax(x, dim)                   out S<dim>, x S<dim>: the row max and the row sum of exp all-reduced (MAX,
                                         SUM) over the sharding dims, as torch's loss_parallel computes it
  _log_softmax_backward_data(g, out, d)  S<d> throughout: grad - exp(out) * (the row sum of grad, all-reduced)
  nll_loss_forward(self (N, C), target)  self S1, target R -> the loss P (each rank picks the targets its classes
                                         hold, zeros elsewhere: a partial sum), total_weight R
  nll_loss_backward(g, self, target, tw) grad_input S1 (the -g of each row at its target where this rank holds it)
Unweighted losses on 2-D logits only (what cross_entropy on flattened tokens gives); a forward mean is excluded
(capture computes the mean as a sum over the total weight). The executor's implementations are in
backends/spmd/vocab_loss.py; `internal_collectives` and `workspace_bytes` tell the cost model what they issue and
hold beyond the graph's buffers.
"""

from __future__ import annotations

import math

import torch

from ..cost.kernels import op_arg

aten = torch.ops.aten
LOG_SOFTMAX = aten._log_softmax.default
LOG_SOFTMAX_BW = aten._log_softmax_backward_data.default
NLL = aten.nll_loss_forward.default
NLL_BW = aten.nll_loss_backward.default
OPS = (LOG_SOFTMAX, LOG_SOFTMAX_BW, NLL, NLL_BW)


def _arg(node, name: str):
    return op_arg(node.target, node.args, node.kwargs, name)


def class_dim(node, in_metas) -> int | None:
    """The class dim of the op's logits-shaped input where class sharding applies to this call, else None."""
    op = node.target
    if op is LOG_SOFTMAX or op is LOG_SOFTMAX_BW:
        x = in_metas[0]
        if not x.dtype.is_floating_point or not x.shape:
            return None
        return _arg(node, "dim") % len(x.shape)
    if op is NLL or op is NLL_BW:
        j = 0 if op is NLL else 1
        if (
            len(in_metas[j].shape) != 2
            or _arg(node, "weight") is not None
            or (op is NLL and _arg(node, "reduction") == 1)
        ):
            return None
        return 1
    return None


def _per_dim(op, d: int) -> tuple:
    """One mesh dim's placements (outputs, then tensor inputs) of the class-sharded form."""
    s = f"S{d}"
    if op is LOG_SOFTMAX:
        return (s, s)
    if op is LOG_SOFTMAX_BW:
        return (s, s, s)
    if op is NLL:
        return ("P", "R", s, "R")  # (output, total_weight; self, target)
    return (s, "R", s, "R", "R")  # grad_input; grad_output, self, target, total_weight


def extend(node, strategies: list, in_metas, mesh_shape, divides, make) -> list:
    """`strategies` plus, for each of them and each mesh dim on which it replicates every tensor, the
    class-sharded form on that dim (`make(outs, ins)` builds a Strategy; `divides(meta, pl, mesh_shape)` keeps even
    shards). One dim at a time: nesting the class dim over several dims adds candidates no plan here used, at a
    large cost in solve time (B6.16's pipeline="auto", measured before the loss ops followed the log-probs in
    passes/costs.py: 46 s against 27 s)."""
    d = class_dim(node, in_metas)
    if d is None:
        return strategies
    extra = _per_dim(node.target, d)
    tensor_outs = [i for i, m in enumerate(node.outs) if m is not None]
    if len(extra) != len(tensor_outs) + len(in_metas):
        return strategies
    metas = [node.outs[i] for i in tensor_outs] + list(in_metas)
    out = list(strategies)
    for s in strategies:
        pls = [s.out[i] for i in tensor_outs] + list(s.ins)
        for m in range(len(mesh_shape)):
            if mesh_shape[m] == 1 or any(pl[m] != "R" for pl in pls):
                continue
            new = [pl[:m] + (extra[t],) + pl[m + 1 :] for t, pl in enumerate(pls)]
            if all(divides(meta, pl, mesh_shape) for meta, pl in zip(metas, new)):
                outs = [None] * len(node.outs)
                for j, i in enumerate(tensor_outs):
                    outs[i] = new[j]
                out.append(make(tuple(outs), tuple(new[len(tensor_outs) :])))
    return out


# The input holding the log-probabilities (the saved output of log_softmax), per op that reads them: the loss's
# other ops follow its placement (passes/costs.py `_lead_input`) instead of each taking a decision of its own
LOG_PROBS_INPUT = {NLL: 0, NLL_BW: 1, LOG_SOFTMAX_BW: 1}


def sharded_dims(node, strategy) -> tuple[int, ...]:
    """The mesh dims on which `strategy` shards the op's class dim (empty: the op runs as on one device there)."""
    ins = getattr(strategy, "ins", None)  # None: a placement record of outputs only (nothing sharded inside)
    if node.target not in OPS or not ins:
        return ()
    x = ins[0 if node.target in (LOG_SOFTMAX, LOG_SOFTMAX_BW, NLL) else 1]
    if node.target is NLL or node.target is NLL_BW:
        return tuple(m for m, p in enumerate(x) if p == "S1")
    d = _arg(node, "dim")
    nd = len(node.outs[0].shape)
    return tuple(m for m, p in enumerate(x) if p == f"S{d % nd}")


def _rows_bytes(node, strategy, in_meta, mesh_shape, itemsize: int) -> float:
    """Bytes of one value per row of the op's local logits (what each all_reduce carries)."""
    d = _arg(node, "dim") % len(in_meta.shape)
    local = list(in_meta.shape)
    for p, n in zip(strategy.ins[0], mesh_shape):
        if p[0] == "S":
            local[int(p[1:])] //= n
    local[d] = 1
    return math.prod(local) * itemsize


def compute_itemsize(dtype) -> int:
    return 8 if dtype == torch.float64 else 4  # torch's _log_softmax decomposition computes in fp32 at least


def internal_collectives(node, strategy, in_metas, mesh_shape) -> list[tuple[str, int, float]]:
    """(kind, mesh dim, bytes) of each collective the executor issues inside the op under `strategy`, in order:
    one per class-sharding mesh dim for each row reduction (log_softmax: the max, then the sum of exp; its
    backward: the sum of the gradient)."""
    dims = sharded_dims(node, strategy)
    if not dims or node.target in (NLL, NLL_BW):
        return []
    x = in_metas[0]
    if node.target is LOG_SOFTMAX:
        b = _rows_bytes(node, strategy, x, mesh_shape, compute_itemsize(x.dtype))
        return [("all_reduce", m, b) for m in dims] * 2
    b = _rows_bytes(node, strategy, x, mesh_shape, x.dtype.itemsize)
    return [("all_reduce", m, b) for m in dims]


def workspace_bytes(node, strategy, in_metas, mesh_shape) -> float:
    """Bytes per rank the executor's implementation holds at its peak inside the op beyond its inputs and its
    output, as torch's loss_parallel does: the forward's shifted logits beside their exp (and an fp32 copy of
    half-precision logits), the backward's exp(out) beside its product with the row sums. The fused kernels of the
    unsharded op hold none."""
    if not sharded_dims(node, strategy) or node.target not in (LOG_SOFTMAX, LOG_SOFTMAX_BW):
        return 0.0
    x = in_metas[0]
    local = x.numel / math.prod(n for p, n in zip(strategy.ins[0], mesh_shape) if p[0] == "S")
    if node.target is LOG_SOFTMAX_BW:
        return local * x.dtype.itemsize
    size = compute_itemsize(x.dtype)
    return local * size * (1 if x.dtype.itemsize == size else 2)
