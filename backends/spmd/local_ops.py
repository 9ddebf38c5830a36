"""How one captured op runs on this rank's local shards (backends/spmd/program.py compiles these into its program).

`local_exact`: ops whose arguments carry no global shape run unchanged on the shards. `local_args`: ops whose
global-shape argument has a local counterpart known ahead of time (a view's size becomes the output's local
shape; a cut or a norm along an unsharded dim runs unchanged). `binder` / `fast_args`: an op's arguments bound
once per instruction. `call_op` / `view_of_copy`: one op, with the fallback for views on inputs laid out otherwise
than on one device. `attention_*_math`: the CPU flash-attention contract as exact math, for devices without that kernel.
"""

from __future__ import annotations

import torch

from autopar.graph import Ref, flat_args, map_refs

aten = torch.ops.aten


class LocalOpError(RuntimeError):
    """Raised by the attention math mapping for options it does not cover."""


# ---- attention on devices without the captured CPU kernel ----------------------------------------------------------


def _scores(q, k, is_causal, scale, attn_mask=None):
    s = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(-2, -1)) * s
    if attn_mask is not None:  # additive (a causal mask's rows on a sequence shard of q: localize.causal_rows)
        scores = scores + attn_mask.float()
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, s


def attention_fw_math(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """(out, logsumexp) of softmax(q k^T * scale [causal]) v, the contract of the CPU flash kernel."""
    if dropout_p or (attn_mask is not None and attn_mask.dtype == torch.bool):
        raise LocalOpError("attention with dropout or a boolean mask is not supported by the math mapping")
    scores, _ = _scores(q, k, is_causal, scale, attn_mask)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    return (p @ v.float()).to(q.dtype), lse


def attention_bw_math(gout, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    scores, s = _scores(q, k, is_causal, scale, attn_mask)
    p = torch.exp(scores - lse.float().unsqueeze(-1))
    go = gout.float()
    dv = p.transpose(-2, -1) @ go
    ds = p * (go @ v.float().transpose(-2, -1) - (go * out.float()).sum(-1, keepdim=True))
    dq = (ds @ k.float()) * s
    dk = (ds.transpose(-2, -1) @ q.float()) * s
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


VIEWS = (aten.view.default, aten._unsafe_view.default)


# ---- ops whose device kernel takes less than what capture recorded ------------------------------------------------


def histc_any(x, bins=100, min=0, max=0):
    """histc where the device kernel counts floating values only (CPU): capture runs the model on meta, so a
    model choosing its input's dtype by device (transformers' MoE: `.float()` on cpu/mps, `.int()` elsewhere)
    records the integer form. The counts of the same values as float32, exact below 2**24, in the recorded dtype."""
    if x.is_floating_point() or x.device.type != "cpu":
        return aten.histc.default(x, bins, min, max)
    return aten.histc.default(x.float(), bins, min, max).to(x.dtype)


def _gmm_aligned(t: torch.Tensor) -> bool:
    """The layout `_grouped_mm`'s kernels take (torch's meta check): unit stride on one of the last two dims and
    the other a multiple of 16 bytes, at least that dim's extent."""
    e, al, st, sh = t.dim() - 1, 16 // t.element_size(), t.stride(), t.shape
    if st[e - 1] == 1 and st[e] >= max(1, sh[e - 1]):
        return st[e] % al == 0
    return st[e] == 1 and st[e - 1] >= max(1, sh[e]) and st[e - 1] % al == 0


def grouped_mm_any(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`_grouped_mm` on operands laid out as its kernel needs: a local shard (N or K of a size whose slice is not
    16-byte aligned), a gathered value or an expanded gradient is copied into a row-major layout with its row
    stride padded to 16 bytes (the same values; the padding is never read)."""

    def aligned(t):
        if _gmm_aligned(t):
            return t
        al = 16 // t.element_size()
        ld = -(-max(t.shape[-1], 1) // al) * al
        out = t.new_empty_strided(tuple(t.shape), _padded_strides(tuple(t.shape), ld))
        out.copy_(t)
        return out

    return aten._grouped_mm.default(aligned(mat_a), aligned(mat_b), offs, bias, out_dtype)


def _padded_strides(shape, ld):
    """Row-major strides of `shape` with the last dim's rows `ld` elements apart."""
    out, step = [1], ld
    for s in reversed(shape[:-1]):
        out.insert(0, step)
        step *= max(s, 1)
    return tuple(out)


LOCAL_IMPL = {aten.histc.default: histc_any, aten._grouped_mm.default: grouped_mm_any}


def call_op(fn, args, kwargs):
    """Run one op. A view whose input has another memory layout here than on one device (a gathered shard, a
    kernel's output order) cannot alias it; no value is mutated in place in a captured step (capture rejects
    in-place ops), so the same values from a contiguous copy are exact."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        return view_of_copy(fn, e, args, kwargs)


def view_of_copy(fn, err: RuntimeError, args, kwargs):
    """After `fn(*args, **kwargs)` raised `err`: a view that cannot alias its input's layout, from a contiguous copy
    of the input; any other error is raised again (call_op; the compiled programs call it from their except)."""
    if fn not in VIEWS or "view size is not compatible" not in str(err):
        raise err
    return fn(args[0].clone(memory_format=torch.contiguous_format), *args[1:], **kwargs)


_LOCAL_OK: dict = {}


def _masked(ins, outs) -> bool:
    """A masked partial among the placements (a vocab-sharded lookup): only DTensor's dispatch applies its mask."""
    return any(p == "Pm" for pl in (*ins, *(o for o in outs if o)) for p in pl)


def local_exact(n, ins, outs) -> bool:
    """Does the op, run on its inputs' local shards, give its planned output shard with nothing else to do? True
    when no argument depends on the global shape (no SymInt / SymInt[] in the schema: sizes, split points,
    padding indices), the op draws no random numbers, mutates nothing and takes no device, and no value is a
    masked partial. The plan's strategy (from DTensor's registry or autopar's rules) guarantees that shards are
    even and that sharded dims are ones the op keeps apart, which is all DTensor's dispatch relies on for these
    ops; running them locally skips DTensor's per-op dispatch (~0.1 ms per op on a CPU)."""
    op = n.target
    ok = _LOCAL_OK.get(op)
    if ok is None:
        s = op._schema
        args = str(s).split(") ->")[0]  # the schema text keeps SymInt (Python's types erase it)
        ok = _LOCAL_OK[op] = (
            not s.is_mutable
            and torch.Tag.nondeterministic_seeded not in op.tags
            and "SymInt" not in args
            and "Device" not in args
        )
    return ok and not _masked(ins, outs)


def _top_refs(args, kwargs):
    """Positions of the tensor inputs among the positional args when no tensor is nested (in a list or a kwarg),
    else None."""
    tops = [i for i, a in enumerate(args) if isinstance(a, Ref)]
    return tops if len(tops) == sum(1 for a in flat_args(args, kwargs) if isinstance(a, Ref)) else None


def binder(args, kwargs):
    """fn(values) -> (args, kwargs): the op's arguments with its tensor inputs (in `Node.inputs()` order) filled in.
    Built once per instruction; the common case (tensors only as top-level positional args) is a list copy."""
    tops = _top_refs(args, kwargs)
    if tops is None:

        def bind_nested(vals):
            vi = iter(vals)
            return map_refs(args, lambda r: next(vi)), map_refs(kwargs, lambda r: next(vi))

        return bind_nested
    base = list(args)
    if tops == list(range(len(tops))):  # tensors first, then constants: one list concatenation
        rest = base[len(tops) :]
        return lambda vals: (vals + rest, kwargs)

    def bind(vals):
        a = base.copy()
        for i, v in zip(tops, vals):
            a[i] = v
        return a, kwargs

    return bind


_BINDINGS: dict | None = None


def binding(op):
    """The op's generated Python binding (torch.mm for aten.mm.default, Tensor.view for aten.view.default...) for the
    overloads that binding resolves to with the captured argument types, else None. Calling it skips OpOverload's
    generic argument matching, ~1 us of a 2-3 us call: the compiled programs run ~2,000 such ops a step. Only
    overloads of one op name computing the same function are listed (mul.Scalar -> torch.mul, whose wrapped scalar
    leaves type promotion as mul.Scalar's); tests/test_execute_local.py checks each against its OpOverload."""
    global _BINDINGS
    if _BINDINGS is None:
        T, nn = torch.Tensor, torch._C._nn
        _BINDINGS = {
            aten.view.default: T.view,
            aten.expand.default: T.expand,
            aten.t.default: torch.t,
            aten.permute.default: torch.permute,
            aten.transpose.int: torch.transpose,
            aten.unsqueeze.default: torch.unsqueeze,
            aten.squeeze.dim: torch.squeeze,
            aten.detach.default: torch.detach,
            aten.mm.default: torch.mm,
            aten.bmm.default: torch.bmm,
            aten.mul.Tensor: torch.mul,
            aten.mul.Scalar: torch.mul,
            aten.add.Tensor: torch.add,
            aten.sub.Tensor: torch.sub,
            aten.div.Tensor: torch.div,
            aten.div.Scalar: torch.div,
            aten.neg.default: torch.neg,
            aten.pow.Tensor_Scalar: torch.pow,
            aten.rsqrt.default: torch.rsqrt,
            aten.exp.default: torch.exp,
            aten.sum.dim_IntList: torch.sum,
            aten.sum.default: torch.sum,
            aten.mean.dim: torch.mean,
            aten.clone.default: torch.clone,
            aten.silu.default: nn.silu,
            aten._softmax.default: torch._softmax,
            aten._softmax_backward_data.default: torch._softmax_backward_data,
        }
    return _BINDINGS.get(op)


def fast_args(args, kwargs, fn):
    """(constant args after the tensors, kwargs) when the tensor inputs are exactly the leading positional args and
    the op returns one Tensor (the compiled path), else None."""
    tops = _top_refs(args, kwargs)
    if tops is None or tops != list(range(len(tops))):
        return None
    rets = getattr(fn, "_schema", None)
    if rets is None or len(rets.returns) != 1 or str(rets.returns[0].type) != "Tensor":
        return None
    return tuple(args[len(tops) :]), dict(kwargs)


def local_shape(shape, strs, mesh_shape):
    """The local shard's shape of a tensor of global `shape` at placements `strs` (None if a shard is uneven)."""
    out = list(shape)
    for p, k in zip(strs, mesh_shape):
        if p[0] == "S":
            d = int(p[1:])
            if out[d] % k:
                return None
            out[d] //= k
    return out


def _arg(n, name):
    """An op argument by schema name (positional, keyword or default)."""
    for i, a in enumerate(n.target._schema.arguments):
        if a.name == name:
            if i < len(n.args):
                return n.args[i]
            return n.kwargs.get(name, a.default_value)
    raise KeyError(name)


def _sharded_dims(pl) -> set:
    return {int(p[1:]) for p in pl if p[0] == "S"}


_SIZE_ARG = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.slice_backward.default,
}
_ON_DIM = {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.select.int,
    aten.slice_backward.default,
}
_NORM = {aten.native_layer_norm.default: 0, aten.native_layer_norm_backward.default: 1}


_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
_NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}


def _partial(*pls) -> bool:
    return any(p[0] == "P" for pl in pls if pl for p in pl)


def _local_lookup(n, ins, outs):
    """Embedding lookups (forward and backward) on local shards: exact when the table's rows are not sharded (a
    row-sharded table is a masked partial, DTensor's), no index is partial and the backward does not scale by
    counts over the whole batch. The backward of a batch-sharded lookup is then this rank's partial sum."""
    if n.target is aten.embedding.default:
        return 0 not in _sharded_dims(ins[0]) and not _partial(ins[1])
    return 0 not in _sharded_dims(outs[0]) and not _partial(ins[1]) and not _arg(n, "scale_grad_by_freq")


def _local_nll(g, n, ins, outs) -> bool:
    """The loss on batch shards, locally: no class weights, log-probs (batch, classes) and targets split alike along
    the batch only. The forward's sum and count (reduction=sum) are then this rank's partial sums; the backward from
    a replicated gradient and a replicated count of the whole batch (reduction sum or mean) is this rank's shard of
    the input's gradient. Anything else (class weights, vocab-sharded log-probs, a per-rank mean) goes through
    DTensor's dispatch."""
    fw = n.target is aten.nll_loss_forward.default
    j = 0 if fw else 1  # the log-probs among the tensor inputs
    r = n.inputs()[j]
    x, t = ins[j], ins[j + 1]
    if (
        _arg(n, "weight") is not None
        or len(g.nodes[r.node].outs[r.out].shape) != 2
        or any(p not in ("R", "S0") for p in x)
        or tuple(x) != tuple(t)
    ):
        return False
    if fw:
        want = tuple("P" if p == "S0" else "R" for p in x)
        return _arg(n, "reduction") == 2 and all(tuple(o) == want for o in outs)
    grad, count = ins[0], ins[3]
    return _arg(n, "reduction") in (1, 2) and tuple(outs[0]) == tuple(x) and all(p == "R" for p in (*grad, *count))


_CONV = (aten.convolution.default, aten.convolution_backward.default)
_PAD_BW = (
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)


def _local_conv(n, ins, outs) -> bool:
    """A convolution (forward or backward) on batch shards, locally: activations split along the batch only
    (possibly over several mesh dims, which DTensor's convolution handler cannot run), weights replicated. The
    forward's output is then this rank's batch shard; the backward's grad_input too, its grad_weight / grad_bias
    this rank's partial sums (P on the mesh dims that split the batch)."""
    batch_only = lambda pl: all(p in ("R", "S0") for p in pl)
    if n.target is aten.convolution.default:
        return batch_only(ins[0]) and all(p == "R" for pl in ins[1:] for p in pl) and tuple(outs[0]) == tuple(ins[0])
    go, x, w = ins
    want = tuple("P" if p == "S0" else "R" for p in x)
    return (
        batch_only(x)
        and tuple(go) == tuple(x)
        and all(p == "R" for p in w)
        and (outs[0] is None or tuple(outs[0]) == tuple(x))
        and all(o is None or tuple(o) == want for o in outs[1:])
    )


def local_args(g, n, ins, outs, mesh_shape, device=None):
    """(args, kwargs) that run op `n` on local shards exactly, for ops whose global-shape arguments have a local
    counterpart known ahead of time; None where only DTensor's dispatch can run it. The plan's strategy (DTensor's
    own) fixes the placements; here: a size argument becomes the output's local shape (views, expand,
    slice_backward, new_zeros...), ops that cut, select or normalize along a dim run unchanged when that dim is not
    sharded (split, slice, topk, layer_norm), `*_like` ops make the shard of their input's shard when both are at
    the same placement, not partial, lookups run on local indices (`_local_lookup`), an unweighted loss on
    batch shards as partial sums (`_local_nll`), a convolution on batch shards (`_local_conv`) and a replication
    pad's backward along unpadded dims. A captured device (meta) becomes `device`."""
    op = n.target
    if _masked(ins, outs):
        return None
    if op in _LIKE or op in _NEW:
        if _partial(outs[0]) or (op in _LIKE and tuple(ins[0]) != tuple(outs[0])):
            return None
        args, kwargs = list(n.args), dict(n.kwargs)
        if op in _NEW:
            local = local_shape(n.out.shape, outs[0], mesh_shape)
            if local is None:
                return None
            args[1] = local
        if "device" in kwargs and device is not None:
            kwargs["device"] = device
        return tuple(args), kwargs
    if op is aten.topk.default:
        if (
            _partial(ins[0])
            or _arg(n, "dim") % max(len(n.outs[0].shape), 1) in _sharded_dims(ins[0])
            or not all(tuple(o) == tuple(ins[0]) for o in outs)
        ):
            return None
        return n.args, n.kwargs
    if op in (aten.embedding.default, aten.embedding_dense_backward.default):
        return (n.args, n.kwargs) if _local_lookup(n, ins, outs) else None
    if op in (aten.nll_loss_forward.default, aten.nll_loss_backward.default):
        return (n.args, n.kwargs) if _local_nll(g, n, ins, outs) else None
    if op in _CONV:
        return (n.args, n.kwargs) if _local_conv(n, ins, outs) else None
    if op in _PAD_BW:  # the padding names the trailing dims only: exact while those are whole
        k, nd = len(_arg(n, "padding")) // 2, len(n.out.shape)
        ok = not _partial(*ins) and all(d < nd - k for pl in (*ins, outs[0]) for d in _sharded_dims(pl))
        return (n.args, n.kwargs) if ok else None
    if op not in _SIZE_ARG and op not in _ON_DIM and op not in _NORM:
        return None

    def ndim(j):
        r = n.inputs()[j]
        return len(g.nodes[r.node].outs[r.out].shape)

    if op in _ON_DIM:
        cut, nd = (outs[0], len(n.out.shape)) if op is aten.slice_backward.default else (ins[0], ndim(0))
        if _arg(n, "dim") % max(nd, 1) in _sharded_dims(cut):
            return None
    if op in _NORM:
        x, k = _NORM[op], len(_arg(n, "normalized_shape"))
        if any(d >= ndim(x) - k for pl in ins[: x + 1] for d in _sharded_dims(pl)):
            return None
    args = list(n.args)
    if op in _SIZE_ARG:
        local = local_shape(n.out.shape, outs[0], mesh_shape)
        if local is None:
            return None
        args[1] = local
    return tuple(args), n.kwargs


# ---- random ops ---------------------------------------------------------------------------------------------------
# Each rank draws the FULL global random tensor from the program's generator (seeded alike and advanced alike on
# every rank) and keeps its own piece: replicated outputs hold the same values on every rank, sharded ones each
# rank its part of the one global tensor, whatever the plan. The draws are the kernels one device runs on the
# global shape (bernoulli_(p), uniform_, normal_, rand, randn, randint), so a program seeded with s draws what
# torch.manual_seed(s) then the eager model draws (checked for float32 on CPU: native_dropout's mask is
# empty_like(x).bernoulli_(1 - p), bernoulli(probs) is rand < probs). DTensor's RNG tracker would give the same on
# CUDA (Philox offsets, no full draw) but refuses CPU meshes in torch 2.13.
RANDOM = {
    aten.bernoulli.p,
    aten.bernoulli.default,
    aten.native_dropout.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.rand.default,
    aten.randn.default,
    aten.uniform.default,
    aten.normal_functional.default,
    aten.randint.default,
    aten.randint.low,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    # the other in-place fills of a fresh buffer (PhiMoE's sparsemixer: empty_like(g).exponential_().log())
    aten.exponential.default,
    aten.geometric.default,
    aten.log_normal.default,
    aten.cauchy.default,
}
RANDOM_LIKE = RANDOM - {aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low}


def draw_random(fn, node, args, kwargs, gen, device, piece, outside):
    """Outputs of random op `fn` on this rank: `args`/`kwargs` hold local shards; `piece(full, k)` cuts this
    rank's piece of output k out of a full global tensor; `outside()` suspends LocalTensorMode for the draw (one
    draw, not one per simulated rank). None: the op draws nothing here (native_dropout in eval), run it as is."""
    kw = dict(kwargs)  # every argument by its schema name
    for a, v in zip(fn._schema.arguments, args):
        kw[a.name] = v
    m = node.outs[0]
    shape, dtype = tuple(m.shape), m.dtype
    with outside():  # draws one device made for values the loss does not read (autopar/capture_rng.py)
        _discard(getattr(node, "rng_skip", ()), device, gen)
    if fn is aten.native_dropout.default and kw.get("train") is False:
        return None
    with outside():
        full = _draw_full(fn, kw, shape, dtype, device, gen, getattr(node, "stride", None))
        _discard(getattr(node, "rng_after", ()), device, gen)
    if fn is aten.bernoulli.default:  # one uniform per element, compared with its probability
        return [(piece(full, 0) < kw["self"]).to(dtype)]
    if fn is aten.native_dropout.default:
        p = kw["p"]
        mask = piece(full, 0)
        out = kw["input"].mul(mask).mul_(0.0 if p == 1 else 1.0 / (1.0 - p))
        return [out, mask.to(node.outs[1].dtype)]
    return [piece(full, 0)]


def _discard(specs, device, gen) -> None:
    """Advance `gen` past the draws `specs` ((op, arguments, shape, dtype, stride) each), as one device draws them."""
    for fn, kw, shape, dtype, stride in specs:
        if fn in RANDOM and not (fn is aten.native_dropout.default and kw.get("train") is False):
            _draw_full(fn, kw, shape, dtype, device, gen, stride)


def _draw_full(fn, kw, shape, dtype, device, gen, stride=None):
    """The global random tensor, drawn as one device does: the `*_like` ops and the in-place fills of an
    `empty_like` (dropout) fill memory in order, so the tensor is laid out with the strides one device's had
    (rand(shape) is empty(shape).uniform_(0, 1), randn normal_(0, 1), randint random_(low, high))."""
    new = lambda d=dtype: (
        torch.empty(shape, dtype=d, device=device)
        if stride is None
        else torch.empty_strided(shape, stride, dtype=d, device=device)
    )
    if fn is aten.bernoulli.p:
        return new().bernoulli_(kw["p"], generator=gen)
    if fn is aten.native_dropout.default:
        return new().bernoulli_(1.0 - kw["p"], generator=gen)
    if fn in (aten.bernoulli.default, aten.rand_like.default, aten.rand.default):
        return new().uniform_(0.0, 1.0, generator=gen)
    if fn in (aten.randn_like.default, aten.randn.default):
        return new().normal_(0.0, 1.0, generator=gen)
    if fn is aten.uniform.default:
        return new().uniform_(kw.get("from", 0.0), kw.get("to", 1.0), generator=gen)
    if fn is aten.normal_functional.default:
        return new().normal_(kw.get("mean", 0.0), kw.get("std", 1.0), generator=gen)
    if fn is aten.exponential.default:
        return new().exponential_(kw.get("lambd", 1.0), generator=gen)
    if fn is aten.geometric.default:
        return new().geometric_(kw["p"], generator=gen)
    if fn is aten.log_normal.default:
        return new().log_normal_(kw.get("mean", 1.0), kw.get("std", 2.0), generator=gen)
    if fn is aten.cauchy.default:
        return new().cauchy_(kw.get("median", 0.0), kw.get("sigma", 1.0), generator=gen)
    if fn in (aten.randint.default, aten.randint.low, aten.randint_like.default, aten.randint_like.low_dtype):
        return new().random_(kw.get("low", 0), kw["high"], generator=gen)
    raise NotImplementedError(f"random op {fn}")
