"""Data parallelism in the engines: how each rank is fed its batch shard, and what of the plan that feeding
cannot reproduce. An input the plan keeps replicated only to chunk it by batch at every forward consumer, or to
feed the loss it runs on the whole batch (gathered log-softmax, replicated labels), is fed batch-sharded; each
rank's mean over an equal shard (weighted by its counted targets, loss.py), gradients averaged, gives the
same values. Refused (TorchLowering.reasons): a class-weighted loss on the whole batch, a batch that does not
split evenly, and any other op the plan runs across batch shards (it couples samples, e.g. batch norm)."""

from __future__ import annotations

import math

from autopar.collectives import dims_of

from autopar.targets import _LOSS_OPS

from .mixed import within


def _check_batch_shards(low, G, plan, inputs, data, loss_fed):
    """Data parallelism in the engines: each rank gets an equal chunk of every input's batch (dim 0), computes its
    own mean loss, and the gradients are averaged. That equals the plan's whole-batch computation only for equal
    chunks; where the plan runs the loss on the whole batch (its inputs gathered), also only for an unweighted
    mean (class weights make each rank's mean a different weighted average)."""
    if not data:
        return
    n = math.prod(plan.mesh_shape[d] for d in data)
    dn = "+".join(plan.mesh_names[d] for d in data)
    for inp in inputs:
        shape = inp.shapes[0]
        if not shape or shape[0] % n:
            low.reasons.append(
                (
                    f"input {inp.name}",
                    f"batch dim {shape[0] if shape else '(scalar)'} does not split "
                    f"into {n} equal shards over the data-parallel dims {dn}: each engine rank's mean loss "
                    f"would weigh a different number of samples than the plan's batch mean",
                )
            )
    for u in sorted({u for _, _, u in loss_fed}):
        rec = G.rec(u)
        if _class_weighted(low, rec):
            continue
        ins = sorted({name for name, _, x in loss_fed if x == u})
        msg = (
            f"the plan runs the loss {rec.name} on the whole batch (inputs {ins} replicated over {dn}); the "
            f"engines feed those batch-sharded too: each rank's mean over its equal shard"
            + (
                ", weighted by its share of the counted targets (the loss hook), gradients averaged: the same values"
                if low.mean_loss
                else ", gradients averaged: the same values for a plain mean over evenly counted "
                "targets (labels that ignore_index skips unevenly over the shards would differ)"
            )
        )
        if msg not in low.notes:
            low.notes.append(msg)


def _class_weighted(low, rec) -> bool:
    """A class-weighted loss the plan computes on the whole batch (its inputs replicated or gathered) is a reason:
    per-rank weighted means over batch shards, averaged, are not the batch's weighted mean."""
    if rec.op not in ("nll_loss_forward", "nll_loss2d_forward") or len(rec.inputs) <= 2:
        return False
    why = (
        f"op {rec.name}",
        "the plan computes this class-weighted loss on the whole batch; per-rank weighted "
        "means over batch shards, averaged, are not the batch's weighted mean",
    )
    if why not in low.reasons:
        low.reasons.append(why)
    return True


_VIEWS = {"view", "_unsafe_view", "reshape", "clone", "contiguous", "alias", "squeeze", "unsqueeze", "flatten"}


def _from_part(G, k, in_part) -> bool:
    """Whether node k is made in a graph part, or is a view of such a value (the part delivers it batch-sharded;
    a view of the batch-major local piece is the engines' local piece of the view)."""
    n = G.rec(k)
    while not in_part(n.module) and n.kind == "op" and n.op in _VIEWS and len(n.inputs) == 1:
        n = G.rec(n.inputs[0][0])
    return in_part(n.module)


def _check_batch_ops(low, G, plan, data, dn):
    """Data parallelism in the engines means every rank computes on its own batch shard. The plan may instead
    gather an activation over a data dim: harmless for the loss (each rank's mean over an equal shard, gradients
    averaged: the same values), but any other such op couples samples across the batch (e.g. batch norm)."""

    parts = getattr(low, "parts", None) or {}
    in_part = lambda m: within(m, parts)
    for r in plan.redistribute_records():
        n = G.rec(r.consumer)
        if (
            r.value_class != "act"
            or not isinstance(r.input, int)
            or not any(set(dims_of(c.mesh_dim)) & set(data) for c in r.collectives)
        ):  # a flattened group's dims too
            continue
        if parts and (
            in_part(n.module) or _from_part(G, n.inputs[r.input][0], in_part) and all(r.dst[d] == "S0" for d in data)
        ):
            continue  # a graph part runs it, or delivers this input batch-sharded (mixed.py)
        _batch_op_finding(low, G, n, r, data, dn)


def _batch_op_finding(low, G, n, r, data, dn) -> None:
    """The note or reason for one redistribute `r` of an activation into node `n` over the data dims
    (_check_batch_ops)."""
    if n.phase == "bw":  # backward choices of the planner: gradients are sums over the batch
        msg = (
            f"the plan gathers some backward inputs over {dn(data)} (e.g. {n.name}); autograd on each "
            f"rank's batch shard computes the same sums as partial gradients, which FSDP/DDP reduce"
        )
        if not any(x.startswith("the plan gathers some backward") for x in low.notes):
            low.notes.append(msg)
    elif n.op in _LOSS_OPS and all(r.src[d] in ("S0", r.dst[d]) for d in data):
        if _class_weighted(low, n):
            return
        msg = (
            f"the plan gathers the loss input {r.input} of {n.name} over {dn(data)}; the engines "
            f"average each rank's loss over its equal batch shard instead (same values)"
        )
        if msg not in low.notes:
            low.notes.append(msg)
    elif G.rec(n.inputs[r.input][0]).shapes[n.inputs[r.input][1]]:
        moved = [d for d in data if r.src[d] != r.dst[d]] or data
        low.reasons.append(
            (
                f"op {n.name}",
                f"in module '{n.module or '<root>'}' redistributes input "
                f"{r.input} [{','.join(r.src)}] -> [{','.join(r.dst)}] over the data-"
                f"parallel dims {dn(moved)}: {_coupling({r.src[d] for d in moved})}",
            )
        )


def _coupling(src) -> str:
    """What a redistribute from `src` (the placements on the moved data dims) does that FSDP/DDP do not."""
    if src == {"S0"}:
        return (
            "it gathers the batch shards: the op computes on the whole batch, while FSDP/DDP ranks "
            "compute on their own shard only"
        )
    if any(p[0] == "P" for p in src):
        return (
            "it sums over the batch ranks a value each computes on its shard (an MoE router's "
            "expert load for an exact aux loss, or tensor parallelism on a data-parallel dim), while "
            "FSDP/DDP ranks compute on their own shard only"
        )
    return (
        "a tensor sharded on a non-batch dim over the batch ranks (tensor parallelism on a data-"
        "parallel dim), which FSDP/DDP do not express"
    )
