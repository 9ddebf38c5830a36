"""Lowering a plan to PyTorch's own engines: FSDP2 (`fully_shard`), tensor / sequence parallelism
(`parallelize_module` with ParallelStyles), HSDP, mixed precision and activation checkpointing.

Recognition reads the Plan alone (its parameter placements and node records with their input edges):
  * mesh dims: a dim on which every input is batch-sharded (Shard(0)) is data-parallel; one whose inputs are
    replicated and that shards parameters or activations is the tensor-parallel dim; a dim with nothing
    sharded is idle (its ranks compute the same thing). An input the plan keeps replicated only to chunk it by
    batch at every forward consumer, or to feed the loss it runs on the whole batch (gathered log-softmax,
    replicated labels), is fed batch-sharded: each rank's mean over an equal shard, gradients averaged, gives
    the same values (refused for a class-weighted loss and for a batch that does not split evenly).
  * replicated parameters on the data-parallel dims (plain data parallelism, or beside FSDP units / tensor
    parallelism): their gradients are averaged by a hook in the plan's own gradient buckets (plan.buckets: one
    all_reduce per bucket, on the planned mesh dim or flattened group, a chain's steps one after the other);
    gradients the plan reduces otherwise go in extra buckets over the data dims (TorchLowering.grad_buckets).
  * data-parallel dims: a parameter Shard(k) on them that every consumer all-gathers before use is FSDP-sharded;
    one fully_shard unit per repeated block (the plan's regions), the remaining parameters in the root unit,
    root last. reshard_after_forward is the plan's own memory/communication choice: True when the plan
    gathers the unit's parameters again in the backward, False when the forward's gathered copy is kept.
    Replicate on one data dim and Shard on another is HSDP; two sharding data dims are flattened into one.
  * the tensor-parallel dim, per nn.Linear (weight (out, in)): Shard(0) ColwiseParallel, Shard(1)
    RowwiseParallel; nn.Embedding: Shard(0) RowwiseParallel, Shard(1) ColwiseParallel. The layouts come from
    the activations at the module boundary: a sequence-sharded (Shard(1)) input the plan gathers before a
    colwise Linear is input_layouts=Shard(1) (PrepareModuleInput on the common parent when several Linears
    gather the same tensor, as torchtitan does for attention / feed_forward); a rowwise output the plan
    reduce-scatters is output_layouts=Shard(1); modules with replicated parameters whose activations stay
    sequence-sharded get SequenceParallel; a vocab-sharded loss input gets loss_parallel.
  * mixed precision and checkpointing are the planner's decisions (plan.meta): MixedPrecisionPolicy on every
    unit, torch.utils.checkpoint around the chosen blocks.
Whatever the engines cannot express is listed in `TorchLowering.reasons` (naming the module / parameter / op),
never silently changed. apply.py applies the lowering to the model with torch's own calls; `TorchLowering.code()`
(render.py) prints the same steps as the code a user would have written (a module FQN -> ParallelStyle dict and
the fully_shard calls).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from autopar.collectives import BUCKET_BYTES, dims_of

from autopar.targets import _fed

from ..float8_linear import unconvertible
from .batch import _check_batch_shards
from .fsdp import blocks, recognize_fsdp
from .lowering import EngineLoweringError, GradBucket, TorchLowering, _Graph
from .loss import recognize_mean_loss
from .mixed import reason_module, within
from .tp import recognize_tp


def _check_state_updates(low, plan, data, in_part):
    """A module that updates a buffer from the batch in its forward (BatchNorm in training mode): on batch shards
    FSDP/DDP run it on each rank's shard, so it normalizes with that shard's statistics and each rank's running
    statistics drift apart; the plan computes the global batch's (SyncBatchNorm's semantics). Not expressible."""
    if not data:
        return
    dn = "+".join(plan.mesh_names[d] for d in data)
    mods: dict = {}
    for fqn in plan.meta.get("state_updates", {}):
        mods.setdefault(fqn.rsplit(".", 1)[0] if "." in fqn else "", []).append(fqn)
    for mod, fqns in sorted(mods.items()):
        if not in_part(mod):
            low.reasons.append(
                (
                    f"module {mod or '<root>'}",
                    f"updates buffers {fqns} in its forward (BatchNorm's "
                    f"running statistics); on batch shards over {dn} FSDP/DDP would compute them per "
                    f"rank from its shard, the plan from the global batch",
                )
            )


def recognize(plan, model: nn.Module | None = None, *, units=None, styles=None, parts=()) -> TorchLowering:
    """What of `plan` fully_shard / parallelize_module can express, and how (see the module docstring).
    units: FSDP unit FQNs to use instead of the plan's blocks (validated); styles: {module FQN: ParallelStyle or
    its class name} the user insists on (must agree with the plan). parts: module FQNs the graph backend runs
    (backends/torch/mixed.py): their parameters are left to it (ignored by FSDP, no style, no hook) and what
    the engines cannot express inside them is not a reason."""
    G = _Graph(plan)
    low = TorchLowering(plan.hash(), tuple(plan.mesh_names), tuple(plan.mesh_shape))
    low.parts = {p: None for p in parts}
    in_part = lambda m: within(m, parts)
    low.part_params = [f for f in plan.params if in_part(f.rsplit(".", 1)[0] if "." in f else "")]
    own = {f: pl for f, pl in plan.params.items() if f not in low.part_params}
    low.block_fqns = blocks(plan)
    inputs, data, model_dims, loss_fed = _feed_inputs(low, G, plan)
    _model_dims(low, G, own, model_dims, in_part)
    for d in data:
        (low.shard_dims if any(p[d][0] == "S" for p in own.values()) else low.replicate_dims).append(d)
    recognize_mean_loss(low, G, plan, data)
    _check_batch_shards(low, G, plan, inputs, data, [x for x in loss_fed if x[1] in data])
    _check_state_updates(low, plan, data, in_part)
    recognize_fsdp(low, G, plan, units)
    if low.tp_dim is not None:
        recognize_tp(low, G, plan, model, styles)
    elif styles:
        raise EngineLoweringError(
            f"styles {sorted(styles)} were forced but the plan has no tensor-parallel dim "
            f"(mesh {dict(zip(low.mesh_names, low.mesh_shape))}, inputs {low.input_placements})"
        )
    _check_shared(low, plan, model)
    _float8(low, plan, model, in_part)
    _mixed_precision(low, plan)
    low.checkpoint = list(plan.meta.get("checkpointing", {}).get("blocks", []))
    if parts:
        _leave_parts(low, parts, in_part)
    _grad_buckets(low, G, plan)
    return low


def _feed_inputs(low, G, plan):
    """low.input_placements (how each rank is fed each input) and the mesh dims they make data-parallel (every
    input batch-sharded) or model dims (every input replicated); a reason for any other dim."""
    names = low.mesh_names
    inputs = [n for n in G.nodes if n.kind == "input"]
    strict, loss_fed = [_fed(G, n) for n in inputs], []
    loose = [_fed(G, n, loss_fed) for n in inputs]
    # a mesh dim is batch-fed when every input is (a loss input counts only where the batch really is sharded)
    batch = [all(f[d] == "S0" for f in loose) and any(f[d] == "S0" for f in strict) for d in range(len(names))]
    low.input_placements = [["S0" if batch[d] else n.out[0][d] for d in range(len(names))] for n in inputs]
    data, model_dims = [], []
    for d, name in enumerate(names):
        pls = {pl[d] for pl in low.input_placements}
        if pls == {"S0"}:
            data.append(d)
        elif pls <= {"R"}:
            model_dims.append(d)
        else:
            low.reasons.append(
                (
                    f"mesh dim {name}",
                    f"inputs are placed {sorted(pls)} on it; the engines lower only "
                    f"batch sharding (Shard(0) of every input) or replication (no context parallelism)",
                )
            )
    return inputs, data, model_dims, loss_fed


def _model_dims(low, G, own, model_dims, in_part) -> None:
    """Each model dim is idle (nothing sharded on it) or the one tensor-parallel dim; a reason for a second."""
    names = low.mesh_names
    for d in model_dims:
        busy = any(p[d] != "R" for p in own.values()) or any(
            o is not None and o[d] != "R" for n in G.nodes if n.kind == "op" and not in_part(n.module) for o in n.out
        )
        if not busy:
            low.idle_dims.append(d)
        elif low.tp_dim is None:
            low.tp_dim = d
        else:
            low.reasons.append(
                (
                    f"mesh dim {names[d]}",
                    f"a second tensor-parallel dim (after {names[low.tp_dim]}): parallelize_module takes one 1-D mesh",
                )
            )


def _float8(low, plan, model, in_part) -> None:
    """The float8 linears the engines convert (backends/float8_linear.py; those of graph-backend parts are the
    graph backend's), or the reason they cannot (a converted module that is no nn.Linear)."""
    f8 = plan.meta.get("float8") or {}
    why = unconvertible(model, plan) if model is not None else None
    if why:
        low.reasons.append(("float8", why))
    elif f8.get("gemms"):
        low.float8 = [f for f in f8["linears"] if not in_part(f)]


def _mixed_precision(low, plan) -> None:
    mp = plan.meta.get("mixed_precision")
    if not mp:
        return
    low.mixed_precision = {"param_dtype": mp["param_dtype"], "reduce_dtype": mp["reduce_dtype"]}
    if not low.units:
        low.reasons.append(
            (
                "mixed precision",
                "the plan runs bf16 parameters, which the engines express with "
                "FSDP2's MixedPrecisionPolicy, but no data-parallel dim shards parameters",
            )
        )
    elif low.replicated_grads:
        low.reasons.append(
            (
                "mixed precision",
                f"parameters {low.replicated_grads[:4]} stay out of FSDP (the "
                f"plan replicates them), so MixedPrecisionPolicy would not cast them to bf16",
            )
        )


def _leave_parts(low, parts, in_part) -> None:
    """What the graph parts run is not the engines' to express: their reasons and styles go; a checkpointed
    block holding a part is a reason (the part's forward and collectives would run again)."""
    low.reasons = [r for r in low.reasons if not in_part(reason_module(*r) or "")]
    for m in [m for m in low.styles if in_part(m)]:
        del low.styles[m]
    for c in low.checkpoint:
        if any(p.startswith(c + ".") or p == c for p in parts):
            low.reasons.append(
                (
                    f"module {c}",
                    "the plan checkpoints this block, which holds a part the graph "
                    "backend runs: its forward (and collectives) would run again in the backward",
                )
            )


def _local_nbytes(low, plan, pnode, fqn) -> int:
    """Bytes of the parameter's gradient on one rank: its shape, split on the tensor-parallel dim."""
    shape = list(pnode.shapes[0])
    t = low.tp_dim
    if t is not None and plan.params[fqn][t][0] == "S":
        shape[int(plan.params[fqn][t][1:])] //= plan.mesh_shape[t]
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, pnode.dtypes[0])).element_size()


