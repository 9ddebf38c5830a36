"""Gradient accumulation without a gradient collective per micro-step (DDP's no_sync, FSDP2's
set_requires_gradient_sync(False)).

A backward under `pm.no_sync()` runs the plan's backward program as usual but issues none of its gradient
reductions (buckets, and the redistribute of an unbucketed gradient to its parameter's placement): each gradient
stays at the placement the backward made it (partial over the data-parallel ranks) and is added into this rank's
accumulator, local tensors only. The backward of the first micro-step outside no_sync adds its own gradients and
then reduces the accumulated sum with the plan's own collectives, once: the parameters' .grad get the sum of every
micro-step's gradient, as on one device. The parameters' .grad are not touched by the micro-steps under no_sync.

Sharded parameters (FSDP-like, gradients reduce-scattered): as FSDP2's set_requires_gradient_sync(False), the
accumulator keeps the unsharded local gradient (the reduce_scatter would shrink it by the data-parallel degree),
so it holds, per rank, the gradient at its pre-reduction size: `accumulated_bytes()` states it. Reduce-scattering
each micro-step instead would keep sharded memory but pay the collective every micro-step, which is what this is
for avoiding.

Which micro-step syncs is decided when its forward runs (as DDP's no_sync): a forward under no_sync whose backward
runs after the context has exited still accumulates. Micro-steps of another shape run another Program (shapes.py)
whose buckets may differ: what the old one accumulated is reduced once, by its own plan, when a micro-step of the
new one arrives (one extra reduction, counted like any other), so the sum stays exact.

Collectives of a micro-step under no_sync: the plan's forward and backward collectives (parameter gathers,
activation redistributes) less its gradient reductions; the sync step: the plan's full step.
"""

from __future__ import annotations

import torch

from .comm import launch_bucket, launch_filled
from .program import ExecutionError, Sharded, _local, placement_strs
from autopar.strategies._torch_adapter import per_rank


class Accumulator:
    """One ParallelModule's accumulated local gradients: per gradient bucket of `prog` its flat buffer or list of
    local shards, per unbucketed gradient its executor value, all before any reduction."""

    def __init__(self):
        self.prog = None
        self.flat: dict[int, torch.Tensor] = {}
        self.lists: dict[int, list] = {}
        self.loose: dict[str, object] = {}
        self.micro_steps = 0

    def accumulated_bytes(self) -> int:
        """Bytes this rank holds in unreduced gradients between micro-steps."""
        vals = (
            list(self.flat.values())
            + [t for ts in self.lists.values() for t in ts]
            + [_local(v) for v in self.loose.values()]
        )
        return sum(t.numel() * t.element_size() for t in vals)

    def backward(self, prog, env: dict, grad_loss: torch.Tensor, sync: bool) -> dict:
        """The gradients to hand to autograd for one micro-step: {} under no_sync (accumulated here), else the
        reduced sum of every micro-step since the last sync."""
        out = {}
        if self.prog is not None and self.prog is not prog:
            out = self.reduce()  # another plan's buckets: reduce what it accumulated, once
        self._collect(prog, env, grad_loss)
        if sync:
            for f, g in self.reduce().items():
                out[f] = out[f] + g if f in out else g
        return out

    def _collect(self, prog, env: dict, grad_loss: torch.Tensor):
        """prog's backward without its gradient collectives; every gradient added to the accumulator."""
        if env is None:
            raise ExecutionError("backward through a step that ran without gradients")
        g = prog.g
        env["seed"] = grad_loss
        with torch.no_grad():
            bufs: dict = {}
            fill = {
                pos: (lambda pos=pos: prog._copy_grads(pos, env, bufs) if pos in prog.copy_at else None)
                for pos in prog.after
            }
            prog.run_bw(env, fill, prog._run1, lambda i, off, n, shape: prog._slice(bufs, i, off, n, shape))
            bucketed = set()
            for i, bs in prog.chains.items():
                bucketed.update(bs[0].params)
                if i in bufs:  # the flat buffer the backward filled
                    buf = bufs.pop(i)
                    if i in self.flat:
                        self.flat[i].add_(buf)
                    else:  # kept: the program must not fill it again next step (it reuses the buffer
                        self.flat[i] = buf  # it holds when no other tensor shares its storage)
                        if prog.flat_bufs.get(i) is buf:
                            del prog.flat_bufs[i]
                    continue
                vals = [per_rank(_local(env[(g.grads[f].node, g.grads[f].out)])) for f in bs[0].params]
                if i in self.lists:
                    for a, v in zip(self.lists[i], vals):
                        a.add_(v)
                else:
                    self.lists[i] = [v.clone() for v in vals]
            for f in prog.grad_fqns:
                if f in bucketed:
                    continue
                r = g.grads[f]
                v = env[(r.node, r.out)]
                if f in self.loose:
                    _local(self.loose[f]).add_(_local(v))
                else:
                    self.loose[f] = Sharded(v.t.clone(), v.strs, v.shape) if type(v) is Sharded else v.clone()
        env.clear()
        self.prog = prog
        self.micro_steps += 1

    def reduce(self) -> dict:
        """The accumulated gradients reduced with the plan's collectives (the same buckets, launched after the
        backward rather than during it), each a DTensor at its parameter's placement; the accumulator is emptied."""
        prog = self.prog
        if prog is None:
            return {}
        handles = {}
        with torch.no_grad():
            for i, bs in prog.chains.items():
                chain = [(b.mesh_dim, b.src, b.dst) for b in bs]
                if i in self.flat:
                    handles[i] = launch_filled(self.flat.pop(i), prog.mesh, chain, prog.flat_sizes[i][2])
                elif i in self.lists:
                    handles[i] = launch_bucket(self.lists.pop(i), prog.mesh, chain)
            grads = prog._finish_buckets({}, handles, {}) if handles else {}
            for f, v in self.loose.items():
                p = prog.g.params[f]
                if (p, "opt") in prog.red:
                    src, dst, _ = prog.red[(p, "opt")]
                    v = prog.redistribute(v, src, dst, (p, "opt"))
                v = prog._dt(v if type(v) is Sharded else per_rank(v))
                want = prog.P[p].out[0]
                if placement_strs(v) != want:
                    raise ExecutionError(f"gradient of '{f}' is at {placement_strs(v)}, its parameter at {want}")
                grads[f] = v
        self.prog, self.loose, self.micro_steps = None, {}, 0
        return grads
