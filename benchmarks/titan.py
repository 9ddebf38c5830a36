"""torchtitan 0.2.2's own Llama-3 hand plan: `torchtitan.models.llama3.infra.parallelize.parallelize_llama` applied to
torchtitan's own `Transformer` (the optional `bench` extra: torchtitan==0.2.2 + triton, which torchtitan imports at
module level; triton imports on a CPU-only machine, no kernel is ever launched here).

Two uses:
  * measured runs (gloo, CPU): `build_titan(...)` builds torchtitan's model from its named args
    (`llama3_args["debugmodel"]`), applies parallelize_llama with a ParallelDims over the real world, and returns
    the module; the loss is cross-entropy on its logits (under loss_parallel when TP shards the vocab, as
    torchtitan's trainer does).
  * modeled runs: `titan_placements(dp_shard, tp)` runs the same parallelize_llama on a fake process group in a
    child process and reads back every parameter's DTensor placements; those become `force=` placements for
    autopar's planner, so torchtitan's layout is priced by the same cost model as every other plan.

Settings that differ from torchtitan's defaults, and why (the same for every plan source in a comparison):
  activation checkpointing "none" (the CPU shapes fit; the modeled planner may add checkpointing to any plan),
  mixed_precision_param "float32" (the CPU runs are fp32 for every source; at scale the planner prices bf16),
  torch.compile off; FSDP2 "force sum reduction for comms" (torchtitan sets a gradient divide factor of 1, which
  FSDP2 turns into a PREMUL_SUM reduce-scatter that gloo does not have; a SUM with the same bytes instead).
  torchtitan picks its mesh device from the machine ("cuda" when no accelerator is found);
  on this CPU-only machine `parallel_dims.device_type` is set to "cpu" before the mesh is built.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

TITAN_VERSION = "0.2.2"


def titan_status() -> str:
    """'' when torchtitan 0.2.2 imports with its llama3 hand plan, else the reason."""
    try:
        import torchtitan  # noqa: F401
        from importlib.metadata import version

        v = version("torchtitan")
        from torchtitan.models.llama3 import llama3_args, parallelize_llama  # noqa: F401
    except Exception as e:  # ImportError, or triton missing (torchtitan imports it at module level)
        return f"torchtitan not importable ({type(e).__name__}: {e}); install the extra: pip install -e '.[bench]'"
    if v != TITAN_VERSION:
        return f"torchtitan {v} installed, the benchmark pins {TITAN_VERSION}"
    return ""


def _job_config(seq: int, tp: int):
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.training.seq_len = seq
    jc.training.mixed_precision_param = "float32"
    jc.training.mixed_precision_reduce = "float32"
    jc.activation_checkpoint.mode = "none"
    jc.compile.enable = False
    jc.parallelism.tensor_parallel_degree = tp
    return jc


def _parallel_dims(world: int, tp: int):
    import torchtitan.distributed.parallel_dims as pdm
    from torchtitan.distributed import ParallelDims

    pdm.device_type = "cpu"  # torchtitan falls back to "cuda" when it finds no accelerator
    pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world)
    pd.build_mesh()
    return pd


def titan_model_args(flavor: str = "debugmodel", **overrides):
    import dataclasses
    from torchtitan.models.llama3 import llama3_args

    args = llama3_args[flavor]
    return dataclasses.replace(args, **overrides) if overrides else args


def build_titan(world: int, tp: int, seq: int, flavor: str = "debugmodel", seed: int = 0, **overrides):
    """torchtitan's Llama-3 (`flavor`) on CPU, parallelized by torchtitan's own parallelize_llama over `world`
    ranks (dp_shard = world / tp, tp). Returns (model, uses_loss_parallel)."""
    import torch
    from torchtitan.models.llama3 import Transformer, parallelize_llama

    args = titan_model_args(flavor, **overrides)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    pd = _parallel_dims(world, tp)
    jc = _job_config(seq, tp)
    model = parallelize_llama(model, pd, jc)
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # gloo has no PREMUL_SUM, which torchtitan's divide factor 1.0 selects
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model, tp > 1 and not jc.parallelism.disable_loss_parallel


def titan_loss(model, tokens, labels, loss_parallel: bool, global_valid_tokens):
    """torchtitan 0.2.2's loss as its train_step computes it: the cross-entropy summed over this rank's tokens
    (fp32 logits) divided by the global count of valid labels (all-reduced over the data-parallel ranks before the
    forward; hand_plans.global_tokens). parallelize_llama turns FSDP's gradient division off
    (disable_fsdp_gradient_division), so the summed gradients are one device's gradient of the mean loss."""
    import torch.nn.functional as F

    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / global_valid_tokens


# ---- placements for the modeled runs ---------------------------------------------------------------------------

_CHILD = r"""
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
world, tp = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
sys.path.insert(0, sys.argv[3])
from titan import _parallel_dims, _job_config
from torchtitan.models.llama3 import Transformer, parallelize_llama, llama3_args
from torch.distributed.tensor import DTensor, Shard, Replicate
with torch.device("meta"):
    model = Transformer(llama3_args["debugmodel"])
pd = _parallel_dims(world, tp)
model = parallelize_llama(model, pd, _job_config(2048, tp))
out = {}
for fqn, p in model.named_parameters():
    if not isinstance(p, DTensor):
        out[fqn] = {"mesh": [], "placements": []}
        continue
    pls = []
    for pl in p.placements:
        if type(pl).__name__ == "_StridedShard":   # FSDP2's shard of dim d over a TP shard of the same dim
            pls.append("S%d*" % pl.dim)
        elif isinstance(pl, Shard):
            pls.append("S%d" % pl.dim)
        elif isinstance(pl, Replicate):
            pls.append("R")
        else:
            pls.append(repr(pl))
    out[fqn] = {"mesh": list(p.device_mesh.mesh_dim_names or ()), "placements": pls}
print(json.dumps(out))
dist.destroy_process_group()
"""


def titan_placements(dp_shard: int, tp: int) -> dict:
    """{normalized FQN ('layers.*.attention.wq.weight'): {"dp": str, "tp": str, "raw": ...}} as torchtitan's
    parallelize_llama lays out the debug model's parameters on a (dp_shard, tp) mesh (fake process group).
    The layout rules do not depend on the model size, so they apply to every Llama-3 shape by FQN."""
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dp_shard * tp), str(tp), os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        raise RuntimeError(f"torchtitan parallelize_llama on a fake process group failed: {r.stderr[-2000:]}")
    raw = json.loads(r.stdout.strip().splitlines()[-1])
    out = {}
    for fqn, d in raw.items():
        dims = dict(zip(d["mesh"], d["placements"]))
        dp = dims.get("fsdp", dims.get("dp_shard", "R"))
        out[re.sub(r"\.\d+\.", ".*.", fqn)] = {"dp": dp.rstrip("*"), "tp": dims.get("tp", "R").rstrip("*"), "raw": d}
    return out
