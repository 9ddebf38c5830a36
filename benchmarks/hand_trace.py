"""The collectives of the hand plans whose schedule follows DTensor's redistributes inside torch's TP styles (tp,
fsdp2_tp, torchtitan), traced on the fake process group: one process stands for rank 0 of the 4-rank world, builds
the plan source exactly as the measured run does (measure.build: apply_hand / torchtitan's parallelize_llama),
runs one training step to warm up and counts the next one's collectives (CollectiveCounter), as the measured run
counts them. Which collectives torch issues, and their sizes, follow from shapes and placements alone, so the trace
is what a real group issues; the values it computes are garbage (the fake group moves no data) and are not looked
at. ddp and fsdp2 are predicted by rules instead (hand_plans.hand_collectives).

    python benchmarks/hand_trace.py '[["llama3-debug", "2x2", "tp"], ...]'
    # prints {"model mesh source": {kind: {"count", "bytes"}}}

report.py runs it once per re-render for the measured rows of these sources.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRACED = ("tp", "fsdp2_tp", "torchtitan")


def trace(model_key: str, mesh_str: str, source: str) -> dict:
    """{kind: {"count", "bytes"}} of one step of `source` on `model_key`, traced as rank 0 of the benchmark's world."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from bench_config import MEASURED, QUICK_MEASURED, WORLD
    from measure import build, comm_summary
    from autopar import models as M
    from autopar.backends.counter import CollectiveCounter

    cfg = {**MEASURED, **QUICK_MEASURED}[model_key]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        world_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        shape = tuple(int(s) for s in mesh_str.split("x"))
        mesh = world_mesh if len(shape) == 1 else init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        x = M.example_inputs(cfg["name"], batch=cfg["batch"], seq=cfg["seq"], device="cpu", seed=0, **cfg["overrides"])
        run = build(source, cfg, mesh, world_mesh, x)
        with torch.no_grad():
            for p in run.module.parameters():  # the fake group leaves gathered shards uninitialized: keep the
                p.zero_()  # garbage finite (a NaN in a router's topk is still a NaN)
        run.step()
        with CollectiveCounter(mesh) as cc:
            run.step()  # as measured: forward, backward, optimizer step (a partial gradient of a
        return comm_summary(cc.records)  # SequenceParallel norm is all-reduced there), zero_grad
    finally:
        dist.destroy_process_group()


def traced(configs) -> dict:
    """Trace [(model, mesh, source), ...] in a child process (the fake group must not meet a real one); {"model mesh
    source": {kind: {count, bytes}} or {"error": message}}."""
    import subprocess

    if not configs:
        return {}
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "hand_trace.py"), json.dumps([list(c) for c in configs])],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {" ".join(c): {"error": f"hand_trace.py failed: {msg}"} for c in configs}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    sys.path.insert(0, HERE)
    out = {}
    for model_key, mesh_str, source in json.loads((argv or sys.argv[1:])[0]):
        try:
            out[f"{model_key} {mesh_str} {source}"] = trace(model_key, mesh_str, source)
        except Exception as e:  # noqa: BLE001  (recorded for that row; the others go on)
            out[f"{model_key} {mesh_str} {source}"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
