"""`parallelize(..., compile=...)`: each rank's local program compiled between its collectives.

The program (backends/spmd/program.py) is a list of instructions per phase. A maximal run of instructions that are plain
local ops (no redistribute before them, no DTensor dispatch, no random draw, no factory, no loss seed) is a
*segment*: one FX graph of aten ops on local shards, compiled by a torch.compile backend's compiler (Inductor by
default). Everything else runs as in the eager program, through its one-instruction interpreter (`run1`), so:
  - every collective (redistributes, loss-tail groups, gradient buckets) is issued by the same code, in the same
    order, and counted by the same counters;
  - random ops stay outside the compiled regions and draw from the program's generator
    (backends/spmd/local_ops.py draw_random): the masks one device draws;
  - a gradient bucket is launched right after the instruction that completes it: a backward segment ends there.
Within a segment a view becomes a reshape (a shard laid out otherwise than on one device cannot alias its input:
the eager program copies it, local_ops.view_of_copy; no value is mutated in a captured step, so the values are the
same). Gradients are copied into their bucket's flat buffer after the segment that makes them (the eager program
makes some in place with out= overloads, which a compiled graph does not take).
A segment is compiled on its first call by the backend's compiler itself (Inductor's compile_fx, AOTAutograd for
"aot_eager") given the graph and the call's inputs, not through a Dynamo frame: the graph is already aten ops, and
a Dynamo call's guards and wrappers cost about as much as the few dozen small ops of a typical segment. Segments
shorter than `min_ops` run their FX graph uncompiled. Python dispatch modes active while a segment compiles (a
collective counter) are suspended for it; no segment holds a collective, so a counter still sees every one.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils import _python_dispatch

from .interpreter import Sharded
from .local_ops import LOCAL_IMPL, VIEWS

aten = torch.ops.aten
BACKENDS = ("inductor", "aot_eager", "eager")


def compile_option(compile) -> str | None:
    """The torch.compile backend of a `compile=` argument (True: Inductor), or None; a clear error otherwise."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile in BACKENDS:
        return compile
    raise ValueError(f"compile must be True, False or a torch.compile backend among {BACKENDS}, got {compile!r}")


_EAGER_KERNELS = frozenset(LOCAL_IMPL.values())  # wrappers fixing what a CPU kernel refuses: run them eagerly


def compilable(it) -> bool:
    """An instruction the compiled program runs inside a segment: a local op on local shards, nothing around it.
    Ops with a local_ops.LOCAL_IMPL wrapper (histc on ints, _grouped_mm's alignment copies) stay eager: the
    wrapper's host-side fixes are not what a compiler traces (`offs has to be 1D` from _grouped_mm under tracing)."""
    return (
        it.mode == "local"
        and not it.redistributes
        and not it.groups
        and not it.contiguous
        and not it.replaced
        and it.fn not in _EAGER_KERNELS
    )


def _single(fn) -> bool:
    s = getattr(fn, "_schema", None)
    return s is not None and len(s.returns) == 1 and str(s.returns[0].type) == "Tensor"


