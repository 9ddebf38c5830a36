"""What splitting the batch into micro-batches and dp ranks asks of a model: each part's loss, weighed by its count
of targets (forward_stage._LossCount) or equally, must combine into the whole batch's, as one device computes it.
A BatchNorm in training mode (each part normalized by its own statistics), a contrastive loss over in-batch pairs
(CLIP's, SigLIP's: a micro-batch of one row has no negatives), or a sum-reduced loss break that, and the step would
train on another loss than the model's; both are refused before the first step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6  # float32 sums of the same terms in another order


def is_split(plan) -> bool:
    """Whether a stage sees less than the whole batch at once: several micro-batches, or the batch split over dp."""
    sc = plan.schedule
    return sc["n_microbatches"] > 1 or (
        sc.get("batch_placement") is not None and any(p == "S0" for p in sc["batch_placement"])
    )


def check_batch_norm(model: nn.Module, plan) -> None:
    """Refuse a BatchNorm in training mode where a stage sees less than the whole batch at once (micro-batches, dp
    ranks): it would normalize by each part's statistics, where one device normalizes by the batch's."""
    bn = next((n for n, m in model.named_modules() if isinstance(m, _BATCH_NORMS) and m.training), None)
    if is_split(plan) and bn is not None:
        raise NotImplementedError(
            f"module '{bn}' is a BatchNorm in training mode: each of the plan's {plan.schedule['n_microbatches']} "
            f"micro-batches (on each dp rank) would be normalized by its own statistics, not the batch's as on one "
            f"device; plan with pipeline=dict(n_microbatches=[1]) and no dp dim, put the norms in eval(), or plan "
            f"without a pp dim (the graph backend normalizes over the whole batch)"
        )


def loss_rows_error(model: nn.Module, call: dict, m: int, loss_of) -> str | None:
    """Why the loss of the first two micro-batches' rows (the local batch's two halves where m == 1) is not the
    runtime's combination of each half's loss (`loss_of(call) -> (loss, count or None)`), or None where it is.
    Run in eval() (no dropout draws), the RNG state restored after, and seeded alike before the whole and before
    its halves in turn, so a forward that draws per-row noise (ViT-MAE's masking) draws the same in both."""
    rows = next((v.shape[0] for v in call.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
    n = min(rows, 2 * math.ceil(rows / m)) if m > 1 else rows
    if n < 2:
        return None
    cut = lambda sl: {k: v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v
                      for k, v in call.items()}  # fmt: skip
    half = math.ceil(n / 2)
    modes = {mod: mod.training for mod in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            whole, _ = loss_of(cut(slice(0, n)))
            torch.manual_seed(0)
            parts = [loss_of(cut(slice(0, half))), loss_of(cut(slice(half, n)))]
    finally:
        for mod, training in modes.items():
            mod.training = training
    counts = [c for _, c in parts]
    if all(c is not None for c in counts):
        combined, how = sum(float(l) * float(c) for (l, _), c in zip(parts, counts)) / float(sum(counts)), "weighed"
    else:
        combined, how = sum(float(l) for l, _ in parts) / 2, "plain"
    whole = float(whole)
    if abs(whole - combined) <= LOSS_RTOL * max(abs(whole), abs(combined)) + LOSS_ATOL:
        return None
    return (
        f"{type(model).__name__}'s loss on {n} rows ({whole:.6g}) is not the {how} mean of its two halves' "
        f"({', '.join(f'{float(l):.6g}' for l, _ in parts)} -> {combined:.6g}): the loss couples the batch's rows (a "
        f"contrastive loss over in-batch pairs, a batch statistic) or is no mean over them, so each of the plan's "
        f"{m} micro-batches (and each dp rank) would train on a loss of its own rows; plan with "
        f"pipeline=dict(n_microbatches=[1]) and no dp dim, or without a pp dim (the graph backend computes the whole "
        f"batch's loss)"
    )
