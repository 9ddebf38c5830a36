"""Values a pipeline stage makes from its parameters that later stages read besides the running tensor: before
the blocks, RoFormer's sinusoidal positions and MPNet's relative position bias handed to every block, the encoder
output every decoder block of T5 or nn.Transformer cross-attends to, CLIP's image embeddings the loss reads after
the text blocks; in the blocks, the position bias T5's first block computes and hands to the blocks after it, or
router logits an MoE block returns for the loss. Later stages do not hold those parameters, so such a value travels with
the running tensor: the stage that makes it sends (running tensor, side values...), each later stage receives them,
its stand-in for the module or block that made them returns them, and it sends them on. The copy it sends on
carries the next stage's gradient back into the received tensor, where the stage's own reads add theirs, so
PipelineStage sends the sum back, and the making stage's backward takes it into the parameters as one device's
would.

Which values those are is seen in the probe forward (forward_stage.probe): `Tracker` marks the tensors each
module before the blocks that holds parameters returns and each block returns after its running tensor, carries
the marks through every torch function, and records the marks that reach a block other than through its running
tensor, or anything after the last block (each block's handed-on running tensor is unmarked: the pipeline carries
it). A side value's key is the module's FQN, or `<block FQN>:<index in its output>`.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary


def _tensors(tree) -> list:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def shape_value(v) -> bool:
    """An int, None or a tuple / list of them: what a module derives from its input's shape, alike for every
    micro-batch of one shape (the pipeline refuses other shapes), so a stand-in may return the probed value."""
    return v is None or type(v) is int or isinstance(v, (tuple, list)) and all(shape_value(x) for x in v)


def probed(out) -> tuple:
    """A module's output as a stand-in returns it: its tree spec and leaves, the tensors as meta tensors."""
    leaves, spec = pytree.tree_flatten(out)
    return spec, [t.detach().to("meta") if isinstance(t, torch.Tensor) else t for t in leaves]


class Tracker(TorchFunctionMode):
    """During the probe forward: `sides` (after it) maps each value later stages read besides the running tensor to
    its tree spec and leaves (meta tensors and the other values as they are); `made` maps each module before the
    blocks that holds parameters to its output alike; `between` names a block whose running tensor the forward
    computes on before the next block takes it (a residual added outside the blocks), which a stage boundary would
    skip; `escaped` a block a value made inside leaves other than through the block's output (a forward hook
    recording it, as transformers' output recorders keep router logits), which a stage standing in for the block
    never makes."""

    def __init__(self, model, modules: list, blocks: list, hidden_of):
        super().__init__()
        self.marks = WeakTensorKeyDictionary()
        self.made, self.read, self.started, self.after = {}, set(), False, False
        self.handed = self.between = self.inside = self.escaped = None  # handed: (block, its running tensor)
        self.alias, self.taken = {}, WeakTensorKeyDictionary()  # a block output that is a side value it took
        self._hidden_of = hidden_of
        get = model.get_submodule
        self._handles = [get(f).register_forward_hook(self._made(f)) for f in modules]
        self._handles += [get(f).register_forward_pre_hook(self._enter(f), with_kwargs=True) for f in blocks]
        self._handles += [get(f).register_forward_hook(self._leave(f, f == blocks[-1])) for f in blocks]

    @property
    def sides(self) -> dict:
        """The side values later stages read: {key: (tree spec, probed leaves)}."""
        return {f: self.made[f] for f in sorted(self.read) if f in self.made}

    @property
    def aliases(self) -> dict:
        """The block outputs that hand a side value back as it came in: {block key: the side value's key}."""
        return {k: v for k, v in self.alias.items() if v in self.read}

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

    def _reads(self, marks: set) -> None:
        self.read |= marks
        inner = sorted(m for m in marks if m.endswith("!in"))
        self.escaped = self.escaped or (inner[0][: -len("!in")] if inner else None)

    def _enter(self, fqn: str):
        def hook(mod, args, kwargs):
            self.started, self.inside = True, fqn
            hidden = self._hidden_of(args, kwargs)
            self.taken = WeakTensorKeyDictionary({t: True for t in _tensors((args, kwargs))})
            if self.handed is not None and hidden is not self.handed[1]:
                self.between = self.between or self.handed[0]
            for t in _tensors((args, kwargs)):
                if t is not hidden:
                    self._reads(self.marks.get(t, set()))

        return hook

    def _leave(self, fqn: str, last: bool):
        def hook(mod, args, out):
            self.inside = None
            running = out if isinstance(out, torch.Tensor) else out[0]
            self.marks.pop(running, None)
            for i, t in enumerate(() if isinstance(out, torch.Tensor) else out[1:], 1):
                if not isinstance(t, torch.Tensor):
                    continue
                came = self.marks.get(t, set())
                if len(came) == 1 and t in self.taken:  # a value it took, handed back (T5's position bias)
                    self.alias[f"{fqn}:{i}"] = next(iter(came))
                else:
                    self.marks[t] = {f"{fqn}:{i}"}
                    self.made[f"{fqn}:{i}"] = probed(t)
            self.after = self.after or last
            self.handed = (fqn, running)

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = _tensors(out)
        if not made:  # a shape, dtype or device: no value flows on
            return out
        got = set()
        for t in _tensors((args, kwargs)):
            got |= self.marks.get(t, set())
        if self.after:
            self._reads(got)
        if self.inside is not None:  # made inside a block: it leaves through the block's output or not at all
            self._reads({m for m in got if m.endswith("!in") and m != self.inside + "!in"})
            got = {m for m in got if not m.endswith("!in")} | {self.inside + "!in"}
        name = getattr(func, "__name__", "")
        if not (name == "__setitem__" or name.endswith("_") and not name.endswith("__")):  # not in place
            ins = {id(t) for t in _tensors((args, kwargs))}
            made = [t for t in made if id(t) not in ins]  # `x.to(x.dtype)` returns x: its marks stay its own
        for t in made if got else ():
            self.marks[t] = self.marks.get(t, set()) | got
        return out


