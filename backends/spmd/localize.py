"""Localize: a plan's global graph -> the per-rank local program (what each op runs on this rank's shards).

A pure function of the Plan's pieces (the graph, each node's placements, the redistributes and how they are shared
or coalesced, the forward's order of execution) and the mesh shape; no tensor is touched and no collective runs.
It decides, per op node:
  - how the op runs (`mode`, program.py's docstring): "local" on the shards (with local arguments where a global
    shape argument has a local counterpart, local_ops.local_args), "dtensor" through DTensor's dispatch, "factory",
    "random" (the program's generator), "seed" (the backward's incoming gradient);
  - the redistributes before it: alone, shared with an earlier consumer of the same value ("store"/"load"), or
    grouped into one all_reduce with other inputs (of this op, or of later ops of a loss-tail group);
  - the placement of each output it must give, and which values die after it.
It lives in backends/spmd, not passes/, because those decisions are the executor's own: which local kernels exist
(local_ops), which ops DTensor must run, how attention is replaced off CPU.
`LocalProgram.text()` prints it for golden tests (tests/test_localize.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from autopar.capture import SDPA, SDPA_BW
from autopar.graph import Ref
from autopar.collectives import steps as plan_steps
from autopar.strategies import Strategy, vocab_parallel

from . import vocab_loss
from .interpreter import _to_device
from .local_ops import LOCAL_IMPL, RANDOM, attention_bw_math, attention_fw_math, local_args, local_exact

aten = torch.ops.aten


class Redistribute(NamedTuple):
    """One input's change of placement before its op. `input`: its position, or for a loss-tail member at a later
    op ("ext", value key, where the group leaves it); `share`: ("store" | "load", env key) where one redistribute
    serves several consumers, else None."""

    input: int | tuple
    src: tuple
    dst: tuple
    share: tuple | None


@dataclass(frozen=True)
class LocalOp:
    node: object  # the graph Node
    mode: str  # "local" | "dtensor" | "factory" | "random" | "seed"
    fn: object  # the op it calls (a local kernel, or the exact math of attention off CPU)
    args: tuple  # its arguments (Refs for tensor inputs), local ones where the op runs on shards with their own
    kwargs: dict
    redistributes: tuple  # Redistribute per input run alone (or shared)
    groups: tuple  # tuples of Redistribute all-reduced together in one collective
    expect: tuple  # the placement each output must have (the plan's)
    out_replicated: tuple  # per output: replicated on every mesh dim (kept as a plain tensor)
    frees: tuple  # env keys dropped after it
    contiguous: bool  # its kernel wants unit inner stride (fused attention)
    replaced: bool  # fn replaces the captured kernel (math attention): outputs take the captured layout
    causal_rows: tuple | None = None  # causal attention on sequence-shard query rows: the mask's rows' placement

    @property
    def name(self) -> str:
        return f"{self.node.name} (module '{self.node.module or '<root>'}')"


@dataclass(frozen=True)
class LocalProgram:
    forward: tuple  # LocalOp in order of execution
    backward: tuple

    def text(self) -> str:
        """One line per op (phase, name = op(args) mode -> output placements), then its redistributes, groups and
        frees, indented: deterministic, for golden tests."""
        names = {op.node.idx: op.node.name for op in (*self.forward, *self.backward)}
        lines = []
        for phase, ops in (("forward", self.forward), ("backward", self.backward)):
            lines.append(phase)
            lines += [line for op in ops for line in _op_text(op, names)]
        return "\n".join(lines) + "\n"


def _op_text(op: LocalOp, names: dict) -> list[str]:
    def arg(a):
        if isinstance(a, Ref):
            return names.get(a.node, f"%{a.node}") + (f"[{a.out}]" if a.out else "")
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        return "tensor" if isinstance(a, torch.Tensor) else str(a)

    pl = lambda p: "-" if p is None else "[" + ",".join(p) + "]"
    call = ", ".join([arg(a) for a in op.args] + [f"{k}={arg(v)}" for k, v in op.kwargs.items()])
    via = "" if op.fn is op.node.target else f" via {getattr(op.fn, '__name__', op.fn)}"
    out = [f"  {op.node.name}({call}){via}  {op.mode} -> {' '.join(pl(p) for p in op.expect)}"]
    for r in op.redistributes:
        how = "" if r.share is None else f"  ({r.share[0]} shared)"
        out.append(f"    input {r.input}: {pl(r.src)} -> {pl(r.dst)}{how}")
    for grp in op.groups:
        members = ", ".join(str(r.input) if isinstance(r.input, int) else names.get(r.input[1][0], "?") for r in grp)
        out.append(f"    one all_reduce for inputs {members}: {pl(grp[0].src)} -> {pl(grp[0].dst)}")
    if op.frees:
        out.append("    free " + ", ".join(sorted(_key_text(k, names) for k in op.frees)))
    return out


def _key_text(key, names: dict) -> str:
    """An env key: a value (node, output), a shared redistribute's result, a loss-tail member's."""
    name = lambda i: names.get(i, f"%{i}")
    if key[0] == "shared":
        return f"{name(key[1])} at [{','.join(key[3])}]"
    if key[0] == "tail":
        return f"{name(key[1])} input {key[2]} reduced"
    return name(key[0]) + (f"[{key[1]}]" if key[1] else "")


def localize(executable, mesh_shape: tuple, device, math: bool) -> LocalProgram:
    """The local program of `executable` (autopar.execution.Executable, or anything with its fields: graph,
    placement, redistributes, shares, coalesced, fw_order) on a mesh of `mesh_shape`; `math`: attention as exact
    math (devices without the CPU kernel)."""
    g, P = executable.graph, executable.placement
    # the forward runs in the plan's order (autopar/loss_tail.py: a loss-tail group's consumers after its last
    # source), the backward in the graph's; a value is freed after its last reader in that order
    fw_at = {i: k for k, i in enumerate(executable.fw_order or ())}
    when = lambda i: fw_at.get(i, i + len(g.nodes))  # a node's place in the order of execution
    frees = _frees(g, when)
    co = executable.coalesced or {}
    share, ext = _group_reductions(g, P, executable.shares or {}, co, frees, when)
    fw, bw = [], []
    for n in g.ops():
        op = _local_op(g, P, executable.redistributes, n, share, co, ext, frees, tuple(mesh_shape), device, math)
        (fw if n.phase == "fw" else bw).append(op)
    if fw_at:
        fw.sort(key=lambda op: fw_at[op.node.idx])
    return LocalProgram(tuple(fw), tuple(bw))


def _frees(g, when) -> dict[int, list]:
    """Node -> the values of ops to drop after it: each after its last reader in the order of execution (`when`),
    the step's results after every node."""
    last = {}
    for n in g.nodes:
        for r in n.inputs():
            if (r.node, r.out) not in last or when(n.idx) > when(last[(r.node, r.out)]):
                last[(r.node, r.out)] = n.idx
    for r in g.outputs():
        last[(r.node, r.out)] = len(g.nodes)
    frees: dict[int, list] = {}
    for key, i in last.items():
        if g.nodes[key[0]].kind == "op":
            frees.setdefault(i, []).append(key)
    return frees


