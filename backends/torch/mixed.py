"""backend="auto": PyTorch's engines for every part of the plan they express, autopar's graph backend for the
modules they cannot (the "parts"), in the user's own module.

Which modules. Each reason the engines give (backends/torch/recognize.py) names a parameter, an op or a module; the part
is the innermost module holding it that can run on its own: not the root, called once per step with positional
arguments (tensors, or constants), returning one tensor, its parameters used by no op outside it. A reason that
names the mesh or the whole model (a mesh dim, mixed precision, a tied parameter, a parameter the root reads)
leaves the whole model to the graph backend, as before. The engines are then recognized again with the parts left
out (their parameters ignored by FSDP, no ParallelStyle, no gradient hook); anything they still cannot express
also means the whole model goes to the graph backend.

How a part runs. The front door plans it as a model of its own (`autopar.plan(part, mesh, its inputs, output=
"activation")`, from the `PartRequest` this module states; the backend never plans) keeping the whole plan's
placements inside it (its op records matched to the part's graph) and with its inputs, its output and their gradients pinned where the engines hold them: batch-sharded (Shard(0)) on
the data-parallel dims and replicated on the others, so each rank's plain local tensor is its piece of the part's
global view; the placements the user forced on its parameters are kept. Instances with the same graph and the same
forced and kept placements share one plan and one Program (backends/spmd/program.py). Its parameters become DTensors at
that plan's placements. Its forward is an autograd.Function: the Program's forward on the local pieces, and in the
backward the Program's backward from the incoming gradient, returning the input gradients to the engines and the
parameter gradients reduced by the part's own plan, divided by the number of batch shards (the engines average
the ranks' gradients over them; the part's global view sums them).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.capture import capture, to_meta

from .graph_backend import ExecutionError, Program, _distribute, agree_on_plan

_IN_MODULE = re.compile(r"in module '([^']*)'")


def reason_module(part: str, why: str) -> str | None:
    """The module a reason of the engines is about, or None when it is about the mesh or the whole model."""
    kind, _, name = part.partition(" ")
    used = _IN_MODULE.search(why)
    used = None if used is None else "" if used.group(1) == "<root>" else used.group(1)
    if kind == "module":
        return "" if name == "<root>" else name
    if kind == "op":
        return used
    if kind == "parameter" and "is the same tensor as" not in why:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        return owner if used is None else _common(owner, used)
    return None


def within(module: str, fqns) -> bool:
    """Whether `module` is one of the modules `fqns` or inside one of them."""
    return any(module == f or module.startswith(f + ".") for f in fqns)


def _common(a: str, b: str) -> str:
    pa, pb = a.split("."), b.split(".")
    k = 0
    while k < min(len(pa), len(pb)) and pa[k] == pb[k]:
        k += 1
    return ".".join(pa[:k])


@dataclass
class Part:
    """One planned part, shared by its instances (modules with the same graph and placements)."""

    plan: object
    state: object
    prog: object = None
    boundary: tuple = ()  # placement of every input, the output and their gradients
    shards: int = 1  # batch shards: the parameter gradients are divided by this
    args: tuple = ()  # the example call's arguments (meta tensors / constants)
    instances: list = field(default_factory=list)
    why: list = field(default_factory=list)
    how: str = ""  # how its plan relates to the whole model's


def _calls(model, example_inputs, fqns, shards=1, split=()) -> dict:
    """{module FQN: [(args, kwargs, output)]} of the modules `fqns` in one forward of `model` on meta tensors;
    with `split` (positions of the inputs fed batch-sharded), on one rank's inputs: those cut into `shards`."""
    meta = {k: to_meta(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}
    ins = [to_meta(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    for i in split:
        ins[i] = torch.empty((ins[i].shape[0] // shards, *ins[i].shape[1:]), dtype=ins[i].dtype, device="meta")
    seen: dict = {f: [] for f in fqns}
    hooks = [
        model.get_submodule(f).register_forward_hook(
            lambda m, a, kw, out, f=f: seen[f].append((a, kw, out)), with_kwargs=True
        )
        for f in fqns
    ]
    try:
        with torch.no_grad():
            torch.func.functional_call(model, meta, tuple(ins))
    finally:
        for h in hooks:
            h.remove()
    return seen


def _runs_alone(plan, fqn, calls, local_calls, shards) -> str | None:
    """Why module `fqn` cannot be a part (None when it can). The shapes its arguments and output take on one
    rank of the engines (`local_calls`, the forward on a rank's batch shard) must be its global shapes split on
    dim 0 into the `shards` batch shards: the part's global view is then the ranks' pieces side by side."""
    if not calls:
        return "it does not run in the forward"
    if len(calls) > 1:
        return f"it runs {len(calls)} times per step"
    args, kwargs, out = calls[0]
    if kwargs:
        return f"it takes keyword arguments {sorted(kwargs)}"
    if not isinstance(out, torch.Tensor):
        return f"it returns {type(out).__name__}, not one tensor"
    local_args, _, local_out = local_calls[0]
    for i, (a, b) in enumerate(zip((*args, out), (*local_args, local_out))):
        what = "its output" if i == len(args) else f"its argument {i}"
        if isinstance(a, torch.Tensor):
            if not a.shape or tuple(b.shape) != (a.shape[0] // shards, *a.shape[1:]) or a.shape[0] % shards:
                return (
                    f"{what} (shape {tuple(a.shape)}, {tuple(b.shape)} on one rank) is not cut into the "
                    f"{shards} batch shards on dim 0 (a part takes and returns batch-sharded tensors)"
                )
        elif not isinstance(a, (int, float, bool, type(None))):
            return f"{what} is a {type(a).__name__}"
    nodes = plan.node_records()
    for n in nodes:
        if n.kind != "op" or within(n.module, (fqn,)):
            continue
        for p, _ in n.inputs:
            src = nodes[p]
            if src.kind == "param" and src.target.startswith(fqn + "."):
                return f"its parameter {src.target} is read by {n.name} in module '{n.module or '<root>'}'"
    return None


def choose_parts(plan, low, model, example_inputs, recognize):
    """({part FQN: [reasons]}, calls) when every reason of `low` names a module that can run as a part (the
    innermost such module holding it); (None, why not) otherwise. A reason about an op outside the parts may
    go once a part delivers its input batch-sharded, so the engines are recognized again with the parts chosen
    so far until no reason is left."""
    data = low.replicate_dims + low.shard_dims
    _, shards = _boundary(low)
    split = [i for i, pl in enumerate(low.input_placements) if data and pl[data[0]] == "S0"]
    split = [
        i for k, i in enumerate(i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)) if k in split
    ]
    parts: dict = {}
    calls: dict = {}
    local: dict = {}
    reasons = low.reasons
    while reasons:
        wanted: dict = {}
        for part, why in reasons:
            m = reason_module(part, why)
            if not m:
                return None, f"{part}: {why} (about {'the whole model' if m == '' else 'the mesh or the model'})"
            wanted.setdefault(m, []).append(f"{part}: {why}")
        chains = {m: [".".join(m.split(".")[:k]) for k in range(m.count(".") + 1, 0, -1)] for m in wanted}
        new = sorted({c for ch in chains.values() for c in ch} - set(calls))
        calls.update(_calls(model, example_inputs, new))
        local.update(_calls(model, example_inputs, new, shards, split))
        alone = lambda c: _runs_alone(plan, c, calls[c], local[c], shards)
        added, refused = False, []
        for m, why in wanted.items():
            c = next((c for c in chains[m] if alone(c) is None), None)
            if c is None:
                refused.append(
                    f"no module holding '{m}' can run as a part ("
                    + "; ".join(f"'{c}': {alone(c)}" for c in chains[m])
                    + ")"
                )
                continue
            owner = next((p for p in parts if c == p or c.startswith(p + ".")), None)
            if owner is None:
                parts[c] = []
                for p in [p for p in parts if p.startswith(c + ".")]:  # a part inside it: merged
                    parts[c] += parts.pop(p)
                added = True
            parts[owner or c] += why
        if not added:
            return None, "; ".join(refused)
        reasons = recognize(plan, model, parts=list(parts)).reasons
    return parts, calls


@dataclass(frozen=True)
class PartRequest:
    """One part the planner must plan (the front door does: autopar/parallel.py), shared by its instances (modules
    with the same graph and the same forced and kept placements): `module` called on `args` with output=
    "activation", its parameters forced to `force`, and each node pinned to `pins` (the whole plan's placements
    inside it, its boundary at `boundary`); `boundary_pins` alone when those do not fit the boundary."""

    key: tuple  # the graph's ops and shapes, the forced and the kept placements
    module: nn.Module
    args: tuple
    force: dict
    pins: dict  # {node name: {(mesh dim, output): placement}}
    boundary_pins: dict
    kept: int  # ops of the part's graph pinned to the whole plan's placements
    ops: int


def _boundary(low) -> tuple[tuple, int]:
    """(a part's boundary placement per mesh dim, its batch shards): Shard(0) on the dims the engines feed
    batch-sharded, Replicate on the others."""
    data = low.replicate_dims + low.shard_dims
    return tuple("S0" if d in data else "R" for d in range(len(low.mesh_shape))), math.prod(
        low.mesh_shape[d] for d in data
    )


def part_requests(whole, model, low, chosen: dict, calls: dict, force=None) -> dict:
    """{module FQN: PartRequest} for the parts `chosen`: what each needs planned, its boundary batch-sharded
    (Shard(0)) on the data-parallel dims and replicated on the others (module docstring). Instances with the same
    graph and pins share one request object."""
    boundary, _ = _boundary(low)
    out, by_key = {}, {}
    for fqn in chosen:
        mod = model.get_submodule(fqn)
        args = calls[fqn][0][0]
        sub_force = {k[len(fqn) + 1 :]: v for k, v in (force or {}).items() if k.startswith(fqn + ".")}
        g = capture(mod, args, output="activation")
        kept, edge = _plan_pins(whole, fqn, g), _boundary_pins(g, boundary)
        key = (
            tuple((n.name, tuple(o.shape) if o is not None else None) for n in g.nodes for o in n.outs),
            tuple(sorted(sub_force.items())),
            tuple(sorted((k, tuple(sorted(v.items()))) for k, v in kept.items())),
        )
        if key not in by_key:
            n_kept, n_ops = len(set(kept) - set(edge)), len(list(g.ops()))
            by_key[key] = PartRequest(key, mod, args, sub_force, {**kept, **edge}, edge, n_kept, n_ops)
        out[fqn] = by_key[key]
    return out


def attach_parts(low, chosen: dict, requests: dict, planned: dict) -> None:
    """Set `low.parts` from the planned requests: `planned` maps each request's key to (plan, state, how)."""
    boundary, shards = _boundary(low)
    made: dict = {}
    for fqn, why in chosen.items():
        req = requests[fqn]
        part = made.get(req.key)
        if part is None:
            plan, state, how = planned[req.key]
            part = made[req.key] = Part(plan, state, boundary=boundary, shards=shards, args=req.args, how=how)
        part.instances.append(fqn)
        part.why += [f"{fqn}: {w}" for w in why]
        low.parts[fqn] = part


def _plan_pins(whole, fqn, g) -> dict:
    """{node name: pin} keeping the whole model's plan inside the part: its op records in module `fqn` matched to
    the part's own graph by (phase, op, output shapes) in order (difflib's longest matching blocks), each matched
    node pinned to the plan's output placements."""
    recs = [r for r in whole.node_records() if r.kind == "op" and within(r.module, (fqn,))]
    ops = list(g.ops())
    key_r = [(r.phase, r.target, tuple(s if s is not None else () for s in r.shapes)) for r in recs]
    key_n = [
        (n.phase, n.name.split(":", 1)[1], tuple(tuple(o.shape) if o is not None else () for o in n.outs)) for n in ops
    ]
    pins = {}
    for a, b, size in difflib.SequenceMatcher(None, key_r, key_n, autojunk=False).get_matching_blocks():
        for k in range(size):
            out = recs[a + k].out
            pins[ops[b + k].name] = {(d, o): p for o, pl in enumerate(out) if pl is not None for d, p in enumerate(pl)}
    return pins


def _boundary_pins(g, boundary) -> dict:
    """{node name: pin}: the part's inputs, output, the output's gradient (the backward's seed) and the input
    gradients at the boundary placement."""
    whole = {d: p for d, p in enumerate(boundary)}
    pins = {g.nodes[i].name: dict(whole) for i in g.inputs}
    refs = [g.loss, *g.input_grads.values()]
    for n in g.ops():
        if n.phase == "bw" and n.target is torch.ops.aten.ones_like.default and n.inputs() == [g.loss]:
            pins[n.name] = dict(whole)
    for r in refs:
        pins.setdefault(g.nodes[r.node].name, {}).update({(d, r.out): p for d, p in enumerate(boundary)})
    return pins


class _PartStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part, mod, need, k, *flat):
        ins, params = list(flat[:k]), flat[k:]
        buffers = dict(mod.named_buffers())
        out, env = part.prog.forward(dict(zip(part.prog.param_fqns, params)), ins, buffers, keep=need)
        ctx.part, ctx.env = part, env
        return out

    @staticmethod
    def backward(ctx, grad_out):
        part = ctx.part
        grads, in_grads = part.prog.backward_part(ctx.env, grad_out.contiguous())
        ctx.env = None
        scaled = []
        for f in part.prog.param_fqns:
            gr = grads.get(f)
            if gr is not None and part.shards > 1:
                gr = gr.mul_(1.0 / part.shards)
            scaled.append(gr)
        pos = [i for i, a in enumerate(part.args) if isinstance(a, torch.Tensor)]
        return (None, None, None, None, *[in_grads.get(i) for i in pos], *scaled)


def install_parts(model, mesh, low, device) -> None:
    """Make each part's parameters DTensors at its plan's placements and route its forward through its Program
    (after the engines are applied: FSDP ignores these parameters)."""
    for fqn, part in low.parts.items():
        if part.prog is None:
            agree_on_plan(mesh, part.plan.hash(), device)
            part.prog = Program(part.state, part.plan, mesh, device, part.args)
        mod = model.get_submodule(fqn)
        for name, p in list(mod.named_parameters()):
            owner, leaf = mod.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            owner._parameters[leaf] = nn.Parameter(
                _distribute(p, mesh, part.prog.param_placement(name), device), requires_grad=p.requires_grad
            )
        for name, b in list(mod.named_buffers()):
            owner, leaf = mod.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            owner._buffers[leaf] = _distribute(b, mesh, part.prog.buffer_placement(name), device)
        mod.forward = _forward(fqn, mod, part)


def _forward(fqn, mod, part):
    """The part's forward: checks that it gets this rank's batch shard, then runs _PartStep."""
    expect = []
    for i, a in enumerate(part.args):
        if isinstance(a, torch.Tensor):
            local = list(a.shape)
            local[0] //= part.shards
            expect.append((i, tuple(local), a.dtype))
    fqns = part.prog.param_fqns

    def forward(*args, **kwargs):
        if kwargs or len(args) != len(part.args):
            raise ExecutionError(
                f"module '{fqn}' (run by autopar's graph backend) was planned for {len(part.args)} "
                f"positional arguments, got {len(args)} and keywords {sorted(kwargs)}"
            )
        ins = []
        for i, shape, dtype in expect:
            a = args[i]
            if (
                not isinstance(a, torch.Tensor)
                or hasattr(a, "placements")
                or tuple(a.shape) != shape
                or a.dtype != dtype
            ):
                got = f"{type(a).__name__} {tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else repr(a)
                raise ExecutionError(
                    f"module '{fqn}' (run by autopar's graph backend) expects as argument {i} this "
                    f"rank's plain local piece {shape} {dtype} (its batch shard), got {got}"
                )
            ins.append(a)
        for i, a in enumerate(part.args):
            if not isinstance(a, torch.Tensor) and args[i] != a:
                raise ExecutionError(f"module '{fqn}': argument {i} is {args[i]!r} but the part was planned with {a!r}")
        params = [mod.get_parameter(f) for f in fqns]
        need = torch.is_grad_enabled() and (any(p.requires_grad for p in params) or any(x.requires_grad for x in ins))
        return _PartStep.apply(part, mod, need, len(ins), *ins, *params)

    return forward


def report(low) -> list[str]:
    """The dump lines of the parts."""
    L, seen = [], set()
    for fqn, part in low.parts.items():
        if part is None:  # recognized with parts= but not planned (the front door plans the parts) yet
            L.append(f"  -> graph  {fqn}: left to the graph backend (not planned yet)")
            continue
        if id(part) in seen:
            continue
        seen.add(id(part))
        pred = part.plan.predicted
        kinds = ", ".join(f"{k} x{v['count']} {v['bytes']:,d} B" for k, v in sorted(pred["collectives"].items()))
        L.append(
            f"  -> graph  {', '.join(part.instances)}: {part.how} (plan {part.plan.hash()}, boundary "
            f"{list(part.boundary)}, predicted step {pred['step_s'] * 1e3:.3f} ms, collectives per call: "
            f"{kinds or 'none'}) because"
        )
        first = [w for w in part.why if w.startswith(part.instances[0] + ": ")]
        L += [f"             {w}" for w in first[:3]]
        more = len(part.why) - min(3, len(first))
        if more:
            L.append(
                f"             ... {more} more reason(s)"
                + (f", in {len(part.instances) - 1} other instance(s) alike" if len(part.instances) > 1 else "")
            )
    return L
