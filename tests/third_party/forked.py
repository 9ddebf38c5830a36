"""A launcher for the zoo's 4-rank run that imports torch, autopar, transformers and torchtitan once and forks the
ranks from that process (a plain module, no tests). tests/_dist.py starts each rank as a fresh interpreter; here
the imports are most of a rank's start (measured: torch + autopar ~10 s, transformers' modeling modules ~9 s,
torchtitan ~11 s, per process, on the 2-core machine), paid once instead of once per rank.

`launch(job_file, fn_name, world, args, run_dir, preload, timeout)` runs this file as a script (the "zygote"):
it imports `job_file`, calls its `preload()` (imports only: no tensor op runs before the fork, so no OpenMP pool
is forked), then forks `world` ranks. Each rank writes its output to rank<r>.log, joins the gloo group (every
collective times out after 60 s), calls `fn(*args)`, writes rank<r>.json, and ends with barrier +
destroy_process_group. The zygote waits at most `timeout` s; a rank still running then logs its Python stack
(faulthandler, SIGUSR1) and is killed. Returns (results by rank, None where a rank wrote none; why, '' if all
ranks exited 0).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

COLLECTIVE_TIMEOUT_S = 60
LOG_TAIL = 4000
FAIL_GRACE_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job_file, fn_name, world, args, run_dir, timeout) -> tuple[list, str]:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "job_file": str(job_file),
        "fn": fn_name,
        "world": world,
        "args": args,
        "port": _free_port(),
        "timeout": timeout,
    }
    (run_dir / "launch.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(run_dir / "zygote.log", "wb") as log:
        try:
            code = subprocess.run(
                [sys.executable, __file__, str(run_dir)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout + 60,
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    results = []
    for r in range(world):
        p = run_dir / f"rank{r}.json"
        results.append(json.loads(p.read_text()) if p.exists() else None)
    if code == 0 and None not in results:
        return results, ""
    tails = "\n".join(
        f"---- {p.name} (last {LOG_TAIL} chars) ----\n{p.read_text(errors='replace')[-LOG_TAIL:]}"
        for p in [run_dir / "zygote.log"] + [run_dir / f"rank{r}.log" for r in range(world)]
        if p.exists()
    )
    zlog = (run_dir / "zygote.log").read_text(errors="replace").strip().splitlines() if code != 0 else []
    last = f": {zlog[-1][:200]}" if zlog else ""
    return (
        results,
        f"the launch failed (zygote exit {code}{last}; ranks without a result: "
        f"{[r for r, x in enumerate(results) if x is None]})\n{tails}",
    )


def _rank(r, spec, module, run_dir):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=r,
        world_size=spec["world"],
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        out = getattr(module, spec["fn"])(*spec["args"])
        (run_dir / f"rank{r}.json").write_text(json.dumps(out, default=str))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _zygote(run_dir):
    run_dir = Path(run_dir)
    spec = json.loads((run_dir / "launch.json").read_text())
    t = time.perf_counter()
    ms = importlib.util.spec_from_file_location(Path(spec["job_file"]).stem, spec["job_file"])
    module = importlib.util.module_from_spec(ms)
    sys.modules[ms.name] = module
    ms.loader.exec_module(module)
    module.preload()
    print(f"zygote: imports {time.perf_counter() - t:.1f} s", flush=True)
    pids = {}
    for r in range(spec["world"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: its own log, then the job; never returns into the zygote
            code = 1
            try:
                fd = os.open(run_dir / f"rank{r}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                faulthandler.register(signal.SIGUSR1, all_threads=True)
                faulthandler.enable(all_threads=True)  # a segfault or abort leaves its Python stacks in the log
                _rank(r, spec, module, run_dir)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = r
    codes, deadline, grace = {}, time.monotonic() + spec["timeout"], None
    while len(codes) < len(pids):
        now = time.monotonic()
        if now > deadline or (grace is not None and now > grace):
            break
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and grace is None:
                grace = now + FAIL_GRACE_S  # the others' errors (or their stacks) are logged, not lost
            continue
        time.sleep(0.2)
    hung = [pid for pid in pids if pids[pid] not in codes]
    for pid in hung:  # where it is stuck, into its log
        os.kill(pid, signal.SIGUSR1)
    if hung:
        time.sleep(1)
    for pid in hung:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(f"zygote: rank exit codes {codes}; killed (still running) {[pids[p] for p in hung]}", flush=True)
    sys.exit(0 if not hung and all(c == 0 for c in codes.values()) else 1)


if __name__ == "__main__":
    _zygote(sys.argv[1])
