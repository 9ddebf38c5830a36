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
never silently changed. `TorchLowering.code()` is the plan as the code a user would have written (a module FQN
-> ParallelStyle dict and the fully_shard calls); `lower_to_torch` executes exactly that code on the model.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch.nn as nn

from .engines_batch import _check_batch_ops, _check_batch_shards, _fed
from .engines_loss import recognize_mean_loss


class EngineLoweringError(ValueError):
    """The plan (or a user override) cannot be expressed with fully_shard / parallelize_module; the message says
    which part and why."""


@dataclass
class Style:
    cls: str  # ColwiseParallel | RowwiseParallel | SequenceParallel | PrepareModuleInput
    kwargs: dict = field(default_factory=dict)  # keyword -> Python source
    why: str = ""

    def code(self) -> str:
        return f"{self.cls}({', '.join(f'{k}={v}' for k, v in self.kwargs.items())})"


@dataclass
class Unit:
    fqn: str  # "" is the root module
    params: list
    reshard_after_forward: bool
    shard_dims: dict = field(default_factory=dict)  # param -> tensor dim FSDP shards, when not 0
    replicated: list = field(default_factory=list)  # replicated on the data dims: ignored by FSDP, grads all-reduced
    why: str = ""


@dataclass
class GradBucket:
    """One bucket of replicated parameters' gradients, reduced by one all_reduce per step: steps are mesh-dim
    tuples (one dim: that dim's group; several: one collective over their flattened group), run one after the
    other (the plan's chain of buckets over the same gradients). planned: the plan's own bucket (its index in
    plan.buckets, first step); None: gradients the plan reduces otherwise, which the engines must reduce here."""

    steps: list
    params: list  # FQNs, in the order the backward produces them
    nbytes: int  # per step (the local gradients' size)
    dtype: str
    planned: int | None = None


@dataclass
class TorchLowering:
    plan_hash: str
    mesh_names: tuple
    mesh_shape: tuple
    shard_dims: list = field(default_factory=list)
    replicate_dims: list = field(default_factory=list)
    tp_dim: int | None = None
    idle_dims: list = field(default_factory=list)
    styles: dict = field(default_factory=dict)  # module FQN (wildcards over repeated blocks) -> Style
    units: list = field(default_factory=list)  # fully_shard units, root last
    replicated_grads: list = field(default_factory=list)  # params whose grads are all-reduced by a hook
    grad_buckets: list = field(default_factory=list)  # GradBucket: how the hook reduces replicated_grads
    batch_shards: int = 1  # ranks that split the batch (product of the data dims)
    mixed_precision: dict | None = None
    checkpoint: list = field(default_factory=list)  # block FQNs
    loss_parallel: bool = False
    input_placements: list = field(default_factory=list)
    reasons: list = field(default_factory=list)  # (part, why it cannot be lowered)
    notes: list = field(default_factory=list)
    block_fqns: list = field(default_factory=list)  # the plan's repeated blocks ("layers.0", ...)
    tp_roles: dict = field(default_factory=dict)  # (node, input) -> what a forward redistribute on tp is
    mean_loss: dict | None = None  # the loss hook (engines_loss.py): labels, ignore_index, ...
    parts: dict = field(default_factory=dict)  # module FQN the graph backend runs -> its Part (engines_mixed)
    part_params: list = field(default_factory=list)  # their parameters (FSDP ignores them, the part reduces them)

    @property
    def expressible(self) -> bool:
        return not self.reasons

    def code(self) -> str:
        from .engines_codegen import render

        return render(self)

    def report(self) -> str:
        from .engines_codegen import report

        return report(self)


_PASS_THROUGH = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "_to_copy",
    "clone",
    "detach",
    "expand",
    "alias",
    "contiguous",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
}


