"""Float8 training of linear layers, as torchao's Float8Linear runs it with tensorwise dynamic scaling (the recipe
torchtitan's float8 converter uses by default), as a precision choice of the planner.

What a converted linear computes: its three GEMMs (forward `x @ W^T`, grad_input `grad_out @ W`, grad_weight
`grad_out^T @ x`) take float8 operands: activations and weights in e4m3, output gradients in e5m2, each scaled by
`max(dtype) / amax(|t|)` (one scale per tensor, computed from the tensor every step), multiplied by
`torch._scaled_mm` with the inverse scales, the output in the GEMM's own dtype (bf16 under mixed precision). The
high-precision input and weight are saved for the backward and cast again there (torchao casts each GEMM operand
itself; a tensorwise grad_out cast is shared by the two backward GEMMs, written in both layouts).

Which linears: `nn.Linear` modules (a forward mm/addmm of the module reading `<module>.weight` through a transpose)
whose weight dims are both multiples of 16 (the float8 tensor cores' requirement) and whose FQN contains none of
`filter_fqns` (default `("output",)`: the output head stays in high precision, as torchtitan recommends). Skipped
linears and why are recorded in `Plan.meta["float8"]["skipped"]`.

Scaling is per rank: each rank scales the tensor its GEMM reads (its local shard), as torchao does under data
parallelism (FSDP/DDP ranks hold plain local tensors). Tensor parallelism: torchao's Float8ColwiseParallel /
Float8RowwiseParallel (torchtitan's TP plan under float8) cast DTensors, so each operand's amax is all-reduced over
the TP group; priced so (`tp_dims`: the mesh dims on which a GEMM holds its weight, or its weight gradient,
sharded; one fp32 scalar all-reduce per operand cast there, inside the cast it blocks). Executed per shard on the
graph backend (every per-shard scale is a valid tensorwise scale, so the result is correct to float8 precision
either way, but not bitwise that of one device when an operand is sharded). Not priced: torchao's float8
all-gather of the sequence-parallel activations (it casts the Shard(1) input before gathering it, so the gather
moves 1 byte per element and the cast runs on 1/tp of the elements): those gathers are priced at the activation
dtype, the cast on the gathered operand (the edge pricing does not know the consumer's float8 operand).

Pricing (`priced`): a converted GEMM at the device's fp8 peak (`DeviceSpec.peak_flops["fp8"]`) with 1-byte operands,
by the device's GEMM model (autopar/cost/kernels.py: by local shape on the GPU presets, its float8 K-block
assumption there; the flat roofline elsewhere), plus its casts, each a memory-bound pass over the operand's local shard: the amax reads it, the scaled cast reads it
again and writes 1 byte per element (2 kernels; a shared grad_out cast adds only its second layout's write). Under
torch.compile (DeviceSpec fusion="inductor", autopar/cost/fusion.py) the amax of an operand that a fusible op of the
same phase produces (a norm's output, the SwiGLU product, a pointwise gradient) runs in that op's kernel: its cast
is one pass, the read and the 1-byte write (torchtitan: compile "fuses the float8 scaling/casting kernels"), and an
activation several converted GEMMs of the phase read (wq, wk, wv; w1, w3) is cast once (CSE of the identical
amax and cast; eager torchao casts it per linear). A
device without an fp8 peak (A100, CPUs) cannot run float8 GEMMs: the config's `emulate=True` allows the numerics
(torch runs `_scaled_mm` on CPU), priced at the bf16 rate (`DeviceSpec.flops_for` falls back).

FSDP float8 all-gather (`fsdp_float8_all_gather=True`, torchao's `enable_fsdp_float8_all_gather`; off by default, as
in torchtitan's float8 config): each rank casts its shard of a converted weight to e4m3 before FSDP gathers it, so
the gathers move 1 byte per element instead of the parameter dtype's 2 (or 4). `mark` writes the float8 dtype on the
transposes / views between the weight and its GEMMs (the graph's value of the gathered weight), so every pass prices
those gathers, and holds their gathered copies, at 1 byte; the weight's operand casts at its GEMMs go away and one
cast of the shard the transpose reads (amax read, cast read, 1-byte write) replaces them. Its scale must be the
whole weight's: the shard amaxes are all-reduced over the dims the weight is sharded on, one scalar all-reduce per
weight at each of its two gathers (forward and backward), or with `precompute_scale=True`
(torchao's precompute_float8_dynamic_scale_for_fsdp) one all-reduce of every weight's amax per step, each weight
paying its share; those all-reduces are priced inside the cast they block. Assumed: the backward's gather reuses
the forward's float8 shard (torchao casts it again: one more shard-sized pass, 1/dp of the weight). Executed on the
graph backend as gathers of the high-precision weight with the same numerics (the gathered weight's amax is the
all-reduced one): priced, not executed, bytes.

`mark` (run by the precision pass, first in PASSES) finds the GEMMs and writes `state.extras["float8"]` (copied
into Plan.meta): the converted and skipped linears and, per GEMM node, its operand dtypes and casts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from autopar.collectives import redistribute_time
from autopar.cost import fusion, global_flops, kernels, roofline_time
from autopar.graph import TensorMeta
from autopar.mixed_precision import retype_float8
from autopar.strategies import num_shards

aten = torch.ops.aten

# GEMM op -> positions of its two matrix operands among the node's args
GEMMS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CAST, SHARED, NONE = 1, 2, 0  # an operand's cast at a GEMM: its own, a shared one's second layout, none
REPEAT = 3  # an activation another converted GEMM of the phase casts too (wq, wk, wv reading one norm output)
_THROUGH = (aten.t.default, aten.view.default, aten._unsafe_view.default, aten._to_copy.default)


@dataclass(frozen=True)
class Float8Config:
    """recipe: "tensorwise" (the only one priced and executed); filter_fqns: linears whose FQN contains one of these
    stay in high precision; emulate: allow a device without float8 matmuls (numerics only, no speed-up);
    fsdp_float8_all_gather: sharded weights gathered in float8 (module docstring); precompute_scale: their amaxes
    all-reduced once per step for all weights (torchao's precompute_float8_dynamic_scale_for_fsdp)."""

    recipe: str = "tensorwise"
    filter_fqns: tuple = ("output",)
    emulate: bool = False
    fsdp_float8_all_gather: bool = False
    precompute_scale: bool = False

    @classmethod
    def of(cls, value) -> Float8Config:
        """From autopar.plan's `float8=`: True, a dict of these fields, or a Float8Config."""
        if isinstance(value, Float8Config):
            cfg = value
        elif value is True or value == "auto":
            cfg = cls()
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"float8={value!r}: unknown fields {unknown}; known: {sorted(cls.__dataclass_fields__)}"
                )
            cfg = cls(**{k: tuple(v) if k == "filter_fqns" else v for k, v in value.items()})
        else:
            raise ValueError(f"float8 must be None, True, 'auto', a dict or a Float8Config, got {value!r}")
        if cfg.recipe != "tensorwise":
            raise ValueError(f"float8 recipe {cfg.recipe!r} is not supported: only 'tensorwise'")
        return cfg

    def option(self) -> dict:
        """The PlanState option (plain values: it travels to stage-search workers and into Plan.meta)."""
        d = asdict(self)
        d["filter_fqns"] = list(d["filter_fqns"])
        return d


