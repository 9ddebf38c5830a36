"""What the torch backend runs, recognized from a Plan (recognize.py) and applied to the user's module
(apply.py): the FSDP units, the ParallelStyles, the gradient buckets and the loss hook, each with why; and the
view of a plan's node records that recognition reads (_Graph)."""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel

from .source import report, source_of


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

    def build(self):
        """The ParallelStyle object itself, built from the same keyword sources `code()` prints."""
        layouts = {"Shard": Shard, "Replicate": Replicate}
        kwargs = {k: _layout_value(ast.parse(v, mode="eval").body, layouts) for k, v in self.kwargs.items()}
        return getattr(parallel, self.cls)(**kwargs)


def _layout_value(node, layouts):
    """A keyword's value from its source: constants, tuples, Shard(k) / Replicate() (what tp.py writes)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, ast.Tuple):
        return tuple(_layout_value(e, layouts) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in layouts:
        return layouts[node.func.id](*[_layout_value(a, layouts) for a in node.args])
    raise ValueError(f"not a layout the torch backend writes: {ast.unparse(node)}")


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
    float8: list = field(default_factory=list)  # nn.Linear FQNs computing in float8 (backends/float8_linear.py)
    checkpoint: list = field(default_factory=list)  # block FQNs
    loss_parallel: bool = False
    input_placements: list = field(default_factory=list)
    reasons: list = field(default_factory=list)  # (part, why it cannot be lowered)
    notes: list = field(default_factory=list)
    block_fqns: list = field(default_factory=list)  # the plan's repeated blocks ("layers.0", ...)
    tp_roles: dict = field(default_factory=dict)  # (node, input) -> what a forward redistribute on tp is
    mean_loss: dict | None = None  # the loss hook (loss.py): labels, ignore_index, ...
    parts: dict = field(default_factory=dict)  # module FQN the graph backend runs -> its Part (mixed.py)
    part_params: list = field(default_factory=list)  # their parameters (FSDP ignores them, the part reduces them)

    @property
    def expressible(self) -> bool:
        return not self.reasons

    def code(self) -> str:
        return source_of(self)

    def report(self) -> str:
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
    """Plan records, typed (NodeRecord, RedistributeRecord), with users, module membership and the parameter chains
    (views/casts of a parameter)."""

    def __init__(self, plan):
        self.plan = plan
        if plan.nodes and "inputs" not in plan.nodes[-1]:
            raise EngineLoweringError(
                "this plan has no input edges in its node records (saved by an older autopar); plan it again"
            )
        self.nodes = plan.node_records()
        self.users = defaultdict(list)  # node -> [(user, input position, producer output)]
        for n in self.nodes:
            for j, (p, o) in enumerate(n.inputs):
                self.users[p].append((n.idx, j, o))
        self.param_node = {n.target: n.idx for n in self.nodes if n.kind == "param"}
        self.red = {(r.consumer, r.input): r for r in plan.redistribute_records()}

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
                if ur.kind == "op" and len(ur.inputs) == 1:
                    nodes.append(u)
                    stack.append(u)
                else:
                    edges.append((u, j, i))
        return nodes, edges

    def in_module(self, i, mod) -> bool:
        m = self.nodes[i].module
        return mod == "" or m == mod or m.startswith(mod + ".")
