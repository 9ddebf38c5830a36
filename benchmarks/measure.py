"""Measured runs: one model, every plan source, on 4 gloo ranks (CPU), in ONE launch so every source shares the
machine's noise. Started by benchmarks/harness.py (one process per rank, OMP_NUM_THREADS=1); not a user entry point.

Per mesh: every source is built on every rank (a failure is recorded for that source, the others go on), then
  * `warmup` rounds, one step of every source per round;
  * one step per source under a CollectiveCounter (TorchDispatchMode over the c10d and _c10d_functional
    collectives: kind, bytes in the plan's convention, group size) -> comm bytes per step (rank 0's view; SPMD);
  * one step per source under torch.profiler (profile_memory) -> peak memory per rank = the model state held at
    the step's start (unique storages of local params, grads (None: zero_grad sets them to None), optimizer
    state, buffers, and the gradient buckets an engine keeps between steps: DDP's reducer, whose buckets hold the
    gradients (gradient_as_bucket_view), autopar-torch's gradient hook and autopar's executor's bucket buffers)
    + the peak of allocations minus frees
    during the step; the max over ranks;
  * `steps` timed rounds, interleaved (source A, B, C, A, B, C, ...): each step is timed on every rank between
    a barrier and its own end; the step time is the max over ranks; the row reports the median over rounds. The
    CPU time of each timed step (the process's, gloo's threads included, and the main thread's) is summed over
    the ranks (`cpu_s`, `main_thread_cpu_s`, medians): with more ranks than cores the step time follows it.
Every step: forward (loss), backward, AdamW step (fused), zero_grad() (set_to_none, torch's default). Hand plans
and torchtitan normalize the loss as torchtitan 0.2.2's train_step does (hand_plans.py, HandRun.forward_backward):
every source computes one device's gradient of the mean loss.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _mesh_shape(s: str) -> tuple:
    return tuple(int(v) for v in s.split("x"))


class Run:
    """One plan source built on this rank: `step()` runs one training step; `state_tensors()` what it keeps."""

    def __init__(self, source, module, opt, step_fn, extra=None):
        self.source, self.module, self.opt, self.step_fn = source, module, opt, step_fn
        self.extra = extra or {}

    def step(self):
        self.step_fn()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        from torch.distributed.tensor import DTensor

        seen, total = set(), 0

        def add(t):
            nonlocal total
            if t is None or not isinstance(t, torch.Tensor):
                return
            if isinstance(t, DTensor):
                t = t.to_local()
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen and st.nbytes():
                seen.add(key)
                total += st.nbytes()

        for p in self.module.parameters():
            add(p)
            add(p.grad)
        for b in self.module.buffers():
            add(b)
        for s in self.opt.state.values():
            for v in s.values():
                add(v)
        keep = self.extra.get("persistent_bytes", 0)
        return total + (keep() if callable(keep) else keep)


def _adamw(params):
    """The optimizer of every plan source: AdamW, fused (torchtitan 0.2.2's default `optimizer.implementation`; torch
    has fused AdamW kernels for CPU too, ~4x faster than foreach there, and one DTensor dispatch per step for the
    sources whose parameters are DTensors (FSDP2, TP, autopar) instead of one per foreach op). A plan that leaves
    some parameters plain tensors beside DTensors (TP of a model with unsharded embeddings) takes the per-tensor
    loop: the fused and foreach ops refuse the mix."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    one_kind = len({isinstance(p, DTensor) for p in params}) == 1
    return torch.optim.AdamW(params, lr=1e-4, fused=one_kind, foreach=False)


