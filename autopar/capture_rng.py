"""Random draws and activation checkpointing during capture.

The CPU generator's state: activation checkpointing (torch.utils.checkpoint, transformers'
gradient_checkpointing_enable) saves `torch.get_rng_state()` in the forward and, recomputing the block in the
backward, restores it, so the recomputed dropout masks are the forward's. Capture draws nothing (meta tensors), and
the program draws each recorded random op afresh (backends/spmd/local_ops.draw_random), so a recomputed draw would
be a second, different mask: gradients of another model, silently. Here the states capture hands out stand for
positions in the stream of recorded random ops; a draw made after restoring one repeats the draw recorded at that
position, and the recorder reuses its value instead of recording a new random op. fork_rng (which checkpoint's
recompute runs under, and which skips meta devices) restores the position on exit, as it restores the generator.
Dead draws (RngStream.carry_dead_draws) keep the stream one device's when the loss does not read a random op; a
reentrant checkpoint is refused with its module named (reentrant_checkpoint_error).
"""

from __future__ import annotations

import contextlib

import torch

from .capture_error import CaptureError


class RngStream:
    """The random ops recorded so far in eager's order, and the position of the next draw in that stream."""

    def __init__(self):
        self.draws: list[tuple] = []  # (op, output metas, output refs) per recorded random op
        self.pos = 0
        self.states: dict[int, int] = {}  # id(a state tensor handed out) -> the position it stands for
        self.keep: list[torch.Tensor] = []  # keeps those ids alive

    def replay(self, func, metas, where: str):
        """The refs of the draw this one repeats (the stream was rewound to before it), else None (a new draw)."""
        if self.pos >= len(self.draws):
            return None
        op, seen, refs = self.draws[self.pos]
        if op is not func or seen != metas:
            raise CaptureError(
                f"random op {func} in {where} runs after the RNG state was restored (activation checkpointing's "
                f"recompute?) but does not repeat the draw made from that state ({op}): the recomputation draws "
                f"differently from the forward"
            )
        self.pos += 1
        return refs

    def record(self, func, metas, refs) -> None:
        self.draws.append((func, metas, refs))
        self.pos = len(self.draws)

    def carry_dead_draws(self, nodes: list, live: set[int]) -> None:
        """Random ops whose values the loss never reads (the dropout of a branch the loss does not use) leave the
        graph, but eager still draws them, so every later mask would come from another place in the stream: each
        live random node keeps the draws dropped since the previous one (`rng_skip`), the last one those after it
        (`rng_after`), which the executor draws and discards (backends/spmd/local_ops.draw_random)."""
        pending, last = [], None
        for _, _, refs in self.draws:
            n = nodes[refs[0].node]
            if n.idx in live:
                n.rng_skip, pending, last = pending, [], n
            else:
                pending.append(_draw_spec(n))
        if pending and last is not None:
            last.rng_after = pending

    @contextlib.contextmanager
    def patched(self):
        """torch.get_rng_state / set_rng_state / random.fork_rng standing for stream positions while capturing."""
        real_get, real_set, real_fork = torch.random.get_rng_state, torch.random.set_rng_state, torch.random.fork_rng

        def get_rng_state():
            state = real_get()
            self.states[id(state)] = self.pos
            self.keep.append(state)
            return state

        def set_rng_state(state):
            if id(state) in self.states:
                self.pos = self.states[id(state)]  # the generator itself is not touched: capture draws nothing
            else:  # a state made elsewhere: later draws cannot be matched to recorded ones; they are new draws
                real_set(state)

        @contextlib.contextmanager
        def fork_rng(*args, **kwargs):
            pos = self.pos
            with real_fork(*args, **kwargs):
                try:
                    yield
                finally:
                    if kwargs.get("enabled", args[1] if len(args) > 1 else True):
                        self.pos = pos

        names = ((torch, "get_rng_state"), (torch, "set_rng_state"), (torch.random, "get_rng_state"))
        names += ((torch.random, "set_rng_state"), (torch.random, "fork_rng"))
        saved = [(m, n, getattr(m, n)) for m, n in names]
        new = {"get_rng_state": get_rng_state, "set_rng_state": set_rng_state, "fork_rng": fork_rng}
        for m, n, _ in saved:
            setattr(m, n, new[n])
        try:
            yield self
        finally:
            for m, n, f in saved:
                setattr(m, n, f)


def _draw_spec(n) -> tuple:
    """What drawing op node `n` takes: (op, its non-tensor arguments by name, shape, dtype, layout)."""
    schema = n.target._schema.arguments  # dispatch leaves out arguments at their defaults
    named = {a.name: a.default_value for a in schema if a.has_default_value()}
    named |= dict(zip((a.name for a in schema), n.args)) | dict(n.kwargs)
    scalars = {k: v for k, v in named.items() if not hasattr(v, "node")}
    return (n.target, scalars, tuple(n.outs[0].shape), n.outs[0].dtype, getattr(n, "stride", None))


def reentrant_checkpoint_error(loss) -> CaptureError:
    """torch.utils.checkpoint(use_reentrant=True) runs .backward() inside its own backward, which
    torch.autograd.grad (capture's backward) refuses; named by the module that called it (the label of its
    CheckpointFunctionBackward node)."""
    stack, seen, where = [loss.grad_fn], set(), "<root>"
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn.name().startswith("CheckpointFunction"):
            where = fn.metadata.get("autopar_module", "") or "<root>"
            break
        stack.extend(f for f, _ in fn.next_functions)
    return CaptureError(
        f"torch.utils.checkpoint(use_reentrant=True) in module '{where}': its backward calls .backward() itself, "
        f"which the recorded gradients cannot include; pass use_reentrant=False (torch's advice, transformers' "
        f"default), whose recompute capture records"
    )