def producer(key: str, owner: dict) -> int:
    """The stage that makes side value `key` (`owner`: each stage module's or block's stage)."""
    return owner[key.rpartition(":")[0] if ":" in key else key]


def routes(sides: dict, owner: dict, k: int, last: bool) -> tuple[list, list]:
    """(the keys stage k receives, the keys it sends after its running tensor), in `sides`' order: what earlier
    stages made, and that plus what it makes, to every later stage (one send list per boundary)."""
    made = {key: producer(key, owner) for key in sides}
    return [key for key in sides if made[key] < k], [] if last else [key for key in sides if made[key] <= k]


def check(sides: dict) -> None:
    """Refuse a side value the stages cannot send: an integer tensor, or an output holding something other than
    tensors and shape values."""
    for key, (_, leaves) in sides.items():
        what = f"block '{key.rpartition(':')[0]}'" if ":" in key else f"module '{key}'"
        index = next((v for v in leaves if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
        if index is not None:  # PipelineStage infers shapes by running the stage on uninitialized inputs
            raise NotImplementedError(
                f"{what} makes a {index.dtype} tensor of shape {tuple(index.shape)} (indices, e.g. a random "
                f"masking's restore order) that later stages read: torch's pipeline stages infer their shapes by "
                f"running on uninitialized inputs, out-of-range indices there"
            )
        odd = next((v for v in leaves if not isinstance(v, torch.Tensor) and not shape_value(v)), None)
        if odd is not None:
            raise NotImplementedError(
                f"{what} returns {type(odd).__name__} besides tensors, and later stages read its output: a "
                f"pipeline stage sends tensors and stands in for shape values only"
            )


def capture(run, fqn: str, holder: dict):
    """The making stage's forward of side module `fqn`: runs it and keeps its output's tensors to send."""

    def forward(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        holder["made"][fqn] = _tensors(out)
        return out

    return forward


def keep(fqn: str, out, sides: dict, holder: dict) -> None:
    """The making stage's block `fqn` ran: keep its side outputs (keys `fqn:i`) to send."""
    for i, t in enumerate(() if isinstance(out, torch.Tensor) else out[1:], 1):
        if f"{fqn}:{i}" in sides:
            holder["made"][f"{fqn}:{i}"] = [t]


def stand_in(made: tuple, fqn: str, holder: dict):
    """A later stage's forward of side module `fqn`: its output as probed, the tensors the ones received."""
    spec, leaves = made

    def forward(self, *args, **kwargs):
        got = iter(holder["got"][fqn])
        return pytree.tree_unflatten([next(got) if isinstance(v, torch.Tensor) else v for v in leaves], spec)

    return forward


def received(fqn: str, rest: tuple, sides: dict, aliases: dict, holder: dict) -> tuple:
    """A later stage's stand-in for block `fqn`: the values after its running tensor (`rest`, as probed), each
    side output (or side value it hands back, `aliases`) the one received."""
    keys = [aliases.get(f"{fqn}:{i}", f"{fqn}:{i}") for i in range(1, len(rest) + 1)]
    return tuple(holder["got"][key][0] if key in sides else v for key, v in zip(keys, rest))


def receive(sides: dict, keys: list, recv: tuple, mark) -> dict:
    """The received side tensors per key (`keys` in order, each output's leaves in tree order), each through
    `mark` (forward_stage's contiguous gradient)."""
    got, i = {}, 0
    for key in keys:
        n = sum(isinstance(v, torch.Tensor) for v in sides[key][1])
        got[key] = [mark(t) for t in recv[i : i + n]]
        i += n
    if i != len(recv):
        raise RuntimeError(f"pipeline stage received {len(recv)} side tensors, its plan sends {i}")
    return got


def outgoing(keys: list, holder: dict) -> list:
    """What a stage sends after its running tensor: the side tensors it made, and the ones it received copied (its
    output: the next stage's gradient flows back through the copy into the received tensor)."""
    out = []
    for key in keys:
        mine = key in holder["made"]
        out += [t.contiguous() if mine else t.clone() for t in (holder["made"] if mine else holder["got"])[key]]
    return out
