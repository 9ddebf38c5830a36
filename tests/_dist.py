"""The multi-process launcher of the distributed tests (tests/test_*_dist.py); a plain module, not a test file.

`launch(fn, world, args, tmp_path)` starts `world` fresh Python processes, one per rank, each running this file as
a script. A rank joins the process group (gloo unless told otherwise; every collective times out after 60 s;
OMP_NUM_THREADS=1 and one torch thread), calls `fn(*args)`, writes the JSON it returns, and ends with barrier +
destroy_process_group. `fn` is a module-level function of a test file (the rank loads that file by its path),
`args` must be JSON-serialisable (tuples arrive as lists). The parent waits at most `timeout` seconds (300) for the
whole launch: a rank that exits with an error (the others then get 10 s to fail or finish on their own), writes no
result, or is still running at the deadline (its Python stack is dumped to its log first) fails the test, naming
the rank and quoting the tail of its log; ranks still running are killed. Each rank's output goes to a log file in
the launch's folder under tmp_path, so no rank can block on a full pipe.

Imported as `from _dist import launch`: pytest's default ("prepend") import mode puts tests/ on sys.path for the
test files (they have no __init__.py), and the rank processes have tests/ as their script directory.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

COLLECTIVE_TIMEOUT_S = 60  # gloo/nccl timeout of each collective: a missing peer raises instead of hanging
LAUNCH_TIMEOUT_S = 300  # the whole launch, all ranks together
LOG_TAIL = 6000  # characters of a failed rank's log quoted in the failure
FAIL_GRACE_S = 10  # after one rank fails, how long the others get to fail or finish on their own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world: int, args: list, tmp_path, backend: str = "gloo", timeout: float = LAUNCH_TIMEOUT_S) -> list:
    """Run `fn(*args)` on `world` ranks of one process group; returns the ranks' results, rank order."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"world{world}_", dir=tmp_path))
    (run_dir / "args.json").write_text(json.dumps(args))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    try:
        for r in range(world):
            log = open(run_dir / f"rank{r}.log", "wb")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        inspect.getfile(fn),
                        fn.__name__,
                        str(r),
                        str(world),
                        str(port),
                        backend,
                        str(run_dir),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline, grace_end = time.monotonic() + timeout, None
        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            if None not in codes or now > deadline or (grace_end is not None and now > grace_end):
                break
            if grace_end is None and any(c not in (None, 0) for c in codes):
                grace_end = now + FAIL_GRACE_S  # the others' errors (or their stacks) are logged, not lost
            time.sleep(0.2)
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        hung = [r for r, c in enumerate(codes) if c is None]
        for r in hung:  # faulthandler (see _rank_main) logs where the rank is stuck
            procs[r].send_signal(signal.SIGUSR1)
        if hung:
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for log in logs:
            log.close()

    def tails(ranks):
        return "\n".join(
            f"---- rank {r} log (last {LOG_TAIL} chars) ----\n"
            f"{(run_dir / f'rank{r}.log').read_text(errors='replace')[-LOG_TAIL:]}"
            for r in ranks
        )

    stuck = f"; ranks {hung} were still running (killed)" if hung else ""
    assert not failed, f"ranks {failed} failed (exit codes {[codes[r] for r in failed]}){stuck}\n{tails(failed + hung)}"
    assert not hung, (
        f"ranks {hung} did not finish within {timeout} s (killed; their Python stacks end the logs)\n{tails(hung)}"
    )
    results = []
    for r in range(world):
        out = run_dir / f"rank{r}.json"
        assert out.exists(), f"rank {r} exited with code 0 and wrote no result\n{tails([r])}"
        results.append(json.loads(out.read_text()))
    return results


def launch_equal(fn, world: int, args: list, tmp_path, timeout: float = LAUNCH_TIMEOUT_S) -> list:
    """`launch`, then what every job built on autopar.testing.train_and_compare checks: the ranks planned alike
    ("hash"), no step differs from one device ("failures", "losses"), the collectives ran as planned
    ("collective_diff"). Returns the ranks' results."""
    results = launch(fn, world, args, tmp_path, timeout=timeout)
    assert len({r["hash"] for r in results}) == 1, "ranks planned differently"
    for r in results:
        assert not r["failures"], r["failures"]
        assert not r["collective_diff"], r["collective_diff"]
        assert all(abs(a - b) <= 1e-6 + 1e-5 * abs(b) for a, b in r["losses"]), r["losses"]
    return results


def _rank_main(file, fn_name, rank, world, port, backend, run_dir):
    """One rank: load the test file, join the group, run the function, write its result, barrier, destroy."""
    rank, world, run_dir = int(rank), int(world), Path(run_dir)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's "where are you stuck?" on a hang
    faulthandler.enable(all_threads=True)  # a segfault or abort leaves its Python stacks in the log
    spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    args = json.loads((run_dir / "args.json").read_text())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = getattr(module, fn_name)(*args)
        (run_dir / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
