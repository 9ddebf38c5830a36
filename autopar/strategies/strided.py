"""`as_strided` / `as_strided_scatter` calls that only restate a layout, recorded as the views they are.

Where they come from: torch's C++ `adaptive_avg_pool2d` with output size 1 (`adaptive_avg_pool1d(x, 1)` in
transformers' Swin pooler, `nn.AdaptiveAvgPool2d(1)`) computes a mean and, for a channels-last input, restrides it
in place (`out.as_strided_(...)`): functionalization records that as `as_strided`, and autograd's backward of it
(`as_strided_backward`) as `new_zeros` of the storage, `as_strided_scatter` of the gradient into it and `as_strided`
of the result. Neither op has a placement rule, and neither can have one in general: they address storage, which
a shard or a gathered value lays out otherwise than one device.

These particular calls select a tensor's own elements in its logical order: `as_strided(x, size, stride, off)` with
`off` x's offset and either x's own size and strides (strides of size-1 dims are free) or, for a contiguous x,
the contiguous strides of a size of as many elements (a reshape); and `as_strided_scatter(base, src, ...)` whose view
covers all of a contiguous `base` in that order (the result is src's values in base's shape). For those the value
is a view (`aten.view`), which has placement rules and runs on shards; capture records that instead
(`restride_decomposition`). Any other call is left as it is: the plan names it with the user's op it came from.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _contiguous_on(size, stride) -> bool:
    """`stride` is the row-major stride of `size` on every dim of extent > 1."""
    step = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def _reads_in_order(x: torch.Tensor, size, stride, offset) -> bool:
    """as_strided(x, size, stride, offset) holds x's elements in the order of x.reshape(size)."""
    size, stride = list(size), list(stride)
    if offset != x.storage_offset() or len(size) != len(stride) or math.prod(size) != x.numel():
        return False
    if size == list(x.shape) and all(n == 1 or s == t for n, s, t in zip(size, stride, x.stride())):
        return True
    return x.is_contiguous() and _contiguous_on(size, stride)


def _args(args, kwargs, names):
    vals = dict(zip(names, args))
    vals.update(kwargs)
    vals.setdefault("storage_offset", None)
    return vals


def restride_decomposition(func, args, kwargs):
    """A function of (args, kwargs) recording the same value with view ops, for the layout-only calls above;
    None for every other op or call."""
    if func is aten.as_strided.default:
        a = _args(args, kwargs, ("self", "size", "stride", "storage_offset"))
        x = a["self"]
        off = x.storage_offset() if a["storage_offset"] is None else a["storage_offset"]
        if isinstance(x, torch.Tensor) and _reads_in_order(x, a["size"], a["stride"], off):
            return lambda *_, **__: aten.view.default(x, list(a["size"]))
        return None
    if func is aten.as_strided_scatter.default:
        a = _args(args, kwargs, ("self", "src", "size", "stride", "storage_offset"))
        base, src = a["self"], a["src"]
        off = base.storage_offset() if a["storage_offset"] is None else a["storage_offset"]
        if (
            isinstance(src, torch.Tensor)
            and src.dtype == base.dtype
            and list(src.shape) == list(a["size"])
            and base.is_contiguous()
            and _reads_in_order(base, a["size"], a["stride"], off)
        ):

            def scatter(*_, **__):
                s = src if src.is_contiguous() else aten.clone.default(src, memory_format=torch.contiguous_format)
                return aten.view.default(s, list(base.shape))

            return scatter
    return None
