"""The one place autopar touches torch's private DTensor modules (`torch.distributed.tensor._*`) and private ops
(`torch._scaled_mm`, the float8 GEMM).

It asks DTensor's own strategy registry which placements an op accepts and turns the answer into autopar's
placement strings ("R", "S<d>", "P", "Pm": the masked partial of a vocab-sharded embedding). Both registry
flavours are served: the per-mesh-dim strategies (`op_single_dim_strategy_funcs`, expanded here over the mesh
dims) and the older full-mesh strategy functions (`op_strategy_funcs`, called with the producers' candidates).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch
from torch.autograd import _make_grads
from torch.autograd.graph import _engine_run_backward
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta as DTMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor.placement_types import _StridedShard

_PROP = DTensor._op_dispatcher.sharding_propagator
_COST_USERS = [
    importlib.import_module(f"torch.distributed.tensor._ops.{m}")
    for m in ("utils", "_math_ops", "_matrix_ops", "_tensor_ops", "_view_ops", "single_dim_strategy")
]


@contextlib.contextmanager
def _no_dtensor_costs():
    """DTensor prices every (input candidate, strategy) pair with its own comm model while enumerating; autopar
    prices redistributes with its cluster model instead, so skip that work (it was 80% of candidate time)."""
    saved = [(m, m.__dict__.get("generate_redistribute_costs")) for m in _COST_USERS]
    stub = lambda src, dst: [0.0] * len(src.strategies)
    for m, f in saved:
        if f is not None:
            m.generate_redistribute_costs = stub
    try:
        yield
    finally:
        for m, f in saved:
            if f is not None:
                m.generate_redistribute_costs = f


def has_single_dim(op) -> bool:
    return op in _PROP.op_single_dim_strategy_funcs


def has_full(op) -> bool:
    return op in _PROP.op_strategy_funcs


def has_decomposition(op) -> bool:
    return op in torch._decomp.decomposition_table


@functools.lru_cache(maxsize=64)
def sim_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh object of the given shape without a process group: strategies only read its shape."""
    return DeviceMesh("cpu", torch.arange(int(torch.tensor(shape).prod())).view(shape), _init_backend=False, _rank=0)


def to_str(p) -> str | None:
    """torch Placement -> autopar placement string (None for placements autopar does not plan with)."""
    if p is None:
        return None
    if isinstance(p, _ShardingPlaceholder):
        return f"S{p.dim}"
    if isinstance(p, _StridedShard):
        return None
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    if type(p).__name__ == "_MaskPartial":
        return "Pm"
    if isinstance(p, Partial):
        return {"sum": "P", "avg": "Pa"}.get(p.reduce_op)
    return None


def to_placement(s: str):
    """autopar placement string -> torch Placement (the masked partial maps to Partial('sum') for users)."""
    if s == "R":
        return Replicate()
    if s in ("P", "Pm"):
        return Partial()
    if s == "Pa":
        return Partial("avg")
    return Shard(int(s[1:]))


def _dtmeta(m):
    shape = torch.Size(m.shape)
    return DTMeta(shape, torch.empty(shape, device="meta").stride() if len(shape) else (), m.dtype)


def _schema_args(args, kwargs, meta_of, wrap):
    """Replace autopar Refs by wrap(ref, meta) (tensor lists become tuples of wrapped items)."""
    from ..graph import Ref

    def conv(a):
        if isinstance(a, Ref):
            return wrap(a, _dtmeta(meta_of(a)))
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def single_dim_rules(op, args, kwargs, meta_of) -> list[tuple[str | None, ...]]:
    """DTensor's per-mesh-dim rules for `op`: each a tuple (outputs..., tensor inputs...) of placement strings."""
    a, k = _schema_args(args, kwargs, meta_of, lambda r, m: m)
    info = _PROP.op_single_dim_strategy_funcs[op]
    rules = info.func(op, a, k)
    out = []
    for r in rules:
        s = tuple(to_str(p) for p in r)
        if all(x is not None or p is None for x, p in zip(s, r)):
            out.append(s)
    return out


