"""Gradient buckets of a program: which gradients go in which bucket, when each bucket is issued in the backward,
how its flat buffer is filled (copied into, or made in place by the op that computes a gradient) and what each
gradient becomes once the bucket is done. `Buckets` is a mixin of `Program` (backends/spmd/program.py)."""

from __future__ import annotations

from collections import Counter
from math import prod

import torch
from autopar.plan import BucketRecord
from autopar.strategies._torch_adapter import collapse, make_dtensor, per_rank, sole_owner

from .comm import executed_placements, finish_bucket, group_name, launch_bucket, launch_filled
from .interpreter import ExecutionError, _global_stride, _local, _pls
from .local_ops import VIEWS, local_shape

aten = torch.ops.aten

_PASS_VIEWS = (
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    *VIEWS,
)  # views that keep the storage offset: a gradient made through them can be made in place
_OUT: dict = {}


def _out_overload(op):
    """The out= overload of a functional aten op (mm -> mm.out, sum.dim_IntList -> sum.IntList_out), else None."""
    if op not in _OUT:
        _OUT[op] = None
        s = getattr(op, "_schema", None)
        pkt = getattr(aten, s.name.split("::")[-1], None) if s is not None and s.name.startswith("aten::") else None
        names = [a.name for a in s.arguments] if s is not None else []
        for ov in pkt.overloads() if pkt is not None else ():
            o = getattr(pkt, ov)._schema
            if (
                o.is_mutable
                and [a.name for a in o.arguments] == names + ["out"]
                and o.arguments[-1].kwarg_only
                and len(o.returns) == 1
            ):
                _OUT[op] = getattr(pkt, ov)
                break
    return _OUT[op]