def unsupported(cfg: Float8Config, cluster) -> str | None:
    """Why the cluster cannot run float8 GEMMs under cfg, else None."""
    if cfg.emulate or "fp8" in cluster.device.peak_flops:
        return None
    return (
        f"cluster {cluster.name!r} (device {cluster.device.name}) has no float8 matmul peak ('fp8' in its "
        f"DeviceSpec.peak_flops; A100s and CPUs have none): pass float8={{'emulate': True}} to plan float8 "
        f"numerics at the device's bf16 rate"
    )


def _root(g, r):
    """The value r reads through transposes, views and dtype casts (a parameter, or the tensor a view shows)."""
    while True:
        n = g.nodes[r.node]
        if n.kind != "op" or n.target not in _THROUGH:
            return r
        r = n.inputs()[0]


def _linears(g, cfg) -> tuple[dict, dict]:
    """(converted module path -> weight FQN, skipped module path -> why) from the forward GEMMs."""
    converted, skipped = {}, {}
    for n in g.ops():
        if n.phase != "fw" or n.target not in GEMMS or not n.module:
            continue
        w = _root(g, n.args[GEMMS[n.target][1]])
        fqn = g.nodes[w.node].target if g.nodes[w.node].kind == "param" else None
        if fqn != f"{n.module}.weight" or len(g.meta(w).shape) != 2:
            continue
        shape = tuple(g.meta(w).shape)
        hit = next((f for f in cfg.filter_fqns if f in n.module), None)
        if hit is not None:
            skipped[n.module] = f"filtered (filter_fqns {hit!r})"
        elif any(d % 16 for d in shape):
            skipped[n.module] = f"weight {list(shape)}: dims not multiples of 16"
        else:
            converted[n.module] = fqn
    return converted, skipped


