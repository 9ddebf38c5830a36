"""Context parallelism on the user's modules (the pipelining runtime's stages): a cp* mesh dim splits every sequence
into contiguous chunks, one per rank, and each attention computes its local queries against K and V all-gathered
along the sequence, the form the plan prices (autopar/strategies/context_parallel.py: the all-gathered-KV form of
torch's context_parallel; its backward reduce-scatters dK / dV).

`Attention` (a TorchFunctionMode) takes every `F.scaled_dot_product_attention` call of a block: K and V are
gathered (`gather_sequence`, differentiable: the backward reduce-scatters the gradient) and a causal attention gets
the mask of this rank's query positions `rank * L + i` against the whole sequence. What a block reads besides the
running tensor that spans the sequence (RoPE tables) is sliced to this rank's positions (`shard_block_inputs`). A
model whose blocks make positions themselves (an `arange` in a block, or a table made outside them cut to the
sequence's length inside one: torchtitan's freqs_cis longer than the sequence) or attend without
scaled_dot_product_attention (an explicit mask, which the CPU capture decomposes) cannot be split so: `unsplittable`
says why, from the plan's graph, before any rank runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autopar.capture_modes import SDPA
from autopar.graph import op_name

_SDPA = op_name(SDPA)  # as plan nodes name their targets


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        n = dist.get_world_size(group)
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((n * front.shape[0], *front.shape[1:]))
        dist.all_gather_into_tensor(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        n = dist.get_world_size(ctx.group)
        front = g.movedim(ctx.dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
        dist.reduce_scatter_tensor(out, front, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """x's chunks along `dim` from every rank of `group`, in rank order (the gradient reduce-scattered back)."""
    return _GatherSequence.apply(x, dim, group)


def local_chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous chunk of t along dim."""
    if t.shape[dim] % size:
        raise ValueError(f"a sequence of {t.shape[dim]} does not split over {size} context-parallel ranks")
    return t.chunk(size, dim)[rank]


class Attention(TorchFunctionMode):
    """scaled_dot_product_attention on this rank's queries against the whole sequence's K and V."""

    def __init__(self, group, rank: int, size: int):
        super().__init__()
        self.group, self.rank, self.size = group, rank, size
        self.calls = 0  # attentions run on the gathered sequence (recomputed ones included)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = {**dict(zip(names, args)), **kwargs}
        if call.get("attn_mask") is not None or call.get("dropout_p", 0.0):
            raise NotImplementedError(
                "context parallelism runs scaled_dot_product_attention without attn_mask and dropout only (a mask "
                "spans the whole sequence; a dropout mask would differ per rank)"
            )
        self.calls += 1
        q = call["query"]
        k = gather_sequence(call["key"], -2, self.group)
        v = gather_sequence(call["value"], -2, self.group)
        mask = None
        if call.get("is_causal"):
            pos = self.rank * q.shape[-2] + torch.arange(q.shape[-2], device=q.device)
            mask = pos[:, None] >= torch.arange(k.shape[-2], device=q.device)[None, :]
        return func(q, k, v, attn_mask=mask, scale=call.get("scale"), enable_gqa=bool(call.get("enable_gqa", False)))


def shard_block_inputs(args: tuple, kwargs: dict, seq: int, rank: int, size: int) -> tuple[tuple, dict]:
    """The block inputs (block_inputs of the pipelining runtime) with each tensor that spans the sequence (one dim of
    length `seq`) cut to this rank's chunk; a tensor with several such dims raises (which one is the sequence?)."""

    def cut(name, t):
        if not isinstance(t, torch.Tensor):
            return t
        dims = [d for d, n in enumerate(t.shape) if n == seq]
        if len(dims) > 1:
            raise NotImplementedError(
                f"the blocks' input {name} {list(t.shape)} has several dims of the sequence length {seq}: "
                f"context parallelism cannot tell which to split"
            )
        return local_chunk(t, dims[0], rank, size) if dims else t

    return tuple(cut(f"#{i}", a) for i, a in enumerate(args)), {k: cut(k, v) for k, v in kwargs.items()}


def unsplittable(plan, prefix: str) -> str | None:
    """Why the plan's blocks cannot run on sequence chunks (None: they can), from its graph's forward ops."""
    in_blocks = lambda n: n["kind"] == "op" and (n["module"] or "").startswith(prefix + ".")  # noqa: E731
    inside = [n for n in plan.nodes if in_blocks(n)]
    made = next((n for n in inside if n["target"].startswith("arange")), None)
    if made is not None:
        return (
            f"module '{made['module']}' makes positions itself ({made['target']}): on a sequence chunk they would "
            f"start at 0 on every context-parallel rank"
        )
    by_idx = {n["idx"]: n for n in plan.nodes}
    for n in inside:  # a table made outside the blocks, cut inside one from position 0 to the sequence's length
        src = by_idx[n["inputs"][0][0]] if n["target"].startswith("slice") and n["inputs"] else None
        if src is not None and not in_blocks(src) and n["shape"][0] != src["shape"][0]:
            return (
                f"module '{n['module']}' cuts {src['kind']} '{src['target']}' {src['shape'][0]} to {n['shape'][0]} "
                f"itself (positions from 0, as torchtitan's freqs_cis longer than the sequence): build the model "
                f"with the table as long as the sequence (torchtitan sets max_seq_len = seq_len)"
            )
    if not any(n["target"] == _SDPA for n in inside):
        return (
            f"the blocks of '{prefix}' attend without scaled_dot_product_attention (or with an explicit mask, "
            f"which the capture decomposes): context parallelism here splits that call"
        )
    return None