class Buckets:
    """The gradient buckets of a `Program`: planning them (which backward instruction completes each, where each
    gradient goes in its flat buffer) and issuing and finishing them during the backward."""

    def _plan_buckets(self):
        """`chains`: the plan's buckets by chain (a chain of buckets, one per mesh-dim step); `bucket_ready`:
        backward position -> the chains whose last gradient that instruction makes."""
        g = self.g
        pos = {it.node.idx: i for i, it in enumerate(self.bw)}
        self.chains: dict[int, list] = {}  # first bucket of a chain -> its buckets (one per step)
        for b in map(BucketRecord.from_json, self.plan.buckets):  # as Plan.bucket_records(), for any plan record
            self.chains.setdefault(b.chain, []).append(b)
        self.bucket_ready: dict[int, list[int]] = {}
        for i, bs in self.chains.items():
            if isinstance(bs[0].mesh_dim, tuple):  # a flattened group: made now, on every rank in plan order
                group_name(self.mesh, bs[0].mesh_dim)
            at = max(pos.get(g.grads[f].node, len(self.bw) - 1) for f in bs[0].params)
            self.bucket_ready.setdefault(at, []).append(i)

    def _plan_bucket_copies(self):
        """All_reduce buckets (real process groups) are filled as the backward goes, as DDP's reducer fills its
        buckets: right after the instruction that makes a gradient, it is copied into its slice of the bucket's flat
        buffer (still in cache) and dropped unless a later op reads it, so a bucket never holds its gradients twice
        and is launched with no copy of its own. `copy_at`: backward position -> [(bucket, slice, key, drop)];
        `flat_sizes`: bucket -> (elements, dtype, [local shapes]). Under LocalTensorMode (one process simulating
        every rank) buckets are concatenated at launch instead."""
        import torch.distributed as dist

        self.copy_at: dict[int, list] = {}
        self.write_at: dict[int, tuple] = {}  # backward position -> (out= overload, bucket, offset, elements, shape)
        self.flat_sizes: dict[int, tuple] = {}
        self.flat_bufs: dict[int, torch.Tensor] = {}  # bucket -> its flat buffer, kept between steps
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return
        g, pos = self.g, {it.node.idx: i for i, it in enumerate(self.bw)}
        readers = Counter((r.node, r.out) for n in g.nodes for r in n.inputs())  # ops reading each value
        read = set(readers)  # values some op reads
        read |= {k for k, c in Counter((r.node, r.out) for r in g.grads.values()).items() if c > 1}
        readers.update((r.node, r.out) for r in g.outputs())  # + results
        for i, bs in self.chains.items():
            if not all(b.dst == "R" for b in bs):
                continue
            plan, off = [], 0
            for f in bs[0].params:
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
            dtype = getattr(torch, bs[0].dtype.split(".")[-1])
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
            if it is None or it.direct_call is None or it.redistributes or it.groups or readers[k] != 1:
                return None
            chain.append(it)
            k = it.keys[0]
        it = self.bw[pos[k[0]]] if k[0] in pos else None
        if (
            it is None
            or it.direct_call is None
            or it.redistributes
            or it.groups
            or k[1] != 0
            or readers[k] != 1
            or "out" in it.direct_call[1]
        ):
            return None
        out = _out_overload(it.fn)
        meta = g.nodes[k[0]].outs[0]
        zshape = local_shape(tuple(meta.shape), self.P[k[0]].out[0], tuple(self.mesh.shape))
        if out is None or zshape is None or meta.dtype != dtype:
            return None
        x = torch.empty(zshape, dtype=dtype, device="meta")
        for v in reversed(chain):
            x = v.fn(x, *v.direct_call[0], **v.direct_call[1])
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
        return buf[off : off + n].view(shape)

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

    def _at(self, pos: int, env: dict, handles: dict, bufs: dict):
        """After backward instruction pos: copy the gradients it made into their buckets, issue the buckets it
        completes."""
        if pos in self.copy_at:
            self._copy_grads(pos, env, bufs)
        for i in self.bucket_ready.get(pos, ()):
            self._launch(i, env, handles, bufs)

    def _launch(self, i: int, env: dict, handles: dict, bufs: dict):
        """Issue gradient bucket i (with the rest of its chain, backends/spmd/comm.py launch_bucket) as soon as the
        backward has produced its last gradient, like DDP's reducer; the backward goes on while it is in flight."""
        g, bs = self.g, self.chains[i]
        chain = [(b.mesh_dim, b.src, b.dst) for b in bs]
        if i in bufs:
            handles[i] = launch_filled(bufs.pop(i), self.mesh, chain, self.flat_sizes[i][2])
            return
        vals = [_local(env[(g.grads[f].node, g.grads[f].out)]) for f in bs[0].params]
        handles[i] = launch_bucket(vals, self.mesh, chain)

    def _bucket_outputs(self) -> dict:
        """Per gradient bucket, what each of its gradients becomes: [(FQN, placements, global shape, replicated)],
        checked once: a bucket must leave every gradient at its parameter's placement."""
        g, outs = self.g, {}
        for i, bs in self.chains.items():
            outs[i] = []
            for f in bs[0].params:
                src, dst, _ = self.red[(g.params[f], "opt")]
                now = executed_placements(src, dst)
                if now != self.P[g.params[f]].out[0]:
                    raise ExecutionError(
                        f"gradient bucket leaves '{f}' at {now}, its parameter at {self.P[g.params[f]].out[0]}"
                    )
                outs[i].append((f, _pls(now), tuple(g.meta(g.grads[f]).shape), all(p == "R" for p in now)))
        return outs

    def _finish_buckets(self, env, handles, bufs) -> dict:
        """Wait for the plan's gradient buckets, in order; each gradient at its parameter's placement."""
        out, mesh = {}, self.mesh
        for i, made in self.bucket_out.items():
            if i not in handles:
                self._launch(i, env, handles, bufs)
            for (f, pls, shape, rep), loc in zip(made, finish_bucket(handles.pop(i))):
                out[f] = make_dtensor(
                    per_rank(collapse(loc)) if rep else loc, mesh, pls, shape, _global_stride(loc, shape)
                )
        return out