class _Graph:
    """Plan records with users, module membership and the parameter chains (views/casts of a parameter)."""

    def __init__(self, plan):
        self.plan, self.nodes = plan, plan.nodes
        self.users = defaultdict(list)  # node -> [(user, input position, producer output)]
        for n in self.nodes:
            for j, (p, o) in enumerate(n.get("inputs", [])):
                self.users[p].append((n["idx"], j, o))
        if self.nodes and "inputs" not in self.nodes[-1]:
            raise EngineLoweringError(
                "this plan has no input edges in its node records (saved by an older autopar); plan it again"
            )
        self.param_node = {n["target"]: n["idx"] for n in self.nodes if n["kind"] == "param"}
        self.red = {(n["idx"], r["input"]): r for n in self.nodes for r in n.get("redistribute", [])}

    def rec(self, i):
        return self.nodes[i]

    def chain(self, fqn):
        """The parameter's node and every single-input op derived from it, with the edges that leave the chain:
        (chain nodes, [(consumer, input position, producer)])."""
        start = self.param_node[fqn]
        nodes, edges, stack = [start], [], [start]
        while stack:
            i = stack.pop()
            for u, j, o in self.users[i]:
                ur = self.nodes[u]
                if ur["kind"] == "op" and len(ur["inputs"]) == 1:
                    nodes.append(u)
                    stack.append(u)
                else:
                    edges.append((u, j, i))
        return nodes, edges

    def in_module(self, i, mod) -> bool:
        m = self.nodes[i]["module"]
        return mod == "" or m == mod or m.startswith(mod + ".")


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
    (backends/engines_mixed.py): their parameters are left to it (ignored by FSDP, no style, no hook) and what
    the engines cannot express inside them is not a reason."""
    G = _Graph(plan)
    names, shape = tuple(plan.mesh_names), tuple(plan.mesh_shape)
    low = TorchLowering(plan.hash(), names, shape)
    low.parts = {p: None for p in parts}
    from .engines_mixed import within

    in_part = lambda m: within(m, parts)
    low.part_params = [f for f in plan.params if in_part(f.rsplit(".", 1)[0] if "." in f else "")]
    own = {f: pl for f, pl in plan.params.items() if f not in low.part_params}
    low.block_fqns = _blocks(plan)
    inputs = [n for n in plan.nodes if n["kind"] == "input"]
    strict, loss_fed = [_fed(G, n) for n in inputs], []
    loose = [_fed(G, n, loss_fed) for n in inputs]
    # a mesh dim is batch-fed when every input is (a loss input counts only where the batch really is sharded)
    batch = [all(f[d] == "S0" for f in loose) and any(f[d] == "S0" for f in strict) for d in range(len(names))]
    low.input_placements = [
        ["S0" if batch[d] else n["placement"]["out"][0][d] for d in range(len(names))] for n in inputs
    ]
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
    for d in model_dims:
        busy = any(p[d] != "R" for p in own.values()) or any(
            o is not None and o[d] != "R"
            for n in plan.nodes
            if n["kind"] == "op" and not in_part(n["module"])
            for o in n["placement"]["out"]
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
    for d in data:
        (low.shard_dims if any(p[d][0] == "S" for p in own.values()) else low.replicate_dims).append(d)
    recognize_mean_loss(low, G, plan, data)
    _check_batch_shards(low, G, plan, inputs, data, [x for x in loss_fed if x[1] in data])
    _check_state_updates(low, plan, data, in_part)
    _recognize_fsdp(low, G, plan, units)
    if low.tp_dim is not None:
        from .engines_tp import recognize_tp

        recognize_tp(low, G, plan, model, styles)
    elif styles:
        raise EngineLoweringError(
            f"styles {sorted(styles)} were forced but the plan has no tensor-parallel dim "
            f"(mesh {dict(zip(names, shape))}, inputs {low.input_placements})"
        )
    _check_shared(low, plan, model)
    mp = plan.meta.get("mixed_precision")
    if mp:
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
    low.checkpoint = list(plan.meta.get("checkpointing", {}).get("blocks", []))
    if parts:
        from .engines_mixed import reason_module

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
    _grad_buckets(low, G, plan)
    return low


def _local_nbytes(low, plan, pnode, fqn) -> int:
    """Bytes of the parameter's gradient on one rank: its shape, split on the tensor-parallel dim."""
    import torch

    shape = list(pnode["shape"][0])
    t = low.tp_dim
    if t is not None and plan.params[fqn][t][0] == "S":
        shape[int(plan.params[fqn][t][1:])] //= plan.mesh_shape[t]
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, pnode["dtype"][0])).element_size()