def mark(state) -> None:
    """Find the converted linears' GEMMs (module docstring); state.extras["float8"] (None option: nothing)."""
    opt = state.options.get("float8")
    if not opt:
        return
    cfg = Float8Config.of(dict(opt))
    g = state.graph
    converted, skipped = _linears(g, cfg)
    nodes, grad_cast = [], set()  # grad_cast: (module, root value) of output gradients already cast
    act_cast = set()  # (phase, root value) of activations already cast
    for n in g.ops():
        if n.target not in GEMMS or n.module not in converted:
            continue
        row = [n.idx]
        casts = []
        for pos in GEMMS[n.target]:
            root = _root(g, n.args[pos])
            grad = g.nodes[root.node].phase == "bw" and g.nodes[root.node].kind == "op"
            row.append("e5m2" if grad else "e4m3")
            key = (n.module, root)
            act = not grad and g.nodes[root.node].kind == "op"
            if grad:
                casts.append(SHARED if key in grad_cast else CAST)
                grad_cast.add(key)
            else:
                casts.append(REPEAT if act and (n.phase, root) in act_cast else CAST)
                act_cast.update([(n.phase, root)] if act else [])
        if row[1:] == ["e5m2", "e5m2"]:  # _scaled_mm takes no e5m2 x e5m2
            continue
        nodes.append(row + casts)
    casts, kept, views = _gathered_in_float8(g, converted, nodes) if cfg.fsdp_float8_all_gather else ({}, {}, [])
    state.extras["float8"] = {
        **cfg.option(),
        "scaling": "tensorwise per rank (each rank's amax of the shard its GEMM reads; priced with the TP amax all-reduce)",
        "linears": sorted(converted),
        "skipped": dict(sorted(skipped.items())),
        "gemms": len(nodes),
        "nodes": nodes,
        "weight_casts": sorted(casts.items()),
        "gathered_views": views,  # retyped e4m3 here; a loaded plan's capture repeats it (execution.capture_for)
        "gathered_high_precision": dict(sorted(kept.items())),
    }


def _weight_views(g, param_idx, gemms) -> list | None:
    """The transposes / views from a parameter to its GEMMs (every consumer path ends at one of `gemms`), in graph
    order; None if some consumer is anything else."""
    views, todo = [], [param_idx]
    while todo:
        for u in g.nodes[todo.pop()].users:
            n = g.nodes[u]
            if u in gemms:
                continue
            if n.kind != "op" or n.target not in _THROUGH or n.target is aten._to_copy.default:
                return None
            views.append(u)
            todo.append(u)
    return sorted(set(views))


