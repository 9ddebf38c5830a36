"""The TorchFunctionModes capture runs under: they rewrite torch-level calls before they reach dispatch, where the
recorder (autopar/capture.py) sees only aten ops. FusedAttention turns F.scaled_dot_product_attention into one fused
attention op (with enable_gqa, on the K/V heads as they are) and batch norm with running statistics into the op
whose schema declares the update; Constants keeps the data of tensors made from Python data on the meta device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .batch_norm import batch_norm_legit

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BW = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class FusedAttention(TorchFunctionMode):
    """Route F.scaled_dot_product_attention to one fused attention op (forward and backward nodes), and keep the
    user-level torch call being run (`current`, e.g. linalg_qr), so that an error inside its decomposition names
    it. The mode is off while its handler runs, so it sees only the outermost calls."""

    def __init__(self):
        super().__init__()
        self.current = None

    def user_op(self) -> str | None:
        return getattr(self.current, "__name__", None) if self.current is not None else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        prev, self.current = self.current, func
        try:
            return self._call(func, args, kwargs)
        finally:
            self.current = prev

    def _call(self, func, args, kwargs):
        if func is F.batch_norm or func is torch.batch_norm:
            return batch_norm_legit(func, args, kwargs)
        if func is F.embedding_bag:
            return _embedding_bag(args, kwargs)
        if func is torch.Tensor.masked_scatter or func is torch.masked_scatter:
            return _masked_scatter(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            gqa = kwargs.get("enable_gqa", False)
            if mask is None and dropout == 0.0 and (_same_heads(q, k, v) or gqa and _groups(q, k, v)):
                return SDPA(q, k, v, 0.0, causal, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


_BAG_ARGS = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse")
_BAG_ARGS += ("per_sample_weights", "include_last_offset", "padding_idx")


def _embedding_bag(args, kwargs):
    """F.embedding_bag (nn.EmbeddingBag) of fixed-size bags (a 2-D input, no offsets) in sum or mean mode as what
    it computes: an embedding lookup reduced over each bag (weighted by per_sample_weights in sum mode). The fused
    aten._embedding_bag and its backward have no placement rule (NoStrategyError); the lookup has them (row- or
    column-sharded tables, batch-sharded bags). Bags given by offsets (their sizes are values) stay the fused op."""
    a = dict(zip(_BAG_ARGS, args)) | kwargs
    x, w, psw, mode = a["input"], a["weight"], a.get("per_sample_weights"), a.get("mode", "mean")
    plain = all(a.get(k) is None for k in ("offsets", "max_norm", "padding_idx")) and not a.get("sparse", False)
    plain = plain and not a.get("scale_grad_by_freq", False) and x.dim() == 2 and mode in ("sum", "mean")
    if not plain or (psw is not None and (mode != "sum" or psw.shape != x.shape)):
        return F.embedding_bag(*args, **kwargs)
    rows = F.embedding(x, w)
    if psw is not None:
        rows = rows * psw.unsqueeze(-1).to(rows.dtype)
    return rows.sum(1) if mode == "sum" else rows.mean(1)


def _masked_scatter(x, mask, source):
    """x.masked_scatter(mask, source) (Llava and other vision-language models put image features at the image
    tokens' places) as the gather it is: the k-th True place of the mask takes source's k-th element, found by a
    cumulative count of the mask. Same values and gradients, static shapes: the fused op and its backward have
    no placement rule, and its backward selects by mask (a shape that depends on values)."""
    mask = mask.expand_as(x)
    if source.numel() == 0:  # nothing to place (an all-False mask; masked_scatter checks it)
        return x.clone()
    k = (mask.reshape(-1).long().cumsum(0) - 1).clamp(min=0)
    picked = source.reshape(-1).index_select(0, k).view(x.shape)
    return torch.where(mask, picked.to(x.dtype), x)


def _same_heads(q, k, v) -> bool:
    return q.size(-3) == k.size(-3) == v.size(-3)


def _groups(q, k, v) -> bool:
    """Whether enable_gqa's K/V heads group the query heads (Hq a multiple of Hkv): the fused op then takes K and V
    at their own head count, as GQA-aware kernels (FlashAttention, torch's CPU flash) run it, so attention saves
    and context parallelism gathers K/V at Hkv heads, not Hq. Meta tensors would otherwise take SDPA's math
    decomposition, whose bmm flattens (batch, heads) into one dim where DTensor's view rule cannot keep the heads
    sharded (head-parallel attention would have no candidate)."""
    hq, hkv = q.size(-3), k.size(-3)
    return hkv == v.size(-3) and hkv > 0 and hq % hkv == 0


class Constants(TorchFunctionMode):
    """torch.tensor(data, device=meta) and its kin make a meta tensor without any dispatch the recorder sees, so
    its data would be lost: make the same tensor on the CPU too and tell the recorder, which records it as a
    constant with that data."""

    FNS = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)
    # `x[..., [-2], :]`: Python turns the int list into an index tensor on x's device with no dispatch either
    INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)

    def _index(self, idx, device):
        """The index with each list of ints/bools made a tensor whose CPU twin the recorder knows."""
        if isinstance(idx, tuple):
            return tuple(self._index(i, device) for i in idx)
        if isinstance(idx, list) and idx and all(type(i) in (int, bool) for i in idx):
            with torch._C._DisableTorchDispatch():  # as Python makes it: no op the recorder sees
                real, out = torch.tensor(idx), torch.tensor(idx, device=device)
            self.rec.origin[id(out)] = real
            self.rec.keep.append(out)
            return out
        return idx

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return _tolist(args[0])
        if (
            func in self.INDEXING
            and len(args) >= 2
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type == "meta"
        ):
            args = (args[0], self._index(args[1], args[0].device), *args[2:])
        out = func(*args, **kwargs)
        if (
            func in self.FNS
            and isinstance(out, torch.Tensor)
            and out.device.type == "meta"
            and id(out) not in self.rec.ref
        ):
            try:
                with torch._C._DisableTorchDispatch():
                    real = func(*args, **{**kwargs, "device": "cpu"})
            except Exception:  # made from meta data itself: nothing to keep
                real = None
            if isinstance(real, torch.Tensor) and real.device.type == "cpu":
                self.rec.origin[id(out)] = real.detach()
                self.rec.keep.append(out)
        return out


def _tolist(t: torch.Tensor):
    """`t.tolist()` of a meta tensor as `.item()` of each element: the C++ tolist reads storage a meta tensor has
    not got ("unallocated storage"), while each .item() reaches the recorder, which specializes it on the example
    values and keeps a guard (as for `.item()` itself)."""
    return t.item() if t.dim() == 0 else [_tolist(r) for r in t.unbind(0)]