def _grad_buckets(low, G, plan) -> None:
    """How the gradients of replicated parameters (low.replicated_grads) are reduced: in the plan's own all_reduce
    buckets when a bucket holds only such gradients and reduces them over exactly the data-parallel dims (the
    engines' partial sums are the plan's); every other such gradient (the plan computes it from gathered
    backward inputs, or reduces it over other dims) in extra buckets over all data dims, in backward order, up
    to the plan's bucket size. The average divides by the number of batch shards (each rank's loss is the mean
    over its own)."""
    from autopar.redistribute import BUCKET_BYTES, dims_of

    data = low.replicate_dims + low.shard_dims
    rep = set(low.replicated_grads)
    if not rep or not data:
        return
    low.batch_shards = math.prod(plan.mesh_shape[d] for d in data)
    pnode = {n["target"]: n for n in plan.nodes if n["kind"] == "param"}
    size = {f: _local_nbytes(low, plan, pnode[f], f) for f in rep}
    dn = lambda ds: "+".join(low.mesh_names[d] for d in ds)
    chains: dict = {}
    for k, b in enumerate(plan.buckets):
        chains.setdefault(b.get("chain", k), []).append((k, b))
    covered, out = set(), []
    for first, bs in sorted(chains.items()):
        params = bs[0][1]["params"]
        if not rep & set(params):
            continue
        steps = [dims_of(b["mesh_dim"]) for _, b in sorted(bs, key=lambda kb: kb[1].get("step", 0))]
        dims = [d for s in steps for d in s]
        ok = (
            set(params) <= rep
            and all(b["kind"] == "all_reduce" for _, b in bs)
            and sorted(dims) == sorted(data)
            and len(set(dims)) == len(dims)
        )
        if not ok:
            low.notes.append(
                f"the plan's gradient bucket {first} ({[b['kind'] for _, b in bs]} over "
                f"{[dn(s) for s in steps]}) is not the engines' averaging over {dn(data)}; its replicated"
                f" gradients are reduced in extra buckets instead"
            )
            continue
        nb = sum(size[f] for f in params)
        out.append(GradBucket(steps, list(params), nb, bs[0][1]["dtype"].replace("torch.", ""), first))
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
        dt = pnode[f]["dtype"][0]
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


def _blocks(plan) -> list[str]:
    return [f"{r['prefix']}.{i}" for r in plan.regions for i in r["layers"]]