def _gathered_in_float8(g, converted, nodes) -> tuple[dict, dict, list]:
    """FSDP float8 all-gather (module docstring): writes e4m3 on the views between each converted weight and its
    GEMMs and drops the weight operand's casts at them. ({cast view idx: weight FQN}, {weight FQN: why kept}, the
    retyped views)."""
    gemms = {row[0] for row in nodes}
    casts, kept, weight_of = {}, {}, {}
    for fqn in converted.values():
        p = g.params[fqn]
        views = _weight_views(g, p, gemms)
        if not views:
            kept[fqn] = (
                "read by ops other than its float8 GEMMs (or through a dtype cast)"
                if views is None
                else "read by its GEMMs without a transpose or view to carry the float8 dtype"
            )
            continue
        retype_float8(g, views)
        weight_of.update({v: fqn for v in views})
        casts.update({v: fqn for v in views if g.nodes[v].inputs()[0].node == p})
    for row in nodes:
        for k, pos in enumerate(GEMMS[g.nodes[row[0]].target]):
            if g.nodes[row[0]].args[pos].node in weight_of:
                row[3 + k] = NONE  # cast on the shard, before the gather
    return casts, kept, sorted(weight_of)


def gemm_roles(extras: dict) -> dict:
    """node idx -> (operand dtypes, casts) from Plan.meta["float8"] / state.extras["float8"]."""
    return {row[0]: (tuple(DTYPES[d] for d in row[1:3]), tuple(row[3:5])) for row in (extras or {}).get("nodes", [])}


def _parts(state, n, s, roles, flop_cache) -> tuple[float, float]:
    """(GEMM seconds, cast seconds) of converted GEMM node n under strategy s, on its local shards."""
    g, mesh_shape, dev = state.graph, state.mesh.shape, state.cluster.device
    _, casts = roles[n.idx]
    work = math.prod(k for p, k in zip(next(p for p in s.out if p is not None), mesh_shape) if p != "R")
    ops = GEMMS[n.target]
    ins = n.inputs()
    local = {}  # operand position -> local elements, element bytes
    for j, r in enumerate(ins):
        local[j] = (g.meta(r).numel / num_shards(s.ins[j], mesh_shape), g.meta(r).dtype.itemsize)
    pos_of = [ins.index(n.args[p]) for p in ops]
    out = n.outs[0].nbytes / num_shards(s.out[0], mesh_shape)
    extra = sum(local[j][0] * local[j][1] for j in local if j not in pos_of)  # addmm's bias
    gemm_bytes = sum(local[j][0] for j in pos_of) + out + extra
    flops = global_flops(g, n, flop_cache) / max(1, work)
    gemm = _gemm_time(g, n, s, mesh_shape, dev, flops, gemm_bytes) + dev.op_overhead
    bw = dev.mem_bw * dev.mem_eff
    if "units" not in flop_cache:  # the compiled programs, once per pricing
        flop_cache["units"] = fusion.compile_units(dev, g, state.region_of) if fusion.check(dev) else None
    units = flop_cache["units"]
    cast = 0.0
    amax = _tp_amax_time(state, n, s, pos_of)
    for j, c in zip(pos_of, casts):
        elems, b = local[j]
        if c == REPEAT:  # torch.compile's CSE: one amax and one cast of the tensor serve every GEMM reading it
            c = NONE if units is not None else CAST
        if c == CAST:
            cast += amax
        if (
            c == CAST and units is not None and fusion.fused_producer(g, ins[j], n, units)
        ):  # amax in the producer's kernel
            cast += elems * (b + 1) / bw + dev.op_overhead
        elif c == CAST:
            cast += elems * (2 * b + 1) / bw + 2 * dev.op_overhead
        elif c == SHARED:
            cast += elems / bw
    return gemm, cast


def tp_dims(g, n, s, pos_of) -> tuple:
    """The mesh dims on which converted GEMM n (strategy s) holds its weight sharded: the weight operand's sharded
    dims, or, for the weight-gradient GEMM (no weight operand), its output's. There torchao's Float8ColwiseParallel
    / Float8RowwiseParallel operands are DTensors (module docstring: tensor parallelism); data-parallel dims hold
    the weight whole at the GEMM (FSDP gathers it) and plain local tensors."""
    weight = next((j for j in pos_of if g.nodes[_root(g, n.inputs()[j]).node].kind == "param"), None)
    placement = s.ins[weight] if weight is not None else s.out[0]
    return tuple(k for k, p in enumerate(placement) if p[0] == "S")