def full_strategies(op, args, kwargs, meta_of, mesh_shape, in_cands) -> list[tuple[tuple, tuple]]:
    """DTensor's full-mesh strategy function for `op`, given each tensor input's candidate placements.

    Returns [(output placements per output, input placements per tensor input)], placements as tuples of strings.
    Some of these functions assume each input holds one placement (as in eager dispatch) and index the inputs'
    strategies in lockstep; for those, call once per candidate of the input with the most candidates.
    """
    try:
        return _full_once(op, args, kwargs, meta_of, mesh_shape, in_cands)
    except (IndexError, KeyError, AssertionError, ValueError, RuntimeError):
        if not in_cands:
            raise
        lead = max(range(len(in_cands)), key=lambda i: len(in_cands[i]))
        rep = tuple("R" for _ in mesh_shape)
        out = []
        for c in in_cands[lead]:
            cands = [[c] if i == lead else [rep] for i in range(len(in_cands))]
            try:
                out.extend(_full_once(op, args, kwargs, meta_of, mesh_shape, cands))
            except (IndexError, KeyError, AssertionError, ValueError, RuntimeError):
                continue  # this input placement cannot propagate through the op (e.g. uneven unflatten)
        return list(dict.fromkeys(out))


def _full_once(op, args, kwargs, meta_of, mesh_shape, in_cands):
    mesh = sim_mesh(mesh_shape)
    it = iter(in_cands)

    def wrap(ref, meta):
        specs = [OpSpec(DTensorSpec(mesh, tuple(to_placement(p) for p in pl), tensor_meta=meta)) for pl in next(it)]
        return OpStrategy(specs)

    def tup(a):
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, OpStrategy) for x in a):
            return TupleStrategy(tuple(a))
        return a

    a, k = _schema_args(args, kwargs, meta_of, wrap)
    schema = OpSchema(
        op, tuple(tup(x) for x in a), {kk: tup(v) for kk, v in k.items()}, schema_info=_PROP.op_to_schema_info.get(op)
    )
    with _no_dtensor_costs():
        res = _PROP.op_strategy_funcs[op](schema)
    children = res.children if isinstance(res, TupleStrategy) else None
    if children is not None:  # e.g. split: one OpStrategy per output, zip them by index
        if len({len(c.strategies) for c in children}) != 1:
            return []
        specs = [[c.strategies[i] for c in children] for i in range(len(children[0].strategies))]
        items = [(tuple(s.output_spec for s in group), group[0].input_specs) for group in specs]
    else:
        items = []
        for s in res.strategies:
            outs = s.output_specs if isinstance(s.output_specs, tuple) else (s.output_specs,)
            if len(outs) == 1 and len(op._schema.returns) > 1:
                outs = outs * len(op._schema.returns)  # one spec for every return (torch 2.11's layer_norm), as
                # torch's ShardingPropagator reads it
            items.append((outs, s.input_specs if s.input_specs is not None else (s.output_spec,)))
    result = []
    for outs, ins in items:
        o = tuple(None if sp is None else tuple(to_str(p) for p in sp.placements) for sp in outs)
        i = tuple(tuple(to_str(p) for p in sp.placements) for sp in ins)
        if any(x is not None and None in x for x in o) or any(None in x for x in i):
            continue
        result.append((o, i))
    return result


def redistribute_cost_dtensor(src: tuple[str, ...], dst: tuple[str, ...], meta, mesh_shape) -> float:
    """DTensor's own redistribute cost estimate (for cross-checks; autopar's cost model uses the cluster spec)."""
    from torch.distributed.tensor._collective_utils import redistribute_cost

    mesh = sim_mesh(mesh_shape)
    m = _dtmeta(meta)
    return redistribute_cost(
        DTensorSpec(mesh, tuple(map(to_placement, src)), tensor_meta=m),
        DTensorSpec(mesh, tuple(map(to_placement, dst)), tensor_meta=m),
    )


# ---- pipelining: torch's own schedule generators (private module torch.distributed.pipelining._*) ----------------
@functools.lru_cache(maxsize=512)
def pipeline_actions(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> tuple:
    """The compute actions torch's schedule class `schedule` runs on each of `pp` ranks, in order, as tuples
    (stage, kind, microbatch) with kind F (forward), B (full backward), I (input backward), W (weight backward).
    OVERLAP_F_B actions (DualPipeV) are expanded into their sub-actions. Raises ValueError when torch rejects the
    (schedule, pp, n_microbatches, stages_per_rank) combination."""
    from unittest import mock
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        _PipelineScheduleRuntime,
        get_schedule_class,
    )

    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle) and stages_per_rank != 1:
        raise ValueError(f"{schedule} runs one stage per rank, not {stages_per_rank}")
    stage = _fake_stage()  # what torch's _schedule_visualizer.get_schedule_ops does, with one cached mock
    stage.group_rank, stage.group_size, stage.submod = 0, pp, None
    stage.num_stages = stages_per_rank * pp
    try:  # only the compute order is read: skip lowering it to send/recv/unshard actions (most of the time)
        with mock.patch.object(_PipelineScheduleRuntime, "_prepare_schedule_with_comms", lambda *a, **k: None):
            sched = cls(stage if issubclass(cls, PipelineScheduleSingle) else [stage] * stages_per_rank, n_microbatches)
        ops = [sched.pipeline_order[r] for r in range(pp)]
    except (AssertionError, RuntimeError, IndexError, KeyError, ValueError) as e:
        raise ValueError(
            f"torch rejects schedule {schedule} with pp={pp}, {n_microbatches} micro-batches, "
            f"{stages_per_rank} stages per rank: {e}"
        ) from e

    def flat(a):
        if a is None:
            return []
        if a.sub_actions is not None:
            return [x for s in a.sub_actions for x in flat(s)]
        kind = a.computation_type.value
        return [(a.stage_index, kind, a.microbatch_index)] if kind in ("F", "B", "I", "W") else []

    return tuple(tuple(x for a in rank for x in flat(a)) for rank in ops)


