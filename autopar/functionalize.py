"""Functionalization as capture uses it: torch's C++ functionalization on for the forward and backward, leaves
wrapped as functional tensors and unwrapped to their current value, the leaves the forward mutated (a buffer's
state update; a parameter or input: refused), and functionalization's copy(dst, src) as the clone it is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .capture_error import CaptureError
from .graph import Node, Ref

aten = torch.ops.aten


class Recording(Protocol):
    """What these helpers read of capture's recorder: the nodes so far and the value each tensor holds."""

    nodes: list[Node]
    ref: dict[int, Ref]  # id(tensor) -> the graph value it holds


class functionalization:
    """C++ functionalization on for the block (with views reapplied as views, as aot_autograd does)."""

    def __enter__(self):
        torch._enable_functionalization(reapply_views=True)

    def __exit__(self, *exc):
        torch._disable_functionalization()


def to_functional(t: torch.Tensor) -> torch.Tensor:
    """t wrapped as a functional tensor, its requires_grad carried over (autograd runs on the wrapper)."""
    f = torch._to_functional_tensor(t)
    torch._mirror_autograd_meta_to(t, f)
    return f


def unwrap(t):
    """The meta tensor holding a functional tensor's current value (after its pending updates)."""
    if not isinstance(t, torch.Tensor) or not torch._is_functional_tensor(t):
        return t
    torch._sync(t)
    return torch._from_functional_tensor(t)


def mutations(rec: Recording, wrapped: dict, originals: dict) -> dict:
    """{name: Ref of the new value} of the wrapped leaves the forward mutated (in place, or through a view)."""
    out = {}
    for k, f in wrapped.items():
        torch._sync(f)
        new = torch._from_functional_tensor(f)
        if new is originals[k]:
            continue
        if torch._functionalize_has_metadata_mutation(f):
            raise CaptureError(
                f"the forward changes the shape or strides of '{k}' in place; a plan keeps each tensor's shape"
            )
        r = rec.ref.get(id(new))
        if r is None:
            raise CaptureError(f"the forward replaces '{k}' with a tensor from outside the graph")
        out[k] = r
    return out


def refuse_mutations(rec: Recording, wrapped: dict, originals: dict, what: str) -> None:
    """A parameter or user input mutated by the forward: refused (one step's in-place change of a weight or of
    the caller's batch would have to be carried between ranks and steps with single-device semantics)."""
    for k, r in mutations(rec, wrapped, originals).items():
        n = rec.nodes[r.node]
        op = getattr(n, "user_op", None) or n.name
        raise CaptureError(
            f"the forward mutates {what} {k!r} in place (in module '{n.module or '<root>'}', op "
            f"{op}); autopar plans a forward that leaves parameters and inputs unchanged: compute a "
            f"new tensor instead"
        )


def copy_as_clone(args, kwargs):
    """Functionalization writes `dst.copy_(src)` (autograd's CopySlices backward of an in-place op on a view, a
    user's copy_) as copy(dst, src), whose value is src laid out as dst: where the shapes and dtypes agree and dst is
    contiguous (or laid out as src), that is clone(src) in dst's layout, an op with a placement rule."""
    dst, src = args[0], args[1]
    if (
        isinstance(src, torch.Tensor)
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and not kwargs.get("non_blocking", len(args) > 2 and args[2])
        and src.device == dst.device
    ):
        if dst.is_contiguous():
            return aten.clone.default, (src,), {"memory_format": torch.contiguous_format}
        # dst a strided view (T5's `shifted[..., 1:] = ids[..., :-1]`, a slice_scatter's source): the value is
        # src's, only its layout differs, and the plan's values carry no layout (views are re-applied on them).
        # The layout still matters to capture: later views of the result (Longformer's chunked attention, in the
        # backward of its slice assignments) are legal on dst's layout only, so the clone is made in it
        target = torch.empty_like(dst).stride()  # copy's own output layout: dense, in dst's dim order
        if src.stride() == target:
            return aten.clone.default, (src,), {}
        order = sorted(range(dst.dim()), key=lambda d: -target[d])
        return _laid_out_as, (src, order), {}
    return aten.copy.default, args, kwargs


def _laid_out_as(src: torch.Tensor, order: list[int]) -> torch.Tensor:
    """src's values laid out densely with its dims `order` outermost first (a permute, a contiguous clone and the
    permute back: ops with placement rules)."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    dense = aten.clone.default(aten.permute.default(src, order), memory_format=torch.contiguous_format)
    return aten.permute.default(dense, inverse)
