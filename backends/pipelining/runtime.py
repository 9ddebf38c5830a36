"""Run a pipeline Plan (autopar.plan(..., pipeline="auto") or a mesh with a "pp" dim) with
torch.distributed.pipelining: one PipelineStage per stage of `plan.stages` on the pp rank that holds it, driven by
the schedule class the plan names (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) with the plan's micro-batch count.

Stage modules come from the plan: each stage of `plan.stages` lists the modules it holds in forward order
(`modules`: the outer modules before the layer list on the stage holding "pre", its blocks under their FQNs
`<layer prefix>.<i>`, the outer modules after the blocks on the stage holding "post"; passes/stage_plan.py reads
them off the plan's graph). The stage registers the model's own modules under those FQNs (deep copies with
`copy_model=True`) and chains them: each outer module takes the running tensor, each block takes it with what the
model's forward hands its blocks besides it (RoPE tables: values that depend on no input, captured once from the
model's forward, stopped at its first block, `block_inputs`); the first `recompute_blocks` blocks are checkpointed
as the plan asks (torch.utils.checkpoint). So a model whose forward outside the layer list is such a chain (the zoo's
Llama and MLP families; torchtitan-style models) runs as planned, whatever its module names. The last stage
outputs logits; the loss is `loss_fn(logits, target)`, by default cross entropy over flattened tokens (what the
zoo's `Transformer.forward` / `MLP.forward` compute), so a step equals `model(x, labels)` on the same batch.

Inside a stage, torchtitan's order: tensor parallelism first, then data parallelism.

Tensor parallelism (a stage-submesh dim of size > 1 not named dp*, "tp"): each module's ParallelStyle comes from its
parameters' placements on that dim (tp_styles.py `stage_tp_styles`, the table of backends/torch/tp.py `param_style`:
nn.Linear weight Shard(0) -> ColwiseParallel, Shard(1) -> RowwiseParallel, the bias with them; nn.Embedding Shard(0) ->
RowwiseParallel, Shard(1) -> ColwiseParallel), applied with `parallelize_module` on the dim's 1-D submesh, so those
parameters become DTensors sharded there. Layouts are Megatron's: a colwise and a rowwise Linear that form a pair in
the plan's forward graph (attention q/k/v -> o with local heads, feed-forward w1/w3 -> w2, MLP fc1 -> fc2) keep
the activation between them sharded; every other style takes and returns whole (replicated) plain tensors, so the
residual stream and the tensors PipelineStage sends between stages are whole on every tp rank; the logits the loss
reads are too, except where the plan's cross entropy reads them class-sharded (torchtitan's loss_parallel layout:
the head keeps them sharded and the step runs under torch's loss_parallel(), with the default loss). Where the
per-op plan places activations otherwise on tp (sequence-parallel norms, a weight gathered before use), the styles
run it with their own collectives (same values); a colwise weight's replicated bias is sharded with it (same
values). Each styled module's output is a copy the model owns (models add into it in place). A placement no style
expresses (a sharded norm weight, a rowwise weight with a sharded bias, ...) raises NotImplementedError naming the
stage, the parameter and its placement; so does a plan that splits the batch over a non-dp dim, shards activations over
one on which every parameter is replicated, or uses two such dims. A non-dp dim the plan leaves idle (every
parameter and activation replicated) runs replicated, as planned.

Context parallelism (a cp* stage dim): each rank runs its contiguous chunk of every sequence, attention against K
and V gathered along it (backends/context_parallel.py); its ranks sum gradients with the dp ranks (below).

Float8 (a plan made with float8=True): the nn.Linear modules the plan names compute their GEMMs in float8, as the
stages were priced (backends/float8_linear.py), before the styles and wrappers below.

Data parallelism (the dp dims), as the plan's per-op plan says: parameters sharded on dp -> FSDP2 `fully_shard`
over the dp submesh (shard dim from the plan, `reshard_after_forward=False`: gathered once per step, as the plan's
cost model assumes; FSDP2 shards every parameter of the module it wraps, so ones the plan keeps replicated are
sharded on dim 0 too: same gradients, less memory than planned; on tp-sharded DTensor parameters FSDP2 shards the
local tensors, the gradients are DTensors on the (dp, tp) submesh); all replicated -> DDP, or FSDP2's `replicate`
(its DDP, which takes DTensor parameters) when the stage is tensor parallel. Where the per-op plan re-shards
activations over dp inside a stage, FSDP2/DDP run it as plain data parallelism (same values, their own
collectives).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from autopar.strategies.context_parallel import cp_dims
from autopar.strategies.data_parallel import dp_dims

from .. import context_parallel, float8_linear
from ..spmd.comm import agree_on_plan
from ..spmd.module import parent_of
from .forward_stage import no_outputs
from .tied import TiedGrads
from .tp_styles import LOSS_STYLE, _styles, stage_tp_styles


def _ties(mod: nn.Module) -> list:
    """The names of each parameter held under several (MPNet's head bias is its decoder Linear's bias)."""
    names: dict = {}
    for n, p in mod.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [ns for ns in names.values() if len(ns) > 1]


def _retie(mod: nn.Module, ties: list) -> None:
    """After parallelize_module: a ParallelStyle replaced a tied parameter under one of its names with a DTensor;
    the other names get that one too, or their copy would be left out of the forward and get no gradient."""
    for names in ties:
        new = next((p for p in map(mod.get_parameter, names) if hasattr(p, "device_mesh")), None)
        for n in names if new is not None else ():
            parent, leaf = parent_of(mod, n)
            parent.register_parameter(leaf, new)


def _own_output(mod, args, out):
    """A ParallelStyle's local output is a view DTensor.to_local() made inside a custom autograd Function, which
    autograd forbids editing in place; models do (Falcon adds the attention output into the MLP's with +=). A copy
    the model owns (one activation-size copy per styled module)."""
    return out.clone() if isinstance(out, torch.Tensor) else out


class PipelineShapeError(ValueError):
    """A batch whose shape breaks the plan's static micro-batch shapes."""


def _local(t):
    """A replicated DTensor's local tensor (loss_parallel's loss); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _ce_loss(logits, target):  # per token ([B, S, V] / [B, S]) or per row ([B, C] / [B]): the class dim last
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


class _Stage(nn.Module):
    """The modules one stage holds (plan.stages[k]["modules"], in forward order), registered under their FQNs in
    the model so parameter names are the plan's; parameters are the model's own. Forward: every module that is not
    a block of the layer list takes the running tensor (the embedding, the final norm, the head), every block takes
    it with `block_args` / `block_kwargs` (what the model's forward hands its blocks besides it, e.g. RoPE tables,
    captured by block_inputs); the first `recompute` blocks are checkpointed as the plan asks."""

    def __init__(self, model, fqns, prefix: str, recompute: int, block_args: tuple, block_kwargs: dict):
        super().__init__()
        self._order = list(fqns)
        self._is_block = [f.startswith(prefix + ".") for f in fqns]
        self._recompute = recompute
        self._block_args, self._block_kwargs = block_args, block_kwargs
        for f in fqns:
            parent, name = parent_of(self, f)  # the stage keeps the model's paths
            parent.add_module(name, model.get_submodule(f))

    def forward(self, x):
        h, j = x, 0
        for f, block in zip(self._order, self._is_block):
            mod = self.get_submodule(f)
            if not block:
                h = mod(h)
                continue
            args = tuple(a.to(h.device) if isinstance(a, torch.Tensor) else a for a in self._block_args)
            out = _run_block(mod, j < self._recompute, h, *args, **self._block_kwargs)
            j += 1
            if isinstance(out, tuple):
                raise NotImplementedError(
                    f"block '{f}' returns several tensors (an MoE aux loss?): a stage boundary carries one tensor "
                    f"in the pipeline runtime (plan-only for such models)"
                )
            h = out
        return h


def _run_block(layer, recompute: bool, *args, **kwargs):
    """A block, checkpointed (activations dropped after forward, recomputed before backward) if the plan says so."""
    if recompute:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return layer(*args, **kwargs)


class _BlockReached(Exception):
    """Raised by the hook on the first block: the model's forward has computed what its blocks take."""


def _rank_microbatch_shapes(plan) -> list:
    """The shapes of one micro-batch's inputs on one rank (what PipelineStage feeds the first stage)."""
    sc = plan.schedule
    local = sc["local_batch_shapes"] if _batch_dp_sharded(plan) else sc["batch_shapes"]
    rows = local[0][0] if local and local[0] else None
    return [[s[0] // sc["n_microbatches"]] + s[1:] if s and s[0] == rows else s for s in local]


def block_inputs(model: nn.Module, plan) -> tuple[tuple, dict]:
    """What the model's forward hands its blocks besides the running tensor (RoPE tables, ...): values that depend
    on no input (passes/stages.py leaves them to each stage), captured from the model's own forward on a zero batch
    of one rank's micro-batch shapes (the plan's input dtypes), stopped at its first block."""
    prefix = plan.schedule["layer_prefix"]
    first = next(f for st in plan.stages for f in st["modules"] if f.startswith(prefix + "."))
    dtypes = [getattr(torch, n["dtype"][0]) for n in plan.nodes if n["kind"] == "input"]
    device = next(model.parameters()).device
    batch = [torch.zeros(s, dtype=d, device=device) for s, d in zip(_rank_microbatch_shapes(plan), dtypes)]
    seen = {}

    def stop(mod, args, kwargs):
        seen["args"], seen["kwargs"] = tuple(args[1:]), dict(kwargs)
        raise _BlockReached

    handle = model.get_submodule(first).register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            model(*batch)
    except _BlockReached:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise ValueError(f"the model's forward never ran its first block '{first}' on a batch of the plan's shapes")
    return seen["args"], seen["kwargs"]


def build_stage_module(model: nn.Module, plan, k: int, block_args=None) -> nn.Module:
    """The module of stage k: the modules the plan's stage holds, parameters shared with `model`. block_args: what
    block_inputs(model, plan) returns (computed here when None)."""
    st = plan.stages[k]
    if "modules" not in st:
        raise ValueError(f"stage {k} of the plan lists no modules (a plan from an older autopar): plan it again")
    args, kwargs = block_args if block_args is not None else block_inputs(model, plan)
    prefix = plan.schedule["layer_prefix"]
    mod = _Stage(model, st["modules"], prefix, int(st.get("recompute_blocks", 0)), args, kwargs)
    have = {n for n, _ in mod.named_parameters()}
    want = set(st["params"])
    if have != want:
        raise ValueError(
            f"stage {k}: module holds parameters {sorted(have ^ want)[:6]} differently from the plan "
            f"(plan {len(want)}, module {len(have)})"
        )
    return mod


def _tp_dims(plan) -> list:
    """Stage-submesh dims (index, name) of size > 1 that are neither data- nor context-parallel (dp*, cp*)."""
    sc = plan.schedule
    cp = _cp_names(plan)
    return [
        (d, nm)
        for d, (nm, size) in enumerate(zip(sc["stage_mesh_names"], sc["stage_mesh_shape"]))
        if size > 1 and not nm.startswith("dp") and nm not in cp
    ]


def _cp_names(plan) -> list:
    """The stage mesh's context-parallel dims (cp*, of size > 1), by name."""
    names = plan.schedule["stage_mesh_names"]
    return [names[d] for d in cp_dims(names, plan.schedule["stage_mesh_shape"])]


def _check_cp(plan) -> None:
    """Refuse, before any rank builds a stage, a cp* stage dim the runtime cannot split the sequence over."""
    cp = _cp_names(plan)
    why = None
    if len(cp) > 1:
        why = f"several context-parallel stage mesh dims {cp}: the runtime splits the sequence over one"
    elif cp and plan.meta.get("keyword_inputs"):
        why = "a plan made from keyword inputs runs the model's own forward per stage, whose masks span the sequence"
    elif cp:
        why = context_parallel.unsplittable(plan, plan.schedule["layer_prefix"])
    if why:
        raise NotImplementedError(
            f"the plan splits the sequence over context-parallel stage mesh dims {cp}, which the pipelining runtime "
            f"cannot run here: {why}; plan the stage mesh without a cp* dim to run it"
        )


def _batch_dp_sharded(plan) -> bool:
    dp = dp_dims(plan.schedule["stage_mesh_names"], plan.schedule["stage_mesh_shape"])
    pl = plan.schedule.get("batch_placement")
    return bool(dp) and pl is not None and all(pl[d] == "S0" for d in dp)


def check_batch(plan, tensors) -> None:
    """Raise PipelineShapeError unless every given tensor (None: not held here) has the plan's per-rank batch shape,
    which the schedule splits into n_microbatches equal micro-batches of the static shapes the stages were planned
    (and exchange activations) for."""
    sc = plan.schedule
    want = sc["local_batch_shapes"] if _batch_dp_sharded(plan) else sc["batch_shapes"]
    m = sc["n_microbatches"]
    for j, (t, w) in enumerate(zip(tensors, want)):
        if t is None:
            continue
        if list(t.shape) != list(w):
            mb = [w[0] // m] + list(w[1:])
            raise PipelineShapeError(
                f"pipeline input {j}: got shape {list(t.shape)}, the plan's static shape on this rank is {w} "
                f"({m} micro-batches of {mb}); stages were planned and exchange activations for exactly these "
                f"shapes: re-plan for a different batch or sequence length"
            )


class PipelineRunner:
    """Executes `plan` on this rank. mesh: a DeviceMesh whose dim names are plan.mesh_names (a "pp" dim and the
    stage submesh dims); built with init_device_mesh from the plan when None (process group already initialized).
    Every rank must hold the same plan (its hash, stages and schedule included): else PlanMismatchError on every
    rank, before any stage is built."""

    def __init__(self, model: nn.Module, plan, mesh=None, loss_fn=None, device=None, copy_model: bool = False):
        from torch.distributed.device_mesh import init_device_mesh

        if not plan.stages or plan.schedule.get("name") in (None, "none"):
            raise ValueError("the plan has no pipeline stages (pp=1): run it with a non-pipeline backend")
        _check_cp(plan)
        self.plan = plan
        sc = plan.schedule
        self.device = torch.device(device or "cpu")
        if mesh is None:
            mesh = init_device_mesh(self.device.type, tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_names))
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names or tuple(mesh.shape) != tuple(plan.mesh_shape) or names != tuple(plan.mesh_names):
            raise ValueError(
                f"mesh {tuple(mesh.shape)}{names} does not match the plan's "
                f"{tuple(plan.mesh_shape)}{tuple(plan.mesh_names)}"
            )
        self.mesh = mesh
        # each rank brings its own plan (autopar.plan on every rank, or a loaded one): stages cut elsewhere on another
        # rank would leave sends without receives, so every rank checks first that all hold this one
        agree_on_plan(mesh, plan.hash(), self.device)
        self.pp_rank = mesh.get_local_rank("pp")
        model = copy.deepcopy(model) if copy_model else model
        self.loss_fn = loss_fn or _ce_loss
        S = sc["num_stages"]
        self.local = [k for k in range(S) if plan.stages[k]["pp_rank"] == self.pp_rank]
        self._pos_of = sc["block_positions"]
        self.is_first = 0 in self.local
        self.is_last = (S - 1) in self.local
        self._model, self.schedule = model, None
        self.loss_parallel = False  # the head's logits class-sharded: the step runs under torch's loss_parallel()
        # a cp* stage dim: each rank runs its chunk of every sequence, attention over the gathered one (every step)
        self.cp_attention = None
        from .batch_split import check_batch_norm
        from .forward_stage import check_chain, check_plan

        check_plan(plan)  # one running tensor between stages
        float8_linear.check(model, plan, self.device)
        check_batch_norm(model, plan)
        if plan.meta.get("keyword_inputs"):  # the model's own forward per stage, built at the first step
            from .forward_stage import loss_of_microbatch

            self.counts = []  # per micro-batch, what the last stage's loss divides by (batch_split.LossCount)
            self.loss_fn = loss_of_microbatch(self)
            return
        check_chain(plan)
        extras = block_inputs(model, plan)
        cp = _cp_names(plan)
        if cp:  # the RoPE tables (what spans the sequence) cut to this rank's positions
            at = self.cp_attention = context_parallel.Attention(
                self.mesh.get_group(cp[0]), self.mesh.get_local_rank(cp[0]), self.mesh[cp[0]].size()
            )
            extras = context_parallel.shard_block_inputs(*extras, _rank_microbatch_shapes(plan)[0][1], at.rank, at.size)
        self._build(lambda k: build_stage_module(model, plan, k, extras))

    def _build(self, make, scale_grads: bool = True) -> None:
        """Stage modules (make(k)), tensor then data parallel inside each, their PipelineStages and the schedule."""
        import torch.distributed.pipelining as pp_api
        from autopar.pipeline_model import get_schedule

        sc, S = self.plan.schedule, self.plan.schedule["num_stages"]
        self.modules, stages, self.tp_styles, self.float8 = [], [], [], []
        for k in self.local:
            mod = make(k).to(self.device)
            self.float8 += float8_linear.convert(mod, self._float8_linears(k))  # TP styles hook around it
            mod = self._tensor_parallel(mod, k)
            mod = self._data_parallel(mod, k)
            self.modules.append(mod)
            stages.append(pp_api.PipelineStage(mod, k, S, self.device, group=self.mesh.get_group("pp")))
        self.wrappers = [type(mod).__name__ for mod in self.modules]
        self.stages = stages
        self.tied = TiedGrads(self.plan, self.mesh, self.local)
        spec = get_schedule(sc["name"])
        cls = getattr(pp_api, spec.torch_class)
        m = sc["n_microbatches"]
        self.schedule = cls(
            stages if spec.multi else stages[0], n_microbatches=m, loss_fn=self.loss_fn, scale_grads=scale_grads
        )

    def _float8_linears(self, k) -> list:
        """The float8 linears (Plan.meta float8) stage k holds."""
        held = set(self.plan.stages[k]["params"])
        return [f for f in (self.plan.meta.get("float8") or {}).get("linears", []) if f"{f}.weight" in held]

    def _tensor_parallel(self, mod, k):
        """ParallelStyles over the stage's tensor-parallel dim (stage_tp_styles), applied with parallelize_module
        on that dim's 1-D submesh; parameters become DTensors there. A non-dp dim on which every parameter of the
        whole plan is replicated and the batch is not split is idle (each of its ranks computes the same)."""
        tps = _tp_dims(self.plan)
        pl = self.plan.schedule.get("batch_placement")
        for d, nm in tps:
            if pl is not None and pl[d] != "R":
                raise NotImplementedError(
                    f"stage {k}: the plan splits the batch ({pl[d]}) over mesh dim '{nm}'; "
                    f"the pipeline runtime runs data parallelism only over dims named dp*"
                )
        used = [(d, nm) for d, nm in tps if any(self.plan.params[f][d] != "R" for f in self.plan.params)]
        for d, nm in tps:
            busy = next(
                (
                    n["name"]
                    for n in self.plan.nodes
                    if n["kind"] == "op"
                    and n["phase"] == "fw"
                    and any(o is not None and o[d] != "R" for o in n["placement"]["out"])
                ),
                None,
            )
            if (d, nm) not in used and busy:
                raise NotImplementedError(
                    f"stage {k}: every parameter is replicated on mesh dim '{nm}' but the "
                    f"plan shards activations over it (e.g. {busy}); the pipeline runtime "
                    f"runs a non-dp dim only as tensor parallelism (sharded Linear/Embedding "
                    f"weights) or idle"
                )
        if len(used) > 1:
            raise NotImplementedError(
                f"stage {k}: parameters are sharded over several non-dp mesh dims "
                f"{[nm for _, nm in used]}; parallelize_module takes one 1-D mesh"
            )
        self.tp_styles.append({})
        if not used:
            return mod
        d, nm = used[0]
        codes = stage_tp_styles(self.plan, k, mod, d, self._pos_of, loss_parallel=self.loss_fn is _ce_loss)
        self.tp_styles[-1] = codes
        self.loss_parallel = self.loss_parallel or LOSS_STYLE in codes.values()
        if codes:
            from torch.distributed.tensor.parallel import parallelize_module

            ties = _ties(mod)
            parallelize_module(mod, self.mesh[nm], _styles(codes))
            _retie(mod, ties)
            for m, code in codes.items():
                if code != LOSS_STYLE:
                    mod.get_submodule(m).register_forward_hook(_own_output)
        return mod

    def _data_parallel(self, mod, k):
        """DDP / FSDP2 over the dims whose ranks sum gradients: the dp dim where it splits the batch, and the cp dim
        (each of its ranks computes the loss of its sequence chunk: torchtitan's dp x cp flattened)."""
        sc = self.plan.schedule
        tp = {d for d, _ in _tp_dims(self.plan)}
        dims = list(zip(sc["stage_mesh_names"], sc["stage_mesh_shape"]))
        data = [(d, nm) for d, (nm, size) in enumerate(dims) if size > 1 and d not in tp]
        cp = _cp_names(self.plan)
        dp = [(d, nm) for d, nm in data if nm not in cp]
        if len(dp) > 1:
            raise NotImplementedError(f"stage {k}: one data-parallel dim supported, plan has {[n for _, n in dp]}")
        if dp and not _batch_dp_sharded(self.plan):
            d, nm = dp[0]
            if any(self.plan.params[f][d] != "R" for f in self.plan.stages[k]["params"]):
                raise NotImplementedError(
                    f"stage {k}: the plan keeps the batch whole on '{nm}' but shards "
                    f"parameters there; only data-parallel dp dims are supported"
                )
            data.remove(dp[0])  # every dp rank computes the same micro-batches: nothing to sum there
        if not data:
            return mod
        first = lambda pl: next((pl[d] for d, _ in data if pl[d] != "R"), "R")  # noqa: E731
        pls = {f: first(self.plan.params[f]) for f in self.plan.stages[k]["params"]}
        from autopar.strategies._torch_adapter import flatten_mesh

        sub = flatten_mesh(self.mesh, tuple(nm for _, nm in data))
        tp_params = any(hasattr(p, "device_mesh") for p in mod.parameters())  # DTensors on the tp submesh
        if all(p == "R" for p in pls.values()):
            if tp_params:  # DDP takes no DTensor parameters: FSDP2's replicate (its DDP) does
                from autopar.strategies._torch_adapter import replicate_dtensor_module

                return replicate_dtensor_module(mod, sub)
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(mod, process_group=sub.get_group())
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        by_param = {p: int(pls[f][1:]) if pls[f].startswith("S") else 0 for f, p in mod.named_parameters()}
        return fully_shard(
            mod, mesh=sub, reshard_after_forward=False, shard_placement_fn=lambda p: Shard(by_param.get(p, 0))
        )

    def check_batch(self, *tensors) -> None:
        check_batch(self.plan, tensors)

    def batch_dims(self) -> list:
        """The stage-mesh dims (names) the batch is split over: the data-parallel ones, where it is sharded."""
        sc = self.plan.schedule
        names = sc["stage_mesh_names"]
        return [names[d] for d in dp_dims(names, sc["stage_mesh_shape"])] if _batch_dp_sharded(self.plan) else []

    def expected_shapes(self) -> list:
        sc = self.plan.schedule
        return sc["local_batch_shapes"] if _batch_dp_sharded(self.plan) else sc["batch_shapes"]

    def step_model(self, *args, **kwargs):
        """One training step of a plan made from keyword inputs: every rank passes the model's call as the model
        takes it (`runner.step_model(**batch)`, its dp rows of the batch); the schedule splits it into micro-batches
        and every stage runs the model's own forward on them (forward_stage.py). Returns the loss of this rank's
        rows on the ranks holding the last stage (None elsewhere); the gradients are the whole batch's: a
        mean-reduced cross_entropy / nll_loss is divided by the batch's count of targets over the micro-batches and
        the dp ranks, as on one device (batch_split.LossCount); another loss weighs each micro-batch the same."""
        from . import forward_stage

        if not self.plan.meta.get("keyword_inputs"):
            raise TypeError("the plan was made from positional inputs: run a step with runner.step(x, target)")
        return forward_stage.step(self, args, kwargs)

    def _agree(self, tensors) -> None:
        """check_batch on this rank, agreed on by every rank of the mesh, so ranks that hold no input raise too
        instead of waiting for activations that never come."""
        err = None
        try:
            check_batch(self.plan, tensors)
        except PipelineShapeError as e:
            err = e
        sc = self.plan.schedule
        self.refuse_together(
            err,
            lambda: PipelineShapeError(
                f"pipeline batch rejected on another rank: the plan's static shapes per rank "
                f"are {self.expected_shapes()} ({sc['n_microbatches']} micro-batches of "
                f"{sc['microbatch_shapes']} over the stage submesh)"
            ),
        )

    def refuse_together(self, err: Exception | None, elsewhere) -> None:
        """Raise `err` on this rank, or `elsewhere()` where another rank of the mesh has one (one int all-reduce
        per mesh dim), so every rank refuses and none waits for a collective the others never join."""
        import torch.distributed as dist

        ok = torch.tensor([0 if err else 1], dtype=torch.int32)
        for d in range(self.mesh.ndim):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.mesh.get_group(d))
        if err is not None:
            raise err
        if not int(ok.item()):
            raise elsewhere()

    def step(self, x=None, target=None):
        """One training step (forward + backward, gradients accumulated in the parameters). Pass the batch on the
        rank holding the first stage and the target on the rank holding the last; returns the mean micro-batch loss
        there (None elsewhere). The shape check is agreed on by every rank of the mesh first (one int all-reduce
        per mesh dim), so ranks that hold no input raise too instead of waiting for activations that never come."""
        if self.plan.meta.get("keyword_inputs"):
            raise TypeError(
                f"the plan was made from keyword inputs {self.plan.meta['keyword_inputs']}: run a step with "
                f"runner.step_model(**batch) on every rank (the model's own call)"
            )
        self._agree((x if self.is_first else None, target if self.is_last else None))
        at = self.cp_attention
        if at:  # this rank's chunk of every sequence (dim 1 of the tokens and of the targets)
            x, target = (
                None if t is None else context_parallel.local_chunk(t, 1, at.rank, at.size) for t in (x, target)
            )
        losses = [] if self.is_last else None
        args = (x,) if self.is_first else ()
        kw = {"target": target, "losses": losses} if self.is_last else {}
        with self._loss_context(), at or contextlib.nullcontext():
            self.schedule.step(*args, **kw, **no_outputs(self.schedule))
        self.tied.sum(self.named_parameters())
        if not self.is_last:
            return None
        loss = torch.stack([_local(loss.detach()) for loss in losses]).mean()
        if at:  # the mean over the sequence: its chunks' means, alike in size
            torch.distributed.all_reduce(loss, group=at.group)
            loss /= at.size
        return loss

    def _loss_context(self):
        """torch's loss_parallel() around forward and backward where the head keeps the logits class-sharded
        (its handlers compute log_softmax, nll_loss and their backward on the shards); else nothing."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def named_parameters(self):
        for mod in self.modules:
            inner = mod.module if hasattr(mod, "module") and isinstance(mod.module, nn.Module) else mod
            yield from inner.named_parameters()


def local_batch(plan, tensors, dp_rank: int):
    """This dp rank's rows of a global batch (the plan's batch is split evenly on dim 0 over dp)."""
    sc = plan.schedule
    if not _batch_dp_sharded(plan):
        return tensors
    dp = math.prod(s for s, nm in zip(sc["stage_mesh_shape"], sc["stage_mesh_names"]) if nm.startswith("dp"))
    return tuple(t.chunk(dp, 0)[dp_rank] if isinstance(t, torch.Tensor) else t for t in tensors)
