"""Capture: one aten-level joint forward+backward graph of `loss = model(*inputs)` and `grad(loss, params)`.

The model runs once on meta tensors (no weights are allocated) under a TorchDispatchMode that records every aten
op below autograd, forward and backward alike. Parameters, buffers and inputs enter as torch's functional tensors
(C++ functionalization, `torch._to_functional_tensor`, the kernel under FunctionalTensorMode and
torch.func.functionalize): the Functionalize dispatch key sits above the Python key, so the recorder sees each
in-place op as its functional form (add_ -> add, bernoulli_ -> bernoulli.p, native_batch_norm with running
stats -> _native_batch_norm_legit_functional) on the unwrapped meta tensors, with views reapplied as view ops.
(FunctionalTensorMode itself is an infra mode, dispatched after every user mode: a recorder above it would see the
ops before functionalization.) A buffer the forward mutates becomes a state update, `Graph.state_updates`: the
buffer's new value after the forward, which the executor writes back. Measured on this machine for the Llama-3-8B shape (32 layers,
7.9k nodes): 1.8 s, against 15 s for make_fx of the same function (bare meta execution alone is 1.3 s).

Each node carries its phase (fw/bw) and the module path that produced it: forward ops from a module-hook stack,
backward ops from the autograd node they run for (labelled with its module when the forward finished).
`F.scaled_dot_product_attention` is captured as one fused attention op (the CPU flash kernel's schema; with
enable_gqa, on the K/V heads as they are) rather than the math decomposition meta tensors would fall back to;
backends map it to the device's kernel.

The parts: the recorder and capture() here; the torch-function modes that rewrite calls before dispatch in
capture_modes.py; the functionalization helpers in functionalize.py; batch norm's rewrites in batch_norm.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .batch_norm import BN_DECOMPOSE
from .capture_error import CaptureError
from .capture_modes import SDPA, SDPA_BW, Constants, FusedAttention
from .capture_rng import RngStream, reentrant_checkpoint_error
from .functionalize import copy_as_clone, functionalization, mutations, refuse_mutations, to_functional, unwrap
from .graph import Graph, Node, Ref, TensorMeta, map_refs
from .guards import NoRealValue, build_guard
from .strategies._torch_adapter import grad_in_modes, reparametrize
from .model_io import ModelIO, pick_loss
from .strategies import decomposition_for, meta_kernel, restride_decomposition

__all__ = ["CaptureError", "NLL_LOSSES", "SDPA", "SDPA_BW", "capture", "to_meta"]
aten = torch.ops.aten
_MUTATING_OK = {aten.detach_.default}
# ops making an uninitialized buffer: a random fill of one (dropout's mask) draws in its layout (_draw_stride)
_FRESH = {aten.empty_like.default, aten.empty_strided.default, aten.empty.memory_format, aten.empty_permuted.default}
# random ops that functionalization makes of an in-place fill (`empty_like(x).bernoulli_(p)`, `.exponential_()`)
_FILLS = {aten.bernoulli.p, aten.exponential.default, aten.geometric.default, aten.log_normal.default}
_FILLS |= {aten.cauchy.default}
_VALUE_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default}
_VALUE_SHAPED.add(aten.unique_consecutive.default)
NLL_LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_MEAN, _SUM = 1, 2  # torch's Reduction enum
_META = torch.device("meta")


class _Recorder(TorchDispatchMode):
    def __init__(self, modstack: list[str], user_op=None):
        super().__init__()
        self.nodes: list[Node] = []
        self.ref: dict[int, Ref] = {}
        self.keep: list[torch.Tensor] = []  # keeps ids stable while recording
        self.modstack = modstack
        self.phase = "fw"
        self.constants: dict[str, torch.Tensor] = {}
        self.functional: dict = {}
        self.memo: dict = {}
        self.user_op = user_op or (lambda: None)  # the torch-level call being run, for messages
        self.decomposing = 0
        self.real: dict[tuple, torch.Tensor] = {}  # (leaf kind, target) -> its real value, where it has one
        self.origin: dict[int, torch.Tensor] = {}  # id(meta tensor made from data) -> that data (Constants)
        self.const_module: dict[str, str] = {}
        self.guards: list = []
        self.input_names: list[str] = []  # the model_io leaf names, for messages
        self.decomp_origin = None  # the user-level op whose decomposition is being recorded
        self.rng = RngStream()  # random ops in eager's order; a restored RNG state repeats them (capture_rng.py)

    def where(self) -> str:
        """The user's module and op an aten op runs for (a decomposition's inner op names its outer call; in the
        backward, the autograd node's name)."""
        node = torch._C._current_autograd_node() if self.phase == "bw" else None
        op = node.name() if node is not None else self.user_op()
        return f"module '{self.module_path() or '<root>'}'" + (f" (in {op})" if op else "")

    def leaf(self, t: torch.Tensor, kind: str, target) -> int:
        module = target.rsplit(".", 1)[0] if kind in ("param", "buffer") and "." in target else ""
        n = Node(len(self.nodes), kind, target, outs=(TensorMeta(tuple(t.shape), t.dtype),), phase="fw", module=module)
        self.nodes.append(n)
        self.ref[id(t)] = Ref(n.idx)
        self.keep.append(t)
        return n.idx

    def module_path(self) -> str:
        if self.phase == "bw":
            node = torch._C._current_autograd_node()
            return node.metadata.get("autopar_module", "") if node is not None else ""
        return self.modstack[-1] if self.modstack else ""

    def run(self, func, args, kwargs):
        """Run `func` on meta tensors. Repeated blocks call the same ops on the same shapes over and over, and
        meta kernels written in Python (torch._refs) dominate capture time; so a functional op (no aliased or
        mutated output) seen before with the same input metadata returns fresh meta tensors of the recorded
        output metadata instead of running again. An op whose meta kernel refuses what its device kernels take
        (strategies.meta_kernel: _grouped_mm in float32) runs that function instead."""
        impl = meta_kernel(func) or func
        if func not in self.functional:
            s = func._schema
            self.functional[func] = not s.is_mutable and all(r.alias_info is None for r in s.returns)
        if not self.functional[func]:
            return impl(*args, **kwargs)
        try:
            key = (func, _key(args), _key(kwargs))
            hit = self.memo.get(key)
        except (TypeError, _NoMemo):
            return impl(*args, **kwargs)
        if hit is None:
            out = impl(*args, **kwargs)
            flat, spec = tree_flatten(out)
            if all(not isinstance(o, torch.Tensor) or o.device.type == "meta" for o in flat):
                self.memo[key] = (
                    spec,
                    [(o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else o for o in flat],
                    [isinstance(o, torch.Tensor) for o in flat],
                )
            return out
        spec, vals, is_t = hit
        return tree_unflatten(
            [torch.empty_strided(v[0], v[1], dtype=v[2], device="meta") if t else v for v, t in zip(vals, is_t)], spec
        )

    def decompose(self, func, decomp, args, kwargs):
        """Record `func` as the ops of its decomposition: batch norm's from torch._decomp, an op with no placement
        rule as strategies.decomposition_for gives it (may return NotImplemented), and composite ops a
        decomposition calls (flatten...) as theirs, since below autograd nothing else would split them. Their
        nodes carry `func` as their origin, for messages."""
        outer, self.decomp_origin = self.decomp_origin, self.decomp_origin or func
        self.decomposing += 1
        try:
            with self:
                return decomp(*args, **kwargs) if decomp is not None else func.decompose(*args, **kwargs)
        finally:
            self.decomposing -= 1
            self.decomp_origin = outer

    def _draw_stride(self, func, args, flat, ins):
        """The layout one device fills a random op's draw in (Node.stride; None: contiguous). Functional calls
        lay out their output as the meta kernel does; dropout's in-place bernoulli_ on empty_like(x), which
        functionalization records as bernoulli.p of that fresh buffer (whose output is contiguous), fills the
        buffer's own layout."""
        out = flat[0] if flat and isinstance(flat[0], torch.Tensor) else None
        if func in _FILLS and ins and isinstance(args[0], torch.Tensor) and self.nodes[ins[0].node].target in _FRESH:
            out = args[0]
        return None if out is None or out.is_contiguous() else tuple(out.stride())

    def constant(self, a: torch.Tensor) -> str:
        """Name a tensor the graph did not make as a constant leaf, holding its data: a meta tensor made from data
        (torch.tensor(..., device=meta): no dispatch sees it) has its CPU twin from Constants; an empty one needs
        none. A meta constant with no data left here is refused after capture if the graph still reads it."""
        name = f"const{len(self.constants)}"
        if a.device.type == "meta":
            a = self.origin.get(id(a), torch.empty(a.shape, dtype=a.dtype) if a.numel() == 0 else a)
        # made under functionalization (an empty KV cache's torch.empty): keep the plain tensor, not its wrapper,
        # which the executor could not mix with its plain tensors
        a = unwrap(a)
        self.constants[name] = a
        self.const_module[name] = self.module_path()
        if a.device.type != "meta":
            self.real[("constant", name)] = a
        return name

    def specialize(self, t: torch.Tensor):
        """A tensor's value decides the model's Python (`.item()`, `bool(t)`): evaluate the recorded cone that made
        it on the real example values, hand the value back and keep the check as a guard the runtime re-checks
        (torch.export's specialization). Refused when the cone reads something with no data (meta weights)."""
        where = self.module_path() or "<root>"
        r = self.ref.get(id(t))
        if r is None:
            if t.device.type != "meta":
                return t.item()  # a constant the model closed over: its value cannot change
            r = Ref(self.leaf(t, "constant", self.constant(t)))
        try:
            gd = build_guard(self.nodes, r, where)
            gd.expected = gd.evaluate(self.real_leaf)
        except NoRealValue as e:
            kind, name = e.leaf
            name = self.input_names[name] if kind == "input" and self.input_names else name
            if kind == "random op":
                raise CaptureError(
                    f"a random draw ({name}) decides Python control flow in {self.where()}, e.g. LayerDrop "
                    f"(`if torch.rand([]) < layerdrop: skip the layer`): one plan is one graph, so a branch "
                    f"taken at random on each step cannot be planned; turn it off in training (layerdrop=0 / "
                    f"encoder_layerdrop=0 in a transformers config) or plan the model in eval()"
                ) from None
            raise CaptureError(
                f"data-dependent control flow or .item() in {self.where()}: a tensor value decides "
                f"Python control flow and it depends on {kind} '{name}', which has no real value here "
                f"(meta device); capture specializes such checks on real example values, so pass "
                f"real example inputs and weights"
            ) from None
        except Exception as e:
            raise CaptureError(
                f"data-dependent control flow or .item() in {self.where()}: evaluating the check on "
                f"the example values failed: {type(e).__name__}: {e}"
            ) from e
        self.guards.append(gd)
        return gd.expected

    def real_leaf(self, leaf: tuple) -> torch.Tensor:
        v = self.real.get(leaf)
        if v is None:
            raise NoRealValue(leaf)
        return v

    def exact_mean_loss(self, func, types, args):
        """Record a mean nll_loss as (sum of the losses, total weight) -> their quotient. Sharded on the batch,
        both are partial sums, so the plan's reduction of each gives the single device's mean exactly, whatever
        labels `ignore_index` skips on each shard (DTensor's Partial("avg") mean, like DDP's averaging, is exact
        only when every shard counts the same number of targets). The backward is unchanged: autograd calls
        nll_loss_backward(reduction=mean) with the total weight, which the plan takes to Replicate."""
        total, weight = self.__torch_dispatch__(func, types, (*args[:3], _SUM, args[4]), {})
        return self.__torch_dispatch__(aten.div.Tensor, types, (total, weight), {}), weight

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NLL_LOSSES and len(args) == 5 and args[3] == _MEAN:
            return self.exact_mean_loss(func, types, args)
        if func is aten._local_scalar_dense.default:
            return self.specialize(args[0])
        dev = kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type != "meta":
            # a tensor made or moved to a device (torch.arange(n), x.cpu(), .to("cuda")): capture runs on meta and
            # the run makes it on the run device (backends/spmd/program.py _to_device), so it is recorded on meta
            kwargs = {**kwargs, "device": _META}
        if func is aten.copy.default:
            func, args, kwargs = copy_as_clone(args, kwargs)
            if not isinstance(func, torch._ops.OpOverload):  # a clone in dst's layout: its ops recorded
                return self.decompose(aten.copy.default, func, args, kwargs)
        decomp = BN_DECOMPOSE.get(func)
        if (
            decomp is not None
            or self.decomposing
            and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
            )
        ):
            return self.decompose(func, decomp, args, kwargs)
        decomp = restride_decomposition(func, args, kwargs) or decomposition_for(func)
        if decomp is not None and (out := self.decompose(func, decomp, args, kwargs)) is not NotImplemented:
            return out
        if func._schema.is_mutable and func not in _MUTATING_OK:
            raise CaptureError(
                f"op {func} in {self.where()} mutates a tensor that functionalization could not"
                f" turn into a functional op"
            )
        try:
            out = self.run(func, args, kwargs)
        except Exception as e:
            if func in _VALUE_SHAPED or "nonzero" in str(e):  # boolean-mask indexing runs nonzero inside
                raise CaptureError(
                    f"op {func} in {self.where()} makes a tensor whose shape depends on tensor values "
                    f"(torch.nonzero, x[bool_mask], masked_select, unique): a plan needs every shape before "
                    f"the step runs; write it with fixed shapes (torch.where, masked_fill, a one-hot product)"
                ) from e
            raise CaptureError(
                f"op {func} in {self.where()} failed on meta tensors (data-dependent shape?): {e}"
            ) from e

        ins: list[Ref] = []

        def conv(a):
            if isinstance(a, torch.Tensor):
                r = self.ref.get(id(a))
                if r is None:  # a tensor from outside the graph (e.g. a CPU constant): record it as a leaf
                    r = Ref(self.leaf(a, "constant", self.constant(a)))
                ins.append(r)
                return r
            t = type(a)
            if (t is list or t is tuple) and a and not isinstance(a[0], (int, float, bool, torch.SymInt)):
                return t(conv(x) for x in a)  # aten lists are homogeneous: int[] / float[] stay as they are
            return a

        flat, _ = tree_flatten(out)
        outs = tuple(TensorMeta(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in flat)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded and (same := self.rng.replay(func, outs, self.where())) is not None:
            return self._alias(out, flat, same)  # a checkpointed block's recompute: the forward's draw again
        rargs = tuple(conv(a) for a in args)
        rkwargs = {k: conv(v) for k, v in kwargs.items()}
        n = Node(
            len(self.nodes), "op", func, rargs, rkwargs, outs, self.phase, self.module_path(), origin=self.decomp_origin
        )
        n._ins, n.user_op = ins, self.user_op()
        if seeded:
            n.stride = self._draw_stride(func, args, flat, ins)
            self.rng.record(func, outs, [Ref(n.idx, i) for i in range(len(flat))])
        self.nodes.append(n)
        return self._alias(out, flat, [Ref(n.idx, i) for i in range(len(flat))])

    def _alias(self, out, flat, refs):
        """`out` (its tensors `flat`) as the recorded values `refs`."""
        for o, r in zip(flat, refs):
            if isinstance(o, torch.Tensor):
                self.ref[id(o)] = r
                self.keep.append(o)
        return out


class _NoMemo(Exception):
    pass


def _key(a):
    """Hashable metadata of an op argument; tensors by shape, stride, offset and dtype (meta tensors only)."""
    if isinstance(a, torch.Tensor):
        if a.device.type != "meta":
            raise _NoMemo
        return ("T", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_key(x) for x in a)
    if isinstance(a, dict):
        return ("D",) + tuple((k, _key(v)) for k, v in a.items())
    if isinstance(a, (torch.SymInt, torch.SymFloat)):
        raise _NoMemo
    return a


def _label_backward_nodes(module_fqn: dict[nn.Module, str], start_seq: dict[nn.Module, int]):
    """Forward hooks that tag each autograd node created inside a module with that module's path."""

    def pre(mod, args):
        if mod in module_fqn:
            start_seq[mod] = _next_seq()

    def post(mod, args, out):
        if mod not in module_fqn:
            return
        lo, fqn = start_seq.pop(mod, 0), module_fqn[mod]
        stack = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen or fn._sequence_nr() < lo:
                continue
            seen.add(fn)
            fn.metadata.setdefault("autopar_module", fqn)
            stack.extend(f for f, _ in fn.next_functions)

    return pre, post


def _next_seq() -> int:
    # grad mode on: a module may run under no_grad (reentrant activation checkpointing's forward)
    with torch._C._DisableTorchDispatch(), torch.enable_grad():
        t = torch.empty(0, device="meta", requires_grad=True).view(0)
    return t.grad_fn._sequence_nr()


def to_meta(t: torch.Tensor, requires_grad: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    m = torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")
    return m.requires_grad_(requires_grad) if requires_grad else m


def capture(
    model: nn.Module,
    example_inputs,
    loss_fn=None,
    param_dtype: torch.dtype | None = None,
    output: str = "loss",
    example_kwargs: dict | None = None,
    backward: bool = True,
) -> Graph:
    """Record the joint fw+bw aten graph of `model` on meta tensors. The model itself is not changed or run.
    example_inputs / example_kwargs: the example call (autopar/model_io.py: a tuple, a dict of keyword inputs, or
    a ModelIO); the graph's inputs are its tensor leaves, the rest are constants of the capture (Graph.io).
    The loss is picked from the output by model_io.pick_loss (tensor, ModelOutput.loss, dict["loss"], tuple[0],
    or loss_fn(out)). Parameters the loss does not reach get no gradient (absent from Graph.grads).
    param_dtype: run with floating-point parameters in this dtype (the graph of FSDP2 mixed precision).
    output: "loss" (the model returns a scalar loss; the backward starts from ones_like(loss)) or "activation"
    (a part of a model: it returns one tensor whose incoming gradient seeds the backward, recorded as
    ones_like(output) in the backward, and the gradients of its floating-point inputs are outputs too:
    Graph.input_grads).
    backward=False: the forward alone (evaluation under no_grad): no backward nodes, no gradients."""
    if output not in ("loss", "activation"):
        raise ValueError(f"output must be 'loss' or 'activation', got {output!r}")
    act = output == "activation"
    io = (
        example_inputs
        if isinstance(example_inputs, ModelIO)
        else ModelIO.from_example(model, example_inputs, example_kwargs)
    )
    named = dict(model.named_parameters())
    aliases = _tied_aliases(model, named)
    buffers = dict(model.named_buffers())
    cast = lambda p: param_dtype if param_dtype is not None and p.is_floating_point() else None
    meta_params = {k: to_meta(p, p.requires_grad, cast(p)) for k, p in named.items()}
    meta_buffers = {k: to_meta(b) for k, b in buffers.items()}
    meta_inputs = [to_meta(x, act and x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in io.leaves]
    modstack: list[str] = []
    pre, post = _module_hooks(model, modstack)
    fused = FusedAttention()
    rec = _Recorder(modstack, fused.user_op)
    params = {k: rec.leaf(t, "param", k) for k, t in meta_params.items()}
    bufs = {k: rec.leaf(t, "buffer", k) for k, t in meta_buffers.items()}
    inputs = [rec.leaf(x, "input", i) for i, x in enumerate(meta_inputs) if isinstance(x, torch.Tensor)]
    f_params = {k: to_functional(t) for k, t in meta_params.items()}
    f_buffers = {k: to_functional(t) for k, t in meta_buffers.items()}
    f_inputs = [to_functional(x) if isinstance(x, torch.Tensor) else x for x in meta_inputs]
    _real_leaves(rec, io, named, buffers, cast)
    rec.input_names = io.names
    call_args, call_kwargs = io.call_args(f_inputs)
    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        # the meta state stays swapped in through the backward (torch.func.functional_call would restore the
        # model's own before it): activation checkpointing's recompute runs the module again there
        state = {**f_params, **f_buffers}
        with fused, Constants(rec), rec, functionalization(), rec.rng.patched(), reparametrize(model, state):
            out = model(*call_args, **call_kwargs)
            loss = _loss_of(out, loss_fn, act, model, io)
            updates = mutations(rec, f_buffers, meta_buffers)
            refuse_mutations(rec, f_params, meta_params, "parameter")
            refuse_mutations(
                rec,
                {i: x for i, x in enumerate(f_inputs) if isinstance(x, torch.Tensor)},
                dict(enumerate(meta_inputs)),
                "input",
            )
            train = [k for k, t in meta_params.items() if t.requires_grad]
            xs = [i for i, x in enumerate(meta_inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
            loss, grads, in_grads = _backward(rec, loss, [f_params[k] for k in train], f_inputs, xs, act, backward)
    finally:
        h1.remove()
        h2.remove()
    leaves = (params, bufs, inputs)
    return _graph_of(rec, leaves, loss, dict(zip(train, grads)), in_grads, updates, aliases, act, io)


def _graph_of(rec: _Recorder, leaves, loss, grads: dict, in_grads: dict, updates: dict, aliases, act, io) -> Graph:
    """The Graph of what the recorder saw: the nodes that reach the loss, the gradients and the state updates
    (others dropped, indices renumbered). leaves: (param nodes, buffer nodes, input nodes) as recorded; grads:
    {parameter FQN: its gradient tensor or None}."""
    params, bufs, inputs = leaves
    # a parameter the loss does not reach keeps no gradient (None), as on one device and under DDP/FSDP2
    loss_ref = rec.ref[id(loss)]
    grad_refs = {k: rec.ref[id(gr)] for k, gr in grads.items() if gr is not None}
    in_refs = {i: rec.ref[id(gr)] for i, gr in in_grads.items() if gr is not None}
    roots = [loss_ref, *grad_refs.values(), *in_refs.values(), *updates.values()]
    live = _live(rec.nodes, [r.node for r in roots])
    rec.rng.carry_dead_draws(rec.nodes, live)  # eager still draws what the loss does not read
    nodes, fix = _drop_dead(rec.nodes, live)
    remap = lambda d: {k: fix(Ref(v)).node for k, v in d.items()}
    _check_constants(nodes, rec)
    g = Graph(
        nodes,
        remap(params),
        remap(bufs),
        [fix(Ref(i)).node for i in inputs],
        fix(loss_ref),
        {k: fix(r) for k, r in grad_refs.items()},
        aliases,
        rec.constants,
        {i: fix(r) for i, r in in_refs.items()},
        act,
        {k: fix(r) for k, r in updates.items()},
    )
    g.io, g.guards = io, rec.guards
    return g


def _tied_aliases(model: nn.Module, named: dict) -> dict[str, str]:
    """{fqn: the fqn named_parameters() keeps} for each tied parameter's other names."""
    aliases = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        for k, q in named.items():
            if q is p and k != fqn:
                aliases[fqn] = k
    return aliases


def _module_hooks(model: nn.Module, modstack: list[str]):
    """Global forward (pre-)hooks keeping `modstack`, the path of the module running now (forward nodes' module),
    and labelling the autograd nodes each module makes (backward nodes' module)."""
    module_fqn = {m: fqn for fqn, m in model.named_modules()}
    start_seq: dict[nn.Module, int] = {}
    pre_lbl, post_lbl = _label_backward_nodes(module_fqn, start_seq)

    def pre(mod, args):
        if mod in module_fqn:
            modstack.append(module_fqn[mod])
        pre_lbl(mod, args)

    def post(mod, args, out):
        if mod in module_fqn and modstack and modstack[-1] == module_fqn[mod]:
            modstack.pop()
        post_lbl(mod, args, out)

    return pre, post


def _loss_of(out, loss_fn, act: bool, model: nn.Module, io: ModelIO) -> torch.Tensor:
    """The tensor the backward starts from: the part's output (act), or the model's scalar loss."""
    if act:
        loss = loss_fn(out) if loss_fn is not None else out
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(f"a module run as part of a model must return one tensor; got {type(loss).__name__}")
    else:
        try:
            loss, io.out_kind = pick_loss(out, loss_fn, type(model).__name__)
        except TypeError as e:
            raise CaptureError(str(e)) from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CaptureError(
                "the model must return a scalar loss (or pass loss_fn=...); got "
                f"{type(loss).__name__}"
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
            )
    if not loss.requires_grad:
        raise CaptureError("the loss does not depend on any trainable parameter")
    return loss


def _backward(rec: _Recorder, loss, wrt: list, f_inputs: list, xs: list[int], act: bool, backward: bool):
    """Record the backward: the gradients of `wrt` and of inputs `xs`, unwrapped to the recorded meta tensors;
    returns (loss, parameter gradients, {input index: gradient}). backward=False (evaluation under no_grad): no
    backward nodes, every gradient None."""
    rec.phase = "bw"
    seed = torch.ones_like(loss) if act else None  # the incoming gradient, taken at run time
    try:
        grads = (
            grad_in_modes(loss, wrt + [f_inputs[i] for i in xs], seed) if backward else [None] * (len(wrt) + len(xs))
        )
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise reentrant_checkpoint_error(loss) from None
    loss, grads = unwrap(loss), [unwrap(gr) for gr in grads]
    return loss, grads[: len(wrt)], dict(zip(xs, grads[len(wrt) :]))


def _real_leaves(rec: _Recorder, io: ModelIO, params: dict, buffers: dict, cast):
    """Real values of the leaves, for evaluating data-dependent checks (guards): the example inputs, and the
    model's own parameters and buffers where they are not on the meta device."""
    for i, x in enumerate(io.leaves):
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            rec.real[("input", i)] = x.detach()
    for kind, d in (("param", params), ("buffer", buffers)):
        for k, t in d.items():
            if t.device.type != "meta":
                c = cast(t) if kind == "param" else None
                rec.real[(kind, k)] = t.detach().to(c) if c is not None else t.detach()


def _check_constants(nodes: list[Node], rec: _Recorder):
    """A meta constant the graph reads has no data to run with: refuse it here, naming the module, rather than
    fail at the first step ("Cannot copy out of meta tensor")."""
    read = {r.node for n in nodes if n.kind == "op" for r in n.inputs()}
    for n in nodes:
        if n.kind == "constant" and n.idx in read and rec.constants[n.target].device.type == "meta":
            where = rec.const_module.get(n.target) or "<root>"
            raise CaptureError(
                f"module '{where}' uses a tensor of shape {tuple(n.out.shape)} on the meta device "
                f"that capture did not see made (its values are unknown); make it in forward with a "
                f"torch factory or torch.tensor(...), or register it as a buffer"
            )


def _live(nodes: list[Node], roots: list[int]) -> set[int]:
    """The nodes that reach a root, and every leaf."""
    live = {n.idx for n in nodes if n.kind != "op"}
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i in live and nodes[i].kind == "op":
            continue
        live.add(i)
        stack.extend(r.node for r in nodes[i].inputs())
    return live


def _drop_dead(nodes: list[Node], live: set[int]):
    """Keep the `live` nodes, renumbered; returns (nodes, old Ref -> new Ref)."""
    if len(live) == len(nodes):
        return nodes, lambda r: r
    remap = {old: new for new, old in enumerate(sorted(live))}
    fix = lambda r: Ref(remap[r.node], r.out)
    out = []
    for old in sorted(live):
        n = nodes[old]
        n.idx, n.args, n.kwargs, n._ins = remap[old], map_refs(n.args, fix), map_refs(n.kwargs, fix), None
        out.append(n)
    return out, fix
