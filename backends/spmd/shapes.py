"""Shapes that change: one plan (and one Program) per input shape signature and mode, made on first use.

A plan is specific to its shapes (capture specializes on them; the solver's placements must divide them). A
ParallelModule therefore keeps a cache keyed by (the shape and dtype of every tensor input, training mode, whether
a backward follows); a call whose key has no plan yet asks the front door's callback (`replan`,
autopar.execution.graph_planner: the same model, mesh and plan options) for one; the backend itself never plans,
and a module running a loaded plan has no callback (NoPlanForShapesError names the shapes). The parameters and
buffers stay the same tensors: the new plan is made with every parameter forced, and every buffer pinned, to the
placements of the first plan, so the optimizer's state and the state_dict never change. Planning a
new shape costs what the first plan cost (benchmarks/training_shapes.py measures it); each later call of that
shape finds its Program in the cache.

Before re-planning, the ranks agree on the new signature (one all_gather_object over a process group of its own,
made at the first new shape, so it can never pair with a step's collectives): ranks holding different shapes get a
ShapeMismatchError naming each rank's shapes, on every rank. A rank that meets a new shape while another rank reuses
a cached plan for its (different) shape cannot be told apart from a slow peer: it waits in the agreement and raises
ShapeMismatchError after the process group's timeout.

Evaluation: with gradients off (torch.no_grad / inference_mode), a call whose key has no training plan gets a
forward-only plan (autopar.plan(..., backward=False): no backward nodes, no gradient buckets), captured in the
module's mode (pm.eval(): dropout off, BatchNorm's running statistics). Under no_grad in training mode at a shape
that has a training plan, that plan's forward runs (its backward and buckets are never issued).

A batch the placements cannot divide: the planner only proposes even shards, so a new plan for 5 rows on 2 ranks
simply does not shard those rows; where the plan options force it (a `pin` sharding the batch), planning fails and
the error names the input, its dim and the mesh dim.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .comm import agree_on_plan
from .program import Program


class ShapeMismatchError(RuntimeError):
    """Ranks called the module with different global input shapes (raised on every rank that can tell)."""


class NoPlanForShapesError(ValueError):
    """A call's input shapes (or mode) have no plan and the module has no planner to make one (a loaded plan)."""


def signature(leaves) -> tuple:
    """The cache key part of one call's inputs: the global shape of each tensor leaf, None for every other leaf
    (dtypes and non-tensor values are the plan's own, checked against the example by Program.prepare_inputs)."""
    return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves)


