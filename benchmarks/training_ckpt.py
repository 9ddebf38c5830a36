"""Kill and resume under torchrun: the example trainer on 4 gloo ranks, one rank SIGKILLed after step k, the job
restarted by torchrun's elastic agent and resumed from its last DCP checkpoint; next to the same job uninterrupted.

    python benchmarks/training_ckpt.py [--model llama-tiny] [--steps 12] [--every 4] [--kill-after 10]

writes benchmarks/results/training_ckpt.md: the commands, the rank-0 log of both attempts (with torchrun's lines
about the failure and the restart), and per step the loss of each attempt, the committed log (an attempt's steps up
to the checkpoint the next attempt resumed from, and the last attempt's steps), the uninterrupted run's loss and
the single-device loss. It checks that the committed log is steps 1..N once each and that every committed loss
equals the uninterrupted run's to the bit (exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEEP = (
    "planned + parallelized",
    "resumed from",
    "no complete checkpoint",
    "step ",
    "checkpoint ",
    "rank ",
    "collectives of step",
    "max |loss diff|",
)
AGENT = ("closing signal", "failed (exitcode", "restart")


def run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as log:
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
            rc = -1
        log.seek(0)
        return rc, log.read().decode(errors="replace"), time.perf_counter() - t0


def log_lines(out: str) -> list[str]:
    """Rank 0's trainer lines and the agent's lines about the failure and the restart, in order."""
    keep = []
    for line in out.splitlines():
        s = line.strip()
        if s.startswith(KEEP) or any(a in s for a in AGENT) and "site-packages/torch/distributed/elastic" in s:
            keep.append(s if "site-packages" not in s else "torchrun: " + s.split("] ", 1)[-1])
    return keep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--kill-after", type=int, default=10)
    ap.add_argument("--out", default=str(HERE / "results" / "training_ckpt.md"))
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    from autopar.examples.train import committed, read_log

    work = Path(tempfile.mkdtemp(prefix="training_ckpt_"))
    train = [
        "-m",
        "autopar.examples.train",
        "--model",
        a.model,
        "--mesh",
        a.mesh,
        "--steps",
        str(a.steps),
        "--momentum",
        "0.9",
    ]
    launcher = ["torchrun", "--standalone", "--nproc-per-node", str(a.nproc)]
    killed = (
        launcher
        + ["--max-restarts", "1"]
        + train
        + [
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--checkpoint-every",
            str(a.every),
            "--resume",
            "--kill-after-step",
            str(a.kill_after),
        ]
    )
    plain = launcher + train
    py = [sys.executable, "-m", "torch.distributed.run"]
    rc_k, out_k, s_k = run(py + killed[1:], a.timeout)
    rc_u, out_u, s_u = run(py + plain[1:], a.timeout)
    attempts, uninterrupted = read_log(out_k), read_log(out_u)
    log = committed(attempts)
    ref = dict(uninterrupted[0]["steps"]) if uninterrupted else {}
    single = _single_device(out_u)
    steps_ok = [s for s, _, _ in log] == list(range(1, a.steps + 1))
    exact = bool(log) and all(ref.get(s) == loss for s, loss, _ in log)
    ok = rc_k == 0 and rc_u == 0 and steps_ok and exact
    worst = max((abs(loss - single[s]) for s, loss, _ in log if s in single), default=float("nan"))

    def cmd(c):
        return " ".join(c).replace(str(work), "$CKPT")

    rows = []
    for s in range(1, a.steps + 1):
        cells = [str(s)]
        for at in attempts:
            cells.append(next((f"{loss:.9f}" for t, loss in at["steps"] if t == s), ""))
        mine = [(loss, at) for t, loss, at in log if t == s]
        cells.append(f"{mine[0][0]:.9f} (attempt {mine[0][1]})" if len(mine) == 1 else f"{len(mine)} entries")
        cells.append(f"{ref[s]:.9f}" if s in ref else "")
        cells.append("yes" if len(mine) == 1 and ref.get(s) == mine[0][0] else "NO")
        cells.append(f"{single[s]:.9f}" if s in single else "")
        rows.append("| " + " | ".join(cells) + " |")
    heads = [f"attempt {at['attempt']}" for at in attempts]
    resumed = [at["start"] - 1 for at in attempts[1:]]
    text = f"""## Checkpoint, kill and resume under torchrun

Made by `python benchmarks/training_ckpt.py --model {a.model} --steps {a.steps} --every {a.every} --kill-after \
{a.kill_after}` ({platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end;
torch {_torch_version()}, gloo). It runs the example trainer twice:

```bash
{cmd(killed)}
{cmd(plain)}
```

The first job writes a DCP checkpoint (model, SGD momentum, step counter, random state) every {a.every} steps; after
step {a.kill_after}, on torchrun's first attempt only, rank {a.nproc - 1} SIGKILLs itself. torchrun stops the other
ranks and starts the job again (`--max-restarts 1`); `--resume` loads the last complete checkpoint (step
{", ".join(map(str, resumed)) or "-"}) and the job runs on to step {a.steps}. The second job is the same training
uninterrupted. Wall time: {s_k:.1f} s (exit code {rc_k}) and {s_u:.1f} s (exit code {rc_u}).

The committed log is each attempt's steps up to the checkpoint the next attempt resumed from, and all of the last
attempt's: the steps after the checkpoint that the killed attempt had logged are superseded (run again).
Committed steps 1..{a.steps} once each: **{"yes" if steps_ok else "NO"}**; every committed loss equal to the
uninterrupted run's to the bit: **{"yes" if exact else "NO"}**; largest |committed - single device| {worst:.2e}
(the trainer's single-device model on rank 0, which replays the steps before a resume).

| step | {" | ".join(heads)} | committed | uninterrupted | equal | single device |
|---|{"---|" * len(heads)}---|---|---|---|
{chr(10).join(rows)}

Rank 0's log of the kill-and-resume job (the plan summaries left out; `torchrun:` lines are the elastic agent's):

```
{chr(10).join(line.replace(str(work), "$CKPT") for line in log_lines(out_k))}
```
"""
    Path(a.out).write_text(text)
    print(text)
    if not ok:
        print(out_k[-4000:], out_u[-2000:], sep="\n----\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def _single_device(out: str) -> dict:
    import re

    got = {}
    for line in out.splitlines():
        m = re.match(r"^step (\d+) loss \S+ single-device (\S+)", line.strip())
        if m:
            got[int(m.group(1))] = float(m.group(2))
    return got


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    raise SystemExit(main())
