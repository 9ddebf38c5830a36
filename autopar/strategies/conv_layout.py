"""The memory layout of a convolution's output on meta tensors, as the device kernels lay it out.

torch's meta kernel of `aten.convolution` always returns a contiguous tensor ("meta tensors have no device info"),
while the CPU (mkldnn, slow2d) and CUDA (cudnn) kernels return channels-last when the input or the weight is
channels-last (an NCHW view of an NHWC tensor: DPT's reassembled ViT tokens, ConvNeXt's permuted blocks). The layout
is a value's identity for one thing the plan reproduces: a random fill of `empty_like(x)` (dropout after the conv)
draws in x's memory order (backends/spmd/local_ops._draw_full), so a contiguous meta layout gave other masks than
one device (DPT's head: 25 gradients off). Views after the conv are also checked against the real layout.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _channels_last_format(t: torch.Tensor):
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return None


def meta_convolution(input, weight, *args, **kwargs):
    """aten.convolution on meta tensors, its output channels-last where the device kernels' would be (input or
    weight channels-last, 2-D and 3-D convolutions: torch's _conv_determine_backend_memory_format)."""
    out = aten.convolution.default(input, weight, *args, **kwargs)
    fmt = _channels_last_format(input) or _channels_last_format(weight)
    if fmt is None or out.dim() != input.dim():
        return out
    return torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=fmt)