def build(source, cfg, mesh, world_mesh, x):
    from autopar import models as M
    from hand_plans import apply_hand

    name, ov = cfg["name"], cfg["overrides"]
    if source == "torchtitan":
        from hand_plans import NotApplicable

        if not name.startswith("llama3"):
            raise NotApplicable("torchtitan's parallelize_llama is the hand plan of Llama-3 models only")
        from titan import build_titan, titan_loss
        from hand_plans import global_tokens

        names = tuple(mesh.mesh_dim_names)
        tp = mesh.size(1) if names == ("dp", "tp") else 1
        model, lp = build_titan(dist.get_world_size(), tp, cfg["seq"])
        dp_rank, dp_size = (
            (mesh.get_local_rank("dp"), mesh.size(0)) if tp > 1 else (dist.get_rank(), dist.get_world_size())
        )
        local = tuple(t.chunk(dp_size, 0)[dp_rank].contiguous() for t in x)
        opt = _adamw(model.parameters())
        dp_group = mesh.get_group("dp") if tp > 1 else world_mesh.get_group(0)

        def step():
            n = global_tokens(local[-1], dp_group)  # before the forward, as torchtitan's train_step
            ctx = _loss_parallel() if lp else _null()
            with ctx:
                titan_loss(model, *local, lp, n).backward()

        return Run(source, model, opt, step, {"note": "torchtitan's own Llama-3 model and parallelize_llama"})
    model = M.build_model(name, device="cpu", seed=0, **ov)
    if source == "autopar":
        import autopar

        pm = autopar.parallelize(model, mesh, x, cluster="cpu-gloo")
        opt = pm.attach_optimizer(_adamw(pm.parameters()))  # step counts as DTensors (backends/spmd/module.py)

        def step():
            pm(*x).backward()

        # the gradient buckets' flat buffers live between steps, as DDP's reducer's (backends/spmd/program.py)
        keep = lambda: sum(b.nbytes for b in pm.program.flat_bufs.values())  # noqa: E731
        return Run(source, pm, opt, step, {"plan": pm.plan, "persistent_bytes": keep})
    if source == "autopar-torch":  # backend="auto": the engines, with graph parts where they cannot
        import autopar
        import autopar.backends.torch as engines
        from hand_plans import NotApplicable

        m = autopar.parallelize(model, mesh, x, backend="auto", cluster="cpu-gloo")
        if m is not model:
            raise NotApplicable(
                f"backend='auto' runs the whole model on the graph backend (the autopar row): {m.autopar_fallback}"
            )
        local = engines.local_inputs(m, mesh, *x)
        opt = _adamw(m.parameters())

        def step():
            with engines.train_context(m):
                m(*local).backward()

        low = m._autopar_lowering
        replan = m._autopar_plan.meta.get("engine_replan")
        extra = {
            "note": "autopar's plan lowered to fully_shard / parallelize_module" + (f"; {replan}" if replan else ""),
            "code": low.code(),
            "plan": m._autopar_plan,
        }
        # predicted: what runs, the engines' collectives (+ each graph part's own plan), not the plan's own list
        # (e.g. the plan reduces the loss's (sum, count) over dp then tp; the loss hook once over both)
        from autopar.backends.counter import tally
        from autopar.backends.torch.collectives import engine_collectives

        extra["predicted_collectives"] = tally(engine_collectives(m._autopar_plan, low)[0])
        if low.parts:
            extra["note"] += (
                f"; graph backend for {sorted(low.parts)} (predicted: the engines' collectives + each part's plan)"
            )
        # the gradient hook's flat buckets live between steps (backends/torch/hooks.py reduce_grads_in_buckets)
        extra["persistent_bytes"] = sum(b.nbytes for b in low.grad_buckets)
        return Run(source, m, opt, step, extra)
    run = apply_hand(source, name, model, mesh, world_mesh)
    local = run.local_inputs(x)
    opt = _adamw(run.module.parameters())

    def step():
        run.forward_backward(local)

    return Run(source, run.module, opt, step, {"persistent_bytes": run.persistent_bytes})


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _null():
    import contextlib

    return contextlib.nullcontext()


def _err(e) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg[:600]


