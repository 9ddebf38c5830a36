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

from collections import Counter
from math import prod

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_flatten

from autopar.capture import SDPA, SDPA_BW
from autopar.graph import map_refs
from autopar.redistribute import steps as plan_steps
from autopar.strategies._torch_adapter import (collapse, local_of, make_dtensor, outside_local_tensor_mode, per_rank,
                                              sole_owner, to_placement, to_str, unmask_partial)

from .comm import executed_placements, finish_bucket, group_name, launch_bucket, launch_filled, redistribute_local
from .local_ops import (VIEWS, local_shape, attention_bw_math, attention_fw_math, binder, binding, call_op,
                        fast_args, local_args, local_exact, view_of_copy)
from .local_ops import LOCAL_IMPL, RANDOM, draw_random

aten = torch.ops.aten


_PASS_VIEWS = (aten.t.default, aten.transpose.int, aten.permute.default, aten.squeeze.dim, aten.unsqueeze.default,
               *VIEWS)   # views that keep the storage offset: a gradient made through them can be made in place
_OUT: dict = {}


def _out_overload(op):
    """The out= overload of a functional aten op (mm -> mm.out, sum.dim_IntList -> sum.IntList_out), else None."""
    if op not in _OUT:
        _OUT[op] = None
        s = getattr(op, "_schema", None)
        pkt = getattr(aten, s.name.split("::")[-1], None) if s is not None and s.name.startswith("aten::") else None
        names = [a.name for a in s.arguments] if s is not None else []
        for ov in (pkt.overloads() if pkt is not None else ()):
            o = getattr(pkt, ov)._schema
            if o.is_mutable and [a.name for a in o.arguments] == names + ["out"] and o.arguments[-1].kwarg_only \
                    and len(o.returns) == 1:
                _OUT[op] = getattr(pkt, ov)
                break
    return _OUT[op]


class ExecutionError(RuntimeError):
    """The program cannot run as planned; the message names the node, its module and what differs."""


_STRS: dict = {}


def placement_strs(dt) -> tuple[str, ...]:
    pls = dt.placements
    try:
        return _STRS[pls]
    except KeyError:
        s = tuple(to_str(p) for p in pls)
        if not any(type(p).__name__ == "_MaskPartial" for p in pls):    # those carry a per-call mask buffer
            _STRS[pls] = s
        return s


def _same(actual, expected) -> bool:
    """Placement strings agree; a masked partial is held as a plain sum partial once unmasked."""
    return all(a == e or (a in ("P", "Pm") and e in ("P", "Pm")) for a, e in zip(actual, expected))


class Sharded:
    """A value sharded or partial on some mesh dim, as the executor keeps it between ops: this rank's local tensor,
    the placement strings and the global shape. A DTensor is made from it only for an op that runs through
    DTensor's dispatch (and for the gradients handed back), so ops that run on local shards pay no wrapping."""
    __slots__ = ("t", "strs", "shape")

    def __init__(self, t: torch.Tensor, strs: tuple, shape: tuple):
        self.t, self.strs, self.shape = t, strs, shape


def _local(v):
    return v.t if type(v) is Sharded else local_of(v) if isinstance(v, DTensor) else v


_GSTRIDE: dict = {}


def _global_stride(local: torch.Tensor, shape) -> tuple[int, ...]:
    """Contiguous strides for the global shape, in the same dim order as the local shard's strides."""
    key = (local.stride(), tuple(shape))
    got = _GSTRIDE.get(key)
    if got is None:
        order = sorted(range(local.dim()), key=lambda d: key[0][d], reverse=True)
        stride, acc = [0] * len(shape), 1
        for d in reversed(order):
            stride[d] = acc
            acc *= max(1, shape[d])
        if len(_GSTRIDE) > 4096:
            _GSTRIDE.clear()
        got = _GSTRIDE[key] = tuple(stride)
    return got


def _in_layout(t: torch.Tensor, stride) -> torch.Tensor:
    """t laid out in memory in the dim order of `stride` (the global layout DTensor is told about)."""
    order = sorted(range(t.dim()), key=lambda d: -stride[d])
    if sorted(range(t.dim()), key=lambda d: -t.stride(d)) == order or t.dim() < 2:
        return t
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return t.permute(order).contiguous().permute(inv)


