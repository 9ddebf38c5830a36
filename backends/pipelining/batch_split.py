"""What splitting the batch into micro-batches and dp ranks asks of a model: each part's loss, weighed by its count
of targets (LossCount) or equally, must combine into the whole batch's, as one device computes it.
A BatchNorm in training mode (each part normalized by its own statistics), a contrastive loss over in-batch pairs
(CLIP's, SigLIP's: a micro-batch of one row has no negatives), an MoE router's load-balancing loss, or a sum-reduced
loss break that, and the step would train on another loss than the model's; they are refused before the first
step.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from autopar.model_io import pick_loss

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


def loss_rows_error(model: nn.Module, call: dict, m: int) -> str | None:
    """Why the loss of the first two micro-batches' rows (the local batch's two halves where m == 1) is not the
    runtime's combination of each half's loss (`loss_and_count`: weighed by its count of targets), or
    None where it is. A model whose output holds an auxiliary loss (an MoE router's load balancing: products of
    the batch's per-expert means) is refused outright: its share of the loss is far below the tolerance, its
    share of the router's gradient is not.
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
            whole, _, aux = loss_and_count(model, cut(slice(0, n)))
            torch.manual_seed(0)
            parts = [loss_and_count(model, cut(slice(0, half))), loss_and_count(model, cut(slice(half, n)))]
    finally:
        for mod, training in modes.items():
            mod.training = training
    if aux:
        return (
            f"{type(model).__name__}'s output holds an aux_loss (its MoE routers' load balancing over the batch's "
            f"tokens, a product of batch means): each of the plan's {m} micro-batches (and each dp rank) would "
            f"balance its own tokens, not the batch's as on one device; plan with pipeline=dict(n_microbatches=[1]) "
            f"and no dp dim, without a pp dim, or turn the aux loss off (config.output_router_logits="
            f"False)"
        )
    counts = [c for _, c, _ in parts]
    if all(c is not None for c in counts):
        combined = sum(float(l) * float(c) for (l, _, _), c in zip(parts, counts)) / float(sum(counts))
        how = "weighed"
    else:
        combined, how = sum(float(l) for l, _, _ in parts) / 2, "plain"
    whole = float(whole)
    if abs(whole - combined) <= LOSS_RTOL * max(abs(whole), abs(combined)) + LOSS_ATOL:
        return None
    return (
        f"{type(model).__name__}'s loss on {n} rows ({whole:.6g}) is not the {how} mean of its two halves' "
        f"({', '.join(f'{float(l):.6g}' for l, _, _ in parts)} -> {combined:.6g}): the loss couples the batch's rows (a "
        f"contrastive loss over in-batch pairs, a batch statistic) or is no mean over them, so each of the plan's "
        f"{m} micro-batches (and each dp rank) would train on a loss of its own rows; plan with "
        f"pipeline=dict(n_microbatches=[1]) and no dp dim, or without a pp dim (the graph backend computes the whole "
        f"batch's loss)"
    )


class LossCount(TorchFunctionMode):
    """What a mean-reduced cross_entropy / nll_loss in the last stage's forward divides by (the targets it does not
    ignore, or their class weights): the micro-batch's loss times it is its sum, and the step divides the sums by
    the whole batch's count, as one device's mean does. None where the forward makes no such loss or several."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.cross_entropy, F.nll_loss):
            a = inspect.signature(func).bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            t, w = a["target"], a["weight"]
            plain = a["reduction"] == "mean" and a["size_average"] is None and a["reduce"] is None
            if plain and not t.is_floating_point():
                keep = t != a["ignore_index"]
                self.found.append((w[t.clamp_min(0)] * keep).sum() if w is not None else keep.sum())
            else:
                self.found.append(None)
        return func(*args, **kwargs)

    def count(self):
        return self.found[0].detach().double() if len(self.found) == 1 and self.found[0] is not None else None


def loss_and_count(model: nn.Module, call: dict) -> tuple:
    """The model's loss on `call`, what its mean divides by (`LossCount`; None where not known), and whether its
    output holds an auxiliary loss (transformers' MoE models: `aux_loss`, the routers' load balancing)."""
    counter = LossCount()
    with counter:
        out = model(**call)
    aux = getattr(out, "aux_loss", None) if not isinstance(out, dict) else out.get("aux_loss")
    return pick_loss(out, None, type(model).__name__)[0], counter.count(), aux is not None