def _tp_amax_time(state, n, s, pos_of) -> float:
    """Seconds of one operand scale's amax all-reduce (one fp32 scalar, max) over the GEMM's tensor-parallel dims;
    0 without any."""
    dims = tp_dims(state.graph, n, s, pos_of)
    if not dims:
        return 0.0
    src = tuple("P" if k in dims else "R" for k in range(len(state.mesh.shape)))
    one = TensorMeta((1,), torch.float32)
    return redistribute_time(src, ("R",) * len(src), one, state.mesh.shape, state.cluster)


def _gemm_time(g, n, s, mesh_shape, dev, flops, nbytes) -> float:
    """Seconds of converted GEMM n's float8 math on its local shapes: the device's kernel model (the GEMM's shape on
    the GPU presets), else the flat roofline at the fp8 peak."""
    if dev.kernels != "roofline":
        shapes = [kernels.local_shape(g.meta(r).shape, p, mesh_shape) for r, p in zip(n.inputs(), s.ins)]
        t = kernels.kernel_time(n.target, n.args, n.kwargs, shapes, flops, nbytes, dev, torch.float8_e4m3fn)
        if t is not None:
            return t
    return roofline_time(flops, nbytes, dev, torch.float8_e4m3fn)


def _weight_cast(state, n, s, extras) -> float:
    """Seconds of casting a gathered-in-float8 weight's shard (module docstring): amax read, cast read, 1-byte write
    of the elements the view reads, plus the amax all-reduce it waits for over the dims the weight is sharded on."""
    g, mesh_shape, dev = state.graph, state.mesh.shape, state.cluster.device
    src = g.meta(n.inputs()[0])
    elems = src.numel / num_shards(s.ins[0], mesh_shape)
    t = elems * (2 * src.dtype.itemsize + 1) / (dev.mem_bw * dev.mem_eff) + 2 * dev.op_overhead
    sharded = tuple("P" if p[0] == "S" else "R" for p in s.ins[0])
    if "P" not in sharded:
        return t
    weights = len(extras["weight_casts"])
    if extras.get("precompute_scale"):  # one all-reduce of every weight's amax per step, its share of it
        amax = TensorMeta((weights,), torch.float32)
        return t + redistribute_time(sharded, ("R",) * len(sharded), amax, mesh_shape, state.cluster) / weights
    one = TensorMeta((1,), torch.float32)
    return t + 2 * redistribute_time(sharded, ("R",) * len(sharded), one, mesh_shape, state.cluster)


def priced(state, node_time):
    """node_time with the converted GEMMs priced as float8 (module docstring); node_time itself without float8."""
    extras = state.extras.get("float8")
    roles = gemm_roles(extras)
    if not roles:
        return node_time
    cache: dict = {}
    weight_casts = {v for v, _ in extras.get("weight_casts", [])}

    def timed(n, s):
        if n.idx in weight_casts:
            return node_time(n, s) + _weight_cast(state, n, s, extras)
        if n.idx not in roles:
            return node_time(n, s)
        gemm, cast = _parts(state, n, s, roles, cache)
        return gemm + cast

    timed.base = node_time  # the pricing without float8 (breakdown's comparison)
    return timed


def breakdown(state) -> dict:
    """At the chosen placement: the converted GEMMs' seconds as float8 and their casts' seconds, and what the same
    GEMMs cost unconverted (the pricing without float8), each summed over the step."""
    extras = state.extras.get("float8")
    roles = gemm_roles(extras)
    base_node_time = state.cost["node_time"].base
    gemm = cast = hp = 0.0
    cache: dict = {}
    for idx in roles:
        n, s = state.graph.nodes[idx], state.placement[idx]
        a, b = _parts(state, n, s, roles, cache)
        gemm, cast, hp = gemm + a, cast + b, hp + base_node_time(n, s)
    for idx, _ in extras.get("weight_casts", []):  # the shard casts of the weights gathered in float8
        cast += _weight_cast(state, state.graph.nodes[idx], state.placement[idx], extras)
    return {"gemm_s": gemm, "cast_s": cast, "unconverted_gemm_s": hp}
