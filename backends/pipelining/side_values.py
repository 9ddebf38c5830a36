"""Values the first pipeline stage makes from its parameters before the blocks that later stages read besides the
running tensor: RoFormer's sinusoidal positions and MPNet's relative position bias handed to every block, the
encoder output every decoder block of T5 or nn.Transformer cross-attends to, CLIP's image embeddings the loss reads
after the text blocks. Later stages do not hold those parameters, so such a value travels with the running tensor:
stage 0 sends (running tensor, side values...), each later stage receives them, its stand-in for the module that
made them returns them, and it sends them on. The copy it sends on carries the next stage's gradient back into the
received tensor, where the stage's own reads add theirs, so PipelineStage sends the sum back, and stage 0's
backward takes it into the module's parameters as one device's would.

Which modules make such values is seen in the probe forward (forward_stage.probe): `Tracker` marks the tensors each
module before the blocks that holds parameters returns, carries the marks through every torch function, and
records the marks that reach a block other than through its running tensor, or anything after the last block
(each block's handed-on running tensor is unmarked: the pipeline carries it).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary


def _tensors(tree) -> list:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def probed(out) -> tuple:
    """A module's output as a stand-in returns it: its tree spec and leaves, the tensors as meta tensors."""
    leaves, spec = pytree.tree_flatten(out)
    return spec, [t.detach().to("meta") if isinstance(t, torch.Tensor) else t for t in leaves]


class Tracker(TorchFunctionMode):
    """During the probe forward: `sides` (after it) maps each module before the blocks whose output a block reads
    besides its running tensor, or the forward after the last block, to that output's tree spec and leaves (meta
    tensors and the other values as they are); `made` maps each such module that holds parameters to its output
    alike; `between` names a block whose running tensor the forward computes on before the next block takes it
    (a residual added outside the blocks), which a stage boundary would skip."""

    def __init__(self, model, modules: list, blocks: list, hidden_of):
        super().__init__()
        self.marks = WeakTensorKeyDictionary()
        self.made, self.read, self.started, self.after = {}, set(), False, False
        self.handed = self.between = None  # (block, its running tensor); a block whose output the forward edits
        self._hidden_of = hidden_of
        get = model.get_submodule
        self._handles = [get(f).register_forward_hook(self._made(f)) for f in modules]
        self._handles += [get(f).register_forward_pre_hook(self._enter, with_kwargs=True) for f in blocks]
        self._handles += [get(f).register_forward_hook(self._leave(f, f == blocks[-1])) for f in blocks]

    @property
    def sides(self) -> dict:
        return {f: self.made[f] for f in sorted(self.read)}

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def _made(self, fqn):
        def hook(mod, args, out):
            if self.started or not any(True for _ in mod.parameters()):
                return
            for t in _tensors(out):
                self.marks[t] = {fqn}
            self.made[fqn] = probed(out)

        return hook

    def _enter(self, mod, args, kwargs):
        self.started = True
        hidden = self._hidden_of(args, kwargs)
        if self.handed is not None and hidden is not self.handed[1]:
            self.between = self.between or self.handed[0]
        for t in _tensors((args, kwargs)):
            if t is not hidden:
                self.read |= self.marks.get(t, set())

    def _leave(self, fqn: str, last: bool):
        def hook(mod, args, out):
            running = out if isinstance(out, torch.Tensor) else out[0]
            self.marks.pop(running, None)
            self.after = self.after or last
            self.handed = (fqn, running)

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        got = set()
        for t in _tensors((args, kwargs)):
            got |= self.marks.get(t, set())
        if got:
            if self.after:
                self.read |= got
            for t in _tensors(out):
                self.marks[t] = self.marks.get(t, set()) | got
        return out


def check(sides: dict, owner: dict, is_value) -> None:
    """Refuse a side value the stages cannot send: one made on a stage after the first (a later stage would wait
    for it), or a module output holding something other than tensors and shape values (`is_value`)."""
    for f, (_, leaves) in sides.items():
        if owner.get(f, 0) != 0:
            raise NotImplementedError(
                f"module '{f}' (stage {owner[f]}) makes a value from its parameters before the blocks that later "
                f"blocks or the head read: the pipeline runtime sends such values on from the first stage only"
            )
        index = next((v for v in leaves if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
        if index is not None:  # PipelineStage infers shapes by running the stage on uninitialized inputs
            raise NotImplementedError(
                f"module '{f}' makes a {index.dtype} tensor of shape {tuple(index.shape)} (indices, e.g. a random "
                f"masking's restore order) that later stages read: torch's pipeline stages infer their shapes by "
                f"running on uninitialized inputs, out-of-range indices there"
            )
        odd = next((v for v in leaves if not isinstance(v, torch.Tensor) and not is_value(v)), None)
        if odd is not None:
            raise NotImplementedError(
                f"module '{f}' returns {type(odd).__name__} besides tensors, and later stages read its output: a "
                f"pipeline stage sends tensors and stands in for shape values only"
            )


def capture(run, fqn: str, holder: dict):
    """The first stage's forward of side module `fqn`: runs it and keeps its output's tensors to send."""

    def forward(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        holder["made"][fqn] = _tensors(out)
        return out

    return forward


def stand_in(made: tuple, fqn: str, holder: dict):
    """A later stage's forward of side module `fqn`: its output as probed, the tensors the ones received."""
    spec, leaves = made

    def forward(self, *args, **kwargs):
        got = iter(holder["got"][fqn])
        return pytree.tree_unflatten([next(got) if isinstance(v, torch.Tensor) else v for v in leaves], spec)

    return forward


def receive(sides: dict, recv: tuple, mark) -> dict:
    """The received side tensors per module (in `sides`' order, each output's leaves in tree order), each through
    `mark` (forward_stage's contiguous gradient)."""
    got, i = {}, 0
    for f, (_, leaves) in sides.items():
        n = sum(isinstance(v, torch.Tensor) for v in leaves)
        got[f] = [mark(t) for t in recv[i : i + n]]
        i += n
    if i != len(recv):
        raise RuntimeError(f"pipeline stage received {len(recv)} side tensors, its plan sends {i}")
    return got


def outgoing(sides: dict, holder: dict, first: bool) -> list:
    """What a stage sends after its running tensor: the side tensors the first stage made, or a later stage's
    received ones copied (its output: the next stage's gradient flows back through the copy into the received
    tensor)."""
    out = []
    for f in sides:
        out += [t.contiguous() for t in holder["made"][f]] if first else [t.clone() for t in holder["got"][f]]
    return out
