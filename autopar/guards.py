"""Guards: the data-dependent checks a capture was specialized on, as torch.export specializes on its example inputs.

Where a model's Python branches on a tensor value (`if (mask == 1).all():`, `.item()`), the recorder meets
aten._local_scalar_dense. It takes the cone of recorded nodes that produce the tensor (a few ops back to the
model's inputs, constants, parameters or buffers), evaluates it on the real example values, hands that Python value
to the model, and keeps the cone with the value as a `Guard`. A plan is valid only for inputs on which every guard
gives the same value again: the runtime evaluates each guard on a step's global inputs before the step (the cones
are small) and stops with a clear error when one differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .graph import Node, Ref, map_refs


class NoRealValue(Exception):
    """A guard's cone reads a value that has no data here (a meta-device weight, a meta input)."""

    def __init__(self, leaf: tuple):
        super().__init__(leaf)
        self.leaf = leaf


@dataclass
class Guard:
    """A small program: `ops` [(target, args, kwargs)] whose Refs point at earlier entries of `ops` (node =
    position) or at `leaves` (node = -1 - position); the value of the last op's `out`, made a Python scalar, must
    equal `expected`."""

    leaves: list[tuple]  # ("input", leaf index) | ("param", FQN) | ("buffer", FQN) | ("constant", name)
    ops: list[tuple]
    out: int
    expected: object
    module: str
    ops_text: str = field(default="")

    def evaluate(self, leaf_value) -> object:
        """The guard's scalar on real values; leaf_value(leaf) gives a leaf's tensor (raises NoRealValue)."""
        vals: dict[int, object] = {}

        def get(r: Ref):
            if r.node < 0:
                key = -1 - r.node
                if key not in vals:
                    vals[key] = leaf_value(self.leaves[key])
                v = vals[key]
            else:
                v = vals[("op", r.node)]
            return v[r.out] if isinstance(v, (tuple, list)) else v

        for k, (target, args, kwargs) in enumerate(self.ops):
            vals[("op", k)] = target(*_cpu(map_refs(args, get)), **_cpu(map_refs(kwargs, get)))
        res = vals[("op", len(self.ops) - 1)]
        res = res[self.out] if isinstance(res, (tuple, list)) else res
        return res.item()

    def inputs_read(self, input_names=None) -> list[str]:
        """What the check reads: 'input attention_mask', 'param lin.weight'..."""
        return [
            f"input '{input_names[name]}'" if kind == "input" and input_names else f"{kind} '{name}'"
            for kind, name in self.leaves
        ]


def _cpu(a):
    """Factory arguments recorded on the meta device run on the CPU here (guards run on the host)."""
    if isinstance(a, torch.device) and a.type == "meta":
        return torch.device("cpu")
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu(x) for x in a)
    if isinstance(a, dict):
        return {k: _cpu(v) for k, v in a.items()}
    return a


def _draws(n: Node) -> bool:
    """Whether op node `n` draws random numbers: a seeded op, unless its dropout is off (attention kernels are
    tagged seeded for their dropout_p; an MoE router after attention with dropout_p=0 is deterministic)."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    schema = n.target._schema.arguments  # dispatch leaves out arguments at their defaults
    named = {a.name: a.default_value for a in schema if a.has_default_value()}
    named |= dict(zip((a.name for a in schema), n.args)) | dict(n.kwargs)
    return not (named.get("dropout_p") == 0.0 or named.get("train") is False)


def build_guard(nodes: list[Node], ref: Ref, module: str) -> Guard:
    """The cone of `nodes` that produces `ref`, as a Guard (expected value not yet known)."""
    cone, stack = set(), [ref.node]
    while stack:
        i = stack.pop()
        if i in cone:
            continue
        cone.add(i)
        if nodes[i].kind == "op":
            stack.extend(r.node for r in nodes[i].inputs())
    leaves, ops, pos = [], [], {}
    for i in sorted(cone):
        n = nodes[i]
        if n.kind != "op":
            pos[i] = -1 - len(leaves)
            leaves.append((n.kind, n.target))
            continue
        if _draws(n):
            raise NoRealValue(("random op", str(n.target)))
        fix = lambda r: Ref(pos[r.node], r.out)
        ops.append((n.target, map_refs(n.args, fix), map_refs(n.kwargs, fix)))
        pos[i] = len(ops) - 1
    text = " -> ".join(str(t).removeprefix("aten.") for t, _, _ in ops[-4:])
    if not ops:  # the scalar of a leaf itself: an identity op keeps evaluate() uniform
        ops.append((torch.ops.aten.alias.default, (Ref(pos[ref.node], ref.out),), {}))
        ref = Ref(len(ops) - 1, 0)
        text = "its value"
    return Guard(leaves, ops, ref.out, None, module, text)


def check_guards(guards: list[Guard], leaf_value, where: str, input_names=None):
    """Raise when a guard's value differs from the example's (before any collective of the step)."""
    for gd in guards:
        got = gd.evaluate(leaf_value)
        if got != gd.expected:
            raise GuardError(
                f"{where}: the plan was captured with a data-dependent check in module '{gd.module or '<root>'}' "
                f"({gd.ops_text}, reading {', '.join(gd.inputs_read(input_names))}) that gave {gd.expected!r} on the example "
                f"inputs; this step's inputs give {got!r}, so the model would take another path than the plan. "
                f"Plan again with example inputs like these (autopar.parallelize(...))."
            )


class GuardError(ValueError):
    """A step's inputs break a data-dependent check the plan was specialized on."""
