"""Candidate placements per op: DTensor's strategy registry (through `_torch_adapter`) plus autopar's own rules.

A `Strategy` gives, per mesh dim, the placement of every output and every tensor input of a node, as strings:
"R" (replicate), "S<d>" (shard tensor dim d), "P" (partial sum), "Pm" (masked partial of a vocab-sharded
embedding). Own rules are registered per op family with `@rule(op, ...)` and written like DTensor's per-mesh-dim
strategies: a list of (outputs..., inputs...) placement tuples valid on ONE mesh dim; `expand` combines them
over the mesh and drops combinations that do not divide a tensor evenly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..graph import Node, Ref, TensorMeta
from . import _torch_adapter as adapter
from .grouped_mm import meta_kernel  # noqa: F401  (registers aten._grouped_mm's rule; capture imports it from here)
from .merged_views import VIEW_OPS, merged_view_strategies
from .registry import RULES, rule
from .strided import restride_decomposition  # noqa: F401  (capture imports it from here)
from . import vocab_parallel

aten = torch.ops.aten
Placements = tuple[str, ...]  # one placement string per mesh dim


@dataclass(frozen=True)
class Strategy:
    out: tuple[Placements | None, ...]  # per output (None: not a tensor)
    ins: tuple[Placements, ...]  # per tensor input, in flatten order


class NoStrategyError(RuntimeError):
    """Ops with no placement rule and no decomposition; the message lists them."""


# ---- autopar's own rules -----------------------------------------------------------------------------------------


@rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _attention_fw(args, kwargs, metas):
    # q, k, v (B, H, S, D) -> out (B, H, S, D), logsumexp (B, H, S): shard batch or heads; or shard the query's
    # sequence (context parallelism, the all-gathered-KV form of torch's context_parallel and Llama 3): each rank
    # attends its query rows to the whole K and V, so K/V are Replicate on that mesh dim (the planner prices their
    # all-gather as a redistribute); a causal kernel on rows [r0, r0 + S/n) needs the mask offset by r0, which the
    # executor gives it (backends/spmd/localize.py, causal_rows)
    return [("S0",) * 5, ("S1",) * 5, ("S2", "S2", "S2", "R", "R")]


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _attention_bw(args, kwargs, metas):
    # grad_out, q, k, v, out, logsumexp -> grad_q, grad_k, grad_v. Sequence-sharded queries: dQ is this rank's
    # rows, dK/dV are partial sums over its rows (their reduce-scatter back to the sequence shard is priced)
    return [("S0",) * 9, ("S1",) * 9, ("S2", "P", "P", "S2", "S2", "R", "R", "S2", "S2")]


@rule(
    aten.avg_pool2d_backward.default,
    aten.max_pool2d_with_indices_backward.default,
    aten.adaptive_max_pool2d_backward.default,
)
def _pool_bw(args, kwargs, metas):
    # grad_out, self (, indices) -> grad_in, all (N, C, H, W): shard batch or channels
    n = 1 + len(metas)
    return [("S0",) * n, ("S1",) * n]


@rule(aten._weight_norm_interface_backward.default)
def _weight_norm_bw(args, kwargs, metas):
    # (grad_w, v, g, norms, dim) -> (grad_v, grad_g): the norms are over every dim of v but `dim` (torch.nn.utils
    # weight_norm / parametrizations.weight_norm, wav2vec2's positional conv), so a shard of `dim` is local
    dim = args[4] % len(metas[1].shape)
    return [(f"S{dim}",) * 6]


@rule(
    aten.bernoulli.p,
    aten.bernoulli.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.uniform.default,
    aten.normal_functional.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.exponential.default,
    aten.geometric.default,
    aten.log_normal.default,
    aten.cauchy.default,
)
def _random_like(args, kwargs, metas):
    # a random tensor of the input's shape: at whatever placement the input takes, never partial (the executor
    # draws the global tensor and keeps this rank's piece: backends/spmd/local_ops.draw_random)
    return [(f"S{d}", f"S{d}") for d in range(len(metas[0].shape))]


@rule(aten.native_dropout.default)
def _dropout(args, kwargs, metas):
    # input -> (output, mask), all at the input's placement
    return [(f"S{d}",) * 3 for d in range(len(metas[0].shape))]


@rule(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.scalar_tensor.default,
    aten.empty.memory_format,
    aten.randn.default,
    aten.rand.default,
    aten.randint.default,
    aten.randint.low,
    aten.lift_fresh_copy.default,
    aten.lift_fresh.default,
)
def _factory(args, kwargs, metas):
    return []  # every rank builds (or copies, lift_fresh_copy: a constant) the same tensor: all-Replicate


def _broadcast(shapes, out_shape):
    """Per-mesh-dim rules of a pointwise op with broadcasting: shard an output dim and the inputs' matching dims
    (an input broadcast along it, or without it, stays replicated)."""
    nd, rules = len(out_shape), []
    for d in range(nd):
        r = [f"S{d}"]
        for sh in shapes:
            k = d - (nd - len(sh))
            r.append(f"S{k}" if k >= 0 and sh[k] == out_shape[d] else "R")
        rules.append(tuple(r))
    return rules


@rule(aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where_scalar(args, kwargs, metas):
    # torch.where with a Python scalar branch: pointwise (torch's decomposition of it lowers to prims.where,
    # which has no rule)
    shapes = [m.shape for m in metas]
    return _broadcast(shapes, tuple(torch.broadcast_shapes(*shapes)))


@rule(aten.fill.Tensor)
def _fill(args, kwargs, metas):
    # fill(self, value): the 0-dim value everywhere in self's shape (functionalized fill_): self's dims shard
    return _broadcast([m.shape for m in metas], tuple(metas[0].shape))


@rule(aten.copy.default)
def _copy(args, kwargs, metas):
    # copy(self, src): src broadcast into self's shape and dtype (what functionalization makes of x.copy_(y)):
    # pointwise in src; a partial src stays partial (a sum of broadcasts is the broadcast of the sum)
    rules = _broadcast([m.shape for m in metas], tuple(metas[0].shape))
    if metas[0].dtype.is_floating_point and metas[1].dtype.is_floating_point:
        rules += [("P", "R", "P"), ("P", "P", "P")]
    return rules


def _except(nd, skip, width):
    """Rules sharding every tensor of the op alike along any dim of `nd` except those in `skip`."""
    return [(f"S{d}",) * width for d in range(nd) if d not in skip]


@rule(aten.glu.default, aten.glu_backward.default)
def _glu(args, kwargs, metas):
    # glu(x, dim) halves x along dim: any other dim shards (its decomposition, tensor_split, has no rule)
    nd = len(metas[-1].shape)
    dim = (args[-1] if len(args) > len(metas) else kwargs.get("dim", -1)) % nd
    return _except(nd, {dim}, 1 + len(metas))


@rule(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def _pad_bw(args, kwargs, metas):
    # grad_output, self -> grad_input: the padded trailing dims stay whole, the others (batch, channels) shard
    nd = len(metas[1].shape)
    k = len(args[2] if len(args) > 2 else kwargs["padding"]) // 2
    return _except(nd, set(range(nd - k, nd)), 3)


@rule(aten.stack.default)
def _stack(args, kwargs, metas):
    # stack(tensors, dim): every input placed alike; input dim d is output dim d before `dim`, d + 1 from it on.
    # (DTensor's rule, offered several candidates per input, keeps only the replicated one and a non-batch split:
    # an LSTM's per-step outputs lost their batch split there.) Stacking is linear: partial inputs stay partial
    # (`divides` drops that for integer tensors).
    nd, n = len(metas[0].shape), len(metas)
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (nd + 1)
    return [(f"S{d if d < dim else d + 1}",) + (f"S{d}",) * n for d in range(nd)] + [("P",) * (n + 1)]


@rule(aten._cdist_forward.default)
def _cdist_fw(args, kwargs, metas):
    # x1 (..., P, M), x2 (..., R, M) -> (..., P, R): batch dims, x1's rows or x2's rows shard
    nd = len(metas[0].shape)
    return _except(nd - 2, (), 3) + [(f"S{nd - 2}", f"S{nd - 2}", "R"), (f"S{nd - 1}", "R", f"S{nd - 2}")]


@rule(aten._cdist_backward.default)
def _cdist_bw(args, kwargs, metas):
    # grad (..., P, R), x1 (..., P, M), x2 (..., R, M), cdist (..., P, R) -> grad_x1 (..., P, M): x1's rows shard
    # alike; x2's rows shard with grad/cdist columns, each rank's grad_x1 a partial sum over its rows of x2
    nd = len(metas[1].shape)
    a, b = f"S{nd - 2}", f"S{nd - 1}"
    return _except(nd - 2, (), 5) + [(a, a, a, "R", a), ("P", b, "R", a, b)]


# ---- ops with no rule: torch's own decompositions ------------------------------------------------------------------

_DECOMP: dict = {}


def has_rule(op) -> bool:
    """An own rule or a DTensor strategy (per mesh dim or full-mesh) exists for `op`."""
    return op in RULES or adapter.has_single_dim(op) or adapter.has_full(op)


def decomposition_for(op):
    """torch's decomposition of `op` (torch._decomp's table, then core ATen's) when `op` has no placement rule,
    else None: the recorder (autopar/capture.py) runs it in place of the op, so the graph holds ops that have rules
    (mse_loss -> sub, pow, mean; its backward -> sub, mul). Never for ops whose identity the plan or the executor
    needs: mutating or aliasing ops (capture's functionalization handles them), random ops (the executor draws
    them from its generator), and ops with a rule (their rule shards them better than their pieces')."""
    got = _DECOMP.get(op, False)
    if got is not False:
        return got
    fn = None
    s = getattr(op, "_schema", None)
    if (
        s is not None
        and not has_rule(op)
        and not s.is_mutable
        and all(r.alias_info is None for r in s.returns)
        and torch.Tag.nondeterministic_seeded not in op.tags
    ):
        fn = torch._decomp.decomposition_table.get(op)
        if fn is None:
            fn = _core_aten().get(op)
    _DECOMP[op] = fn
    return fn


def user_op(node) -> str:
    """The op a user's code called for this node: the op whose torch decomposition produced it, else its own."""
    return str(node.origin or node.target)


def describe(node) -> str:
    """The node for a message: its name, the op it was decomposed from and the user's torch call it ran in
    (`Node.user_op`, where the recorder notes it)."""
    call = getattr(node, "user_op", None)
    return (
        node.name
        + (f" (in torch's decomposition of {node.origin})" if node.origin is not None else "")
        + (f", called from {call}" if call else "")
    )


_CORE: list = []


def _core_aten() -> dict:
    if not _CORE:
        from torch._decomp import core_aten_decompositions

        _CORE.append(dict(core_aten_decompositions().items()))
    return _CORE[0]


# ---- expansion over the mesh -------------------------------------------------------------------------------------


def divides(meta: TensorMeta, pl: Placements, mesh_shape) -> bool:
    if meta is None:
        return True
    if sum(p == "Pm" for p in pl) > 1:  # DTensor's MaskPartial keeps one mask per op: two mesh dims masking the
        return False  # same lookup fail at run time ("MaskBuffer has been materialized with conflicting data")
    split = [1] * len(meta.shape)
    for p, n in zip(pl, mesh_shape):
        if p[0] == "S":
            d = int(p[1:])
            if d >= len(meta.shape):
                return False
            split[d] *= n
        elif (
            p[0] == "P" and p != "Pm" and not meta.dtype.is_floating_point
        ):  # Pm: masked indices of a vocab-sharded table
            return False
    return all(s % k == 0 for s, k in zip(meta.shape, split))


def expand(rules, metas: list[TensorMeta | None], mesh_shape) -> list[tuple[Placements, ...]]:
    """Combine per-mesh-dim rules over all mesh dims; metas = outputs then inputs, aligned with each rule."""
    rules = list(dict.fromkeys([tuple(r) for r in rules]))
    rep = tuple(None if m is None else "R" for m in metas)
    if rep not in rules:
        rules.insert(0, rep)
    out = []
    for combo in itertools.product(rules, repeat=len(mesh_shape)):
        per_tensor = tuple(None if metas[t] is None else tuple(c[t] for c in combo) for t in range(len(metas)))
        if all(pl is None or divides(m, pl, mesh_shape) for m, pl in zip(metas, per_tensor)):
            out.append(per_tensor)
    return out


def leaf_strategies(meta: TensorMeta, mesh_shape, allow_partial=False) -> list[Strategy]:
    """All placements of a parameter or input: Replicate or Shard(d) on each mesh dim (evenly dividing)."""
    opts = ["R"] + [f"S{d}" for d in range(len(meta.shape))]
    res = []
    for pl in itertools.product(opts, repeat=len(mesh_shape)):
        if divides(meta, pl, mesh_shape):
            res.append(Strategy((pl,), ()))
    return res


def _sig(a, metas):
    if isinstance(a, Ref):
        m = metas(a)
        return ("T", m.shape, m.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_sig(x, metas) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _sig(v, metas)) for k, v in a.items()))
    return a