def _to_device(a, device):
    if isinstance(a, torch.device) and a.type == "meta":
        return device
    if isinstance(a, (list, tuple)):
        return type(a)(_to_device(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _to_device(v, device) for k, v in a.items()}
    return a


class _Instr:
    __slots__ = ("node", "mode", "fn", "conv", "groups", "expect", "frees", "name", "strides", "bind", "keys",
                 "swapped", "contig", "out_r", "fast")


class Program:
    def __init__(self, state, plan, mesh, device, example_inputs, attention: str = "auto", compile=None):
        if attention not in ("auto", "kernel", "math"):
            raise ValueError(f"attention must be 'auto', 'kernel' or 'math', got {attention!r}")
        g = state.graph
        self.g, self.P, self.red, self.plan = g, state.placement, state.redistributes, plan
        self.mesh, self.device, self.example = mesh, device, tuple(example_inputs)
        math = attention == "math" or (attention == "auto" and device.type != "cpu")
        self.param_fqns = list(g.params)
        self.grad_fqns = [f for f in self.param_fqns if f in g.grads]
        self._check_inputs_match_graph()
        self.loss_pl = self.P[g.loss.node].out[g.loss.out]
        self.rep = tuple(to_placement("R") for _ in range(mesh.ndim))
        self.constants = [(n.idx, g.constants[n.target]) for n in g.nodes if n.kind == "constant"]
        # the forward runs in the plan's order (autopar/schedule.py: a loss-tail group's consumers after its last
        # source), the backward in the graph's; a value is freed after its last reader in that order
        order = getattr(state, "fw_order", None)
        fw_at = {i: k for k, i in enumerate(order or ())}
        when = lambda i: fw_at.get(i, i + len(g.nodes))          # a node's place in the order of execution
        last = {}
        for n in g.nodes:
            for r in n.inputs():
                if (r.node, r.out) not in last or when(n.idx) > when(last[(r.node, r.out)]):
                    last[(r.node, r.out)] = n.idx
        for r in g.outputs():
            last[(r.node, r.out)] = len(g.nodes)
        frees: dict[int, list] = {}
        for key, i in last.items():
            if g.nodes[key[0]].kind == "op":
                frees.setdefault(i, []).append(key)
        # shared redistributes (passes/redistribute.py): the first consumer keeps its result in env under a key of
        # its own ("store"), the others read it ("load"); it is freed after the last of them
        conv_share, last_share = {}, {}
        for (c, j), (c0, j0) in sorted((state.shares or {}).items()):
            r = g.nodes[c0].inputs()[j0]
            ck = ("shared", r.node, r.out, self.P[c0].ins[j0])
            conv_share[(c0, j0)], conv_share[(c, j)] = ("store", ck), ("load", ck)
            last_share[ck] = max(last_share.get(ck, c), c, key=when)
        co = state.coalesced or {}
        ext: dict = {}          # lead (consumer, input) of a loss-tail group -> its members at other consumers
        for (c, j), (c0, j0) in sorted(co.items()):
            if c == c0:
                continue        # inputs of one op: its own group (below)
            r = g.nodes[c].inputs()[j]
            held = conv_share.get((c, j))
            ck = held[1] if held is not None else ("tail", c, j)    # where the group leaves the member's result
            if held is None:
                frees.setdefault(c, []).append(ck)
            conv_share[(c, j)] = ("load", ck)
            ext.setdefault((c0, j0), []).append((("ext", (r.node, r.out), ck), self.P[r.node].out[r.out],
                                                 self.P[c].ins[j], None))
        for ck, c in last_share.items():
            frees.setdefault(c, []).append(ck)
        self.fw, self.bw = [], []
        for n in g.ops():
            ins = self.P[n.idx].ins
            outs = self.P[n.idx].out
            it = _Instr()
            it.node, it.name = n, f"{n.name} (module '{n.module or '<root>'}')"
            it.conv = [(j, self.P[r.node].out[r.out], ins[j], conv_share.get((n.idx, j)))
                       for j, r in enumerate(n.inputs()) if (n.idx, j) in self.red]
            it.expect = outs
            it.frees = frees.get(n.idx, [])
            it.fn = LOCAL_IMPL.get(n.target, n.target)    # ops whose kernel needs more than the graph gives
            it.strides = {}
            it.swapped = it.contig = False
            it.out_r = [o is None or all(p == "R" for p in o) for o in outs]
            # tensors the forward makes or moves (arange, masks, caches, .to(device=...)) were recorded on the meta
            # device of the capture: they are made on the run device
            args, kwargs = _to_device(n.args, device), _to_device(n.kwargs, device)
            all_r = all(p == "R" for pl in ins for p in pl) and all(it.out_r)
            if n.phase == "bw" and n.target is aten.ones_like.default and n.inputs() == [g.loss]:
                it.mode = "seed"
            elif n.target in RANDOM:          # drawn from the program's generator (local_ops.draw_random)
                it.mode = "random"
            elif not n.inputs():
                it.mode = "factory"
            elif n.target in (SDPA, SDPA_BW):
                it.mode, it.contig = "local", True        # fused kernels want unit inner stride
                if math:
                    it.fn, it.swapped = (attention_fw_math if n.target is SDPA else attention_bw_math), True
            elif all_r or local_exact(n, ins, outs):
                it.mode = "local"
            else:
                local = local_args(g, n, ins, outs, tuple(mesh.shape), device)
                if local is not None:
                    it.mode, (args, kwargs) = "local", _to_device(local, device)
                else:
                    it.mode = "dtensor"
            it.keys = [(r.node, r.out) for r in n.inputs()]
            it.bind = binder(args, kwargs)
            if it.mode == "local":      # a change of label on size-1 mesh dims moves no data: an op on local shards
                it.conv = [c for c in it.conv if c[3] is not None or    # does not need it (one-device meshes)
                           any(mesh.size(m) > 1 for m, _, _ in plan_steps(tuple(c[1]), tuple(c[2])))]
            lead = {j: co[(n.idx, j)][1] for j, *_ in it.conv if co.get((n.idx, j), (None,))[0] == n.idx}
            it.groups = [[c for c in it.conv if c[0] == j0 or lead.get(c[0]) == j0] + ext.get((n.idx, j0), [])
                         for j0 in sorted(set(lead.values()) | {j for i, j in ext if i == n.idx})]
            it.conv = [c for c in it.conv if not any(c in grp for grp in it.groups)]
            # the common case, a local op with one tensor out: a direct call in the compiled program
            it.fast = fast_args(args, kwargs, it.fn) if it.mode == "local" and not (it.contig or it.swapped) else None
            (self.fw if n.phase == "fw" else self.bw).append(it)
        if fw_at:
            self.fw.sort(key=lambda it: fw_at[it.node.idx])

        pos = {it.node.idx: i for i, it in enumerate(self.bw)}
        self.chains: dict[int, list] = {}          # first bucket of a chain -> its buckets (one per step)
        for i, b in enumerate(plan.buckets):
            self.chains.setdefault(b.get("chain", i), []).append(b)
        self.bucket_ready: dict[int, list[int]] = {}
        for i, bs in self.chains.items():
            if isinstance(bs[0]["mesh_dim"], list):     # a flattened group: made now, on every rank in plan order
                group_name(self.mesh, bs[0]["mesh_dim"])
            at = max(pos.get(g.grads[f].node, len(self.bw) - 1) for f in bs[0]["params"])
            self.bucket_ready.setdefault(at, []).append(i)
        from .compiled import build, compile_option
        self.compile_backend = compile_option(compile)      # local segments compiled between the collectives
        self._plan_bucket_copies()
        self.bucket_out = self._bucket_outputs()
        self.after = set(self.bucket_ready) | set(self.copy_at)     # backward positions with bucket work
        if self.compile_backend is None:
            self.run_fw = self._compile(self.fw, ())
            self.run_bw = self._compile(self.bw, self.after, self.write_at)
        else:
            self.run_fw, self.fw_segments = build(self, self.fw, (), (), self.compile_backend)
            self.run_bw, self.bw_segments = build(self, self.bw, self.after, set(self.bucket_ready),
                                                  self.compile_backend)

    def _plan_bucket_copies(self):
        """All_reduce buckets (real process groups) are filled as the backward goes, as DDP's reducer fills its
        buckets: right after the instruction that makes a gradient, it is copied into its slice of the bucket's flat
        buffer (still in cache) and dropped unless a later op reads it, so a bucket never holds its gradients twice
        and is launched with no copy of its own. `copy_at`: backward position -> [(bucket, slice, key, drop)];
        `flat_sizes`: bucket -> (elements, dtype, [local shapes]). Under LocalTensorMode (one process simulating
        every rank) buckets are concatenated at launch instead."""
        import torch.distributed as dist
        self.copy_at: dict[int, list] = {}
        self.write_at: dict[int, tuple] = {}   # backward position -> (out= overload, bucket, offset, elements, shape)
        self.flat_sizes: dict[int, tuple] = {}
        self.flat_bufs: dict[int, torch.Tensor] = {}      # bucket -> its flat buffer, kept between steps
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return
        g, pos = self.g, {it.node.idx: i for i, it in enumerate(self.bw)}
        readers = Counter((r.node, r.out) for n in g.nodes for r in n.inputs())   # ops reading each value
        read = set(readers)                                                       # values some op reads
        read |= {k for k, c in Counter((r.node, r.out) for r in g.grads.values()).items() if c > 1}
        readers.update((r.node, r.out) for r in g.outputs())                     # + results
        for i, bs in self.chains.items():
            if not all(b["to"] == "R" for b in bs):
                continue
            plan, off = [], 0
            for f in bs[0]["params"]:
                r = g.grads[f]
                shape = local_shape(tuple(g.meta(r).shape), self.red[(g.params[f], "opt")][0], tuple(self.mesh.shape))
                if r.node not in pos or shape is None:
                    plan = None
                    break
                n = prod(shape)
                key = (r.node, r.out)
                plan.append((pos[r.node], (off, n, tuple(shape)), key, key not in read))
                off += n
            if plan is None:
                continue
            dtype = getattr(torch, bs[0]["dtype"].split(".")[-1])
            self.flat_sizes[i] = (off, dtype, [sl[2] for _, sl, _, _ in plan])
            for at, sl, key, drop in plan:
                # a compiled segment makes its gradients, which are then copied into the bucket (compiled.py)
                root = self._in_place(key, sl[2], dtype, pos, readers) if drop and not self.compile_backend else None
                if root is None:
                    self.copy_at.setdefault(at, []).append((i, sl, key, drop))
                else:
                    self.write_at[root[0]] = (root[1], i, sl[0], sl[1], root[2])

    def _in_place(self, key, shape, dtype, pos, readers):
        """Where a gradient can be made in its bucket's slice instead of copied there (DDP's reducer copies each
        gradient; a compiler knows where it will go): the gradient is the output of a compiled op with an out=
        overload (mm, sum, embedding_dense_backward...) seen through transposes and views, each value on the way
        read once, and those views of a contiguous tensor are the slice itself (checked on meta tensors).
        (backward position of that op, its out= overload, its local output shape), else None."""
        g, chain, k = self.g, [], key
        while g.nodes[k[0]].target in _PASS_VIEWS:
            it = self.bw[pos[k[0]]] if k[0] in pos else None
            if it is None or it.fast is None or it.conv or it.groups or readers[k] != 1:
                return None
            chain.append(it)
            k = it.keys[0]
        it = self.bw[pos[k[0]]] if k[0] in pos else None
        if it is None or it.fast is None or it.conv or it.groups or k[1] != 0 or readers[k] != 1 \
                or "out" in it.fast[1]:
            return None
        out = _out_overload(it.fn)
        meta = g.nodes[k[0]].outs[0]
        zshape = local_shape(tuple(meta.shape), self.P[k[0]].out[0], tuple(self.mesh.shape))
        if out is None or zshape is None or meta.dtype != dtype:
            return None
        x = torch.empty(zshape, dtype=dtype, device="meta")
        for v in reversed(chain):
            x = v.fn(x, *v.fast[0], **v.fast[1])
        if list(x.shape) != list(shape) or not x.is_contiguous() or x.storage_offset():
            return None
        return pos[k[0]], out, tuple(zshape)

    def _copy_grads(self, at: int, env: dict, bufs: dict):
        for i, (off, n, shape), key, drop in self.copy_at[at]:
            self._slice(bufs, i, off, n, shape).copy_(_local(env.pop(key) if drop else env[key]))

    def _slice(self, bufs: dict, i: int, off: int, n: int, shape) -> torch.Tensor:
        """A gradient's slice of bucket i's flat buffer (the buffer taken for this step on first use)."""
        buf = bufs.get(i)
        if buf is None:
            buf = bufs[i] = self._bucket_buffer(i)
        return buf[off:off + n].view(shape)

    def _bucket_buffer(self, i: int) -> torch.Tensor:
        """The flat buffer of all_reduce bucket i. The gradients handed out are views of it, so last step's buffer
        is filled again only once nothing else holds it (the optimizer's zero_grad(set_to_none=True) dropped
        them), as DDP's reducer keeps its buckets between steps; gradients still held (accumulation over
        steps) keep theirs and the bucket gets a new one."""
        buf = self.flat_bufs.get(i)
        if buf is None or not sole_owner(buf):
            size, dtype, _ = self.flat_sizes[i]
            buf = self.flat_bufs[i] = torch.empty(size, dtype=dtype, device=self.device)
        return buf

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
                    raise ValueError(f"example input '{self.input_names[i]}' (shape {tuple(x.shape)}) does not "
                                     f"match the captured graph")

    def check_guards(self, leaves: list, params: dict, buffers: dict):
        """Every data-dependent check the capture specialized on (autopar/guards.py) gives its example value on
        this step's global inputs, else GuardError naming the module, before the step runs any collective. A
        sharded leaf a guard reads is gathered (the same collective on every rank, in guard order)."""
        if not self.g.guards:
            return
        from autopar.guards import check_guards

        def value(leaf):
            kind, name = leaf
            v = {"input": lambda: leaves[name], "param": lambda: params[name], "buffer": lambda: buffers[name],
                 "constant": lambda: self.g.constants[name]}[kind]()
            return (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        check_guards(self.g.guards, value, f"autopar.parallelize({self.g.io.model_name if self.g.io else 'model'})",
                     self.input_names)

    def prepare_inputs(self, inputs) -> list:
        """Validate a call's inputs (the model_io leaves of the call) against the example inputs; return DTensors
        at the plan's placements (the local slice of a global tensor, no communication; a DTensor at other
        placements is redistributed)."""
        if len(inputs) != len(self.example):
            raise TypeError(f"the parallelized module takes {len(self.example)} inputs (like its example inputs), "
                            f"got {len(inputs)}")
        out, names = [], self.input_names
        for i, (x, ex) in enumerate(zip(inputs, self.example)):
            if not isinstance(ex, torch.Tensor):
                if x is not ex and x != ex:
                    raise ValueError(f"input '{names[i]}' is {x!r} but the plan was captured with {ex!r}; "
                                     f"non-tensor inputs are baked into the plan")
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input '{names[i]}' must be a tensor like the example input, got "
                                f"{type(x).__name__}")
            if tuple(x.shape) != tuple(ex.shape):
                raise ValueError(f"input '{names[i]}' has global shape {tuple(x.shape)} but the plan was made for the "
                                 f"example input shape {tuple(ex.shape)}; call autopar.parallelize with example "
                                 f"inputs of the new shape (a plan is specific to its shapes)")
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

    # ---- running --------------------------------------------------------------------------------------------------
    # Values in `env`: a plain tensor is replicated on every mesh dim (its local value is the global value; under
    # LocalTensorMode one plain tensor for all simulated ranks); anything sharded or partial is a `Sharded`.
    def _dt(self, v) -> DTensor:
        """The DTensor of an executor value (for DTensor's dispatch and for the gradients handed back)."""
        if type(v) is Sharded:
            return make_dtensor(v.t, self.mesh, _pls(v.strs), v.shape, _global_stride(v.t, v.shape))
        if isinstance(v, DTensor):
            return v
        return make_dtensor(v, self.mesh, self.rep, v.shape, v.stride())

    def _store(self, t):
        """A DTensor (parameter, input, DTensor op result) as an executor value."""
        if not isinstance(t, DTensor):
            return t
        strs = placement_strs(t)
        if all(p == "R" for p in strs):
            return collapse(local_of(t))
        return Sharded(local_of(t), strs, tuple(t.shape))

    def _as_sum(self, t, src, lead):
        """A loss-tail group member's local piece in its lead's partial kind: a partial mean ("Pa") joining a
        partial sum divides by its ranks (a mean is the sum of the parts over their count), and the other way."""
        for d, (a, b) in enumerate(zip(src, lead)):
            if a != b and {a, b} == {"P", "Pa"}:
                t = t / self.mesh.size(d) if a == "Pa" else t * self.mesh.size(d)
        return t

    def _flat(self, key):
        """The mesh dims of the one all_reduce over a flattened group the plan records for redistribute `key`
        (autopar.redistribute.flat_reduce), else None: the executor runs the collectives the plan priced."""
        cs = self.red[key][2] if key in self.red else ()
        return cs[0].mesh_dim if len(cs) == 1 and isinstance(cs[0].mesh_dim, tuple) else None

    def redistribute(self, v, src, dst, key=None):
        local = redistribute_local(_local(v), src, dst, self.mesh, self._flat(key))
        now = executed_placements(src, dst)
        if all(p == "R" for p in now):
            return collapse(local)
        return Sharded(local, now, tuple(v.shape))

    def _out_strides(self, it, vals):
        """Global strides of a replaced op's outputs (math attention): what the captured kernel gives on one device
        for the global input layouts (its meta kernel), so later view/reshape ops see the captured layout."""
        metas = [_gmeta(v) for v in vals]
        key = tuple(m[1] for m in metas)
        got = it.strides.get(key)
        if got is None:
            with outside_local_tensor_mode():
                mi = iter([torch.empty_strided(sh, st, dtype=_local(v).dtype, device="meta")
                           for (sh, st), v in zip(metas, vals)])
                n = it.node
                res = n.target(*map_refs(n.args, lambda r: next(mi)), **map_refs(n.kwargs, lambda r: next(mi)))
            got = it.strides[key] = [tuple(t.stride()) if isinstance(t, torch.Tensor) else None for t in _flat(res)]
        return got

    def _wrap(self, t, strs, meta):
        if all(p == "R" for p in strs):
            return t
        return Sharded(t, tuple(strs), tuple(meta.shape))

    def forward(self, params: dict, inputs: list, buffers: dict, keep: bool):
        """One step's forward: (the loss, replicated; the env the backward needs, when keep). For a part of a model
        (captured with output="activation"), `inputs` are this rank's local pieces of the part's inputs at their
        planned placements and the result is this rank's local piece of its output (a copy)."""
        g = self.g
        env = {}
        with torch.no_grad():
            for fqn, i in g.params.items():
                env[(i, 0)] = self._store(params[fqn])
            for fqn, i in g.buffers.items():
                env[(i, 0)] = self._store(buffers[fqn])
            for k, idx in enumerate(g.inputs):
                env[(idx, 0)] = self._wrap(inputs[k].detach(), self.P[idx].out[0], g.nodes[idx].out) \
                    if g.activation else self._store(inputs[k])
            for idx, t in self.constants:
                env[(idx, 0)] = t.to(self.device)
            self.run_fw(env, None, self._run1)
            if g.state_updates:
                self._write_state(env, buffers)
            loss = env[(g.loss.node, g.loss.out)]
            if g.activation:
                return _local(loss).clone(), (env if keep else None)
            if (g.loss.node, "loss") in self.red:          # the plan's reduction of the loss to Replicate
                src, dst, _ = self.red[(g.loss.node, "loss")]
                loss = self.redistribute(loss, src, dst, (g.loss.node, "loss"))
            if type(loss) is Sharded:
                raise ExecutionError(f"the plan leaves the loss at placement {list(self.loss_pl)} and plans no "
                                     f"reduction to Replicate; the global loss cannot be returned")
            out = loss.clone()
        return out, (env if keep else None)

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
            self.run_bw(env, {pos: (lambda pos=pos: self._at(pos, env, handles, bufs)) for pos in self.after},
                        self._run1, lambda i, off, n, shape: self._slice(bufs, i, off, n, shape))
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

    def _at(self, pos: int, env: dict, handles: dict, bufs: dict):
        """After backward instruction pos: copy the gradients it made into their buckets, issue the buckets it
        completes."""
        if pos in self.copy_at:
            self._copy_grads(pos, env, bufs)
        for i in self.bucket_ready.get(pos, ()):
            self._launch(i, env, handles, bufs)

    def _launch(self, i: int, env: dict, handles: dict, bufs: dict):
        """Issue gradient bucket i (with the rest of its chain, backends/comm.py launch_bucket) as soon as the
        backward has produced its last gradient, like DDP's reducer; the backward goes on while it is in flight."""
        g, bs = self.g, self.chains[i]
        chain = [(b["mesh_dim"], b["from"], b["to"]) for b in bs]
        if i in bufs:
            handles[i] = launch_filled(bufs.pop(i), self.mesh, chain, self.flat_sizes[i][2])
            return
        vals = [_local(env[(g.grads[f].node, g.grads[f].out)]) for f in bs[0]["params"]]
        handles[i] = launch_bucket(vals, self.mesh, chain)

    def _bucket_outputs(self) -> dict:
        """Per gradient bucket, what each of its gradients becomes: [(FQN, placements, global shape, replicated)],
        checked once: a bucket must leave every gradient at its parameter's placement."""
        g, outs = self.g, {}
        for i, bs in self.chains.items():
            outs[i] = []
            for f in bs[0]["params"]:
                src, dst, _ = self.red[(g.params[f], "opt")]
                now = executed_placements(src, dst)
                if now != self.P[g.params[f]].out[0]:
                    raise ExecutionError(f"gradient bucket leaves '{f}' at {now}, its parameter at "
                                         f"{self.P[g.params[f]].out[0]}")
                outs[i].append((f, _pls(now), tuple(g.meta(g.grads[f]).shape), all(p == "R" for p in now)))
        return outs

    def _finish_buckets(self, env, handles, bufs) -> dict:
        """Wait for the plan's gradient buckets, in order; each gradient at its parameter's placement."""
        out, mesh = {}, self.mesh
        for i, made in self.bucket_out.items():
            if i not in handles:
                self._launch(i, env, handles, bufs)
            for (f, pls, shape, rep), loc in zip(made, finish_bucket(handles.pop(i))):
                out[f] = make_dtensor(per_rank(collapse(loc)) if rep else loc, mesh, pls, shape,
                                      _global_stride(loc, shape))
        return out

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
        sharded = lambda k: not all(p == "R" for p in P[k[0]].out[k[1]])      # what env holds for a value
        lines = ["def run(env, L, run1, B=None):"]
        for pos, it in enumerate(instrs):
            n = it.node
            if it.fast is not None and not it.conv and not it.groups:
                rest, kwargs = it.fast
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
                if n.target in VIEWS:       # a shard laid out otherwise than on one device: a view of its copy
                    ns[f"F{pos}"], out = it.fn, "_v"
                    lines += ["    try:", f"        _v = {call}", "    except RuntimeError as _e:",
                              f"        _v = view_of_copy(F{pos}, _e, ({', '.join(ins)}, *R{pos}), W{pos})"]
                if it.out_r[0]:
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
        with outside_local_tensor_mode():   # one generator for every simulated rank, as for every real one
            self.rng_seed = int(seed)
            self._rng = torch.Generator(device=self.device).manual_seed(self.rng_seed)

    def rng(self) -> torch.Generator:
        if getattr(self, "_rng", None) is None:
            seed = getattr(self, "rng_seed", None)
            with outside_local_tensor_mode():
                self.manual_seed(int(torch.initial_seed()) if seed is None else seed)
        return self._rng

    def _random(self, it, local: list) -> list:
        """A random op's outputs on this rank: its piece of the global random tensor (local_ops.draw_random)."""
        n, rep = it.node, ("R",) * self.mesh.ndim
        args, kwargs = it.bind(local)
        piece = lambda full, k: redistribute_local(full, rep, it.expect[k], self.mesh)
        res = draw_random(it.fn, n, args, kwargs, self.rng(), self.device, piece, outside_local_tensor_mode)
        if res is None:
            res = _flat(call_op(it.fn, args, kwargs))
        return [None if not isinstance(t, torch.Tensor) else t if r else Sharded(t, s, m.shape)
                for t, r, s, m in zip(res, it.out_r, it.expect, n.outs)]

    def _run1(self, it, env):
        """Run one instruction (the compiled program's path for everything but plain local ops)."""
        n = it.node
        vals = [env[k] for k in it.keys]
        # inputs all-reduced to Replicate in one collective (passes/redistribute.py), with the loss-tail members of
        # later ops where this op leads their group (autopar/schedule.py; entries ("ext", value key, where it goes))
        for grp in it.groups:
            locs = [_local(env[c[0][1]] if type(c[0]) is tuple else vals[c[0]]) for c in grp]
            locs = [self._as_sum(t, c[1], grp[0][1]) for t, c in zip(locs, grp)]
            flat = redistribute_local(torch.cat([t.reshape(-1) for t in locs]), grp[0][1], grp[0][2], self.mesh,
                                      self._flat((n.idx, grp[0][0])))
            for (j, _, _, share), t, piece in zip(grp, locs, flat.split([t.numel() for t in locs])):
                if type(j) is tuple:    # a member at a later consumer (autopar/schedule.py): left where it loads
                    env[j[2]] = collapse(piece.view(t.shape))
                    continue
                vals[j] = collapse(piece.view(t.shape))
                if share is not None and share[0] == "store":
                    env[share[1]] = vals[j]
        for j, src, dst, share in it.conv:
            if share is None:
                vals[j] = self.redistribute(vals[j], src, dst, (n.idx, j))
            elif share[0] == "load":
                vals[j] = env[share[1]]
            else:
                vals[j] = env[share[1]] = self.redistribute(vals[j], src, dst, (n.idx, j))
        mode = it.mode
        if mode == "local":
            local = [v.t if type(v) is Sharded else v for v in vals]
            if it.contig:
                local = [t if t.stride(-1) == 1 else t.contiguous() for t in local]
            args, kwargs = it.bind(local)
            res = call_op(it.fn, args, kwargs)
            flat = [res] if isinstance(res, torch.Tensor) else _flat(res)
            if it.swapped:          # a replacement must hand on the captured kernel's memory layout
                flat = [_in_layout(t, st) if isinstance(t, torch.Tensor) else t
                        for t, st in zip(flat, self._out_strides(it, vals))]
            outs = [None if not isinstance(t, torch.Tensor) else t if r else Sharded(t, s, m.shape)
                    for t, r, s, m in zip(flat, it.out_r, it.expect, n.outs)]
        elif mode == "dtensor":
            args, kwargs = it.bind([self._dt(v) for v in vals])
            try:
                res = call_op(it.fn, args, kwargs)
            except Exception as e:
                raise ExecutionError(f"{it.name} failed on DTensors with input placements "
                                     f"{[_strs(v) for v in vals]}: {type(e).__name__}: {e}") from e
            outs = []
            for k, t in enumerate(_flat(res)):
                if isinstance(t, DTensor):
                    t = unmask_partial(t)
                    have = placement_strs(t)
                    if it.expect[k] is not None and have != tuple(it.expect[k]) and all(
                            a == e or self.mesh.size(d) == 1 for d, (a, e) in enumerate(zip(have, it.expect[k]))):
                        loc = local_of(t)           # a label of a size-1 mesh dim: the same data, the plan's label
                        outs.append(Sharded(loc, tuple(it.expect[k]), tuple(n.outs[k].shape))
                                    if any(p != "R" for p in it.expect[k]) else collapse(loc))
                        continue
                    if it.expect[k] is None or not _same(have, it.expect[k]):
                        raise ExecutionError(
                            f"{it.name}: output {k} came out of DTensor at {list(have)} but the plan has "
                            f"{it.expect[k]} (inputs at {[list(_strs(v)) for v in vals]})")
                    t = self._store(t)
                elif isinstance(t, torch.Tensor):
                    raise ExecutionError(f"{it.name}: output {k} is not a DTensor")
                outs.append(t)
        elif mode == "random":
            outs = self._random(it, [v.t if type(v) is Sharded else v for v in vals])
        elif mode == "factory":
            res = it.fn(*_to_device(n.args, self.device), **_to_device(n.kwargs, self.device))
            outs = [self._wrap(t, s, m) if t is not None else None for t, s, m in zip(_flat(res), it.expect, n.outs)]
        elif self.g.activation:     # seed of a part: this rank's piece of its output's gradient, as planned
            seed = env["seed"].to(self.device)
            want = self.P[self.g.loss.node].out[self.g.loss.out]
            if tuple(it.expect[0]) != tuple(want):
                raise ExecutionError(f"{it.name}: the output gradient is planned at {it.expect[0]}, the output at "
                                     f"{want}")
            outs = [self._wrap(seed, it.expect[0], n.out)]
        else:   # seed: the gradient flowing into the loss, replicated, taken to the planned placement locally
            seed = env["seed"].to(self.device).reshape(n.out.shape)
            rep = ("R",) * self.mesh.ndim
            if any(p[0] == "S" for p in it.expect[0]):
                raise ExecutionError(f"{it.name}: the loss gradient is planned at {it.expect[0]}")
            outs = [self._wrap(redistribute_local(seed, rep, it.expect[0], self.mesh), it.expect[0], n.out)]
        for k, t in enumerate(outs):
            if t is not None:
                env[(n.idx, k)] = t
        for key in it.frees:
            env.pop(key, None)


def _flat(res) -> list:
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, (list, tuple)) and all(isinstance(t, torch.Tensor) or t is None for t in res):
        return list(res)
    return tree_flatten(res)[0]


def _strs(v) -> tuple[str, ...]:
    return v.strs if type(v) is Sharded else placement_strs(v) if isinstance(v, DTensor) else ("R",)


def _gmeta(v) -> tuple:
    """(global shape, global strides) of an executor value."""
    if type(v) is Sharded:
        return tuple(v.shape), _global_stride(v.t, v.shape)
    return tuple(v.shape), tuple(v.stride())


_PLS: dict = {}


def _pls(strs) -> tuple:
    got = _PLS.get(strs)
    if got is None:
        got = _PLS[strs] = tuple(to_placement(p) for p in strs)
    return got
