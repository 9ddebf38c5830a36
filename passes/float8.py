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
parallelism (FSDP/DDP ranks hold plain local tensors). torchao's tensor-parallel path all-reduces the amax of a
DTensor instead; autopar does not (every per-shard scale is a valid tensorwise scale, so the result is correct to
float8 precision either way, but not bitwise that of one device when an operand is sharded).

Pricing (`priced`): a converted GEMM at the device's fp8 peak (`DeviceSpec.peak_flops["fp8"]`) with 1-byte operands,
by the device's GEMM model (autopar/cost/kernels.py: by local shape on the GPU presets, its float8 K-block
assumption there; the flat roofline elsewhere), plus its casts, each a memory-bound pass over the operand's local shard: the amax reads it, the scaled cast reads it
again and writes 1 byte per element (2 kernels; a shared grad_out cast adds only its second layout's write). A
device without an fp8 peak (A100, CPUs) cannot run float8 GEMMs: the config's `emulate=True` allows the numerics
(torch runs `_scaled_mm` on CPU), priced at the bf16 rate (`DeviceSpec.flops_for` falls back).

`mark` (run by the precision pass, first in PASSES) finds the GEMMs and writes `state.extras["float8"]` (copied
into Plan.meta): the converted and skipped linears and, per GEMM node, its operand dtypes and casts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from autopar.cost import global_flops, roofline_time
from autopar.cost import kernels
from autopar.strategies import num_shards

aten = torch.ops.aten

# GEMM op -> positions of its two matrix operands among the node's args
GEMMS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CAST, SHARED, NONE = 1, 2, 0  # an operand's cast at a GEMM: its own, a shared one's second layout, none
_THROUGH = (aten.t.default, aten.view.default, aten._unsafe_view.default, aten._to_copy.default)


@dataclass(frozen=True)
class Float8Config:
    """recipe: "tensorwise" (the only one priced and executed); filter_fqns: linears whose FQN contains one of these
    stay in high precision; emulate: allow a device without float8 matmuls (numerics only, no speed-up)."""

    recipe: str = "tensorwise"
    filter_fqns: tuple = ("output",)
    emulate: bool = False

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
            casts.append(SHARED if grad and key in grad_cast else CAST)
            if grad:
                grad_cast.add(key)
        if row[1:] == ["e5m2", "e5m2"]:  # _scaled_mm takes no e5m2 x e5m2
            continue
        nodes.append(row + casts)
    state.extras["float8"] = {
        **cfg.option(),
        "scaling": "tensorwise per rank (each rank's amax of the shard its GEMM reads)",
        "linears": sorted(converted),
        "skipped": dict(sorted(skipped.items())),
        "gemms": len(nodes),
        "nodes": nodes,
    }


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
    cast = 0.0
    for j, c in zip(pos_of, casts):
        elems, b = local[j]
        if c == CAST:
            cast += elems * (2 * b + 1) / bw + 2 * dev.op_overhead
        elif c == SHARED:
            cast += elems / bw
    return gemm, cast


def _gemm_time(g, n, s, mesh_shape, dev, flops, nbytes) -> float:
    """Seconds of converted GEMM n's float8 math on its local shapes: the device's kernel model (the GEMM's shape on
    the GPU presets), else the flat roofline at the fp8 peak."""
    if dev.kernels != "roofline":
        shapes = [kernels.local_shape(g.meta(r).shape, p, mesh_shape) for r, p in zip(n.inputs(), s.ins)]
        t = kernels.kernel_time(n.target, n.args, n.kwargs, shapes, flops, nbytes, dev, torch.float8_e4m3fn)
        if t is not None:
            return t
    return roofline_time(flops, nbytes, dev, torch.float8_e4m3fn)


def priced(state, node_time):
    """node_time with the converted GEMMs priced as float8 (module docstring); node_time itself without float8."""
    roles = gemm_roles(state.extras.get("float8"))
    if not roles:
        return node_time
    cache: dict = {}

    def timed(n, s):
        if n.idx not in roles:
            return node_time(n, s)
        gemm, cast = _parts(state, n, s, roles, cache)
        return gemm + cast

    timed.base = node_time  # the pricing without float8 (breakdown's comparison)
    return timed


def breakdown(state) -> dict:
    """At the chosen placement: the converted GEMMs' seconds as float8 and their casts' seconds, and what the same
    GEMMs cost unconverted (the pricing without float8), each summed over the step."""
    roles = gemm_roles(state.extras.get("float8"))
    base_node_time = state.cost["node_time"].base
    gemm = cast = hp = 0.0
    cache: dict = {}
    for idx in roles:
        n, s = state.graph.nodes[idx], state.placement[idx]
        a, b = _parts(state, n, s, roles, cache)
        gemm, cast, hp = gemm + a, cast + b, hp + base_node_time(n, s)
    return {"gemm_s": gemm, "cast_s": cast, "unconverted_gemm_s": hp}
