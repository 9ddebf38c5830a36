"""The executor behind `autopar.parallelize`: one compiled list of instructions per captured graph node.

For every op node the program knows, ahead of time: which inputs the plan redistributes (and to what), how the
op runs, the placement of each output the plan expects, and which values die after it. How an op runs:
  - "dtensor": the aten op on DTensor inputs at the plan's placements. DTensor rewrites global shape arguments
    (view/reshape/expand sizes, embedding with a sharded vocab, reductions over sharded dims) to the local shard;
    the output placement must equal the plan's or the run stops with ExecutionError.
  - "local": the op on the local shards, its output kept at the planned placement (a `Sharded` value: local
    tensor, placements, global shape; no DTensor is built). Used where that is exact by construction: every
    input and output replicated; attention (batch- or head-sharded, autopar's own rule); every op whose
    arguments carry no global shape (pointwise, matmuls, reductions over dims, transposes, softmax...:
    `local_ops.local_exact`), where DTensor's dispatch would run the same local op; and ops whose global-shape
    argument has a local counterpart known ahead (`local_ops.local_args`: view/reshape/expand/new_zeros with the
    output's local shape, split/slice/select/topk/layer_norm along an unsharded dim, zeros_like/ones_like of a shard
    at its own placement, embedding lookups into a table whose rows are not sharded, an unweighted nll loss on batch
    shards).
    Attention runs the captured CPU kernel on CPU; on other devices an exact math formulation with the same
    (out, logsumexp) contract, since the CPU kernel does not exist there.
  - "factory": arange/zeros/... with the meta device of the capture replaced by the mesh's device.
  - "seed": `ones_like(loss)`, where the backward starts, takes the incoming gradient of the loss.
Each instruction list is compiled once to a straight-line Python function (`_compile`) that calls each local op
through its Python binding where one resolves to it (`local_ops.binding`); gradient buckets are issued from it as
soon as their last gradient exists.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.guards import check_guards
from autopar.strategies._torch_adapter import local_of, outside_local_tensor_mode, per_rank, to_placement

from .buckets import Buckets
from .compiled import build, compile_option

# ExecutionError, Sharded, placement_strs and _local are imported from here by the other backends and the tests
from .interpreter import ExecutionError, Interpreter, Sharded, _Instr, _local, placement_strs
from .local_ops import VIEWS, binder, binding, fast_args, view_of_copy
from . import float8
from .localize import localize

aten = torch.ops.aten


class Program(Interpreter, Buckets):
    """The compiled program of one plan (module docstring); running one instruction (`Interpreter`) and the
    gradient buckets (`Buckets`) are its mixins."""

    def __init__(self, executable, plan, mesh, device, example_inputs, attention: str = "auto", compile=None):
        """`executable`: an autopar.execution.Executable (or the planner's PlanState: the same fields), `plan` its
        Plan."""
        if attention not in ("auto", "kernel", "math"):
            raise ValueError(f"attention must be 'auto', 'kernel' or 'math', got {attention!r}")
        g = executable.graph
        self.g, self.P, self.red, self.plan = g, executable.placement, executable.redistributes, plan
        self.mesh, self.device, self.example = mesh, device, tuple(example_inputs)
        math = attention == "math" or (attention == "auto" and device.type != "cpu")
        self.param_fqns = list(g.params)
        self.grad_fqns = [f for f in self.param_fqns if f in g.grads]
        self._check_inputs_match_graph()
        self.loss_pl = self.P[g.loss.node].out[g.loss.out]
        self.rep = tuple(to_placement("R") for _ in range(mesh.ndim))
        self.constants = [(n.idx, g.constants[n.target]) for n in g.nodes if n.kind == "constant"]
        self.local = localize(executable, tuple(mesh.shape), device, math)  # what each op runs on this rank
        self.local = float8.lower(self.local, plan, device)  # a float8 plan's GEMMs as scaled float8 kernels
        self.causal_masks: dict = {}  # (node, dtype) -> this rank's rows of a causal mask (Interpreter._offset_causal)
        self.fw = [_instr(op) for op in self.local.forward]
        self.bw = [_instr(op) for op in self.local.backward]
        self._plan_buckets()
        self._compile_phases(compile)

    def _compile_phases(self, compile):
        """The forward and backward instruction lists as functions: straight-line Python (`_compile`), or with the
        runs of local ops between collectives compiled by a torch.compile backend (backends/spmd/compiled.py)."""
        self.compile_backend = compile_option(compile)  # local segments compiled between the collectives
        self._plan_bucket_copies()
        self.bucket_out = self._bucket_outputs()
        self.after = set(self.bucket_ready) | set(self.copy_at)  # backward positions with bucket work
        if self.compile_backend is None:
            self.run_fw = self._compile(self.fw, ())
            self.run_bw = self._compile(self.bw, self.after, self.write_at)
        else:
            self.run_fw, self.fw_segments = build(self, self.fw, (), (), self.compile_backend)
            self.run_bw, self.bw_segments = build(
                self, self.bw, self.after, set(self.bucket_ready), self.compile_backend
            )

    # ---- leaves ---------------------------------------------------------------------------------------------------
    def param_placement(self, fqn: str) -> tuple[str, ...]:
        base = self.g.aliases.get(fqn, fqn)
        if base not in self.g.params:
            raise KeyError(f"parameter '{fqn}' is not in the captured graph")
        return self.P[self.g.params[base]].out[0]

    def buffer_placement(self, fqn: str) -> tuple[str, ...]:
        return self.P[self.g.buffers[fqn]].out[0]

    def _check_inputs_match_graph(self):
        g = self.g
        pos = {g.nodes[i].target: i for i in g.inputs}
        self.input_node = pos
        self.input_names = list(g.io.names) if g.io is not None else [str(i) for i in range(len(self.example))]
        for i, x in enumerate(self.example):
            if isinstance(x, torch.Tensor):
                if i not in pos or tuple(g.nodes[pos[i]].out.shape) != tuple(x.shape):
                    raise ValueError(
                        f"example input '{self.input_names[i]}' (shape {tuple(x.shape)}) does not "
                        f"match the captured graph"
                    )

    def check_guards(self, leaves: list, params: dict, buffers: dict):
        """Every data-dependent check the capture specialized on (autopar/guards.py) gives its example value on
        this step's global inputs, else GuardError naming the module, before the step runs any collective. A
        sharded leaf a guard reads is gathered (the same collective on every rank, in guard order)."""
        if not self.g.guards:
            return

        def value(leaf):
            kind, name = leaf
            v = {
                "input": lambda: leaves[name],
                "param": lambda: params[name],
                "buffer": lambda: buffers[name],
                "constant": lambda: self.g.constants[name],
            }[kind]()
            return (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()

        check_guards(
            self.g.guards,
            value,
            f"autopar.parallelize({self.g.io.model_name if self.g.io else 'model'})",
            self.input_names,
        )

    def prepare_inputs(self, inputs) -> list:
        """Validate a call's inputs (the model_io leaves of the call) against the example inputs; return DTensors
        at the plan's placements (the local slice of a global tensor, no communication; a DTensor at other
        placements is redistributed)."""
        if len(inputs) != len(self.example):
            raise TypeError(
                f"the parallelized module takes {len(self.example)} inputs (like its example inputs), got {len(inputs)}"
            )
        out, names = [], self.input_names
        for i, (x, ex) in enumerate(zip(inputs, self.example)):
            if not isinstance(ex, torch.Tensor):
                if x is not ex and x != ex:
                    raise ValueError(
                        f"input '{names[i]}' is {x!r} but the plan was captured with {ex!r}; "
                        f"non-tensor inputs are baked into the plan"
                    )
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input '{names[i]}' must be a tensor like the example input, got {type(x).__name__}")
            if tuple(x.shape) != tuple(ex.shape):
                raise ValueError(
                    f"input '{names[i]}' has global shape {tuple(x.shape)} but the plan was made for the "
                    f"example input shape {tuple(ex.shape)}; call autopar.parallelize with example "
                    f"inputs of the new shape (a plan is specific to its shapes)"
                )
            if x.dtype != ex.dtype:
                raise ValueError(f"input '{names[i]}' has dtype {x.dtype} but the example input has {ex.dtype}")
            want = self.P[self.input_node[i]].out[0]
            if isinstance(x, DTensor):
                if x.device_mesh != self.mesh:
                    raise ValueError(f"input '{names[i]}' is a DTensor on another device mesh ({x.device_mesh})")
                have = placement_strs(x)
                if have != want:
                    x = self._dt(self.redistribute(x, have, want))
                out.append(x)
            else:
                pl = [to_placement(s) for s in want]
                out.append(distribute_tensor(x.detach().to(self.device), self.mesh, pl, src_data_rank=None))
        return out

    def forward(self, params: dict, inputs: list, buffers: dict, keep: bool):
        """One step's forward: (the loss, replicated; the env the backward needs, when keep). For a part of a model
        (captured with output="activation"), `inputs` are this rank's local pieces of the part's inputs at their
        planned placements and the result is this rank's local piece of its output (a copy)."""
        g = self.g
        env = {}
        with torch.no_grad():
            for fqn, i in g.params.items():
                env[(i, 0)] = self._compute_param(self._store(params[fqn]), g.nodes[i].out.dtype)
            for fqn, i in g.buffers.items():
                env[(i, 0)] = self._store(buffers[fqn])
            for k, idx in enumerate(g.inputs):
                env[(idx, 0)] = (
                    self._wrap(inputs[k].detach(), self.P[idx].out[0], g.nodes[idx].out)
                    if g.activation
                    else self._store(inputs[k])
                )
            for idx, t in self.constants:
                env[(idx, 0)] = t.to(self.device)
            self.run_fw(env, None, self._run1)
            if g.state_updates:
                self._write_state(env, buffers)
            loss = env[(g.loss.node, g.loss.out)]
            if g.activation:
                return _local(loss).clone(), (env if keep else None)
            if (g.loss.node, "loss") in self.red:  # the plan's reduction of the loss to Replicate
                src, dst, _ = self.red[(g.loss.node, "loss")]
                loss = self.redistribute(loss, src, dst, (g.loss.node, "loss"))
            if type(loss) is Sharded:
                raise ExecutionError(
                    f"the plan leaves the loss at placement {list(self.loss_pl)} and plans no "
                    f"reduction to Replicate; the global loss cannot be returned"
                )
            out = loss.clone()
        return out, (env if keep else None)

    @staticmethod
    def _compute_param(v, dtype):
        """A parameter as the graph computes with it. A mixed-precision plan's graph was captured with bf16
        parameters (passes/precision.py) while the module keeps fp32 master parameters, so this rank's shard is
        cast before anything gathers it, as FSDP2's MixedPrecisionPolicy(param_dtype) casts before its all_gather;
        the gradient comes back through the graph's own cast to the reduce dtype."""
        local = v.t if type(v) is Sharded else v
        if local.dtype == dtype:
            return v
        cast = local.to(dtype)
        return Sharded(cast, v.strs, v.shape) if type(v) is Sharded else cast

    def _write_state(self, env: dict, buffers: dict):
        """Each buffer the forward updates (BatchNorm's running statistics) takes its new value in place, at the
        buffer's placement (the plan's redistribute where the update was computed elsewhere). A backward op that
        reads the buffer's old value reads a copy of it."""
        g = self.g
        for fqn, r in g.state_updates.items():
            b = g.buffers[fqn]
            v = env[(r.node, r.out)]
            if (b, "state") in self.red:
                src, dst, _ = self.red[(b, "state")]
                v = self.redistribute(v, src, dst, (b, "state"))
            if (b, 0) in env:
                old = env[(b, 0)]
                env[(b, 0)] = Sharded(old.t.clone(), old.strs, old.shape) if type(old) is Sharded else old.clone()
            buf = buffers[fqn]
            (local_of(buf) if isinstance(buf, DTensor) else buf).copy_(_local(v))

    def backward_part(self, env: dict, grad_out: torch.Tensor) -> tuple[dict, dict]:
        """The backward of a part's forward from this rank's local piece of the output's gradient: (parameter
        gradients as DTensors at their parameters' placements, {input position: local input gradient})."""
        g = self.g
        ins = {k: (r.node, r.out) for k, r in g.input_grads.items()}
        grads, kept = self.backward(env, grad_out, keep=ins)
        return grads, {k: _local(v) for k, v in kept.items()}

    def backward(self, env: dict, grad_loss: torch.Tensor, keep=None):
        """The parameters' gradients; with keep ({name: value key}): (gradients, {name: the value})."""
        if env is None:
            raise ExecutionError("backward through a step that ran without gradients")
        g = self.g
        env["seed"] = grad_loss
        with torch.no_grad():
            handles, bufs = {}, {}
            self.run_bw(
                env,
                {pos: (lambda pos=pos: self._at(pos, env, handles, bufs)) for pos in self.after},
                self._run1,
                lambda i, off, n, shape: self._slice(bufs, i, off, n, shape),
            )
            grads = self._finish_buckets(env, handles, bufs)
            for fqn in self.grad_fqns:
                if fqn in grads:
                    continue
                r = g.grads[fqn]
                v = env[(r.node, r.out)]
                p = g.params[fqn]
                if (p, "opt") in self.red:
                    src, dst, _ = self.red[(p, "opt")]
                    v = self.redistribute(v, src, dst, (p, "opt"))
                want = self.P[p].out[0]
                v = self._dt(v if type(v) is Sharded else per_rank(v))
                if placement_strs(v) != want:
                    raise ExecutionError(f"gradient of '{fqn}' is at {placement_strs(v)}, its parameter at {want}")
                grads[fqn] = v
        kept = {k: env[key] for k, key in (keep or {}).items()}
        env.clear()
        return grads if keep is None else (grads, kept)

    def _compile(self, instrs, launch_at, writes=None):
        """The instruction list as one straight-line Python function `run(env, L, run1, B)`: every local op with
        one tensor output and no redistribute before it becomes a direct call of the aten op on local shards, with
        constant arguments bound ahead of time and, since each value's placement is static, no test of whether an
        input is sharded; anything else (redistributes, DTensor dispatch, factories) goes through `run1`, the
        interpreter of one instruction; `L[pos]()` issues the gradient buckets ready after instruction pos; an op
        in `writes` makes its output in a gradient bucket's slice (its out= overload on B(bucket, offset, n,
        shape), `_in_place`)."""
        P, writes = self.P, writes or {}
        ns = {"Sharded": Sharded, "view_of_copy": view_of_copy}
        sharded = lambda k: not all(p == "R" for p in P[k[0]].out[k[1]])  # what env holds for a value
        lines = ["def run(env, L, run1, B=None):"]
        for pos, it in enumerate(instrs):
            n = it.node
            if it.direct_call is not None and not it.redistributes and not it.groups:
                rest, kwargs = it.direct_call
                ins = [f"env[{k!r}].t" if sharded(k) else f"env[{k!r}]" for k in it.keys]
                ns[f"R{pos}"], ns[f"W{pos}"] = rest, kwargs
                args = ins + ([f"*R{pos}"] if rest else []) + ([f"**W{pos}"] if kwargs else [])
                fn = it.fn
                if pos in writes:
                    fn, i, off, numel, shape = writes[pos]
                    args.append(f"out=B({i}, {off}, {numel}, {shape!r})")
                # the op's Python binding where one resolves to it (local_ops.binding), else its C++ entry
                ns[f"C{pos}"] = (pos not in writes and binding(fn)) or getattr(fn, "_op", fn)
                call = out = f"C{pos}({', '.join(args)})"
                if n.target in VIEWS:  # a shard laid out otherwise than on one device: a view of its copy
                    ns[f"F{pos}"], out = it.fn, "_v"
                    lines += [
                        "    try:",
                        f"        _v = {call}",
                        "    except RuntimeError as _e:",
                        f"        _v = view_of_copy(F{pos}, _e, ({', '.join(ins)}, *R{pos}), W{pos})",
                    ]
                if it.out_replicated[0]:
                    lines.append(f"    env[{(n.idx, 0)!r}] = {out}")
                else:
                    ns[f"E{pos}"], ns[f"S{pos}"] = it.expect[0], n.outs[0].shape
                    lines.append(f"    env[{(n.idx, 0)!r}] = Sharded({out}, E{pos}, S{pos})")
                lines += [f"    env.pop({k!r}, None)" for k in it.frees]
            else:
                ns[f"I{pos}"] = it
                lines.append(f"    run1(I{pos}, env)")
            if pos in launch_at:
                lines.append(f"    L[{pos}]()")
        lines.append("    return env")
        exec(compile("\n".join(lines), f"<autopar program: {len(instrs)} instructions>", "exec"), ns)
        return ns["run"]

    # ---- randomness: one generator per program, seeded alike on every rank -------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed the generator the program's random ops draw from (parallelize seeds it with rank 0's
        torch.initial_seed(); call on every rank alike)."""
        with outside_local_tensor_mode():  # one generator for every simulated rank, as for every real one
            self.rng_seed = int(seed)
            self._rng = torch.Generator(device=self.device).manual_seed(self.rng_seed)

    def rng(self) -> torch.Generator:
        if getattr(self, "_rng", None) is None:
            seed = getattr(self, "rng_seed", None)
            with outside_local_tensor_mode():
                self.manual_seed(int(torch.initial_seed()) if seed is None else seed)
        return self._rng


def _instr(op) -> _Instr:
    """The executor's instruction of a localized op (localize.LocalOp) with what running it caches: its inputs' env
    keys, its arguments bound once, and for the common case (a local op with one tensor out, no layout fix-up) the
    arguments of a direct call in the compiled program."""
    it = _Instr()
    it.node, it.name, it.mode, it.fn = op.node, op.name, op.mode, op.fn
    it.redistributes, it.groups, it.expect, it.frees = list(op.redistributes), op.groups, op.expect, op.frees
    it.out_replicated, it.contiguous, it.replaced = op.out_replicated, op.contiguous, op.replaced
    it.causal_rows = op.causal_rows
    it.strides = {}
    it.keys = [(r.node, r.out) for r in op.node.inputs()]
    it.bind = binder(op.args, op.kwargs)
    direct = op.mode == "local" and not (op.contiguous or op.replaced)
    it.direct_call = fast_args(op.args, op.kwargs, op.fn) if direct else None
    return it
