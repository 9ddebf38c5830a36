"""Run a pipeline Plan (autopar.plan(..., pipeline="auto") or a mesh with a "pp" dim) with
torch.distributed.pipelining: one PipelineStage per stage of `plan.stages` on the pp rank that holds it, driven by
the schedule class the plan names (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) with the plan's micro-batch count.

Stage modules are built torchtitan-style from the user's model: the stage keeps the modules of its clusters (the
embedding on the stage holding "pre", its blocks under their original FQNs `layers.<i>`, final norm and head on the
stage holding "post"), shares their parameters with the model (deep copies with `copy_model=True`), and recomputes
what depends on no input (RoPE tables) itself, and checkpoints the first `recompute_blocks` blocks the plan asks
for (torch.utils.checkpoint). The last stage outputs logits; the loss is `loss_fn(logits, target)`,
by default the model's own loss for the example families (cross entropy over flattened tokens, what
`Transformer.forward` / `MLP.forward` compute), so a step equals `model(x, labels)` on the same batch.

Inside a stage: the stage submesh's dp dims run data parallel, as the plan's per-op plan says: parameters sharded on
dp -> FSDP2 `fully_shard` over the dp submesh (shard dim from the plan, `reshard_after_forward=False`: gathered
once per step, as the plan's cost model assumes; FSDP2 shards every parameter of the module it wraps, so ones the
plan keeps replicated are sharded on dim 0 too: same gradients, less memory than planned); all replicated -> DDP.
Where the per-op plan re-shards activations over dp inside a stage, FSDP2/DDP run it as plain data parallelism
(same values, their own collectives). A stage plan that shards anything over a
tp dim needs a backend that can express it and is refused here with a clear error.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


class PipelineShapeError(ValueError):
    """A batch whose shape breaks the plan's static micro-batch shapes."""


def _ce_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


class _LlamaStage(nn.Module):
    """A stage of an autopar Llama-family Transformer (tok_embeddings / layers / norm / output)."""

    def __init__(self, model, layer_ids, first, last, recompute=0):
        super().__init__()
        self.cfg = model.cfg
        self.recompute = recompute
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x):
        from autopar.models.llama import rope_cos_sin
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if len(self.layers):
            cos, sin = rope_cos_sin(h.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device, h.dtype)
            for j, layer in enumerate(self.layers.values()):
                out = _run_block(layer, j < self.recompute, h, cos, sin)
                if isinstance(out, tuple):
                    raise NotImplementedError("blocks returning several tensors (MoE aux loss) need a stage boundary "
                                              "carrying two tensors; the pipeline runtime passes one")
                h = out
        return self.output(self.norm(h)) if self.output is not None else h


class _MLPStage(nn.Module):
    """A stage of autopar's residual MLP language model (embed / layers / output)."""

    def __init__(self, model, layer_ids, first, last, recompute=0):
        super().__init__()
        self.recompute = recompute
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.output = model.output if last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for j, layer in enumerate(self.layers.values()):
            h = _run_block(layer, j < self.recompute, h)
        return self.output(h) if self.output is not None else h


def _run_block(layer, recompute: bool, *args):
    """A block, checkpointed (activations dropped after forward, recomputed before backward) if the plan says so."""
    if recompute:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)


def _family(model):
    names = dict(model.named_children())
    if {"tok_embeddings", "layers", "norm", "output"} <= set(names) and hasattr(model, "cfg"):
        if getattr(model.cfg, "n_experts", None):
            raise NotImplementedError(f"{type(model).__name__}: MoE blocks return (h, aux); the pipeline runtime "
                                      f"passes one tensor between stages (plan-only for MoE models)")
        return _LlamaStage
    if {"embed", "layers", "output"} <= set(names):
        return _MLPStage
    raise NotImplementedError(f"no pipeline stage adapter for {type(model).__name__}: the runtime knows the Llama "
                              f"(tok_embeddings/layers/norm/output) and MLP (embed/layers/output) module layouts")


def build_stage_module(model: nn.Module, plan, k: int) -> nn.Module:
    """The module of stage k: the model's modules of the stage's clusters, parameters shared with `model`."""
    st = plan.stages[k]
    prefix = plan.schedule["layer_prefix"]
    cls = _family(model)
    if prefix != "layers":
        raise NotImplementedError(f"stage adapters expect the layer list at 'layers', the plan has '{prefix}'")
    ids = [int(c.rsplit(".", 1)[1]) for c in st["clusters"] if c.startswith(prefix + ".")]
    mod = cls(model, ids, "pre" in st["clusters"], "post" in st["clusters"], int(st.get("recompute_blocks", 0)))
    have = {n for n, _ in mod.named_parameters()}
    want = set(st["params"])
    if have != want:
        raise ValueError(f"stage {k}: module holds parameters {sorted(have ^ want)[:6]} differently from the plan "
                         f"(plan {len(want)}, module {len(have)})")
    return mod


def _batch_dp_sharded(plan) -> bool:
    names = plan.schedule["stage_mesh_names"]
    dp = [d for d, nm in enumerate(names) if nm.startswith("dp") and plan.schedule["stage_mesh_shape"][d] > 1]
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
                f"shapes: re-plan for a different batch or sequence length")


