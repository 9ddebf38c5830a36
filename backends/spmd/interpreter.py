"""The executor's values and its interpreter of one instruction (backends/spmd/program.py compiles the rest).

Values in a program's `env`: a plain tensor is replicated on every mesh dim; anything sharded or partial is a
`Sharded` (this rank's local tensor, placement strings, global shape). `Interpreter` is the part of `Program` that
runs one instruction (`_run1`: redistributes, DTensor dispatch, factories, random ops, the backward's seed) and
converts values between those forms and DTensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from autopar.capture import SDPA_BW
from autopar.graph import map_refs
from autopar.strategies._torch_adapter import (
    collapse,
    local_of,
    make_dtensor,
    outside_local_tensor_mode,
    to_placement,
    to_str,
    unmask_partial,
)

from .comm import executed_placements, redistribute_local
from .local_ops import call_op, draw_random


class ExecutionError(RuntimeError):
    """The program cannot run as planned; the message names the node, its module and what differs."""


_STRS: dict = {}


def placement_strs(dt) -> tuple[str, ...]:
    pls = dt.placements
    try:
        return _STRS[pls]
    except KeyError:
        s = tuple(to_str(p) for p in pls)
        if not any(type(p).__name__ == "_MaskPartial" for p in pls):  # those carry a per-call mask buffer
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
    __slots__ = (
        "node",
        "mode",
        "fn",
        "redistributes",
        "groups",
        "expect",
        "frees",
        "name",
        "strides",
        "bind",
        "keys",
        "replaced",
        "contiguous",
        "out_replicated",
        "direct_call",
        "causal_rows",
    )


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


class Interpreter:
    """Running one instruction and converting values (a mixin of `Program`, which sets g, P, red, mesh,
    device, rep and rng)."""

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
        (autopar.collectives.flat_reduce), else None: the executor runs the collectives the plan priced."""
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
                mi = iter(
                    [
                        torch.empty_strided(sh, st, dtype=_local(v).dtype, device="meta")
                        for (sh, st), v in zip(metas, vals)
                    ]
                )
                n = it.node
                res = n.target(*map_refs(n.args, lambda r: next(mi)), **map_refs(n.kwargs, lambda r: next(mi)))
            got = it.strides[key] = [tuple(t.stride()) if isinstance(t, torch.Tensor) else None for t in _flat(res)]
        return got

    def _wrap(self, t, strs, meta):
        if all(p == "R" for p in strs):
            return t
        return Sharded(t, tuple(strs), tuple(meta.shape))

    def _random(self, it, local: list) -> list:
        """A random op's outputs on this rank: its piece of the global random tensor (local_ops.draw_random)."""
        n, rep = it.node, ("R",) * self.mesh.ndim
        args, kwargs = it.bind(local)
        piece = lambda full, k: redistribute_local(full, rep, it.expect[k], self.mesh)
        res = draw_random(it.fn, n, args, kwargs, self.rng(), self.device, piece, outside_local_tensor_mode)
        if res is None:
            res = _flat(call_op(it.fn, args, kwargs))
        return [
            None if not isinstance(t, torch.Tensor) else t if r else Sharded(t, s, m.shape)
            for t, r, s, m in zip(res, it.out_replicated, it.expect, n.outs)
        ]

    def _run1(self, it, env):
        """Run one instruction (the compiled program's path for everything but plain local ops)."""
        n = it.node
        vals = self._inputs(it, env)
        mode = it.mode
        if mode == "local":
            outs = self._run_local(it, vals)
        elif mode == "dtensor":
            outs = self._run_dtensor(it, vals)
        elif mode == "random":
            outs = self._random(it, [v.t if type(v) is Sharded else v for v in vals])
        elif mode == "factory":
            res = it.fn(*_to_device(n.args, self.device), **_to_device(n.kwargs, self.device))
            outs = [self._wrap(t, s, m) if t is not None else None for t, s, m in zip(_flat(res), it.expect, n.outs)]
        else:
            outs = self._seed(it, env)
        for k, t in enumerate(outs):
            if t is not None:
                env[(n.idx, k)] = t
        for key in it.frees:
            env.pop(key, None)

    def _inputs(self, it, env) -> list:
        """The instruction's inputs, each redistributed as the plan says (alone, in a group, or shared)."""
        n = it.node
        vals = [env[k] for k in it.keys]
        # inputs all-reduced to Replicate in one collective (passes/redistribute.py), with the loss-tail members of
        # later ops where this op leads their group (autopar/loss_tail.py; entries ("ext", value key, where it goes))
        for grp in it.groups:
            locs = [_local(env[c[0][1]] if type(c[0]) is tuple else vals[c[0]]) for c in grp]
            locs = [self._as_sum(t, c[1], grp[0][1]) for t, c in zip(locs, grp)]
            flat = redistribute_local(
                torch.cat([t.reshape(-1) for t in locs]),
                grp[0][1],
                grp[0][2],
                self.mesh,
                self._flat((n.idx, grp[0][0])),
            )
            for (j, _, _, share), t, piece in zip(grp, locs, flat.split([t.numel() for t in locs])):
                if type(j) is tuple:  # a member at a later consumer (autopar/loss_tail.py): left where it loads
                    env[j[2]] = collapse(piece.view(t.shape))
                    continue
                vals[j] = collapse(piece.view(t.shape))
                if share is not None and share[0] == "store":
                    env[share[1]] = vals[j]
        for j, src, dst, share in it.redistributes:
            if share is None:
                vals[j] = self.redistribute(vals[j], src, dst, (n.idx, j))
            elif share[0] == "load":
                vals[j] = env[share[1]]
            else:
                vals[j] = env[share[1]] = self.redistribute(vals[j], src, dst, (n.idx, j))
        return vals

    def _run_local(self, it, vals) -> list:
        """The op on the local shards; its outputs at the planned placements."""
        local = [v.t if type(v) is Sharded else v for v in vals]
        if it.contiguous:
            local = [t if t.stride(-1) == 1 else t.contiguous() for t in local]
        args, kwargs = it.bind(local)
        if it.causal_rows is not None:
            args, kwargs = self._offset_causal(it, args, kwargs)
        res = call_op(it.fn, args, kwargs)
        flat = [res] if isinstance(res, torch.Tensor) else _flat(res)
        if it.replaced:  # a replacement must hand on the captured kernel's memory layout
            flat = [
                _in_layout(t, st) if isinstance(t, torch.Tensor) else t
                for t, st in zip(flat, self._out_strides(it, vals))
            ]
        return [
            None if not isinstance(t, torch.Tensor) else t if r else Sharded(t, s, m.shape)
            for t, r, s, m in zip(flat, it.out_replicated, it.expect, it.node.outs)
        ]

    def _offset_causal(self, it, args, kwargs) -> tuple:
        """Causal attention on this rank's sequence shard of the queries (localize.causal_rows): the kernel run
        non-causal with this rank's rows of the global causal mask (additive, in q's dtype, as the CPU kernel
        takes it; built once per node)."""
        bw = it.node.target is SDPA_BW
        q, k = args[1 if bw else 0], args[2 if bw else 1]
        key = (it.node.idx, q.dtype)
        mask = self.causal_masks.get(key)
        if mask is None:  # the query's global length is the output's (fw) or its gradient's (bw); K/V are whole
            sq, sk = it.node.outs[0].shape[-2], k.shape[-2]
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            full = torch.zeros(sq, sk, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
            mask = redistribute_local(full, ("R",) * self.mesh.ndim, it.causal_rows, self.mesh)
            self.causal_masks[key] = mask
        names = [a.name for a in it.node.target._schema.arguments]
        c = names.index("is_causal")
        args = list(args)
        if len(args) > c:
            args[c] = False
        kwargs = {**kwargs, "is_causal": False} if "is_causal" in kwargs else dict(kwargs)
        kwargs["attn_mask"] = mask
        return tuple(args), kwargs

    def _run_dtensor(self, it, vals) -> list:
        """The op through DTensor's dispatch; each output must come out at the plan's placement."""
        n = it.node
        args, kwargs = it.bind([self._dt(v) for v in vals])
        try:
            res = call_op(it.fn, args, kwargs)
        except Exception as e:
            raise ExecutionError(
                f"{it.name} failed on DTensors with input placements "
                f"{[_strs(v) for v in vals]}: {type(e).__name__}: {e}"
            ) from e
        outs = []
        for k, t in enumerate(_flat(res)):
            if isinstance(t, DTensor):
                t = unmask_partial(t)
                have = placement_strs(t)
                if (
                    it.expect[k] is not None
                    and have != tuple(it.expect[k])
                    and all(a == e or self.mesh.size(d) == 1 for d, (a, e) in enumerate(zip(have, it.expect[k])))
                ):
                    loc = local_of(t)  # a label of a size-1 mesh dim: the same data, the plan's label
                    outs.append(
                        Sharded(loc, tuple(it.expect[k]), tuple(n.outs[k].shape))
                        if any(p != "R" for p in it.expect[k])
                        else collapse(loc)
                    )
                    continue
                if it.expect[k] is None or not _same(have, it.expect[k]):
                    raise ExecutionError(
                        f"{it.name}: output {k} came out of DTensor at {list(have)} but the plan has "
                        f"{it.expect[k]} (inputs at {[list(_strs(v)) for v in vals]})"
                    )
                t = self._store(t)
            elif isinstance(t, torch.Tensor):
                raise ExecutionError(f"{it.name}: output {k} is not a DTensor")
            outs.append(t)
        return outs

    def _seed(self, it, env) -> list:
        """Where the backward starts: the incoming gradient (env["seed"]) at the planned placement."""
        n = it.node
        if self.g.activation:  # seed of a part: this rank's piece of its output's gradient, as planned
            seed = env["seed"].to(self.device)
            want = self.P[self.g.loss.node].out[self.g.loss.out]
            if tuple(it.expect[0]) != tuple(want):
                raise ExecutionError(
                    f"{it.name}: the output gradient is planned at {it.expect[0]}, the output at {want}"
                )
            return [self._wrap(seed, it.expect[0], n.out)]
        # the gradient flowing into the loss, replicated, taken to the planned placement locally
        seed = env["seed"].to(self.device).reshape(n.out.shape)
        rep = ("R",) * self.mesh.ndim
        if any(p[0] == "S" for p in it.expect[0]):
            raise ExecutionError(f"{it.name}: the loss gradient is planned at {it.expect[0]}")
        return [self._wrap(redistribute_local(seed, rep, it.expect[0], self.mesh), it.expect[0], n.out)]
