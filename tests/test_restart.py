"""Fault and restart under torchrun's elastic agent: the example trainer on 4 gloo ranks (2x2 mesh, every parameter
sharded: fsdp+tp), a DCP checkpoint every 3 steps, and one rank SIGKILLs itself after step 5 on the first attempt
(`--kill-after-step`, which checks TORCHELASTIC_RESTART_COUNT). torchrun (`--max-restarts 1`) stops the other ranks
and starts the job again; `--resume` loads the checkpoint of step 3 and the job runs steps 4..6.

What is asserted, on rank 0's log (autopar.examples.train.read_log / committed):
* two attempts; the first logged steps 1..5 and the kill, the second resumed from step 3 and logged 4..6;
* the committed log (an attempt's steps up to the checkpoint the next attempt resumed from, and all of the last
  attempt's) is steps 1..6 once each: none lost, none run twice;
* the superseded steps (4, 5 of the first attempt) and their rerun have the same loss to the bit (same plan, same
  state: the checkpoint restored model, optimizer momentum, step counter, data position and random state);
* every committed step's loss equals a single-device run of 6 uninterrupted steps (computed here, in this
  process) to 1e-6 + 1e-4 |ref|;
* the checkpoint directory holds the complete checkpoints of steps 3 and 6 and no partial one; torchrun exits 0.
The whole job has a deadline (a hung rank fails the test; its process group is killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

STEPS, EVERY, KILL = 6, 3, 5
TRAIN = ["--model", "mlp-tiny", "--mesh", "2x2", "--shard", "fsdp+tp", "--steps", str(STEPS), "--momentum", "0.9"]
DEADLINE_S = 300


def torchrun(args: list[str], log_path, timeout: float = DEADLINE_S) -> tuple[int, str, float]:
    """torchrun (this interpreter's) in its own process group; (exit code, output, seconds). Past the deadline
    the whole group (agent and workers) is killed and the test fails with the log's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
            rc = None
    out = open(log_path, errors="replace").read()
    assert rc is not None, f"torchrun did not finish within {timeout} s (killed):\n{out[-6000:]}"
    return rc, out, time.perf_counter() - t0


def single_device_losses(argv) -> list[float]:
    """The uninterrupted run on one device: the trainer's model, optimizer and batches, STEPS steps."""
    from autopar.examples import train
    from autopar.models import build_model

    args = train.parse(argv)
    model = build_model(args.model, device="cpu", seed=args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    return [float(train.sgd_step(model, opt, train.batch(args, s)).detach()) for s in range(1, args.steps + 1)]


def test_kill_one_rank_and_resume_under_torchrun(tmp_path):
    from autopar.examples.train import committed, read_log

    ckpt = tmp_path / "ckpt"
    argv = TRAIN + [
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(EVERY),
        "--resume",
        "--kill-after-step",
        str(KILL),
    ]
    rc, out, secs = torchrun(
        ["--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "-m", "autopar.examples.train", *argv],
        tmp_path / "torchrun.log",
    )
    print(f"torchrun, 2 attempts: {secs:.1f} s")
    assert rc == 0, out[-6000:]
    attempts = read_log(out)
    assert [a["attempt"] for a in attempts] == [0, 1], (attempts, out[-4000:])
    first, second = attempts
    assert first["start"] == 1 and first["killed"] == KILL, first
    assert [s for s, _ in first["steps"]] == list(range(1, KILL + 1)), first
    last_ckpt = KILL // EVERY * EVERY
    assert second["start"] == last_ckpt + 1 and second["killed"] is None, second
    assert [s for s, _ in second["steps"]] == list(range(last_ckpt + 1, STEPS + 1)), second

    log = committed(attempts)
    assert [s for s, _, _ in log] == list(range(1, STEPS + 1)), log  # steps 1..N, once each
    assert [a for s, _, a in log] == [0] * last_ckpt + [1] * (STEPS - last_ckpt), log
    superseded = {s: loss for s, loss in first["steps"] if s > last_ckpt}
    rerun = dict(second["steps"])
    assert superseded and all(rerun[s] == loss for s, loss in superseded.items()), (superseded, rerun)

    ref = single_device_losses(argv)
    for s, loss, _ in log:
        assert abs(loss - ref[s - 1]) <= 1e-6 + 1e-4 * abs(ref[s - 1]), (s, loss, ref[s - 1])
    assert ref[STEPS - 1] < ref[0]  # it trains
    assert sorted(os.listdir(ckpt)) == [f"step_{s:06d}" for s in (last_ckpt, STEPS)], os.listdir(ckpt)
    assert f"collectives of step {last_ckpt + 1}:" in out and "COLLECTIVES DIFFER" not in out