class PipelineRunner:
    """Executes `plan` on this rank. mesh: a DeviceMesh whose dim names are plan.mesh_names (a "pp" dim and the
    stage submesh dims); built with init_device_mesh from the plan when None (process group already initialized)."""

    def __init__(self, model: nn.Module, plan, mesh=None, loss_fn=None, device=None, copy_model: bool = False):
        from torch.distributed.device_mesh import init_device_mesh
        import torch.distributed.pipelining as pp_api
        from autopar.pipeline_model import get_schedule
        if not plan.stages or plan.schedule.get("name") in (None, "none"):
            raise ValueError("the plan has no pipeline stages (pp=1): run it with a non-pipeline backend")
        self.plan = plan
        sc = plan.schedule
        self.device = torch.device(device or "cpu")
        if mesh is None:
            mesh = init_device_mesh(self.device.type, tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_names))
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names or tuple(mesh.shape) != tuple(plan.mesh_shape) or names != tuple(plan.mesh_names):
            raise ValueError(f"mesh {tuple(mesh.shape)}{names} does not match the plan's "
                             f"{tuple(plan.mesh_shape)}{tuple(plan.mesh_names)}")
        self.mesh = mesh
        self.pp_rank = mesh.get_local_rank("pp")
        model = copy.deepcopy(model) if copy_model else model
        self.loss_fn = loss_fn or _ce_loss
        S, m = sc["num_stages"], sc["n_microbatches"]
        self.local = [k for k in range(S) if plan.stages[k]["pp_rank"] == self.pp_rank]
        self.modules, stages = [], []
        for k in self.local:
            mod = build_stage_module(model, plan, k).to(self.device)
            mod = self._data_parallel(mod, k)
            self.modules.append(mod)
            stages.append(pp_api.PipelineStage(mod, k, S, self.device, group=mesh.get_group("pp")))
        self.wrappers = [type(mod).__name__ for mod in self.modules]
        self.stages = stages
        spec = get_schedule(sc["name"])
        cls = getattr(pp_api, spec.torch_class)
        self.schedule = cls(stages if spec.multi else stages[0], n_microbatches=m, loss_fn=self.loss_fn)
        self.is_first = 0 in self.local
        self.is_last = (S - 1) in self.local

    def _data_parallel(self, mod, k):
        sc = self.plan.schedule
        dims = list(zip(sc["stage_mesh_names"], sc["stage_mesh_shape"]))
        for d, (nm, size) in enumerate(dims):
            if size > 1 and not nm.startswith("dp"):
                bad = [f for f in self.plan.stages[k]["params"] if self.plan.params[f][d] != "R"]
                raise NotImplementedError(f"stage {k}: mesh dim '{nm}' (size {size}) shards {bad[:3]}...; tensor "
                                          f"parallelism inside a pipeline stage is not wired in backends/pipeline.py")
        dp = [(d, nm) for d, (nm, size) in enumerate(dims) if size > 1]
        if not dp:
            return mod
        if len(dp) != 1:
            raise NotImplementedError(f"stage {k}: one data-parallel dim supported, plan has {[n for _, n in dp]}")
        d, nm = dp[0]
        pls = {f: self.plan.params[f][d] for f in self.plan.stages[k]["params"]}
        if not _batch_dp_sharded(self.plan):
            if any(p != "R" for p in pls.values()):
                raise NotImplementedError(f"stage {k}: the plan keeps the batch whole on '{nm}' but shards "
                                          f"parameters there; only data-parallel dp dims are supported")
            return mod                      # every dp rank computes the same micro-batches: nothing to wrap
        sub = self.mesh[nm]
        if all(p == "R" for p in pls.values()):
            from torch.nn.parallel import DistributedDataParallel
            return DistributedDataParallel(mod, process_group=sub.get_group())
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        by_param = {p: int(pls[f][1:]) if pls[f].startswith("S") else 0 for f, p in mod.named_parameters()}
        return fully_shard(mod, mesh=sub, reshard_after_forward=False,
                           shard_placement_fn=lambda p: Shard(by_param.get(p, 0)))

    def check_batch(self, *tensors) -> None:
        check_batch(self.plan, tensors)

    def expected_shapes(self) -> list:
        sc = self.plan.schedule
        return sc["local_batch_shapes"] if _batch_dp_sharded(self.plan) else sc["batch_shapes"]

    def step(self, x=None, target=None):
        """One training step (forward + backward, gradients accumulated in the parameters). Pass the batch on the
        rank holding the first stage and the target on the rank holding the last; returns the mean micro-batch loss
        there (None elsewhere). The shape check is agreed on by every rank of the mesh first (one int all-reduce
        per mesh dim), so ranks that hold no input raise too instead of waiting for activations that never come."""
        import torch.distributed as dist
        err = None
        try:
            self.check_batch(x if self.is_first else None, target if self.is_last else None)
        except PipelineShapeError as e:
            err = e
        ok = torch.tensor([0 if err else 1], dtype=torch.int32)
        for d in range(self.mesh.ndim):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.mesh.get_group(d))
        if err is not None:
            raise err
        if not int(ok.item()):
            sc = self.plan.schedule
            raise PipelineShapeError(f"pipeline batch rejected on another rank: the plan's static shapes per rank "
                                     f"are {self.expected_shapes()} ({sc['n_microbatches']} micro-batches of "
                                     f"{sc['microbatch_shapes']} over the stage submesh)")
        losses = [] if self.is_last else None
        args = (x,) if self.is_first else ()
        kw = {"target": target, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, **kw)
        if self.is_last:
            return torch.stack([l.detach() for l in losses]).mean()
        return None

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