_CACHE: dict = {}


def node_strategies(node: Node, meta_of, mesh_shape: tuple[int, ...], in_cands: list[list[Placements]]):
    """Candidate strategies of one op node and where they came from ("autopar", "dtensor", "dtensor-full",
    "factory" or "fallback" when no rule exists)."""
    op = node.target
    ins = node.inputs()
    key = (op, _sig(node.args, meta_of), _sig(node.kwargs, meta_of), mesh_shape)
    if op not in RULES and not adapter.has_single_dim(op) and adapter.has_full(op):
        key = key + (tuple(tuple(c) for c in in_cands),)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    in_metas = [meta_of(r) for r in ins]
    n_out = len(node.outs)
    res, source = None, None
    try:
        if op in RULES or adapter.has_single_dim(op):
            source = "autopar" if op in RULES else "dtensor"
            rules = (
                RULES[op](node.args, node.kwargs, in_metas)
                if op in RULES
                else adapter.single_dim_rules(op, node.args, node.kwargs, meta_of)
            )
            tensor_outs = [i for i, m in enumerate(node.outs) if m is not None]
            width = len(tensor_outs) + len(ins)
            # a rule may list every output of the schema, also those this call does not compute (e.g.
            # convolution_backward's grad_input of a first layer): keep the entries of the computed ones
            rules = [
                r if len(r) == width else tuple(r[i] for i in tensor_outs) + tuple(r[n_out:])
                for r in rules
                if len(r) in (width, n_out + len(ins))
            ]
            metas = [node.outs[i] for i in tensor_outs] + in_metas
            res = []
            for combo in expand(rules, metas, mesh_shape):
                outs = [None] * n_out
                for j, i in enumerate(tensor_outs):
                    outs[i] = combo[j]
                res.append(Strategy(tuple(outs), tuple(combo[len(tensor_outs) :])))
        elif adapter.has_full(op):
            source = "dtensor-full"
            res = []
            for o, i in adapter.full_strategies(op, node.args, node.kwargs, meta_of, mesh_shape, in_cands):
                o = tuple(o) + (None,) * (n_out - len(o))
                if all(divides(m, p, mesh_shape) for m, p in zip(node.outs, o) if p is not None) and all(
                    divides(m, p, mesh_shape) for m, p in zip(in_metas, i)
                ):
                    res.append(Strategy(o[:n_out], i))
    except Exception as e:  # a strategy function that cannot handle these args: report as no rule
        res, source = None, f"error: {type(e).__name__}: {e}"
    if not ins and res is None:
        res, source = [], "factory"
    rep = Strategy(
        tuple(None if m is None else ("R",) * len(mesh_shape) for m in node.outs),
        tuple(("R",) * len(mesh_shape) for _ in ins),
    )
    if res is not None and op in VIEW_OPS and len(ins) == 1:  # a sequence shard through a (batch, seq) flatten
        m = in_metas[0]
        res = res + [
            Strategy((o,), (i,))
            for o, i in merged_view_strategies(m.shape, node.outs[0].shape, m.dtype.is_floating_point, mesh_shape)
        ]
    if res is None:
        res, source = [rep], "fallback" if source is None else "fallback (" + source + ")"
    elif rep not in res:
        res.insert(0, rep)
    if op in vocab_parallel.OPS:  # the class-sharded loss (vocab parallelism) beside DTensor's strategies
        res = vocab_parallel.extend(node, res, in_metas, mesh_shape, divides, Strategy)
    res = list(dict.fromkeys(res))
    _CACHE[key] = (res, source)
    return res, source


def num_shards(pl: Placements, mesh_shape) -> int:
    return math.prod(n for p, n in zip(pl, mesh_shape) if p[0] == "S")
