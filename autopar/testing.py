"""Checking a parallelized model against the single-device model, and plan constraints for tests and examples.

`fsdp_force` / `tp_force` build `force=` dicts (FSDP-like: every parameter sharded on dim 0 of one mesh dim;
Megatron-like tensor parallel: column-wise / row-wise projections on one mesh dim) so a test can pin a plan
family on models too small for the cost model to shard by itself. `train_and_compare` runs SGD steps on both
models and reports the largest differences of the loss, every gradient and every parameter, plus the
collectives the first step issued against the plan's list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.cost.cluster import ClusterSpec, DeviceSpec, LinkSpec
from autopar.strategies._torch_adapter import collapse, local_of, outside_local_tensor_mode

from autopar.backends.counter import CollectiveCounter, compare
from autopar.backends.spmd.comm import redistribute_local
from autopar.backends.spmd.program import placement_strs

# Cost models for tests and benchmarks of plan *shapes* on tiny models. SHAPES: the CPU preset autopar shipped
# before it was calibrated on the 2-core CI machine (benchmarks/cpu_calibrate.py): with its cheap collectives (50 us,
# 2 GB/s) the tiny models plan the Megatron / FSDP shapes the lowering tests need, where the calibrated preset's
# milliseconds per gloo collective rightly keep them replicated.
_DEV_FAST = DeviceSpec(
    "cpu-fast-links",
    {"fp32": 1e11, "bf16": 1e11, "fp16": 1e11},
    mem_bw=2e10,
    mem_bytes=16e9,
    matmul_eff=0.5,
    mem_eff=0.7,
)
_LINK_FAST = LinkSpec("fast-loopback", alpha=5e-5, bw=2e9)
SHAPES = ClusterSpec("cpu-fast-links", _DEV_FAST, 1 << 20, _LINK_FAST, _LINK_FAST)

# Slow compute, links slow in bandwidth only: on llama-tiny at 8 tokens a row a replicated weight would cost a
# gradient all_reduce larger than the activations tensor parallelism reduces, so the planner shards the blocks'
# Linears over tp (and the batch over dp): tests/test_pipeline_dist.py's stage plans, tests/test_report.py's page.
_DEV_SLOW = DeviceSpec(
    "cpu-slow-compute",
    {"fp32": 1e8, "bf16": 1e8, "fp16": 1e8},
    mem_bw=2e10,
    mem_bytes=16e9,
    matmul_eff=0.5,
    mem_eff=0.7,
)
_LINK_SLOW = LinkSpec("slow-bandwidth-loopback", alpha=1e-6, bw=1e8)
TP_FRIENDLY = ClusterSpec("tp-friendly", _DEV_SLOW, 1 << 20, _LINK_SLOW, _LINK_SLOW)


COLWISE = (
    "wq.weight",
    "wk.weight",
    "wv.weight",
    "w1.weight",
    "w3.weight",
    "c_fc.weight",
    "c_attn.weight",
    "fc1.weight",
    "router.weight",
)
ROWWISE = ("wo.weight", "w2.weight", "c_proj.weight", "fc2.weight")


def fsdp_force(model: nn.Module, mesh_shape, dim: int = 0) -> dict:
    """Every parameter Shard(0) on mesh dim `dim` where that divides it evenly, replicated elsewhere."""
    out = {}
    for k, p in model.named_parameters():
        pl = ["R"] * len(mesh_shape)
        if p.dim() and p.shape[0] % mesh_shape[dim] == 0:  # a 0-dim parameter (CLIP's logit scale): whole
            pl[dim] = "S0"
        out[k] = tuple(pl)
    return out


def tp_force(model: nn.Module, mesh_shape, dim: int = -1) -> dict:
    """Column-wise (Shard(0)) input projections and row-wise (Shard(1)) output projections on mesh dim `dim`
    where the sharded size divides evenly; everything else replicated."""
    dim = dim % len(mesh_shape)
    n = mesh_shape[dim]
    out = {}
    for k, p in model.named_parameters():
        pl = ["R"] * len(mesh_shape)
        if k.endswith(COLWISE) and p.shape[0] % n == 0:
            pl[dim] = "S0"
        elif k.endswith(ROWWISE) and p.ndim == 2 and p.shape[1] % n == 0:
            pl[dim] = "S1"
        out[k] = tuple(pl)
    return out


def fsdp_tp_force(model: nn.Module, mesh_shape) -> dict:
    """2-D: FSDP-like on mesh dim 0 and tensor parallel on mesh dim 1 (a tensor dim sharded by both is nested,
    dp outer)."""
    a, b = fsdp_force(model, mesh_shape, 0), tp_force(model, mesh_shape, 1)
    shapes = {k: p.shape for k, p in model.named_parameters()}
    out = {}
    for k in a:
        pl = (a[k][0] if a[k][0] != "R" else b[k][0],) + tuple(b[k][1:])
        split = {}
        for p, n in zip(pl, mesh_shape):
            if p[0] == "S":
                split[int(p[1:])] = split.get(int(p[1:]), 1) * n
        out[k] = pl if all(shapes[k][d] % n == 0 for d, n in split.items()) else b[k]  # nested must divide
    return out


def global_value(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor / LocalTensor / plain tensor as one plain tensor."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):  # gathered with the executor's own collectives (as the plan would)
            src = placement_strs(t)
            t = redistribute_local(local_of(t), src, ("R",) * len(src), t.device_mesh)
        return collapse(t)


def _diff(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float):
    a, b = a.double(), b.double()
    err = (a - b).abs()
    bad = (err > atol + rtol * b.abs()).any().item()
    return err.max().item(), (err / b.abs().clamp_min(1e-30)).max().item(), bad


@dataclass
class Report:
    steps: int = 0
    losses: list = field(default_factory=list)  # (autopar, single device) per step
    max_abs: float = 0.0  # over losses, grads and final params
    max_rel: float = 0.0
    failures: list = field(default_factory=list)  # what exceeded rtol/atol
    measured: list = field(default_factory=list)  # collectives of the first step
    predicted: list = field(default_factory=list)
    collective_diff: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.collective_diff


def train_and_compare(
    pm,
    ref: nn.Module,
    inputs,
    steps: int = 3,
    lr: float = 0.1,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    count: bool = True,
    all_grads: bool = False,
) -> Report:
    """`steps` SGD steps on the parallelized module `pm` and on the single-device `ref` (same initial weights,
    same inputs); compares the loss at each step, every gradient of the first step (of every step with
    all_grads=True) and every parameter at the end. The first step's collectives are counted (count=True)."""
    rep = Report(steps=steps)
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    named = dict(pm.named_parameters())
    ref_named = dict(ref.named_parameters())

    def check(what, a, b):
        ma, mr, bad = _diff(a, b, rtol, atol)
        rep.max_abs, rep.max_rel = max(rep.max_abs, ma), max(rep.max_rel, mr)
        if bad:
            rep.failures.append(f"{what}: max abs {ma:.3e}, max rel {mr:.3e}")

    mesh = pm.program.mesh
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        counter = CollectiveCounter(mesh) if count and s == 0 else None
        if counter is not None:
            with counter:
                loss = pm(*inputs)
                loss.backward()
                opt.step()
        else:
            loss = pm(*inputs)
            loss.backward()
        with outside_local_tensor_mode():  # the reference is one plain single-device run
            ref_loss = ref(*inputs)
            ref_loss.backward()
        lv = global_value(loss)
        rep.losses.append((lv.item(), ref_loss.item()))
        check(f"step {s} loss", lv, ref_loss.detach())
        for k, p in ref_named.items():
            if p.grad is None or (s > 0 and not all_grads):
                continue
            g = named[k].grad
            if g is None:
                rep.failures.append(f"step {s} grad of {k}: missing")
                continue
            check(f"step {s} grad {k}", global_value(g), p.grad)
        if counter is not None:
            rep.measured = list(counter.collectives())
            rep.predicted = pm.plan.collectives()
            rep.collective_diff = compare(rep.measured, rep.predicted)
        else:
            opt.step()
        with outside_local_tensor_mode():
            ref_opt.step()
    for k, p in ref_named.items():
        check(f"param {k} after {steps} steps", global_value(named[k]), p.detach())
    return rep