class PlanCache:
    """Programs by (input signature, training, backward). `first` is the program parallelize made; its parameter
    and buffer placements are the ones every later plan keeps."""

    def __init__(self, model, first, replan, attention: str, training: bool):
        self.model = model  # re-captured for a new shape (never run, never written)
        self.first = first
        # the front door's callback for new shapes (autopar.execution.graph_planner); None: a loaded plan
        self.replan = replan
        self.attention = attention
        self.programs = {(signature(first.example), training, True): first}
        self.training0 = training
        self.modes0 = [(m, m.training) for m in model.modules()]  # the modes the first plan was captured in
        # one record per plan made after the first: its key, plan_s (the callback), total_s (with the agreements
        # and building the program)
        self.replans: list[dict] = []
        self._group = None

    def program(self, leaves, training: bool, backward: bool):
        sig = signature(leaves)
        got = self.programs.get((sig, training, True))
        if got is None and not backward:
            got = self.programs.get((sig, training, False))
        return got if got is not None else self._replan(leaves, sig, training, backward)

    def _replan(self, leaves, sig, training: bool, backward: bool):
        prog0 = self.first
        if self.replan is None:
            raise NoPlanForShapesError(
                f"this call's input shapes {_shapes(sig)} ({'training' if training else 'eval'}"
                f"{'' if backward else ', no backward'}) have no plan: the module runs a finished plan made for "
                f"{_shapes(signature(prog0.example))} (training, backward) and was given no planner for new "
                f"shapes; save a plan for these shapes too, or let autopar.parallelize plan (no plan=)"
            )
        t0 = time.perf_counter()
        self._agree(sig, prog0)
        t1 = time.perf_counter()
        io = prog0.g.io
        leaves = [x.full_tensor() if isinstance(x, DTensor) else x for x in leaves]
        args, kwargs = io.call_args(leaves)
        params = {f: tuple(prog0.param_placement(f)) for f in prog0.param_fqns}
        buffers = {f: tuple(prog0.buffer_placement(f)) for f in prog0.g.buffers}
        # capture records autograd's backward even for a forward-only plan (its module labels): grad mode on
        with (
            _mode(self.model, training, self.modes0 if training == self.training0 else None),
            torch.inference_mode(False),
            torch.enable_grad(),
        ):
            try:
                executable = self.replan(args, kwargs, backward=backward, params=params, buffers=buffers)
            except ValueError as e:
                raise ValueError(
                    f"re-planning for new input shapes {_shapes(sig)} failed: {e}{_undivided(prog0, sig)}"
                ) from e
        t_plan = time.perf_counter() - t1
        plan = executable.plan
        agree_on_plan(prog0.mesh, plan.hash(), prog0.device)
        prog = Program(
            executable,
            plan,
            prog0.mesh,
            prog0.device,
            executable.graph.io.leaves,
            attention=self.attention,
            compile=prog0.compile_backend,
        )  # compile= carries over to every shape's program
        prog.rng = prog0.rng  # one random stream for every shape (pm.program.manual_seed seeds it)
        for f in prog.param_fqns:
            if prog.param_placement(f) != prog0.param_placement(f):
                raise RuntimeError(
                    f"the plan for new shapes moved parameter '{f}' to {prog.param_placement(f)}; "
                    f"it is pinned at {prog0.param_placement(f)}"
                )
        self.programs[(sig, training, backward)] = prog
        self.replans.append(
            {
                "shapes": [s for s in sig if s is not None],
                "training": training,
                "backward": backward,
                "plan_s": t_plan,
                "total_s": time.perf_counter() - t0,
                "hash": plan.hash(),
            }
        )
        return prog

    def _agree(self, sig, prog0):
        """Every rank's new signature, compared before any collective of the new plan."""
        if not dist.is_initialized() or dist.get_backend() == "fake" or dist.get_world_size() == 1:
            return
        rank = dist.get_rank()
        try:
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, sig, group=self._group)
        except RuntimeError as e:
            raise ShapeMismatchError(
                f"rank {rank} met new input shapes {_shapes(sig)} and waited for the other ranks to agree on them, "
                f"but they did not answer ({type(e).__name__}: {str(e)[:200]}); every rank must call the "
                f"parallelized module with the same global input shapes"
            ) from e
        if any(s != sig for s in got):
            by: dict = {}
            for r, s in enumerate(got):
                by.setdefault(_shapes(s), []).append(r)
            detail = "; ".join(f"{s} on ranks {rs}" for s, rs in by.items())
            raise ShapeMismatchError(
                f"ranks called the parallelized module with different global input shapes "
                f"({detail}); every rank must pass the same global batch"
            )


def _shapes(sig) -> str:
    return ", ".join(f"{s}" for s in sig if s is not None)


def _undivided(prog0, sig) -> str:
    """Where the first plan sharded an input dim that the new size does not divide (the likely cause)."""
    out = []
    for k, idx in enumerate(prog0.g.inputs):
        pos = prog0.g.nodes[idx].target
        s = sig[pos] if pos < len(sig) else None
        if s is None:
            continue
        for m, p in enumerate(prog0.P[idx].out[0]):
            if p.startswith("S"):
                d = int(p[1:])
                n = prog0.mesh.size(m)
                if d < len(s) and s[d] % n:
                    name = prog0.input_names[pos] if pos < len(prog0.input_names) else pos
                    mname = (prog0.mesh.mesh_dim_names or [None] * prog0.mesh.ndim)[m] or m
                    out.append(
                        f"input '{name}' dim {d} has size {s[d]}, which mesh dim {m} ('{mname}', {n} "
                        f"ranks) does not divide"
                    )
    return (
        (
            "; " + "; ".join(out) + " (the planner shards only evenly: drop the pin that shards it, or pass a "
            "batch that divides)"
        )
        if out
        else ""
    )


class _mode:
    """The model in the module's mode while it is captured (pm.eval() -> dropout off; in the first plan's mode,
    every submodule as it was then); every submodule's own flag is put back after."""

    def __init__(self, model, training: bool, modes=None):
        self.model, self.training, self.modes = model, training, modes

    def __enter__(self):
        self.was = [(m, m.training) for m in self.model.modules()]
        if self.modes is None:
            self.model.train(self.training)
        else:
            for m, t in self.modes:
                m.training = t

    def __exit__(self, *exc):
        for m, t in self.was:
            m.training = t
