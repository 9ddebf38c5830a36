"""Batch norm as capture records it: the training call swapped for the op whose schema declares the running-
statistics update (so functionalization keeps it), and its forward and backward (and var_mean) decomposed into
reductions and pointwise ops that have placement rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


_BN_ARGS = {
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    torch.batch_norm: (
        "input",
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "training",
        "momentum",
        "eps",
        "cudnn_enabled",
    ),
}
_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def batch_norm_legit(func, args, kwargs):
    """Batch norm that updates running statistics, as `_native_batch_norm_legit`, whose schema declares the
    update (native_batch_norm's does not, so functionalization would drop it): functionalization turns it into
    `_native_batch_norm_legit_functional` with the new statistics as outputs. aot_autograd makes the same swap
    (torch._decomp `native_batch_norm_decomposition`, on the Python dispatcher's Autograd key)."""
    a = {**_BN_DEFAULTS, **dict(zip(_BN_ARGS[func], args)), **kwargs}
    rm, rv = a["running_mean"], a["running_var"]
    if not a["training"] or rm is None or rv is None:
        return func(*args, **kwargs)
    if a["input"].dim() < 2 or a["input"].numel() // a["input"].shape[1] <= 1:
        return func(*args, **kwargs)  # its own error ("Expected more than 1 value per channel")
    return aten._native_batch_norm_legit.default(
        a["input"], a["weight"], a["bias"], rm, rv, True, a["momentum"], a["eps"]
    )[0]


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """var_mean as the two means it is (torch._decomp's lands in prims): over a sharded batch both are partial
    means the plan all-reduces, which gives one device's statistics."""
    mean = aten.mean.dim(x, dim, keepdim=True)
    d = aten.sub.Tensor(x, mean)
    n = x.numel() // max(1, mean.numel())
    var = aten.sum.dim_IntList(aten.mul.Tensor(d, d), dim, keepdim)
    var = aten.div.Tensor(var, max(0, n - (1 if correction is None else correction)))
    return var, (mean if keepdim else aten.squeeze.dims(mean, dim))


def _bn_decompositions() -> dict:
    """Batch norm's forward (with its running-statistics update) and backward, from torch._decomp: reductions over
    the batch and pointwise ops, so a batch-sharded plan computes the global batch's statistics (SyncBatchNorm's
    semantics) with all_reduces the solver prices like any other."""
    from torch._decomp import decomposition_table as table

    ops = (
        aten._native_batch_norm_legit_functional.default,
        aten._native_batch_norm_legit_no_training.default,
        aten.native_batch_norm.default,
        aten.native_batch_norm_backward.default,
    )  # the last two: eval, no stats
    out = {op: table[op] for op in ops}
    out[aten.var_mean.correction] = _var_mean
    return out


BN_DECOMPOSE = _bn_decompositions()
