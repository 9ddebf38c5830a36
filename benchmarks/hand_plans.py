"""The plans experts write by hand, in two forms that describe the same parameter layout:

  * `forced_placements(source, ...)`: {param FQN: placement per mesh dim} for `autopar.plan(..., force=...)`. The
    planner then chooses only the activations (the best execution of that hand layout) and prices it with the same
    cost model and memory budget as autopar's own plan.
  * `apply_hand(source, ...)`: the same layout written with torch's own APIs (DistributedDataParallel,
    fully_shard per block, parallelize_module with Colwise/Rowwise/SequenceParallel, distribute_module), for the
    measured CPU runs.

Sources (mesh dims are named ("dp",) or ("dp", "tp")):
  ddp       every parameter replicated; DistributedDataParallel over the whole world (on a 2-D mesh too).
  fsdp2     every parameter Shard(0) over the whole world, one fully_shard unit per block + the root (FSDP2's
            default reshard_after_forward=True). On a 2-D mesh that is ("S0", "S0").
  tp        Megatron-style tensor parallelism on the "tp" dim (the only dim of a 1-D mesh), data parallel
            replicate on "dp": column-parallel in-projections, row-parallel out-projections, vocab-parallel
            embedding and output with a vocab-parallel loss (loss_parallel); Llama-family blocks also use
            sequence parallelism on the norms exactly as torchtitan's apply_tp does.
  fsdp2_tp  tp's layout on "tp" + fully_shard per block on "dp" (2-D meshes only), as torchtitan composes them.
  torchtitan  Llama-3 only: torchtitan 0.2.2's parallelize_llama (benchmarks/titan.py).

Per-family TP rules (`tp_placement`):
  llama / moe attention: wq, wk, wv colwise (S0); wo rowwise (S1); feed_forward / shared_experts w1, w3 colwise,
    w2 rowwise; tok_embeddings vocab-sharded (S0, RowwiseParallel on nn.Embedding); output colwise (S0); norms R.
  moe routed experts (E, dim, hidden) / (E, hidden, dim): tensor parallel inside every expert: w1, w3 S2, w2 S1
    (torch has no ParallelStyle for batched expert weights: applied with distribute_module); router R. MoE models
    run TP without sequence parallelism and with all-gathered logits instead of loss_parallel: their loss adds the
    router's plain-tensor aux loss, which cannot meet loss_parallel's DTensor loss in the backward.
  gpt2: mlp.c_fc colwise, mlp.c_proj rowwise, wte vocab-sharded, lm_head colwise; attention c_attn / c_proj stay
    replicated: c_attn packs q|k|v, and ColwiseParallel would give a rank parts of q, k and v of different heads
    (Megatron re-orders that weight head-wise; torch's styles cannot). The benchmark's GPT-2 is untied
    (tie_embeddings=False): parallelize_module re-registers wte's weight, which breaks a tie to lm_head.
  mlp: fc1 colwise, fc2 rowwise, embed vocab-sharded, output colwise.

Loss (`HandRun.forward_backward`): every source normalizes as torchtitan 0.2.2's train_step does: each rank's
summed loss over the global count of valid labels, that count all-reduced over the data-parallel ranks before the
forward (8 bytes). Every source then computes one device's gradient of the mean loss, as autopar does; a rank's
plain mean would weight each rank's tokens by 1 / its own count (not the same gradient when labels carry
ignore_index). An MoE's router aux loss (per layer, a product of two means over the tokens) is the model's too: the
plans that split the batch all-reduce the router statistics over the data-parallel ranks (`global_router_means`:
2 x experts floats a layer, every layer's in one all_reduce after the last), where plain DDP would give each rank
its own shard's aux loss, another gradient (until 2026-12 the benchmark's hand plans did that).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

HAND_SOURCES = ("ddp", "fsdp2", "tp", "fsdp2_tp", "torchtitan")
BLOCK_LISTS = ("layers", "h")  # the ModuleList of repeated blocks, per family


class NotApplicable(ValueError):
    """The hand plan does not exist for this model or mesh (the row is kept and says why)."""


def family_of(model_name: str) -> str:
    from autopar.models import get_config

    return get_config(model_name).family


def tp_placement(family: str, fqn: str, shape) -> str:
    """Megatron-style TP placement of one parameter (see the module docstring)."""
    mod = fqn.split(".")[-2] if "." in fqn else ""
    is_bias = fqn.endswith(".bias")
    if family in ("llama", "moe"):
        if ".experts." in fqn:
            return {"w1": "S2", "w3": "S2", "w2": "S1"}[fqn.rsplit(".", 1)[-1]]
        if mod in ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings"):
            return "S0"
        if mod in ("wo", "w2"):
            return "S1"
        return "R"  # norms, router
    if family == "gpt2":
        if ".attn." in fqn or mod in ("wpe", "ln_1", "ln_2", "ln_f"):
            return "R"
        if mod in ("c_fc", "wte", "lm_head"):
            return "S0"
        if mod == "c_proj":  # mlp.c_proj (attention's was handled above)
            return "R" if is_bias else "S1"
        return "R"
    if family == "mlp":
        if mod in ("fc1", "embed", "output"):
            return "S0"
        if mod == "fc2":
            return "R" if is_bias else "S1"
        return "R"
    raise NotApplicable(f"no hand-written tensor-parallel rule for model family {family!r}")


def forced_placements(
    source: str,
    model_name: str,
    model: nn.Module,
    mesh_names: tuple,
    titan: dict | None = None,
    mesh_shape: tuple | None = None,
    notes: list | None = None,
) -> dict[str, tuple[str, ...]]:
    """{param FQN: placements per mesh dim} of a hand plan, for autopar.plan(force=...).

    FSDP2 pads a dim that does not divide evenly (Shard(0) of a 128256-row embedding over 512 ranks); the planner
    needs even shards, so with `mesh_shape` given, an FSDP shard that does not divide moves to the first dim that
    does (what FSDP2's `shard_placement_fn` lets a user choose; same bytes gathered); `notes` gets one line."""
    fam = family_of(model_name)
    two_d = tuple(mesh_names) == ("dp", "tp")
    if not two_d and tuple(mesh_names) != ("dp",):
        raise NotApplicable(f"hand plans are defined on ('dp',) or ('dp', 'tp') meshes, not {mesh_names}")
    out, moved = {}, []
    for fqn, p in model.named_parameters():
        if source == "ddp":
            pl = ("R", "R") if two_d else ("R",)
        elif source == "fsdp2":
            pl = ("S0", "S0") if two_d else ("S0",)
        elif source == "tp":
            t = tp_placement(fam, fqn, p.shape)
            pl = ("R", t) if two_d else (t,)
        elif source == "fsdp2_tp":
            if not two_d:
                raise NotApplicable("FSDP2 x TP needs a 2-D (dp, tp) mesh")
            pl = ("S0", tp_placement(fam, fqn, p.shape))
        elif source == "torchtitan":
            if fam != "llama" or not model_name.startswith("llama3"):
                raise NotApplicable("torchtitan's parallelize_llama is the hand plan of Llama-3 models only")
            if titan is None:
                raise NotApplicable("torchtitan placements unavailable")
            key = re.sub(r"\.\d+\.", ".*.", fqn)
            if key not in titan:
                raise NotApplicable(f"torchtitan's model has no parameter {key}")
            pl = (titan[key]["dp"], titan[key]["tp"]) if two_d else (titan[key]["dp"],)
        else:
            raise ValueError(f"unknown plan source {source!r}; known: autopar, {', '.join(HAND_SOURCES)}")
        if mesh_shape is not None and source in ("fsdp2", "fsdp2_tp", "torchtitan"):
            fsdp_dims = range(len(pl)) if source == "fsdp2" else (0,)
            even = _even(pl, tuple(p.shape), tuple(mesh_shape), [i for i in fsdp_dims if pl[i][0] == "S"])
            if even != pl:
                moved.append(f"{fqn} {list(pl)}->{list(even)}")
                pl = even
        out[fqn] = pl
    if moved and notes is not None:
        notes.append(f"uneven FSDP shard moved to an even dim for {len(moved)} param(s), e.g. {moved[0]}")
    return out


def _even(pl, shape, mesh_shape, movable) -> tuple:
    """`pl` if every sharded tensor dim divides evenly, else the first re-assignment of the `movable` mesh dims
    (one at a time, then all together) to a tensor dim that does; `pl` unchanged when none does."""
    import math

    def ok(c):
        return all(
            shape[d] % math.prod(m for p, m in zip(c, mesh_shape) if p == f"S{d}") == 0 for d in range(len(shape))
        )

    if ok(pl) or not movable:
        return tuple(pl)
    for i in movable:
        for d in range(len(shape)):
            c = list(pl)
            c[i] = f"S{d}"
            if ok(c):
                return tuple(c)
    for d in range(len(shape)):
        c = [f"S{d}" if i in movable else p for i, p in enumerate(pl)]
        if ok(c):
            return tuple(c)
    return tuple(pl)


def state_bytes_lower_bound(model: nn.Module, force: dict, mesh_shape, precision) -> float:
    """Per-rank bytes of params + grads + optimizer state at the forced placements (a lower bound of the peak)."""
    import math

    seen, total = set(), 0.0
    for fqn, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        shards = math.prod(n for s, n in zip(force[fqn], mesh_shape) if s[0] == "S")
        total += p.numel() * precision.bytes_per_param / shards
    return total


# ---- the same plans with torch's APIs (measured runs) -----------------------------------------------------------


def _blocks(model: nn.Module) -> list[nn.Module]:
    for name in BLOCK_LISTS:
        lst = getattr(model, name, None)
        if isinstance(lst, (nn.ModuleList, nn.ModuleDict)):
            return list(lst.values()) if isinstance(lst, nn.ModuleDict) else list(lst)
    raise NotApplicable(f"{type(model).__name__} has no block list ({' / '.join(BLOCK_LISTS)}) to wrap per block")


def tp_styles(family: str, model: nn.Module) -> tuple[dict, bool]:
    """parallelize_module plan (module FQN -> ParallelStyle) of the family's TP rule, and whether the loss runs under
    loss_parallel (vocab-sharded logits)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    col, row = ColwiseParallel, RowwiseParallel
    head = col(output_layouts=Shard(-1), use_local_output=False)  # vocab-parallel logits
    plan = {}
    if family == "llama":  # torchtitan's apply_tp layer plan (TP + sequence parallel)
        plan.update(
            {
                "tok_embeddings": row(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "output": col(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            }
        )
        for i in range(len(model.layers)):
            b = f"layers.{i}."
            plan.update(
                {
                    b + "attention_norm": SequenceParallel(),
                    b + "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                    b + "attention.wq": col(),
                    b + "attention.wk": col(),
                    b + "attention.wv": col(),
                    b + "attention.wo": row(output_layouts=Shard(1)),
                    b + "ffn_norm": SequenceParallel(),
                    b + "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    b + "feed_forward.w1": col(),
                    b + "feed_forward.w3": col(),
                    b + "feed_forward.w2": row(output_layouts=Shard(1)),
                }
            )
        return plan, True
    if family == "moe":  # Megatron TP without sequence parallelism; experts: see tp_experts
        # logits all-gathered (no loss_parallel): the model adds a plain-tensor router aux loss to the CE loss
        plan.update({"tok_embeddings": row(input_layouts=Replicate()), "output": col(output_layouts=Replicate())})
        for i, blk in enumerate(model.layers):
            b = f"layers.{i}."
            plan.update(
                {
                    b + "attention.wq": col(),
                    b + "attention.wk": col(),
                    b + "attention.wv": col(),
                    b + "attention.wo": row(),
                }
            )
            ffn = b + ("moe.shared_experts" if blk.is_moe else "feed_forward")
            if not blk.is_moe or blk.moe.shared_experts is not None:
                plan.update({ffn + ".w1": col(), ffn + ".w3": col(), ffn + ".w2": row()})
        return plan, False
    if family == "gpt2":
        plan.update({"wte": row(input_layouts=Replicate()), "lm_head": head})
        for i in range(len(model.h)):
            plan.update({f"h.{i}.mlp.c_fc": col(), f"h.{i}.mlp.c_proj": row()})
        return plan, True
    if family == "mlp":
        plan.update({"embed": row(input_layouts=Replicate()), "output": head})
        for i in range(len(model.layers)):
            plan.update({f"layers.{i}.fc1": col(), f"layers.{i}.fc2": row()})
        return plan, True
    raise NotApplicable(f"no hand-written tensor-parallel plan for model family {family!r}")


def tp_experts(model: nn.Module, tp_mesh) -> None:
    """Tensor parallelism inside every routed expert (w1, w3 Shard(2), w2 Shard(1)) with distribute_module: inputs
    enter replicated, the expert sum leaves as a Partial that is all-reduced (Megatron's row-parallel output)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

    dims = {"w1": 2, "w3": 2, "w2": 1}

    def partition(name, module, mesh):
        if name == "":  # the Experts module itself (distribute_module visits it first)
            for pn, d in dims.items():
                p = getattr(module, pn)
                module.register_parameter(pn, nn.Parameter(distribute_tensor(p, mesh, [Shard(d)])))

    def inputs(module, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

    def outputs(module, out, mesh):
        return out.redistribute(mesh, [Replicate()]).to_local()

    for blk in model.layers:
        if getattr(blk, "is_moe", False):
            distribute_module(blk.moe.experts, tp_mesh, partition, inputs, outputs)


IGNORE_INDEX = -100  # F.cross_entropy's default, the models' loss


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(sum) of a small tensor over the data-parallel group in the forward; in the backward, this rank's
    gradient times `run.aux_grad_factor` (the engine's divisor over the rank's loss scale, HandRun.forward_backward):
    the sum's gradient reaches each rank's own tokens once, and after the engine's averaging over the ranks and
    the loss scale, with the weight one device gives it."""

    @staticmethod
    def forward(ctx, x, group, run):
        import torch.distributed as dist

        ctx.run = run
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.run.aux_grad_factor, None, None


def global_router_means(model: nn.Module, run: "HandRun") -> None:
    """MoE models in a plan that splits the batch: the router aux loss over the global batch, as the model defines it
    (per layer, each expert's share of the routed tokens times its mean probability, means over every token), not
    over each rank's shard. As an expert would write it by hand: every MoE layer's token sums (2 x experts floats)
    are kept through the forward and all-reduced over the data-parallel ranks in ONE collective after the last
    layer (Megatron-LM's global aux loss reduces per layer), the aux loss computed from them there: each layer's
    `token_means` records its sums and hands the layer zeros, `logits_and_aux` adds the global aux loss. Batches
    split evenly (HandRun.local_inputs), so the global count is the local one times the ranks."""
    sums: list = []
    moes = [blk.moe for blk in _blocks(model) if getattr(blk, "is_moe", False)]
    if not moes:
        return

    def token_means(moe, mask, probs):
        sums.append(torch.cat([mask.sum(0), probs.sum(0)]))
        zero = probs.new_zeros(probs.shape[1])
        return zero, zero

    def logits_and_aux(tokens):
        sums.clear()
        logits, aux = model_logits_and_aux(tokens)  # each layer's own aux loss is 0 here
        total = _SumOverRanks.apply(torch.cat(sums), run.dp_group, run)
        n = tokens.numel() * run.dp_size
        for moe, s in zip(moes, total.split([2 * m.n_experts for m in moes])):
            load, mean_probs = s[: moe.n_experts] / n, s[moe.n_experts :] / n
            aux = aux + moe.n_experts * (load / moe.top_k * mean_probs).sum()  # as MoE.forward computes it
        return logits, aux

    model_logits_and_aux = model.logits_and_aux
    for moe in moes:
        moe.token_means = token_means.__get__(moe)
    model.logits_and_aux = logits_and_aux


def global_tokens(labels: torch.Tensor, group) -> torch.Tensor:
    """The number of valid labels (!= IGNORE_INDEX) of the global batch: this rank's count, summed over the
    data-parallel `group` (None: this rank holds the whole batch), as torchtitan 0.2.2's train_step counts them."""
    import torch.distributed as dist

    n = (labels != IGNORE_INDEX).sum()
    if group is not None:
        dist.all_reduce(n, group=group)
    return n


class HandRun:
    """One hand plan applied to a model with torch APIs: the module, the optimizer's params, what to call around
    forward+backward (loss_parallel) and this rank's slice of the global batch. `dp_group`: the data-parallel
    ranks (None without data parallelism); `divides`: what the engine divides the summed gradients by (DDP and
    FSDP2 average over the data-parallel ranks)."""

    def __init__(
        self,
        module,
        loss_parallel: bool,
        dp_rank: int,
        dp_size: int,
        after_backward=None,
        persistent_bytes: int = 0,
        dp_group=None,
        divides: int = 1,
    ):
        self.module, self.loss_parallel = module, loss_parallel
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.after_backward = after_backward
        self.persistent_bytes = persistent_bytes  # buffers the engine holds between steps (not params/grads/opt)
        self.dp_group, self.divides = dp_group, divides

    def forward_backward(self, local):
        """One forward and backward on this rank's shard `local`: the module's mean loss rescaled to its summed loss
        over the global count of valid labels (counted before the forward), times the engine's gradient divisor
        (module docstring); then `after_backward`. A shard whose labels are all ignored would give nan (the
        model's 0 / 0 mean)."""
        labels = local[-1]
        scale = (labels != IGNORE_INDEX).sum().item() * self.divides / global_tokens(labels, self.dp_group).item()
        self.aux_grad_factor = self.divides / scale if scale else 0.0  # global_router_means
        with self.context():
            (self.module(*local) * scale).backward()
        if self.after_backward is not None:
            self.after_backward()

    def local_inputs(self, inputs):
        if inputs[0].shape[0] % self.dp_size:
            raise ValueError(
                f"the global batch of {inputs[0].shape[0]} does not split over {self.dp_size} data-parallel ranks"
            )
        return tuple(x.chunk(self.dp_size, dim=0)[self.dp_rank].contiguous() for x in inputs)

    def context(self):
        import contextlib

        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()


def _allreduce_grads(params, group, bucket_bytes=25 * 2**20):
    """Data-parallel gradient averaging over `group` in flat buckets of <= 25 MiB (DDP's default bucket size), on
    the local shards of DTensor gradients: used for TP x replicate-DP, which DistributedDataParallel does not
    support on DTensor parameters."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    buckets, cur, size = [], [], 0
    for g in grads:
        nb = g.numel() * g.element_size()
        if cur and size + nb > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(g)
        size += nb
    if cur:
        buckets.append(cur)
    n = dist.get_world_size(group)
    for b in buckets:
        flat = torch.cat([g.reshape(-1) for g in b])
        dist.all_reduce(flat, group=group)
        flat /= n
        off = 0
        for g in b:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()


def hand_collectives(source: str, model: nn.Module, world: int) -> dict | None:
    """What torch's engines issue in one step of the hand plan `source` (apply_hand) on `world` ranks, from the
    model's parameters alone: {kind: {"count", "bytes"}} in the plan's byte convention, or None where torch's
    schedule is not modelled here (tp, fsdp2_tp, torchtitan: their collectives follow DTensor's redistributes).
      * every source: the count of valid labels, one 8-byte all_reduce before the forward (HandRun), and for an MoE
        every layer's router statistics in one all_reduce (global_router_means: 2 x experts floats a layer).
      * ddp: every gradient once, in DDP's buckets (its reducer's limits after the first step: 1 MiB, then 25 MiB;
        counted with torch's own assignment over the parameters in reverse order, as the backward makes them).
      * fsdp2: per unit (each block, then the root) the padded parameters (dim 0 padded to a multiple of the ranks):
        all_gathered in the forward and again in the backward (reshard_after_forward=True) except the root's,
        which FSDP2 keeps gathered for the backward, and one reduce_scatter of the gradients."""
    import torch.distributed as dist

    if source not in ("ddp", "fsdp2"):
        return None
    out: dict = {}

    def add(kind, nbytes, count=1):
        e = out.setdefault(kind, {"count": 0, "bytes": 0})
        e["count"] += count
        e["bytes"] += nbytes

    add("all_reduce", 8)
    blocks = _blocks(model)
    moes = [blk.moe for blk in blocks if getattr(blk, "is_moe", False)]
    if moes:
        add("all_reduce", sum(2 * m.n_experts * 4 for m in moes))
    params = [p for p in model.parameters() if p.requires_grad]
    if source == "ddp":
        first, cap = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20), 25 * 2**20
        buckets, _ = dist._compute_bucket_assignment_by_size(list(reversed(params)), [first, cap])
        add("all_reduce", sum(p.numel() * p.element_size() for p in params), len(buckets))
        return out

    if any(p.dim() == 0 for p in params):
        return None

    def padded(ps):
        return sum(-(-p.shape[0] // world) * world * (p.numel() // max(p.shape[0], 1)) * p.element_size() for p in ps)

    in_blocks = set()
    for blk in blocks:
        ps = [p for p in blk.parameters() if p.requires_grad]
        in_blocks |= {id(p) for p in ps}
        add("all_gather", 2 * padded(ps), 2)
        add("reduce_scatter", padded(ps))
    root = [p for p in params if id(p) not in in_blocks]
    add("all_gather", padded(root))
    add("reduce_scatter", padded(root))
    return out


def apply_hand(source: str, model_name: str, model: nn.Module, mesh, world_mesh) -> HandRun:
    """Parallelize `model` (full weights on this rank's CPU) in place as the hand plan `source` on the DeviceMesh
    `mesh` (dims ("dp",) or ("dp", "tp")); `world_mesh` is a 1-D mesh over every rank (DDP / FSDP2 use it). An MoE
    whose batch the plan splits computes its router aux loss over the global batch (global_router_means)."""
    run = _apply(source, model_name, model, mesh, world_mesh)
    if family_of(model_name) == "moe" and run.dp_group is not None and run.dp_size > 1:
        global_router_means(model, run)
    return run


def _apply(source: str, model_name: str, model: nn.Module, mesh, world_mesh) -> HandRun:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    fam = family_of(model_name)
    names = tuple(mesh.mesh_dim_names)
    rank, world = dist.get_rank(), dist.get_world_size()
    if source == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, process_group=world_mesh.get_group(0), gradient_as_bucket_view=True)
        # the reducer's gradient buckets live between steps (the gradients are views into them): every trainable
        # parameter's size, which neither the parameters nor a set_to_none .grad shows
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return HandRun(
            ddp, False, rank, world, persistent_bytes=buckets, dp_group=world_mesh.get_group(0), divides=world
        )
    if source == "fsdp2":
        for blk in _blocks(model):
            fully_shard(blk, mesh=world_mesh)
        fully_shard(model, mesh=world_mesh)
        return HandRun(model, False, rank, world, dp_group=world_mesh.get_group(0), divides=world)
    if source in ("tp", "fsdp2_tp"):
        two_d = names == ("dp", "tp")
        if source == "fsdp2_tp" and not two_d:
            raise NotApplicable("FSDP2 x TP needs a 2-D (dp, tp) mesh")
        tp_mesh = mesh["tp"] if two_d else mesh
        styles, lp = tp_styles(fam, model)
        parallelize_module(model, tp_mesh, styles)
        if fam == "moe":
            tp_experts(model, tp_mesh)
        dp_rank, dp_size = (mesh.get_local_rank("dp"), mesh.size(0)) if two_d else (0, 1)
        group = mesh.get_group("dp") if two_d else None
        if source == "fsdp2_tp":
            for blk in _blocks(model):
                fully_shard(blk, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            return HandRun(model, lp, dp_rank, dp_size, dp_group=group, divides=dp_size)
        after = None
        if two_d:
            params = [p for p in model.parameters()]
            after = lambda: _allreduce_grads(params, group)  # noqa: E731
        return HandRun(model, lp, dp_rank, dp_size, after, dp_group=group, divides=dp_size)
    raise ValueError(f"apply_hand: unknown source {source!r}")
