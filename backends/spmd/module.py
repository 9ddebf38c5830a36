"""SPMD graph backend: run a plan's captured fw+bw graph on every rank, on DTensors, under autograd.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(model, mesh, example_inputs=(tokens, labels))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    loss = pm(tokens, labels); loss.backward(); opt.step()
    pm.plan.save("plan.json")  # later, with no planning: autopar.parallelize(model, mesh, (tokens, labels),
                               #                                               plan=autopar.Plan.load("plan.json"))

`lower` is the entry (autopar.parallelize calls it with a finished plan); this backend never plans. Each parameter becomes an `nn.Parameter(DTensor)` with its planned placement, under the model's own FQN. A call
runs the captured graph node by node (backends/spmd/program.py): before each op every input is redistributed to the
placement the plan chose for it, with the plan's own collectives (backends/spmd/comm.py); the op runs on DTensors
(DTensor rewrites shapes and view arguments to the local shards); its output placement is checked against the
plan. The fw nodes run in an autograd.Function's forward, the bw nodes (from `ones_like(loss)`, which takes the
incoming gradient) in its backward, which returns each gradient at its parameter's placement.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.execution import finished
from autopar.model_io import ModelIO
from autopar.strategies._torch_adapter import make_dtensor, per_rank, to_placement

from .accumulate import Accumulator
from .comm import agree_on_plan, redistribute_local
from .compiled import compile_option
from .shapes import NoPlanForShapesError, PlanCache, ShapeMismatchError
from .state import agreed_seed, check_replicas, simulated_world, sync_from_rank0
from .program import ExecutionError, Program, placement_strs

__all__ = [
    "lower",
    "check_call",
    "parallelize",
    "ParallelModule",
    "ExecutionError",
    "ShapeMismatchError",
    "NoPlanForShapesError",
]


def _check_mesh(mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"parallelize needs a torch DeviceMesh (init_device_mesh(...)) to run on, got "
            f"{type(mesh).__name__}; use autopar.plan(...) to plan for a mesh you do not have"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call dist.init_process_group (or use torchrun) "
            "before autopar.parallelize"
        )
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"the mesh has {mesh.size()} ranks (shape {tuple(mesh.shape)}) but the world has {world} "
            f"processes; parallelize runs one rank per process on the whole world: build the mesh "
            f"with init_device_mesh(..., ({world},)) or a shape whose product is {world}"
        )


def _device(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


OPTIONS = ("attention", "assume_identical", "check_replicas", "compile")  # lower()'s options, not the planner's


def check_call(model: nn.Module, mesh, example_inputs=None, example_kwargs=None, compile=False) -> None:
    """The arguments of a parallelize call, checked before anything is planned: bad ones named, at once."""
    ModelIO.from_example(model, example_inputs, example_kwargs)
    _check_mesh(mesh)
    compile_option(compile)


def lower(
    model: nn.Module,
    mesh,
    executable,
    *,
    replan=None,
    attention: str = "auto",
    assume_identical: bool = False,
    check_replicas: bool = True,
    compile=False,
) -> "ParallelModule":
    """The module that runs `executable` (autopar/execution.py: a finished Plan and its graph) one SPMD training
    step per call on this rank. Never plans: a call with input shapes (or a mode) the plan was not made for asks
    `replan` (the front door's callback, autopar.execution.graph_planner) for a new one, or raises
    NoPlanForShapesError when there is none (a loaded plan).

    attention: "auto" (the captured CPU kernel on CPU, an exact math formulation elsewhere), "kernel" or "math".
    assume_identical: the model's parameters and buffers are already the same on every rank (as DTensor's
        src_data_rank=None): skip taking rank 0's values (backends/spmd/state.py; `pm.init_comm` states the cost).
    check_replicas: on the first call, check that ranks holding replicas of a parameter or buffer agree.
    compile: True (Inductor) or a torch.compile backend name ("aot_eager", "eager"): each rank's local program is
        compiled between its collectives (backends/spmd/compiled.py); the collectives and random draws are
        unchanged. `torch.compile(pm)` also works, with or without it: Dynamo runs the program as an opaque call.
    The user's random number generator state is left as it was; the program's random ops draw from a generator
    seeded by rank 0's torch.initial_seed() (`pm.program.rng_seed`).
    """
    _check_mesh(mesh)
    compile_option(compile)
    plan = executable.plan
    if tuple(plan.mesh_shape) != tuple(mesh.shape):
        raise ValueError(f"the plan is for mesh {tuple(plan.mesh_shape)} but the mesh is {tuple(mesh.shape)}")
    with torch.random.fork_rng(devices=_rng_devices(mesh)):
        device = _device(mesh)
        agree_on_plan(mesh, plan.hash(), device)
        prog = Program(executable, plan, mesh, device, executable.graph.io.leaves, attention=attention, compile=compile)
        prog.rng_seed = agreed_seed(device)
        pm = ParallelModule(model, prog, assume_identical=assume_identical, check_replicas=check_replicas)
        pm._plans = PlanCache(model, prog, replan, attention, model.training)
    return pm


def parallelize(
    model: nn.Module, mesh, example_inputs=None, *, example_kwargs=None, planned=None, replan=None, **options
):
    """The graph backend for a plan made elsewhere: `planned=(plan, state)`, or `(plan, None)` for a loaded plan, as
    the torch backend's fallback passes it; `replan`: the front door's planner for new shapes (autopar.graph_planner),
    else a call with new shapes raises NoPlanForShapesError. `autopar.parallelize` is the front door."""
    check_call(model, mesh, example_inputs, example_kwargs, options.get("compile", False))
    executable = finished(model, example_inputs, example_kwargs, planned=planned)
    return lower(model, mesh, executable, replan=replan, **options)


def _rng_devices(mesh) -> list:
    return [] if mesh.device_type == "cpu" else [_device(mesh)]


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prog, inputs, buffers, need_backward, acc, *params):
        loss, env = prog.forward(dict(zip(prog.param_fqns, params)), inputs, buffers, keep=need_backward)
        ctx.prog, ctx.env, ctx.acc = prog, env, acc
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        acc, sync = ctx.acc  # (Accumulator, sync): no_sync micro-steps accumulate (backends/spmd/accumulate.py)
        if sync and acc.prog is None:
            grads = ctx.prog.backward(ctx.env, grad_loss)
        else:
            grads = acc.backward(ctx.prog, ctx.env, grad_loss, sync)
        ctx.env = None
        return (None, None, None, None, None, *[grads.get(f) for f in ctx.prog.param_fqns])


class ParallelModule(nn.Module):
    """The parallelized model: the same parameter/buffer FQNs as the original (tied parameters stay tied), each
    an nn.Parameter(DTensor) at its planned placement; calling it runs one SPMD step. The original module is not
    modified. `plan` is the Plan it runs; `program` the executor."""

    def __init__(self, model: nn.Module, prog: Program, assume_identical: bool = False, check_replicas: bool = True):
        super().__init__()
        self.program = prog
        self.plan = prog.plan
        mesh = prog.mesh
        self._orig_class = type(model).__name__
        self.train(model.training)  # the mode the plan was captured in
        self._plans = PlanCache(model, prog, None, "auto", model.training)
        self._acc, self._sync = Accumulator(), True
        made: dict[int, nn.Parameter] = {}
        state = []  # (fqn, dtensor, placement strings, the model's tensor)
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) in made:
                _register(self, fqn, made[id(p)], param=True)
                continue
            pl = prog.param_placement(fqn)
            made[id(p)] = nn.Parameter(_distribute(p, mesh, pl, prog.device), requires_grad=p.requires_grad)
            _register(self, fqn, made[id(p)], param=True)
            state.append((fqn, made[id(p)], pl, p))
        for fqn, b in model.named_buffers():
            pl = prog.buffer_placement(fqn)
            _register(self, fqn, _distribute(b, mesh, pl, prog.device), param=False)
            state.append((fqn, self.get_buffer(fqn), pl, b))
        self.init_comm = _take_rank0(state, mesh, prog.device, assume_identical)
        self._state_entries = [(f, isinstance(dt, nn.Parameter), pl) for f, dt, pl, _ in state]
        if check_replicas:
            self._first_check = self.register_forward_pre_hook(_check_first_step)

    def extra_repr(self) -> str:
        c = self.init_comm
        how = c.get("skipped") or (
            f"{c['broadcast_bytes'] + c['scatter_bytes']:,d} B once ({c['broadcast_bytes']:,d} "
            f"broadcast, {c['scatter_bytes']:,d} scattered, {c['collectives']} collectives)"
        )
        return (
            f"autopar {self._orig_class} on mesh {tuple(self.program.mesh.shape)}, plan {self.plan.hash()}; "
            f"state from rank 0: {how}"
        )

    def _slots(self, prog):
        """(module, name) of every parameter and buffer the program reads, found once per program: a forward reads
        the current tensors through them (a walk of the module tree per step cost milliseconds on small models)."""
        if getattr(self, "_slot_cache", None) is None:
            self._slot_cache = {}
        if prog not in self._slot_cache:

            def at(fqn):
                *path, leaf = fqn.split(".")
                mod = self
                for name in path:
                    mod = mod._modules[name]
                return mod, leaf

            self._slot_cache[prog] = ([at(f) for f in prog.param_fqns], [(f, *at(f)) for f, _ in self.named_buffers()])
        return self._slot_cache[prog]

    # torch.compile(pm): Dynamo runs the step as one opaque call (tracing the generated program's Python, the
    # executor's bookkeeping and its collectives fails or takes minutes); compile=True compiles its local segments
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        """One step, called like the model; returns the loss (in the model's container kind, model_io.wrap_loss)."""
        leaves = self.program.g.io.flatten_call(args, kwargs)
        grad = torch.is_grad_enabled()
        prog = self._plans.program(leaves, self.training, grad)  # this call's shapes and mode (shapes.py)
        pslots, bslots = self._slots(prog)
        params = [mod._parameters[leaf] for mod, leaf in pslots]
        buffers = {f: mod._buffers[leaf] for f, mod, leaf in bslots}
        ins = prog.prepare_inputs(leaves)
        # every rank evaluates the same global values, so a broken guard stops all of them alike (no hang)
        prog.check_guards(leaves, dict(zip(prog.param_fqns, params)), buffers)
        need = grad and any(p.requires_grad for p in params)
        return prog.g.io.wrap_loss(_Step.apply(prog, ins, buffers, need, (self._acc, self._sync), *params))

    @property
    def programs(self) -> dict:
        """Every Program made so far: {(input (shape, dtype)s, training, backward): Program}; `program` is the
        first (parallelize's), `plan_cache.replans` what each later one cost to plan."""
        return self._plans.programs

    @property
    def plan_cache(self) -> PlanCache:
        return self._plans

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """As FSDP2's: False makes each backward accumulate this rank's local gradients with no gradient
        collective (backends/spmd/accumulate.py); True again: the next backward reduces the accumulated sum once."""
        self._sync = bool(requires)

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's: the micro-steps whose forward runs inside accumulate local gradients with no gradient
        collective; the first backward of a forward run outside reduces everything accumulated, once."""
        was, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = was

    def accumulated_bytes(self) -> int:
        """Bytes of unreduced gradients this rank holds between accumulation micro-steps (unsharded for
        sharded parameters, as FSDP2 without gradient sync)."""
        return self._acc.accumulated_bytes()

    def attach_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Let a fused optimizer (torch.optim.Adam/AdamW(..., fused=True)...) step this module's DTensor parameters
        without DTensor building a spec per parameter per step: torch's optimizers keep each parameter's `step`
        count as a plain scalar tensor, which DTensor's dispatch of the fused op replicates anew on every call
        (~20 us a parameter). A step post-hook turns those counts into replicated DTensors on the parameter's mesh,
        once, after the step that creates them; the values and the update are the same. Returns `opt`."""
        mine, prog = {id(p) for p in self.parameters()}, self.program

        def to_dtensor(o, args, kwargs):
            for group in o.param_groups:
                if not group.get("fused"):
                    continue
                for p in group["params"]:
                    st = o.state.get(p)
                    s = st.get("step") if st else None
                    if (
                        id(p) not in mine
                        or not isinstance(s, torch.Tensor)
                        or isinstance(s, DTensor)
                        or s.dim()
                        or s.device != p.device
                    ):
                        continue
                    st["step"] = make_dtensor(s, prog.mesh, prog.rep, s.shape, s.stride())

        opt.register_step_post_hook(to_dtensor)
        return opt

    def shard_inputs(self, *args, **kwargs) -> tuple:
        """Each rank's DTensor of a global batch's tensor inputs at the plan's input placements (local slicing, no
        communication), in the order of the call's tensor leaves. A positional-only call gets back a tuple to pass
        to the module like the global tensors; `shard_batch` keeps the call's keywords."""
        return tuple(self.program.prepare_inputs(self.program.g.io.flatten_call(args, kwargs)))

    def shard_batch(self, *args, **kwargs) -> tuple[tuple, dict]:
        """(args, kwargs) of the call with each tensor replaced by this rank's DTensor at its planned placement."""
        io = self.program.g.io
        leaves = io.flatten_call(args, kwargs)
        it = iter(self.program.prepare_inputs(leaves))
        return io.call_args([next(it) if isinstance(x, torch.Tensor) else x for x in leaves])


def _distribute(t: torch.Tensor, mesh, placements, device) -> DTensor:
    """This rank's shard of a full tensor that every rank holds (no communication), as a copy: training the
    parallel module never writes into the original model. Under LocalTensorMode every simulated rank gets its own
    copy (distribute_tensor would hand all of them the same replicated tensor)."""
    pl = [to_placement(s) for s in placements]
    with torch.no_grad():
        dt = distribute_tensor(t.detach().to(device, copy=True), mesh, pl, src_data_rank=None)
        local = dt.to_local()
        own = per_rank(local)
        if own is not local:
            dt = make_dtensor(own, mesh, pl, dt.shape, dt.stride())
    return dt


def _take_rank0(state, mesh, device, assume_identical: bool) -> dict:
    """Overwrite every rank's shards in `state` [(fqn, dtensor, placements, the model's own full tensor)] with rank
    0's values (backends/spmd/state.py); returns the one-time cost."""
    if assume_identical:
        return {"skipped": "skipped (assume_identical=True)", "broadcast_bytes": 0, "scatter_bytes": 0}
    if simulated_world():
        return {"skipped": "none (one process simulates every rank)", "broadcast_bytes": 0, "scatter_bytes": 0}
    partial = lambda pl: any(p[0] == "P" for p in pl)
    # a partial placement's shards are not pieces of the full value: it travels whole (a copy: the user's model is
    # never written) and is split again here
    fulls = [t.detach().to(device, copy=True) if partial(pl) else t.detach() for _, _, pl, t in state]
    with torch.no_grad():  # to_local() is then the DTensor's own local tensor, written in place
        cost = sync_from_rank0([(f, full, pl, dt.to_local()) for (f, dt, pl, _), full in zip(state, fulls)], mesh)
        for (fqn, dt, pl, _), full in zip(state, fulls):
            if partial(pl):
                dt.to_local().copy_(_distribute(full, mesh, pl, device).to_local())
    return cost


@torch.compiler.disable
def _check_first_step(module, args):
    """Forward pre-hook, once: the replica checksum (backends/spmd/state.py) before the first step."""
    module._first_check.remove()
    with torch.no_grad():
        entries = [
            (f, (module.get_parameter(f) if param else module.get_buffer(f)).to_local(), pl)
            for f, param, pl in module._state_entries
        ]
    check_replicas(entries, module.program.mesh, module.program.device, what=f"autopar {module._orig_class}: ")


def parent_of(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """(the module that holds path `fqn` under `root`, the last name of the path), with empty containers made for
    the path's missing parents."""
    *path, leaf = fqn.split(".")
    mod = root
    for name in path:
        sub = mod._modules.get(name)
        if sub is None:
            sub = nn.Module()
            mod.add_module(name, sub)
        mod = sub
    return mod, leaf


def _register(root: nn.Module, fqn: str, t, param: bool):
    mod, leaf = parent_of(root, fqn)
    if param:
        mod.register_parameter(leaf, t)
    else:
        mod.register_buffer(leaf, t)


def local_batch(pm: ParallelModule, *inputs) -> tuple:
    """This rank's local shard (plain tensors) of a global batch, at the plan's input placements."""
    return tuple(x.to_local() if isinstance(x, DTensor) else x for x in pm.shard_inputs(*inputs))


__all__ += ["local_batch", "placement_strs", "redistribute_local"]