def _recognize_fsdp(low, G, plan, forced_units):
    data = low.shard_dims + low.replicate_dims
    if not data:
        return
    dn = lambda ds: "+".join(low.mesh_names[d] for d in ds)
    blocks = _blocks(plan)
    if forced_units is not None:
        for u in forced_units:
            inside = next((b for b in blocks if u.startswith(b + ".")), None)
            if inside:
                raise EngineLoweringError(
                    f"FSDP unit '{u}' lies inside the repeated block '{inside}': the plan decides"
                    f" per block, so a unit must be a whole block (or a union of blocks, or "
                    f"the root)"
                )
        unit_fqns = [u for u in forced_units if u] + [""]
    else:
        unit_fqns = blocks + [""]
    unit_of = lambda f: next((u for u in unit_fqns if u and f.startswith(u + ".")), "")
    per_unit = {u: Unit(u, [], False) for u in unit_fqns}
    for fqn, pl in plan.params.items():
        if fqn not in G.param_node or fqn in low.part_params:  # an alias of a tied parameter; a graph part's
            continue
        u = per_unit[unit_of(fqn)]
        sh = [pl[d] for d in low.shard_dims]
        rp = [pl[d] for d in low.replicate_dims]
        if any(p != "R" for p in rp):
            low.reasons.append(
                (
                    f"parameter {fqn}",
                    f"is {pl} but dims {dn(low.replicate_dims)} replicate every other "
                    f"parameter (HSDP shards on one dim group only)",
                )
            )
            continue
        if all(p == "R" for p in sh):
            u.replicated.append(fqn)
            continue
        if len(set(sh)) != 1:
            low.reasons.append(
                (
                    f"parameter {fqn}",
                    f"is {pl}: FSDP2 shards a parameter on one tensor dim over all of {dn(low.shard_dims)}",
                )
            )
            continue
        k = int(sh[0][1:])
        nodes, edges = G.chain(fqn)
        bad = [
            (c, j)
            for c, j, src in edges
            if G.rec(c)["kind"] == "op" and any(G.rec(c)["placement"]["ins"][j][d][0] != "R" for d in low.shard_dims)
        ]
        consumers = edges + [(c, 0, None) for c in nodes[1:]]
        gathers = [
            c
            for c, j, _ in consumers
            if (c, j) in G.red
            and any(G.red[(c, j)]["src"][d][0] == "S" and G.red[(c, j)]["dst"][d] == "R" for d in low.shard_dims)
        ]
        if bad:
            c, j = bad[0]
            low.reasons.append(
                (
                    f"parameter {fqn}",
                    f"is used sharded on {dn(low.shard_dims)} by "
                    f"{G.rec(c)['name']} in module '{G.rec(c)['module']}' (input {j} "
                    f"{G.rec(c)['placement']['ins'][j]}): FSDP2 gathers a parameter before every use, and a "
                    f"ParallelStyle cannot shard it on a mesh dim that also splits the batch (tensor or "
                    f"expert parallelism on a data-parallel dim)",
                )
            )
            continue
        outside = [c for c, _, _ in edges if u.fqn and not G.in_module(c, u.fqn)]
        if outside:
            c = outside[0]
            low.reasons.append(
                (
                    f"parameter {fqn}",
                    f"is used outside its FSDP unit '{u.fqn}' by {G.rec(c)['name']} in "
                    f"module '{G.rec(c)['module'] or '<root>'}'; FSDP2 unshards it only while the unit runs",
                )
            )
            continue
        u.params.append(fqn)
        if k != 0:
            u.shard_dims[fqn] = k
        if any(G.rec(c)["phase"] == "bw" for c in gathers):
            u.reshard_after_forward = True
    _check_batch_ops(low, G, plan, data, dn)
    for u in per_unit.values():
        if u.replicated:
            low.replicated_grads += u.replicated
        if not u.params and u.fqn:
            continue
        gathered = (
            "re-gathered in the backward"
            if u.reshard_after_forward
            else "kept from the forward's gather (no backward gather)"
        )
        u.why = f"{len(u.params)} params sharded on {dn(low.shard_dims)}, gathered before use; {gathered}" + (
            f"; {len(u.replicated)} replicated params left out (ignored_params), grads all-reduced"
            if u.replicated
            else ""
        )
        if low.shard_dims:
            low.units.append(u)
    if len(low.shard_dims) > 1 and low.replicate_dims:
        low.reasons.append(
            (
                "data-parallel dims",
                f"HSDP with a flattened shard group ({dn(low.shard_dims)}) and a "
                f"replicate group ({dn(low.replicate_dims)}) is not lowered",
            )
        )
    elif low.shard_dims and low.replicate_dims:
        low.notes.append(f"HSDP: replicate over {dn(low.replicate_dims)}, shard over {dn(low.shard_dims)}")
    elif not low.shard_dims:
        low.notes.append(
            f"data parallel over {dn(low.replicate_dims)} with every parameter replicated: gradients "
            f"averaged in the plan's buckets (one all_reduce per bucket, started when its last "
            f"gradient is ready)"
        )


# ---- applying ------------------------------------------------------------------------------------------------


def lower_to_torch(model: nn.Module, mesh, plan, *, units=None, styles=None, compile_blocks=None) -> nn.Module:
    """Parallelize `model` in place with fully_shard / parallelize_module as `plan` says; raises
    EngineLoweringError (listing every reason) when the plan is not expressible. Returns the same module."""
    low = recognize(plan, model, units=units, styles=styles)
    if not low.expressible:
        raise EngineLoweringError(
            "the plan cannot be lowered to fully_shard / parallelize_module:\n"
            + "\n".join(f"  {part}: {why}" for part, why in low.reasons)
        )
    return apply_lowering(model, mesh, low, compile_blocks)


def apply_lowering(model, mesh, low: TorchLowering, compile_blocks=None) -> nn.Module:
    if tuple(mesh.shape) != tuple(low.mesh_shape):
        raise EngineLoweringError(f"the plan is for mesh {low.mesh_shape} but the mesh is {tuple(mesh.shape)}")
    names = tuple(mesh.mesh_dim_names or ())
    if names != tuple(low.mesh_names):
        raise EngineLoweringError(f"the plan names mesh dims {low.mesh_names} but the DeviceMesh has {names}")
    ns: dict = {}
    exec(compile(low.code(), "<autopar lowering>", "exec"), ns)
    ns["apply"](model, mesh, compile_blocks)
    model._autopar_lowering = low
    return model


apply_torch_engines = lower_to_torch


def export_code(plan, model: nn.Module | None = None, *, units=None, styles=None) -> str:
    """The plan as the Python a user would have written (parallelize_plan dict, fully_shard units, apply());
    printable, importable, editable. Raises EngineLoweringError when the engines cannot express the plan."""
    low = recognize(plan, model, units=units, styles=styles)
    if not low.expressible:
        raise EngineLoweringError(
            "the plan cannot be exported as fully_shard / parallelize_module code:\n"
            + "\n".join(f"  {part}: {why}" for part, why in low.reasons)
        )
    return low.code()


