"""autopar's IR: a flat, topologically ordered list of aten op nodes of the joint forward+backward graph.

A node's tensor arguments are `Ref(node, out)` placeholders; everything else (ints, dtypes, shapes) is kept as is.
Nodes of kind "param" / "buffer" / "input" are the graph's leaves; the graph's outputs are the loss, per
parameter FQN the node holding its gradient, and per mutated buffer its new value (`Graph.outputs()`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Ref:
    node: int
    out: int = 0


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):  # sizes are read in every cost loop: computed once (not fields: eq/hash ignore them)
        object.__setattr__(self, "numel", math.prod(self.shape))
        object.__setattr__(self, "nbytes", self.numel * self.dtype.itemsize)


@dataclass
class Node:
    idx: int
    kind: str  # "op" | "param" | "buffer" | "input" | "constant"
    target: Any  # OpOverload for ops; FQN / input position for leaves
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outs: tuple[TensorMeta | None, ...] = ()
    phase: str = "fw"  # "fw" | "bw" (bw: run by autograd's backward)
    module: str = ""  # module path that produced the node, "" for the root
    users: list[int] = field(default_factory=list)
    origin: Any = None  # the user-level op whose torch decomposition produced this node, else None

    @property
    def name(self) -> str:
        if self.kind != "op":
            return f"{self.kind}:{self.target}"
        return f"%{self.idx}:{op_name(self.target)}"

    _ins: list | None = field(default=None, repr=False, compare=False)
    user_op: str | None = field(default=None, repr=False, compare=False)  # the torch call it ran for (messages)
    # a random op's first output's strides on one device: the kernels fill memory in order, so the layout decides
    # which element gets which draw (dropout on a transposed activation); None: contiguous
    stride: tuple | None = field(default=None, repr=False, compare=False)

    def inputs(self) -> list[Ref]:
        """Tensor arguments in flatten order (the order DTensor's strategies list input specs)."""
        if self._ins is None:
            self._ins = [a for a in flat_args(self.args, self.kwargs) if isinstance(a, Ref)]
        return self._ins

    @property
    def out(self) -> TensorMeta:
        return self.outs[0]


_NAMES: dict = {}


def op_name(target) -> str:
    s = _NAMES.get(target)
    if s is None:
        s = str(target)
        s = _NAMES[target] = s[len("aten.") :] if s.startswith("aten.") else s
    return s


def flat_args(args, kwargs):
    out = []

    def walk(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
        else:
            out.append(a)

    walk(args)
    walk(kwargs)
    return out


def map_refs(a, fn):
    """Rebuild args/kwargs with every Ref replaced by fn(ref)."""
    if isinstance(a, Ref):
        return fn(a)
    if isinstance(a, tuple):
        return tuple(map_refs(x, fn) for x in a)
    if isinstance(a, list):
        return [map_refs(x, fn) for x in a]
    if isinstance(a, dict):
        return {k: map_refs(v, fn) for k, v in a.items()}
    return a


@dataclass
class Graph:
    nodes: list[Node]
    params: dict[str, int]  # param FQN -> node idx
    buffers: dict[str, int]  # buffer FQN -> node idx
    inputs: list[int]  # example input position -> node idx
    loss: Ref
    grads: dict[str, Ref]  # param FQN -> gradient ref
    aliases: dict[str, str] = field(default_factory=dict)  # tied param FQN -> the FQN it shares storage with
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors the model closed over
    input_grads: dict[int, Ref] = field(default_factory=dict)  # input position -> its gradient (output="activation")
    activation: bool = False  # `loss` is a part's output activation, its backward seeded from outside
    # buffer FQN -> its new value after the forward (BatchNorm's running stats): outputs of the step, like the loss,
    # which the executor writes into the buffer
    state_updates: dict[str, Ref] = field(default_factory=dict)
    io: Any = None  # model_io.ModelIO: how the model is called; input targets are its leaf indices
    guards: list = field(default_factory=list)  # guards.Guard: data-dependent checks the capture specialized on

    def __post_init__(self):
        for n in self.nodes:
            n.users = []
        for n in self.nodes:
            for r in n.inputs():
                self.nodes[r.node].users.append(n.idx)

    def outputs(self) -> list[Ref]:
        """Every value the step hands out: the loss, the gradients, input gradients and buffer updates."""
        return [self.loss, *self.grads.values(), *self.input_grads.values(), *self.state_updates.values()]

    def meta(self, r: Ref) -> TensorMeta:
        return self.nodes[r.node].outs[r.out]

    def ops(self):
        return (n for n in self.nodes if n.kind == "op")

    def param_of(self, idx: int) -> str | None:
        n = self.nodes[idx]
        return n.target if n.kind == "param" else None

    def num_params(self) -> int:
        return sum(self.nodes[i].out.numel for i in self.params.values())

    def __len__(self):
        return len(self.nodes)


def param_root(g: "Graph", idx: int) -> str | None:
    """The parameter FQN a tensor derives from through single-input ops (views, transposes, casts), else None:
    redistributes of such values are parameter gathers, which engines prefetch and overlap with compute."""
    seen = 0
    while g.nodes[idx].kind == "op" and seen < 64:
        ins = g.nodes[idx].inputs()
        if len(ins) != 1:
            return None
        idx, seen = ins[0].node, seen + 1
    return g.nodes[idx].target if g.nodes[idx].kind == "param" else None
