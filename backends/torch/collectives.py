"""What the engines (FSDP2, tensor parallelism) issue for one step of a lowered plan, derived from the plan, and
that step's predicted time (backends/counter.py counts what a real step issues, in the same convention).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from autopar.cost import get_cluster
from autopar.cost.comm import collective_time
from autopar.collectives import dims_of, link_of
from autopar.strategies.vocab_parallel import compute_itemsize

from .mixed import within

# ---- what the engines will issue for a lowered plan ------------------------------------------------------------


def _nb(shape, dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def engine_collectives(plan, low) -> tuple[list, list]:
    """The collectives fully_shard / parallelize_module issue for one step of `low` (a TorchLowering of `plan`),
    derived from the plan: (list of (kind, mesh dim or tuple of dims, bytes), notes on how it differs from the
    plan's own per-edge prediction). Rules, each checked against measured runs:
      * FSDP2 unit u: one all_gather of its parameters in the forward (and again in the backward when
        reshard_after_forward), one reduce_scatter of its gradients (reduce dtype), HSDP: one all_reduce of the
        reduce-scattered gradients on the replicate dim; sizes are the (tensor-parallel local) unsharded sizes.
      * replicated parameters outside FSDP: one all_reduce per step of each gradient bucket (TorchLowering.
        grad_buckets: the plan's own buckets where they reduce over exactly the data-parallel dims, a tuple of
        dims being one collective over their flattened group), sized by the local gradients.
      * tensor-parallel dim, forward: the plan's redistributes, once per produced tensor (a style redistributes
        a module's input or output once, however many ops consume it); backward: autograd's mirror of each:
        an input gather of a colwise Linear -> reduce_scatter, a reduce_scatter -> all_gather, a gather to a
        replicated output or an all_reduce -> nothing; a colwise Linear fed a replicated tensor all-reduces its
        input gradient (each colwise module on its own: three for wq/wk/wv).
      * parameters of SequenceParallel modules (replicated, used on sequence shards): their gradient is partial
        on the tp dim and is all-reduced once (DTensor), at the size autograd produced it (before FSDP sharding).
    """
    notes = []
    nodes = plan.node_records()
    pnode = {n.target: n for n in nodes if n.kind == "param"}
    t = low.tp_dim
    tp_n = plan.mesh_shape[t] if t is not None else 1

    def local_param(f, dtype):
        shape = list(pnode[f].shapes[0])
        if t is not None and plan.params[f][t][0] == "S":
            shape[int(plan.params[f][t][1:])] //= tp_n
        return _nb(shape, dtype)

    out = _data_parallel_collectives(plan, low, pnode, local_param, notes)
    out += _redistribute_collectives(plan, nodes, low, notes)
    parts = getattr(low, "parts", {})
    for part in {id(p): p for p in parts.values()}.values():  # each part's own plan, per instance
        out += part.plan.collectives() * len(part.instances)
    out += _tp_backward_collectives(plan, nodes, low, pnode, local_param)
    out += _loss_parallel_collectives(nodes, low)
    return out, notes


def _loss_parallel_collectives(nodes, low) -> list:
    """torch's loss_parallel on the tensor-parallel dim: per vocab-sharded log_softmax the all_reduces of the row
    max and the row sum of exp, then nll_loss's of each row's target log-prob (at the log-probs' dtype); its
    backward runs nll_loss's and log_softmax's fused, with none (the plan's own backward row sum is not issued,
    nor its all_reduce of the partial loss: the handler returns it replicated)."""
    if not low.loss_parallel:
        return []
    out, t = [], low.tp_dim
    for n in nodes:
        if n.kind != "op" or n.phase != "fw" or not n.target.startswith("_log_softmax"):
            continue
        rows = [c for c in n.internal if c[1] == t]
        out += [(k, t, b) for k, _, b, _ in rows]
        if rows:
            dtype = getattr(torch, n.dtypes[0])  # the row count at the compute dtype's size, at the log-probs' size
            out.append(("all_reduce", t, rows[0][2] // compute_itemsize(dtype) * dtype.itemsize))
    return out


def _data_parallel_collectives(plan, low, pnode, local_param, notes) -> list:
    """FSDP2 units' gathers and reduce-scatters, the gradient buckets' all_reduces, the loss hook's."""
    out = []
    grad_dtype = lambda f: (low.mixed_precision or {}).get("reduce_dtype") or pnode[f].dtypes[0]
    shard_key = low.shard_dims[0] if len(low.shard_dims) == 1 else tuple(low.shard_dims)
    n_shard = 1
    for d in low.shard_dims:
        n_shard *= plan.mesh_shape[d]
    for u in low.units:
        if not u.params:
            continue
        ag = sum(local_param(f, pnode[f].dtypes[0]) for f in u.params)
        rs = sum(local_param(f, grad_dtype(f)) for f in u.params)
        out += [("all_gather", shard_key, ag)] * (2 if u.reshard_after_forward else 1)
        out.append(("reduce_scatter", shard_key, rs))
        for d in low.replicate_dims:
            out.append(("all_reduce", d, rs // n_shard))
    for b in getattr(low, "grad_buckets", []):  # replicated parameters: one all_reduce per bucket step
        for dims in b.steps:
            out.append(("all_reduce", dims[0] if len(dims) == 1 else tuple(dims), b.nbytes))
        if b.planned is None:
            notes.append(
                f"gradients {b.params[:3]}{' ...' if len(b.params) > 3 else ''}: the plan reduces them "
                f"otherwise; the engines all-reduce them in an extra bucket ({b.nbytes:,d} B)"
            )
    if getattr(low, "mean_loss", None):  # the loss hook: (weighted loss, count) over the data dims
        dims = tuple(low.replicate_dims + low.shard_dims)
        out.append(("all_reduce", dims[0] if len(dims) == 1 else dims, low.mean_loss["nbytes"]))
    return out


def _data_dim_note(nodes, low, n, r, coalesced) -> str | None:
    """How the engines replace a redistribute `r` into node `n` the plan runs over the data dims (None: nothing to
    say); coalesced: the inputs of n whose all_reduce another of its redistributes carries."""
    cs, move = r.collectives, f"{list(r.src)} -> {list(r.dst)}"
    if not isinstance(r.input, int):  # e.g. "loss": the plan reduces the loss value itself
        if not cs:
            return None
        return f"{n.name} {r.input}: the plan reduces it ({move}); the engines " + (
            "reduce (weighted loss, count) in the loss hook" if low.mean_loss else "leave each rank its local loss"
        )
    src = n.inputs[r.input]
    shape = nodes[src[0]].shapes[src[1]]
    if r.value_class == "act" and r.input in coalesced and low.mean_loss and len(cs) == 1:
        return (
            f"{n.name}: the plan's all_reduce of (loss sum, count) over the data dims is the "
            f"loss hook's all_reduce of (weighted loss, count)"
        )
    if r.value_class == "act":
        return (
            f"{n.name}: the plan redistributes {'a scalar' if not shape else 'a loss input'} "
            f"({move}) over the data dims; "
            + (
                "the engines reduce (weighted loss, count) in the loss hook instead"
                if low.mean_loss
                else "each engine rank averages its own equal batch shard instead"
            )
        )
    return None


def _redistribute_collectives(plan, nodes, low, notes) -> list:
    """The plan's forward redistributes on the tensor-parallel dim, once per produced tensor, and their
    backward mirrors; notes for the redistributes over the data dims the engines do otherwise."""
    out, seen, t = [], set(), low.tp_dim
    data = set(low.replicate_dims + low.shard_dims)
    parts = getattr(low, "parts", {})
    records = plan.redistribute_records()
    coalesced = defaultdict(set)  # node -> its inputs whose all_reduce another of its redistributes carries
    for r in records:
        if r.coalesced is not None:
            coalesced[r.consumer].add(r.coalesced)
    for r in records:
        n = nodes[r.consumer]
        if parts and within(n.module, parts) or r.input == "opt":
            continue  # run by the graph backend (mixed.py); the optimizer's input
        cs = r.collectives
        if not isinstance(r.input, int) or any(set(dims_of(c.mesh_dim)) & data for c in cs):
            note = _data_dim_note(nodes, low, n, r, coalesced[n.idx])  # (over a flattened group of dims too)
            if note:
                notes.append(note)
            continue
        if t is None or n.phase != "fw" or not any(c.mesh_dim == t for c in cs):
            continue
        role = low.tp_roles.get((n.idx, r.input))
        if role == "loss_parallel":  # torch's nll_loss handler reduces the loss itself (_loss_parallel_collectives)
            continue
        key = (n.inputs[r.input], r.src, r.dst)
        if key in seen:
            notes.append(
                f"{n.name}: the plan redistributes {nodes[key[0][0]].name} again for this consumer; the style does it once"
            )
            continue
        seen.add(key)
        for c in cs:
            if c.mesh_dim != t:
                continue
            out.append((c.kind, t, c.nbytes))
            if c.kind == "all_gather" and role == "in_gather":
                out.append(("reduce_scatter", t, c.nbytes))
            elif c.kind == "reduce_scatter":
                out.append(("all_gather", t, c.nbytes))
    return out


def _tp_backward_collectives(plan, nodes, low, pnode, local_param) -> list:
    """SequenceParallel parameters' partial gradients all-reduced; the backward of a rowwise Linear fed a
    replicated input (gather) and of a colwise Linear fed one (all_reduce of the input gradient)."""
    out, t = [], low.tp_dim
    parts = getattr(low, "parts", {})
    sp = [m for m, st in low.styles.items() if st.cls == "SequenceParallel"]
    for f in pnode:  # SequenceParallel params: partial gradients, all-reduced
        if t is not None and any(f.startswith(m + ".") for m in sp):
            out.append(("all_reduce", t, local_param(f, pnode[f].dtypes[0])))
    for (i, j), role in low.tp_roles.items():
        if parts and within(nodes[i].module, parts):
            continue
        p, o = nodes[i].inputs[j]
        pl = nodes[p].out[o]
        local = _nb(nodes[p].shapes[o], nodes[p].dtypes[o])
        for d, x in enumerate(pl):
            if x[0] == "S" and d != t:
                local //= plan.mesh_shape[d]
        if role == "chunk":  # RowwiseParallel(input_layouts=Replicate()): backward gathers
            out.append(("all_gather", t, local))
        elif role == "in_repl":  # ColwiseParallel on a replicated input: its gradient is partial
            out.append(("all_reduce", t, local))  # and all-reduced in the backward (Megatron's f operator)
    return out


def engine_step_time(plan, low, cluster) -> float:
    """Predicted step of `low` as the engines run it: the plan's compute plus each collective engine_collectives
    lists, priced by the cost model (autopar/cost/comm.py) on its group's link, every one exposed (as the plan's own
    prediction on a cluster whose collectives block). Comparable with plan.predicted["step_s"]."""

    cl, shape = get_cluster(cluster), tuple(plan.mesh_shape)
    comm = sum(
        collective_time(kind, nbytes, math.prod(shape[d] for d in dims_of(dim)), link_of(cl, shape, dim))
        for kind, dim, nbytes in engine_collectives(plan, low)[0]
    )
    return plan.predicted["compute_s"] + comm