@functools.lru_cache(maxsize=1)
def _fake_stage():
    from unittest import mock
    from torch.distributed.pipelining.stage import PipelineStage

    return mock.create_autospec(PipelineStage, instance=True)


def pipeline_stage_to_rank(pp: int, num_stages: int, style: str) -> tuple[int, ...]:
    """torch's stage -> pp rank mapping: style "loop" (stage k on rank k % pp) or "v" (V-shape, ZBV/DualPipeV)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    m = generate_stage_to_rank_mapping(pp, num_stages, style=style)
    return tuple(m[k] for k in range(num_stages))


# ---- execution (backends/spmd/module.py): the masked partial of a vocab-sharded embedding ---------------------------------
def unmask_partial(dt: DTensor) -> DTensor:
    """A DTensor with `_MaskPartial` placements (embedding / gather on a sharded table) -> the same value as a plain
    Partial('sum'): the rows whose index fell outside this rank's shard are zeroed now instead of at reduction."""
    pls = dt.placements
    if not any(type(p).__name__ == "_MaskPartial" for p in pls):
        return dt
    local = dt.to_local().clone()
    for m, p in enumerate(pls):
        if type(p).__name__ == "_MaskPartial":
            if p.mask_buffer.data is None and dt.device_mesh.size(m) == 1:
                continue  # one rank holds the whole table: DTensor masked nothing, nothing to zero
            p.mask_buffer.apply_mask(local)
            p.mask_buffer.release_mask()
    return DTensor.from_local(
        local,
        dt.device_mesh,
        [Partial() if type(p).__name__ == "_MaskPartial" else p for p in pls],
        run_check=False,
        shape=dt.shape,
        stride=dt.stride(),
    )


# ---- lowering to torch's engines (backends/torch/) ----------------------------------------------------------------
def flatten_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """A 1-D DeviceMesh over several dims of `mesh` (its ranks row-major), for FSDP2 sharding over more than one
    data-parallel dim. `DeviceMesh._flatten` is the method torchtitan uses for the same purpose (dp x cp)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names))


def replicate_dtensor_module(module, mesh):
    """Data parallelism (gradients all-reduced) for a module whose parameters are already DTensors (tensor
    parallel): DDP takes no DTensor parameters; FSDP2's `replicate` (torch.distributed._composable.
    replicate_with_fsdp) does."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError as e:  # older torch
        raise NotImplementedError(
            f"data parallelism over tensor-parallel (DTensor) parameters needs FSDP2's "
            f"replicate, which this torch ({torch.__version__}) lacks: {e}"
        ) from e
    return replicate(module, mesh=mesh)


def resolve_group(name: str):
    """The ProcessGroup registered under a group name (what functional collectives carry)."""
    import torch.distributed as dist

    return dist.distributed_c10d._resolve_process_group(name)


FLAT_GROUPS: dict[str, tuple[int, ...]] = {}  # process-group name -> the mesh dims it flattens


def flat_group_name(mesh: DeviceMesh, dims) -> str:
    """The process group of one collective over several mesh dims (a flattened gradient bucket): the default
    group when the dims are the whole mesh and the mesh spans the world, else `flatten_mesh` (collective: every
    rank must call it, in the same order: the first call, when the program is built). Recorded in FLAT_GROUPS for
    the collective counters; later calls (each bucket launch) are a lookup in the mesh's own cache."""
    import torch.distributed as dist

    dims = tuple(sorted(int(d) for d in dims))
    cache = mesh.__dict__.setdefault("_autopar_flat_groups", {})
    if dims in cache:
        return cache[dims]
    if len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        name = dist.group.WORLD.group_name
    else:
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(
                f"a collective over mesh dims {dims} of a mesh without dim names that is not the whole "
                f"world: name the mesh dims (init_device_mesh(..., mesh_dim_names=...))"
            )
        name = flatten_mesh(mesh, tuple(names[d] for d in dims)).get_group().group_name
    FLAT_GROUPS[name] = dims
    cache[dims] = name
    return name


