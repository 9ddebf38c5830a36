"""`aten._grouped_mm` (transformers' grouped_mm MoE experts, torch.nn.functional.grouped_mm): its shape on meta and
its placement rule.

Meta: torch's meta kernel copies the CUDA kernel's checks and refuses anything but bfloat16, while the CPU kernel
(and so the model on one CPU device) runs float32: capture asks `meta_kernel(op)` first and gets torch's own output
shape function (`_create_grouped_mm_output_tensor`) with the other checks kept. The backward needs nothing of its
own: autograd's GroupedMmBackward0 is again two `_grouped_mm` calls on transposed views, dgrad (2d x 3d, as the
forward) and wgrad (2d x 2d -> (G, K, N)), which the same shape function and rule cover.

Rule: `offs` (G,) holds global row offsets (cumulative token counts per expert), so it is always replicated and
the grouped dim M (the rows of mat_a in 2d x 3d, the contraction of 2d x 2d) is never split: a rank holding a
slice of the rows would read the offsets of the whole batch. What is exact, per mesh dim:
  2d x 3d  a (M, K), b (G, K, N) -> (M, N):  b sharded on N (column-parallel experts, out sharded on N); a and b
           sharded on K (each rank a partial sum); a or b partial (the op is linear in each).
  2d x 2d  a (K, M), b (M, N) -> (G, K, N):  a on K (out on K), b on N (out on N), a or b partial.
  3d x 2d  a (G, M, K), b (K, N) -> (M, N), N grouped: a on M (out on M), a and b on K (partial).
  3d x 3d  (no offs, a batched mm): batch G, rows, columns, contraction.
"""

from __future__ import annotations

import torch

from .conv_layout import meta_convolution
from .registry import rule

aten = torch.ops.aten


def meta_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output of `_grouped_mm` on meta tensors for every floating dtype the CPU kernel takes."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    torch._check(
        mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point,
        lambda: f"_grouped_mm: mat_a and mat_b must have the same floating dtype, got {mat_a.dtype} and {mat_b.dtype}",
    )
    torch._check(
        mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
        lambda: f"_grouped_mm: multiplicands must be 2D or 3D, got {mat_a.dim()}D and {mat_b.dim()}D",
    )
    if mat_a.dim() == 3 or mat_b.dim() == 3:
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "_grouped_mm: contraction dims differ")
    if mat_a.dim() == 2 or mat_b.dim() == 2:
        torch._check(
            offs is not None and offs.dim() == 1 and offs.dtype == torch.int32,
            lambda: "_grouped_mm: a 2D multiplicand needs 1D int32 offsets",
        )
    else:
        torch._check(offs is None, lambda: "_grouped_mm: offsets given for 3D x 3D")
    torch._check(bias is None, lambda: "_grouped_mm: bias is not supported")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


META = {aten._grouped_mm.default: meta_grouped_mm}
META[aten.convolution.default] = meta_convolution  # the device kernels' output layout (conv_layout.py)


def meta_kernel(op):
    """The function capture runs in place of `op` on meta tensors, where torch's own meta kernel refuses inputs
    the device kernels accept (_grouped_mm) or lays its output out otherwise (convolution); None: the op itself."""
    return META.get(op)


@rule(aten._grouped_mm.default)
def _grouped_mm(args, kwargs, metas):
    # (out, mat_a, mat_b[, offs]) per mesh dim; offs (when given) always "R"
    a, b = len(metas[0].shape), len(metas[1].shape)
    offs = ("R",) if len(metas) > 2 else ()
    if len(metas) > 3:  # a bias: no rule of its own (the kernels refuse it today)
        return []
    rules = [("P", "P", "R"), ("P", "R", "P")]  # linear in each multiplicand
    if (a, b) == (2, 3):
        rules += [("S1", "R", "S2"), ("P", "S1", "S1")]
    elif (a, b) == (2, 2):
        rules += [("S1", "S0", "R"), ("S2", "R", "S1")]
    elif (a, b) == (3, 2):
        rules += [("S0", "S1", "R"), ("P", "S2", "S0")]
    else:
        rules += [("S0", "S0", "S0"), ("S1", "S1", "R"), ("S2", "R", "S2"), ("P", "S2", "S1")]
    return [r + offs for r in rules]