def _group_reductions(g, P, shares: dict, co: dict, frees: dict, when) -> tuple[dict, dict]:
    """Where redistributes are shared or grouped across consumers: ((consumer, input) -> ("store"|"load", env key),
    lead (consumer, input) of a loss-tail group -> its members at other consumers). Adds the shared results to
    `frees`."""
    # shared redistributes (passes/redistribute.py): the first consumer keeps its result in env under a key of its
    # own ("store"), the others read it ("load"); it is freed after the last of them
    share, last_share = {}, {}
    for (c, j), (c0, j0) in sorted(shares.items()):
        r = g.nodes[c0].inputs()[j0]
        key = ("shared", r.node, r.out, P[c0].ins[j0])
        share[(c0, j0)], share[(c, j)] = ("store", key), ("load", key)
        last_share[key] = max(last_share.get(key, c), c, key=when)
    ext: dict = {}  # lead (consumer, input) of a loss-tail group -> its members at other consumers
    for (c, j), (c0, j0) in sorted(co.items()):
        if c == c0:
            continue  # inputs of one op: its own group (_local_op)
        r = g.nodes[c].inputs()[j]
        held = share.get((c, j))
        key = held[1] if held is not None else ("tail", c, j)  # where the group leaves the member's result
        if held is None:
            frees.setdefault(c, []).append(key)
        share[(c, j)] = ("load", key)
        ext.setdefault((c0, j0), []).append(
            Redistribute(("ext", (r.node, r.out), key), P[r.node].out[r.out], P[c].ins[j], None)
        )
    for key, c in last_share.items():
        frees.setdefault(c, []).append(key)
    return share, ext


