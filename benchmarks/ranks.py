"""Running a benchmark's worker on `world` spawned gloo ranks on this machine, and reading back what rank 0 wrote."""
from __future__ import annotations

import json
import os
import socket
import tempfile

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, args, result: str = "res.json"):
    """worker(rank, world, port, args, out_dir) on `world` spawned processes; returns the JSON file `result` that
    the worker wrote into out_dir."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, free_port(), args, tmp), nprocs=world, start_method="spawn")
        with open(os.path.join(tmp, result)) as f:
            return json.load(f)