class Segment:
    """One compiled region: reads `ins` from env, writes `outs` to env (Sharded where the plan shards them), drops
    `drops` after."""

    def __init__(self, prog, instrs: list, needed: set, backend: str, min_ops: int):
        P = prog.P
        self.instrs, self.n_ops = instrs, len(instrs)
        made, ins, freed = {}, [], set()
        for it in instrs:
            for k in it.keys:
                if k not in made and k not in ins:
                    ins.append(k)
            for k in range(len(it.node.outs)):
                made[(it.node.idx, k)] = it
            freed.update(it.frees)
        self.ins = ins
        self.in_sharded = [not all(p == "R" for p in P[k[0]].out[k[1]]) for k in ins]
        self.outs = [k for k in made if k in needed and k not in freed]
        self.wrap = []  # (placements, global shape) of a sharded output, else None
        for k in self.outs:
            it = made[k]
            self.wrap.append(None if it.out_replicated[k[1]] else (it.expect[k[1]], tuple(it.node.outs[k[1]].shape)))
        self.drops = [k for k in freed if k not in made or k not in self.outs]
        self.gm = _graph(instrs, ins, self.outs)
        self.backend = backend
        self.compiled = self.n_ops >= min_ops
        self.fns: dict = {}  # input strides -> the compiled function for them
        self.compile_s = 0.0

    def _compile(self, vals, key):
        """The segment compiled for these inputs' layouts by the torch.compile backend's compiler itself (given the
        FX graph and example inputs, as Dynamo would give them): no Dynamo frame, no guards, a fraction of a
        torch.compile call's cost; shapes are the plan's, and a new layout compiles again (`key`)."""
        import time
        from torch._dynamo import lookup_backend

        t0 = time.perf_counter()
        with _python_dispatch._disable_current_modes():  # a user's mode (a counter) must not see the tracing
            gm = _graph(self.instrs, self.ins, self.outs)  # a fresh graph: compilers may rewrite theirs
            fn = self.fns[key] = lookup_backend(self.backend)(gm, list(vals))
        self.compile_s += time.perf_counter() - t0
        return fn

    def __call__(self, env, Sharded):
        vals = [env[k].t if s else env[k] for k, s in zip(self.ins, self.in_sharded)]
        if self.compiled:
            key = tuple(t.stride() for t in vals)
            fn = self.fns.get(key) or self._compile(vals, key)
            res = fn(*vals)
        else:
            res = self.gm(*vals)
        for k, t, w in zip(self.outs, res, self.wrap):
            if isinstance(t, torch.Tensor):
                env[k] = t if w is None else Sharded(t, w[0], w[1])
        for k in self.drops:
            env.pop(k, None)


def _graph(instrs, ins, outs) -> fx.GraphModule:
    """The segment as an FX graph of aten ops: placeholders for its inputs, one node per op (getitem per output of
    a multi-output op), its outputs as a tuple."""
    g = fx.Graph()
    # names by position, not by node: the segments of repeated blocks are the same graph, which Inductor's FX graph
    # cache then compiles once
    vals = {k: g.placeholder(f"a{i}") for i, k in enumerate(ins)}
    for it in instrs:
        n = it.node
        args, kwargs = it.bind([vals[k] for k in it.keys])
        fn = aten.reshape.default if it.fn in VIEWS else it.fn
        node = g.call_function(fn, tuple(args), dict(kwargs))
        if _single(it.fn):
            vals[(n.idx, 0)] = node
        else:
            for k in range(len(n.outs)):
                vals[(n.idx, k)] = g.call_function(operator.getitem, (node, k))
    g.output(tuple(vals[k] for k in outs))
    return fx.GraphModule(torch.nn.Module(), g)


def needed_values(g) -> set:
    """Every value something reads after the op that makes it: an op, or the step's results."""
    keys = {(r.node, r.out) for n in g.nodes for r in n.inputs()}
    return keys | {(r.node, r.out) for r in g.outputs()}


def build(prog, instrs: list, launch_at, ready, backend: str, min_ops: int = 3):
    """The phase as `run(env, L, run1, B=None)` (the eager program's contract, program.Program._compile): segments
    compiled, the other instructions through run1; `L[pos]()` after instruction pos as in the eager program, at the
    end of the segment holding pos (a segment ends at every position in `ready`, where a bucket launches).
    Returns (run, segments)."""
    needed = needed_values(prog.g)
    steps, segs, cur = [], [], []

    def close(end_pos):
        if cur:
            seg = Segment(prog, [it for _, it in cur], needed, backend, min_ops)
            segs.append(seg)
            steps.append(("seg", seg, [p for p, _ in cur if p in launch_at]))
            cur.clear()

    for pos, it in enumerate(instrs):
        if compilable(it):
            cur.append((pos, it))
            if pos in ready:
                close(pos)
        else:
            close(pos)
            steps.append(("one", it, [pos] if pos in launch_at else []))
    close(len(instrs))

    def run(env, L, run1, B=None):
        for kind, what, launches in steps:
            if kind == "seg":
                what(env, Sharded)
            else:
                run1(what, env)
            for p in launches:
                L[p]()
        return env

    return run, segs


def summary(segs) -> dict:
    """How much of a phase is compiled: segments, compiled segments, ops in them."""
    return {
        "segments": len(segs),
        "compiled": sum(s.compiled for s in segs),
        "compiled_ops": sum(s.n_ops for s in segs if s.compiled),
        "ops": sum(s.n_ops for s in segs),
        "compile_s": round(sum(s.compile_s for s in segs), 2),
    }