def train_context(model) -> contextlib.AbstractContextManager:
    """Wrap forward AND backward of a lowered model in this (loss_parallel when the plan shards the loss)."""
    low = getattr(model, "_autopar_lowering", None)
    if low is not None and low.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def local_inputs(model_or_lowering, mesh, *inputs):
    """This rank's piece of the global inputs: sharded on the data dims (batch), whole on the others."""
    low = getattr(model_or_lowering, "_autopar_lowering", model_or_lowering)
    out = []
    for x, pl in zip(inputs, low.input_placements):
        for d, p in enumerate(pl):
            if p[0] == "S":
                x = x.chunk(mesh.size(d), dim=int(p[1:]))[mesh.get_local_rank(d)]
        out.append(x)
    return tuple(out)


def parallelize_torch(
    model: nn.Module,
    mesh,
    example_inputs,
    *,
    backend: str = "torch",
    units=None,
    styles=None,
    planned=None,
    compile_blocks=None,
    assume_identical: bool = False,
    check_replicas: bool = True,
    **plan_kwargs,
):
    """Plan `model` for `mesh` and lower it: backend "torch" (the user's own module, parallelized in place by the
    engines; EngineLoweringError if the plan does not fit them), "mixed" (the engines for what they express, the
    graph backend for the modules they cannot, backends/engines_mixed.py; the whole model on the graph backend
    when no such split exists) or "auto" ("mixed", but a split is kept only when the cost model predicts it no
    slower than the graph backend running the whole plan). The dump says which part went where and why.
    compile_blocks: torch.compile keyword arguments to compile each repeated block in place (torchtitan's order:
    after tensor parallelism and checkpointing, before FSDP).
    assume_identical / check_replicas: as autopar.backends.graph.parallelize (rank 0's parameters and buffers are
    broadcast before the engines shard them, `model.autopar_init_comm`; a replica checksum before the first step).
    The user's RNG state is left as it was; `model.autopar_rng_seed` is rank 0's torch.initial_seed()."""
    import torch
    from .spmd.module import _rng_devices

    with torch.random.fork_rng(devices=_rng_devices(mesh)):
        return _parallelize_torch(
            model,
            mesh,
            example_inputs,
            backend,
            units,
            styles,
            planned,
            compile_blocks,
            assume_identical,
            check_replicas,
            plan_kwargs,
        )


def _take_rank0(model, mesh, assume_identical, check_replicas) -> str:
    from .spmd.module import _device
    from .spmd.state import prepare_engine_model

    return prepare_engine_model(model, mesh, _device(mesh), assume_identical, check_replicas)


