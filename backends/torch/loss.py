"""The loss in the engines: the mean cross-entropy over the whole batch, as one device computes it.

The plan computes a mean nll_loss as the loss sum over the total weight of the counted targets (autopar/capture.py),
both summed over the batch shards, so labels that `ignore_index` skips unevenly over the shards leave it exact.
An engine rank runs the user's module on its batch shard and gets the mean over its own counted targets; averaged
over the shards (DDP's and FSDP2's gradient averaging) that is the batch's mean only when every shard counts as
many. So where the plan's loss is such a mean and the labels are an input fed batch-sharded, the lowering adds a
forward hook on the root module that weighs each rank's mean by its share of the counted targets, in the value the
module returns and in the gradients: one all_reduce of (weighted loss, count) over the data-parallel dims a step.
"""

from __future__ import annotations

import math

from .collectives import _nb

# ops between the labels input and the loss that keep every label (in some order): the count is the same
_KEEP_LABELS = {
    "view",
    "_unsafe_view",
    "reshape",
    "clone",
    "detach",
    "alias",
    "contiguous",
    "_to_copy",
    "t",
    "transpose",
    "permute",
    "squeeze",
    "unsqueeze",
}
_NLL = ("nll_loss_forward", "nll_loss2d_forward")


def recognize_mean_loss(low, G, plan, data) -> None:
    """Set low.mean_loss = {labels, ignore_index, shards, nbytes} when the plan's loss is a mean nll_loss over
    batch-sharded labels; otherwise leave it None and say why in low.notes (where it matters: data dims)."""
    if not data:
        return
    if plan.meta.get("loss_fn"):
        low.notes.append(
            "the loss is computed outside the module (loss_fn): each rank applies it to its own batch "
            "shard and the gradients are averaged (labels that ignore_index skips unevenly over the "
            "shards would change a mean)"
        )
        return
    for n in G.nodes:
        if n.kind != "op" or n.op != "div" or n.phase != "fw" or len(n.inputs) != 2:
            continue
        (a, i), (b, j) = n.inputs
        nll = G.rec(a)
        if a != b or (i, j) != (0, 1) or nll.op not in _NLL:
            continue
        if not any(G.rec(u).op == "ones_like" and G.rec(u).phase == "bw" for u, _, _ in G.users[n.idx]):
            low.notes.append(
                f"the mean loss {n.name} is not the value the step returns; the engines average "
                f"each rank's loss over its own batch shard"
            )
            return
        if len(nll.inputs) != 2 or nll.consts is None:
            return  # class weights: _check_batch_shards refuses; a plan from an older autopar: no ignore_index
        k = nll.inputs[1][0]
        while G.rec(k).kind == "op" and G.rec(k).op in _KEEP_LABELS and len(G.rec(k).inputs) == 1:
            k = G.rec(k).inputs[0][0]
        inputs = [x.idx for x in G.nodes if x.kind == "input"]
        if G.rec(k).kind != "input" or any(low.input_placements[inputs.index(k)][d] != "S0" for d in data):
            low.notes.append(
                f"the labels of {nll.name} are not an input fed batch-sharded; the engines average "
                f"each rank's mean loss over its shard (labels that ignore_index skips unevenly over "
                f"the shards would change it)"
            )
            return
        low.mean_loss = {
            "labels": G.rec(k).target,
            "ignore_index": nll.const(4, -100),
            "shards": math.prod(plan.mesh_shape[d] for d in data),
            "nbytes": _nb([2], n.dtypes[0]),
        }
        return