def _local_op(g, P, red, n, share, co, ext, frees, mesh_shape, device, math) -> LocalOp:
    """The local op of node n: its redistributes (alone or in groups), how it runs, what it frees."""
    ins, outs = P[n.idx].ins, P[n.idx].out
    conv = [
        Redistribute(j, P[r.node].out[r.out], ins[j], share.get((n.idx, j)))
        for j, r in enumerate(n.inputs())
        if (n.idx, j) in red
    ]
    out_replicated = tuple(o is None or all(p == "R" for p in o) for o in outs)
    mode, fn, contiguous, replaced, args, kwargs = _how(g, n, ins, outs, out_replicated, mesh_shape, device, math)
    if mode == "local":  # a change of label on size-1 mesh dims moves no data: an op on local shards
        conv = [
            c
            for c in conv
            if c.share is not None  # does not need it (one-device meshes)
            or any(mesh_shape[m] > 1 for m, _, _ in plan_steps(tuple(c.src), tuple(c.dst)))
        ]
    lead = {c.input: co[(n.idx, c.input)][1] for c in conv if co.get((n.idx, c.input), (None,))[0] == n.idx}
    groups = tuple(
        tuple([c for c in conv if c.input == j0 or lead.get(c.input) == j0] + ext.get((n.idx, j0), []))
        for j0 in sorted(set(lead.values()) | {j for i, j in ext if i == n.idx})
    )
    conv = tuple(c for c in conv if not any(c in grp for grp in groups))
    return LocalOp(
        n,
        mode,
        fn,
        args,
        kwargs,
        conv,
        groups,
        outs,
        out_replicated,
        tuple(frees.get(n.idx, [])),
        contiguous,
        replaced,
        causal_rows(n, ins, mesh_shape) if n.target in (SDPA, SDPA_BW) else None,
    )


def causal_rows(n, ins, mesh_shape) -> tuple | None:
    """Causal attention whose query rows are a sequence shard (context parallelism, autopar.strategies'
    attention rule: q Shard(2), K/V whole on that mesh dim): rank r's rows start at r * S / n, so the kernel's own
    causal mask (row i sees keys <= i, counted from the shard's first row) would be wrong. The placement of the
    rows of the global (Sq, Sk) causal mask that this rank's queries need, per mesh dim ("S0" where q's sequence is
    sharded); the executor cuts them from the global mask and runs the kernel non-causal with it. None when the
    kernel's own mask is right (not causal, or the query sequence whole on every mesh dim of size > 1)."""
    j = 1 if n.target is SDPA_BW else 0  # the query's input position
    names = [a.name for a in n.target._schema.arguments]
    k = names.index("is_causal")
    causal = n.args[k] if len(n.args) > k else n.kwargs.get("is_causal", False)
    rows = tuple("S0" if p == "S2" and m > 1 else "R" for p, m in zip(ins[j], mesh_shape))
    return rows if causal and "S0" in rows else None


def _how(g, n, ins, outs, out_replicated, mesh_shape, device, math) -> tuple:
    """(mode, fn, contiguous, replaced, args, kwargs) of op node n: program.py's modes; local arguments where the
    op runs on local shards with arguments of its own."""
    # tensors the forward makes or moves (arange, masks, caches, .to(device=...)) were recorded on the meta device
    # of the capture: they are made on the run device
    args, kwargs = _to_device(n.args, device), _to_device(n.kwargs, device)
    fn = LOCAL_IMPL.get(n.target, n.target)  # ops whose kernel needs more than the graph gives
    contiguous = replaced = False
    all_r = all(p == "R" for pl in ins for p in pl) and all(out_replicated)
    if n.phase == "bw" and n.target is aten.ones_like.default and n.inputs() == [g.loss]:
        mode = "seed"
    elif n.target in RANDOM:  # drawn from the program's generator (local_ops.draw_random)
        mode = "random"
    elif not n.inputs():
        mode = "factory"
    elif vocab_parallel.sharded_dims(n, Strategy(outs, ins)):  # a class-sharded loss op: its own collectives
        mode, fn = "dtensor", vocab_loss.IMPL[n.target]
    elif n.target in (SDPA, SDPA_BW):
        mode, contiguous = "local", True  # fused kernels want unit inner stride
        if math:
            fn, replaced = (attention_fw_math if n.target is SDPA else attention_bw_math), True
    elif all_r or local_exact(n, ins, outs):
        mode = "local"
    else:
        local = local_args(g, n, ins, outs, mesh_shape, device)
        if local is not None:
            mode, (args, kwargs) = "local", _to_device(local, device)
        else:
            mode = "dtensor"
    return mode, fn, contiguous, replaced, args, kwargs
