"""Running a benchmark's job on `world` spawned gloo ranks on this machine, and reading back what rank 0 returned."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, job, args, out):
    """One rank: one thread, a gloo group, job(args, world); rank 0 writes what the job returned as JSON."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        res = job(args, world)
        if rank == 0:
            with open(os.path.join(out, "res.json"), "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(job, world: int, args):
    """job(args, world) -> a JSON-able result, on `world` spawned processes (job must be a module-level function:
    spawn pickles it); returns rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, free_port(), job, args, tmp), nprocs=world, start_method="spawn")
        with open(os.path.join(tmp, "res.json")) as f:
            return json.load(f)