def make_dtensor(local: torch.Tensor, mesh, placements, shape, stride) -> DTensor:
    """A DTensor around `local` without autograd bookkeeping (DTensor.from_local goes through an autograd
    Function and a view, which costs ~2 ms per call under LocalTensorMode); for values computed under no_grad."""
    key = (id(mesh), tuple(placements), tuple(shape), tuple(stride), local.dtype)
    spec = _SPECS.get(key)
    if spec is None or spec.mesh is not mesh:
        if len(_SPECS) > 4096:
            _SPECS.clear()
        spec = _SPECS[key] = DTensorSpec(
            mesh, tuple(placements), tensor_meta=DTMeta(torch.Size(shape), tuple(stride), local.dtype)
        )
    return DTensor(local, spec, requires_grad=False)


_SPECS: dict = {}  # DTensorSpecs are immutable: one per (mesh, placements, shape, stride, dtype)


def sole_owner(t: torch.Tensor) -> bool:
    """No other tensor (a view handed out, a gradient kept by autograd) shares t's storage: t may be overwritten."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2  # t's own + the temporary handle


def per_rank(x: torch.Tensor) -> torch.Tensor:
    """Under LocalTensorMode (all ranks simulated in one process) a plain tensor is the same on every rank; make it
    a LocalTensor so rank-dependent local ops (chunk at this rank's coordinate) can apply. Otherwise x itself."""
    lt = _local_tensor_module()
    mode = lt.enabled_local_tensor_mode() if lt is not None else None
    if mode is None or isinstance(x, lt.LocalTensor):
        return x
    return mode.rank_map(lambda r: x.clone())  # one copy per rank: in-place updates must not alias


def collapse(x: torch.Tensor) -> torch.Tensor:
    """Under LocalTensorMode: a LocalTensor whose ranks all hold the same value (a replicated value) -> one plain
    tensor, so ops on it run once instead of once per simulated rank; raises if the ranks disagree. Otherwise x."""
    lt = _local_tensor_module()
    if lt is None or not isinstance(x, lt.LocalTensor):
        return x
    try:
        return x.reconcile()
    except AssertionError as e:
        raise AssertionError("a value planned as Replicate differs between the simulated ranks") from e


def outside_local_tensor_mode():
    """A context that suspends LocalTensorMode (if active): single-device reference computations in tests."""
    lt = _local_tensor_module()
    return lt.maybe_disable_local_tensor_mode() if lt is not None else contextlib.nullcontext()


_LT: list = []


def _local_tensor_module():
    """torch.distributed._local_tensor, or None on builds without LocalTensorMode (nothing is ever simulated);
    looked up once: the executor asks on every value it stores."""
    if not _LT:
        try:
            from torch.distributed import _local_tensor as lt
        except ImportError:
            lt = None
        _LT.append(lt)
    return _LT[0]


def local_of(dt: DTensor) -> torch.Tensor:
    """The local shard itself. `DTensor.to_local()` returns a fresh view for a Parameter(DTensor) (a view costs
    ~2 ms under LocalTensorMode); the executor reads shards under no_grad and never needs that view."""
    return dt._local_tensor


def reparametrize(module, state: dict):
    """The module with `state` (parameter and buffer FQN -> tensor) swapped in, as torch.func.functional_call
    does it, for as long as the context lasts (capture keeps it through the backward); tied tensors stay tied."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, state, tie_weights=True)


def grad_in_modes(output: torch.Tensor, inputs: list, seed: torch.Tensor | None) -> tuple:
    """torch.autograd.grad(output, inputs, seed, allow_unused=True) with the active TorchFunctionModes kept on.
    Under a mode, grad() hands itself to the mode's __torch_function__, which runs it with the mode popped, so
    Python that the backward runs (activation checkpointing's recompute, a custom Function's backward) would run
    outside capture's modes: its recomputed SDPA unfused, unlike the forward it must match. The engine called
    directly, as grad() calls it, keeps them."""
    grads = _make_grads((output,), (seed,), is_grads_batched=False)
    return _engine_run_backward((output,), grads, False, False, tuple(inputs), True, accumulate_grad=False)


def scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm: a (row-major) @ b (column-major) in float8, times the inverse scales, in out_dtype."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