def _parallelize_torch(
    model,
    mesh,
    example_inputs,
    backend,
    units,
    styles,
    planned,
    compile_blocks,
    assume_identical,
    check_replicas,
    plan_kwargs,
):
    if backend not in ("torch", "mixed", "auto"):
        raise ValueError(f"backend must be 'torch', 'mixed' or 'auto' here, got {backend!r}")
    # keyword inputs (autopar/model_io.py) plan like positional ones; the engines run the user's own module, which
    # takes them itself; the graph parts of "mixed" are split by positional calls, so keyword inputs skip them
    kw = plan_kwargs.pop("example_kwargs", None)
    if isinstance(example_inputs, dict):
        example_inputs, kw = (), {**example_inputs, **(kw or {})}
    ex = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    replan = None
    plan_kwargs.setdefault("cluster", "cpu-gloo" if mesh.device_type == "cpu" else "h100")  # also the parts'
    if planned is None:
        from .engines_plan import plan_for_engines

        planned, replan = plan_for_engines(model, mesh, ex, **({"example_kwargs": kw} if kw else {}), **plan_kwargs)
    plan, state = planned
    low = recognize(plan, model, units=units, styles=styles)
    if replan:
        low.notes.insert(0, replan)
    if low.expressible:
        init = _take_rank0(model, mesh, assume_identical, check_replicas)
        apply_lowering(model, mesh, low, compile_blocks)
        model._autopar_plan = plan
        model.autopar_dump = _dump(plan, low, "torch", init)
        return model
    if backend == "torch":
        raise EngineLoweringError(
            "the plan cannot be lowered to fully_shard / parallelize_module (use "
            "backend='auto', 'mixed' or 'graph'):\n" + "\n".join(f"  {part}: {why}" for part, why in low.reasons)
        )
    mixed, why = (
        _mixed(model, mesh, ex, plan, low, units, styles, plan_kwargs)
        if not kw
        else (None, "keyword inputs: graph parts are split off positional calls only")
    )
    if mixed is not None and backend == "auto":  # the faster of the two by the cost model
        from .engines_comm import engine_step_time

        t_mixed, t_graph = engine_step_time(plan, mixed, plan_kwargs["cluster"]), plan.predicted["step_s"]
        if t_mixed > t_graph:
            mixed, why = (
                None,
                (
                    f"the engines with graph parts for {', '.join(sorted(mixed.parts))} are predicted "
                    f"slower ({t_mixed * 1e3:.2f} ms a step: their collectives) than the graph backend "
                    f"running the plan ({t_graph * 1e3:.2f} ms)"
                ),
            )
    if mixed is not None:
        init = _take_rank0(model, mesh, assume_identical, check_replicas)
        apply_lowering(model, mesh, mixed, compile_blocks)
        from .engines_mixed import install_parts
        from .spmd.module import _device

        install_parts(model, mesh, mixed, _device(mesh))
        model._autopar_plan = plan
        model.autopar_dump = _dump(plan, mixed, "torch + graph parts", init)
        return model
    from .spmd.module import parallelize as graph_parallelize

    pm = graph_parallelize(
        model,
        mesh,
        ex,
        example_kwargs=kw,
        planned=(plan, state),
        assume_identical=assume_identical,
        check_replicas=check_replicas,
    )
    low.notes.append(f"the whole model runs on the graph backend: {why}")
    pm.autopar_dump, pm.autopar_fallback = _dump(plan, low, "graph"), why
    return pm


def _mixed(model, mesh, ex, plan, low, units, styles, plan_kwargs):
    """(the lowering with graph parts, None) when every reason names a module that can run as a part on the
    graph backend while the engines run the rest (backends/engines_mixed.py); (None, why not) otherwise."""
    from .engines_mixed import choose_parts, plan_parts

    try:
        chosen, calls = choose_parts(plan, low, model, ex, recognize)
    except Exception as e:  # noqa: BLE001 (e.g. a forward that cannot run on meta tensors: recorded, not fatal)
        return None, f"the modules the engines cannot express were not split off ({type(e).__name__}: {e})"
    if chosen is None:
        return None, calls
    mixed = recognize(plan, model, units=units, styles=styles, parts=list(chosen))
    if not mixed.expressible:
        return None, "with " + ", ".join(
            chosen
        ) + " on the graph backend the engines still cannot express " + "; ".join(f"{p}: {w}" for p, w in mixed.reasons)
    if mixed.tp_dim is not None and any(st.cls == "SequenceParallel" for st in mixed.styles.values()):
        return None, "a part's inputs would be sequence-sharded on the tensor-parallel dim (SequenceParallel)"
    kw = {k: v for k, v in plan_kwargs.items() if k != "force"}
    plan_parts(plan, model, mesh, mixed, chosen, calls, force=plan_kwargs.get("force"), **kw)
    return mixed, None


def _compare_collectives(plan, low) -> None:
    """A note when what the engines issue (engine_collectives) differs from the plan's own prediction."""
    from .engines_comm import engine_collectives

    mine, _ = engine_collectives(plan, low)
    planned = plan.collectives()
    a, b = sum(x[2] for x in mine), sum(x[2] for x in planned)
    if (len(mine), a) != (len(planned), b):
        low.notes.append(
            f"the engines issue {len(mine)} collectives, {a:,d} B a step, where the plan predicts "
            f"{len(planned)}, {b:,d} B (see the notes above; autograd runs the backward as the "
            f"forward's mirror, not the plan's own backward placements"
            + ("; the graph parts run their own plans" if low.parts else "")
            + ")"
        )


def _dump(plan, low, backend, init: str = "") -> str:
    if backend != "graph":
        _compare_collectives(plan, low)
    head = f"backend: {backend}" + (
        ""
        if backend == "torch"
        else " (the torch engines for the rest, the graph backend for the modules marked '-> graph')"
        if low.parts
        else " (fallback: the torch engines cannot express the parts marked '-> graph')"
    )
    return head + "\n" + (init + "\n" if init else "") + low.report() + "\n" + plan.summary()
