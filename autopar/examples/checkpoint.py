"""Checkpoints of a training job with torch.distributed.checkpoint (DCP), as the example trainer writes them.

    save(dir, step, pm, opt, extra)   # every rank; writes dir/step_000004.tmp, then renames it dir/step_000004
    step = resume(dir, pm, opt, extra)   # every rank; the last complete checkpoint's step (0: none), loaded

One checkpoint holds the model's state dict and the optimizer's (`get_state_dict`: FQN keys, DTensors where the
model is sharded, so DCP writes each shard once and can load it into another plan, mesh or world size), the step
counter and `extra` (tensors every rank holds alike: random generator states). A checkpoint is complete when its
directory has lost the `.tmp` suffix: rank 0 renames it after `dcp.save` returned (DCP writes its `.metadata` last,
after every rank's data), so a job killed while saving leaves only a `.tmp` directory, which is never loaded.
Rank 0 picks the checkpoint to resume from and tells the others, so every rank loads the same one.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist

_NAME = re.compile(r"^step_(\d+)$")


def path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:06d}")


def _state(model, opt, step: int, extra: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "trainer": {"step": torch.tensor(step, dtype=torch.int64), **extra}}


def save(directory: str, step: int, model, opt, extra: dict | None = None) -> str:
    """A checkpoint of the state after `step` (collective: every rank calls it). Returns its directory."""
    import torch.distributed.checkpoint as dcp

    final, tmp = path(directory, step), path(directory, step) + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step cut short by a kill
    dist.barrier()
    dcp.save(_state(model, opt, step, extra or {}), checkpoint_id=tmp)
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()  # nobody reads the directory while rank 0 renames
    return final


def latest(directory: str) -> int:
    """The step of the last complete checkpoint in `directory` as rank 0 sees it, on every rank (0: none)."""
    step = 0
    if dist.get_rank() == 0 and os.path.isdir(directory):
        done = [
            int(m.group(1))
            for n in os.listdir(directory)
            if (m := _NAME.match(n)) and os.path.exists(os.path.join(directory, n, ".metadata"))
        ]
        step = max(done, default=0)
    t = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


def resume(directory: str, model, opt, extra: dict | None = None) -> int:
    """Load the last complete checkpoint into `model`, `opt` (in their own layout, whatever layout wrote it) and
    `extra` (its tensors are overwritten in place); returns its step, or 0 (nothing loaded) when there is none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    step = latest(directory)
    if step == 0:
        return 0
    sd = _state(model, opt, 0, {k: v.clone() for k, v in (extra or {}).items()})
    dcp.load(sd, checkpoint_id=path(directory, step))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for k, v in (extra or {}).items():
        v.copy_(sd["trainer"][k])
    got = int(sd["trainer"]["step"])
    if got != step:
        raise RuntimeError(f"checkpoint {path(directory, step)} holds step {got}, its name says {step}")
    return step