def _grad_buckets(low, G, plan) -> None:
    """How the gradients of replicated parameters (low.replicated_grads) are reduced: in the plan's own all_reduce
    buckets when a bucket holds only such gradients and reduces them over exactly the data-parallel dims (the
    engines' partial sums are the plan's); every other such gradient (the plan computes it from gathered
    backward inputs, or reduces it over other dims) in extra buckets over all data dims, in backward order, up
    to the plan's bucket size. The average divides by the number of batch shards (each rank's loss is the mean
    over its own)."""
    data = low.replicate_dims + low.shard_dims
    rep = set(low.replicated_grads)
    if not rep or not data:
        return
    low.batch_shards = math.prod(plan.mesh_shape[d] for d in data)
    pnode = {n.target: n for n in G.nodes if n.kind == "param"}
    size = {f: _local_nbytes(low, plan, pnode[f], f) for f in rep}
    dn = lambda ds: "+".join(low.mesh_names[d] for d in ds)
    chains: dict = {}
    for k, b in enumerate(plan.bucket_records()):
        chains.setdefault(b.chain, []).append((k, b))
    covered, out = set(), []
    for first, bs in sorted(chains.items()):
        params = bs[0][1].params
        if not rep & set(params):
            continue
        steps = [dims_of(b.mesh_dim) for _, b in sorted(bs, key=lambda kb: kb[1].step)]
        dims = [d for s in steps for d in s]
        ok = (
            set(params) <= rep
            and all(b.kind == "all_reduce" for _, b in bs)
            and sorted(dims) == sorted(data)
            and len(set(dims)) == len(dims)
        )
        if not ok:
            low.notes.append(
                f"the plan's gradient bucket {first} ({[b.kind for _, b in bs]} over "
                f"{[dn(s) for s in steps]}) is not the engines' averaging over {dn(data)}; its replicated"
                f" gradients are reduced in extra buckets instead"
            )
            continue
        nb = sum(size[f] for f in params)
        out.append(GradBucket(steps, list(params), nb, bs[0][1].dtype.replace("torch.", ""), first))
        covered |= set(params)
    extra = [f for f in reversed(list(plan.params)) if f in rep and f not in covered]
    if extra:
        low.notes.append(
            f"the plan reduces the gradients of {extra[:4]}{' ...' if len(extra) > 4 else ''} otherwise "
            f"(e.g. from backward inputs it gathers); the engines' partial gradients are all-reduced over "
            f"{dn(data)} in {'an extra bucket' if len(extra) == 1 else 'extra buckets'}"
        )
    open_: dict = {}
    for f in extra:
        dt = pnode[f].dtypes[0]
        b = open_.get(dt)
        if b is None or b.nbytes + size[f] > BUCKET_BYTES:
            b = open_[dt] = GradBucket([tuple(data)], [], 0, dt)
            out.append(b)
        b.params.append(f)
        b.nbytes += size[f]
    low.grad_buckets = out


def _check_shared(low, plan, model):
    """A tensor registered under two FQNs (tied / shared weights) must stay within one FSDP unit and out of
    ParallelStyles: FSDP2 and parallelize_module replace a module's parameter with their own DTensor."""
    if model is None:
        return
    units = [u.fqn for u in low.units if u.fqn]
    unit_of = lambda f: next((u for u in units if f.startswith(u + ".")), "")
    styled = lambda f: any(f.rsplit(".", 1)[0] == m or f.startswith(m + ".") for m in low.styles)
    seen = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        base = seen.setdefault(id(p), fqn)
        if base == fqn:
            continue
        if unit_of(fqn) != unit_of(base):
            low.reasons.append(
                (
                    f"parameter {fqn}",
                    f"is the same tensor as {base}, which is in FSDP unit "
                    f"'{unit_of(base) or '<root>'}' while it is in '{unit_of(fqn) or '<root>'}'; a "
                    f"shared parameter must live in one unit",
                )
            )
        elif styled(fqn) or styled(base):
            low.reasons.append(
                (
                    f"parameter {fqn}",
                    f"is the same tensor as {base}; a ParallelStyle would replace it in one module only",
                )
            )