def _agree(ok: bool, msg: str):
    """Every rank learns whether every rank succeeded (and the first message of a failing rank)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (ok, msg))
    bad = [(r, m) for r, (o, m) in enumerate(out) if not o]
    return (True, "") if not bad else (False, f"rank {bad[0][0]}: {bad[0][1]}")


def comm_summary(records) -> dict:
    """{kind: {"count", "bytes"}} over the collectives of groups larger than one rank, in the plan's byte convention
    (the tensor over the group), which CollectiveCounter's records already follow (an all_to_all: this rank's input
    times the group size, autopar/collectives.py: S(i)->S(j) moves the full tensor)."""
    out = {}
    for r in records:
        if r.group_size <= 1:
            continue
        k = out.setdefault(r.kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += r.nbytes
    return out


def _peak_during(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    mem = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    cur = peak = 0
    for e in mem:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def measure_mesh(cfg, mesh_str, sources, x, world_mesh, steps, warmup, progress):
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.backends.counter import CollectiveCounter

    shape = _mesh_shape(mesh_str)
    mesh = world_mesh if len(shape) == 1 else init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    rows, runs = {}, {}
    for src in sources:
        progress(f"{mesh_str} {src} build")
        t0 = time.perf_counter()
        from hand_plans import NotApplicable

        try:
            run, ok, msg = build(src, cfg, mesh, world_mesh, x), True, ""
        except NotApplicable as e:
            run, ok, msg = None, False, f"n/a: {e}"
        except Exception as e:  # noqa: BLE001  (recorded in the row, the other sources go on)
            run, ok, msg = None, False, _err(e)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        ok, msg = _agree(ok, msg)
        na = msg.split(": ", 1)[-1].startswith("n/a: ")
        rows[src] = {
            "mesh": mesh_str,
            "source": src,
            "status": "ok" if ok else "n/a" if na else "error",
            "note": msg.split("n/a: ", 1)[-1] if na else msg,
            "build_s": time.perf_counter() - t0,
            "times": [],
            "cpu": [],
        }
        if ok:
            runs[src] = run
            rows[src].update({k: v for k, v in run.extra.items() if k in ("note", "code")})
            if "plan" in run.extra:
                p = run.extra["plan"]
                kinds = run.extra.get("predicted_collectives") or p.predicted["collectives"]
                rows[src].update(
                    {
                        "plan_hash": p.hash(),
                        "params": p.params,
                        "predicted_comm_bytes": sum(v["bytes"] for v in kinds.values()),
                        "predicted_collectives": kinds,
                        "predicted_step_s": p.predicted["step_s"],
                        "predicted_peak_mem_bytes": p.predicted["peak_mem_bytes"],
                    }
                )

    def one(src, phase, fn):
        progress(f"{mesh_str} {src} {phase}")
        try:
            fn()
            ok, msg = True, ""
        except Exception as e:  # noqa: BLE001
            ok, msg = False, _err(e)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        ok, msg = _agree(ok, msg)
        if not ok:
            rows[src].update(status="error", note=f"{phase} step failed: {msg}")
            runs.pop(src, None)
        return ok

    for r in range(warmup):
        for src in list(runs):
            one(src, f"warm-up {r}", runs[src].step)
    for src in list(runs):
        cc = CollectiveCounter(world_mesh if mesh is world_mesh else mesh)

        def counted():
            with cc:
                runs[src].step()

        if one(src, "comm count", counted):
            summ = comm_summary(cc.records)
            rows[src]["comm"] = summ
            rows[src]["comm_bytes"] = sum(v["bytes"] for v in summ.values())
    for src in list(runs):
        box = {}

        def mem_step():
            box["state"] = runs[src].state_bytes()
            box["peak"] = _peak_during(runs[src].step)

        if one(src, "memory", mem_step):
            t = torch.tensor([float(box["state"] + box["peak"]), float(box["state"])], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows[src]["peak_mem_bytes"], rows[src]["state_mem_bytes"] = int(t[0]), int(t[1])
    for r in range(steps):
        for src in list(runs):
            dist.barrier()
            box = {}

            def timed():
                c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                runs[src].step()
                box["dt"] = time.perf_counter() - t0
                box["cpu"] = [time.process_time() - c0, time.thread_time() - m0]

            if one(src, f"timed {r}", timed):
                t = torch.tensor([box["dt"]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows[src]["times"].append(float(t[0]))
                c = torch.tensor(box["cpu"], dtype=torch.float64)
                dist.all_reduce(c)  # CPU seconds of the step, summed over the ranks
                rows[src]["cpu"].append(c.tolist())
    for src, row in rows.items():
        if row["times"] and row["status"] == "ok":
            row["measured_step_s"] = statistics.median(row["times"])
            row["cpu_s"] = statistics.median(c[0] for c in row["cpu"])
            row["main_thread_cpu_s"] = statistics.median(c[1] for c in row["cpu"])
    runs.clear()
    gc.collect()
    return list(rows.values())


def worker(args):
    from bench_config import MEASURED, QUICK_MEASURED
    from autopar import models as M

    cfg = {**MEASURED, **QUICK_MEASURED}[args.model]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    x = M.example_inputs(cfg["name"], batch=cfg["batch"], seq=cfg["seq"], device="cpu", seed=0, **cfg["overrides"])
    out = {"model": args.model, "world": world, "rows": [], "progress": ""}

    def write():
        if rank == 0:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1, default=str)
            os.replace(tmp, args.out)

    def progress(p):
        out["progress"] = p
        write()

    excluded = {tuple(e.split(":", 1)) for e in args.exclude}
    for mesh_str in args.meshes:
        srcs = [s for s in args.sources if (mesh_str, s) not in excluded]
        out["rows"] += measure_mesh(cfg, mesh_str, srcs, x, world_mesh, args.steps, args.warmup, progress)
        write()
    out["progress"] = "done"
    write()
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--meshes", nargs="+", required=True)
    ap.add_argument("--sources", nargs="+", required=True)
    ap.add_argument("--exclude", nargs="*", default=[], help="mesh:source pairs to skip (after a crash)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0, help="gloo collective timeout, seconds")
    ap.add_argument("--out", required=True)
    worker(ap.parse_args())


if __name__ == "__main__":
    main()
