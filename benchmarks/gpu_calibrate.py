"""Calibrate autopar's cost model on the real device (one GPU), then check it on the debug model.

    python benchmarks/gpu_calibrate.py                    # on a GPU machine (torch >= 2.11 + CUDA), ~2 min
    python benchmarks/gpu_calibrate.py --device cpu --quick   # the same code path on this CPU (smoke test)

Measures, with the device's own timers (CUDA events; perf_counter + synchronize elsewhere):
  * matmul throughput per dtype (bf16, fp16, fp32 with and without TF32): the best FLOP/s over square and
    transformer-shaped (tokens x dim x ffn) matmuls;
  * memory bandwidth: a large device-to-device copy (bytes read + written per second);
  * the attention kernel: F.scaled_dot_product_attention forward + backward (causal, bf16 on GPU), achieved FLOP/s by
    torch's own FLOP formula (the one the cost model counts with), and its ratio to the matmul rate.
Writes benchmarks/results/bench_gpu_cluster.json: a ClusterSpec JSON that `autopar.plan(..., cluster=PATH)` /
`autopar.cost.get_cluster(PATH)` loads. The device's peak_flops per dtype are the measured rates with matmul_eff 1.0,
mem_bw the measured copy bandwidth with mem_eff 1.0 (the cost model multiplies the two); the links keep the preset's
values (one GPU cannot measure NVLink / InfiniBand) and say so; the raw measurements are under "calibration".
Then runs torchtitan's Llama-3 debug model shape (autopar's llama3-debug) for one training step on world 1 and writes
benchmarks/results/bench_gpu.md: predicted compute time (autopar.plan on a 1-rank mesh with the calibrated spec and
with the preset) vs the measured forward+backward time (median of several steps after warm-up).
If autopar's planner cannot be imported on the device machine (missing scipy/highspy/networkx), the measurement
JSON is still written; rerun with `--compare benchmarks/results/bench_gpu_cluster.json` where autopar imports.
Keeps to torch APIs present in 2.11.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Timer:
    """Seconds of `fn()` on `device`: CUDA events on GPUs, perf_counter with synchronize elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                self.sync()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def matmul_rates(dev, timer, quick) -> dict:
    sizes = (
        [(512, 512, 512)]
        if quick
        else [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096), (16384, 4096, 4096)]
    )
    if dev.type == "cpu" and not quick:
        sizes = [(1024, 1024, 1024), (2048, 2048, 2048)]
    out = {}
    variants = [("bf16", False), ("fp16", False), ("fp32", False)] + ([("tf32", True)] if dev.type == "cuda" else [])
    for key, tf32 in variants:
        dt = torch.float32 if key in ("fp32", "tf32") else DTYPES[key]
        prev = torch.backends.cuda.matmul.allow_tf32 if dev.type == "cuda" else None
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tf32
        best, per = 0.0, []
        for m, k, n in sizes:
            try:
                a = torch.randn(m, k, device=dev, dtype=dt)
                b = torch.randn(k, n, device=dev, dtype=dt)
            except (RuntimeError, TypeError):
                continue
            reps = 3 if quick else 10
            t = timer(lambda: torch.mm(a, b), reps)
            rate = 2 * m * k * n / t
            per.append({"m": m, "k": k, "n": n, "s": t, "flops_per_s": rate})
            best = max(best, rate)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = prev
        out[key] = {"best_flops_per_s": best, "runs": per}
    return out


def copy_bandwidth(dev, timer, quick) -> dict:
    n = (64 if quick else (2048 if dev.type == "cuda" else 256)) * 2**20 // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), 5 if quick else 20)
    return {"bytes_moved": 2 * src.numel() * 4, "s": t, "bytes_per_s": 2 * src.numel() * 4 / t}


def attention_rate(dev, timer, quick) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    b, h, s, d = (1, 4, 256, 64) if quick else ((8, 16, 2048, 128) if dev.type == "cuda" else (2, 8, 512, 64))
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    go = torch.randn(b, h, s, d, device=dev, dtype=dt)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(go)
        q.grad = k.grad = v.grad = None

    with FlopCounterMode(display=False) as fc:
        fwd_bwd()
    flops = fc.get_total_flops()
    t = timer(fwd_bwd, 3 if quick else 10)
    return {
        "shape_bhsd": [b, h, s, d],
        "dtype": str(dt).replace("torch.", ""),
        "flops_torch_formula": flops,
        "s": t,
        "flops_per_s": flops / t if t > 0 else 0.0,
    }


def launch_overhead(dev, timer, quick) -> dict:
    """Seconds per eager op when ops are too small to matter: 200 back-to-back adds on a 1 KiB tensor, timed as one
    batch. On a GPU the kernels overlap the host's launches, so this is the host's dispatch + launch cost per op,
    the floor of a step made of many small kernels."""
    x = torch.ones(256, device=dev)
    n = 50 if quick else 200

    def run():
        y = x
        for _ in range(n):
            y = y + 1.0
        return y

    t = timer(run, 3 if quick else 10)
    return {"ops": n, "s": t, "s_per_op": t / n}


def calibrate(dev, quick, base="h200") -> dict:
    sys.path.insert(0, ROOT)
    try:
        import autopar.cost  # noqa: F401  (registers the CPU flash-attention FLOP formulas with torch's counter)
    except ImportError:
        pass
    timer = Timer(dev)
    mm = matmul_rates(dev, timer, quick)
    bw = copy_bandwidth(dev, timer, quick)
    att = attention_rate(dev, timer, quick)
    launch = launch_overhead(dev, timer, quick)
    att["ratio_to_matmul"] = att["flops_per_s"] / max(
        1.0, mm["bf16" if dev.type == "cuda" else "fp32"]["best_flops_per_s"]
    )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 16e9
    base = base if dev.type == "cuda" else "cpu-gloo"
    preset = _preset(base)
    peak = {k: v["best_flops_per_s"] for k, v in mm.items() if v["best_flops_per_s"] > 0}
    spec = {
        "name": f"calibrated-{name.replace(' ', '_')}",
        "device": {
            "name": name,
            "peak_flops": peak,
            "mem_bw": bw["bytes_per_s"],
            "mem_bytes": float(mem),
            "matmul_eff": 1.0,
            "mem_eff": 1.0,
            "op_overhead": launch["s_per_op"],
        },
        "gpus_per_node": preset["gpus_per_node"] if preset else 8,
        "intra": preset["intra"] if preset else {"name": "unmeasured", "alpha": 3e-6, "bw": 450e9},
        "inter": preset["inter"] if preset else {"name": "unmeasured", "alpha": 15e-6, "bw": 40e9},
        "calibration": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": name,
            "matmul": mm,
            "copy": bw,
            "attention": att,
            "launch": launch,
            "quick": quick,
            "links": f"not measured (one device): copied from the '{base}' preset",
            "preset_device": preset["device"] if preset else None,
            "base": base,
            "compute_key": "bf16" if dev.type == "cuda" else "fp32",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    return spec


def _preset(name):
    try:
        from autopar.cost import get_cluster

        return get_cluster(name).to_json()
    except Exception:  # noqa: BLE001  (autopar's deps may be missing on the device machine)
        return None


def run_debug_step(dev, quick) -> dict:
    """One training step of autopar's llama3-debug (torchtitan's debugmodel shape) on world 1: median forward+backward
    seconds over several steps after warm-up, and the optimizer step separately."""
    sys.path.insert(0, ROOT)
    from autopar.models import build_model, example_inputs

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batch, seq = (1, 128) if quick else ((8, 2048) if dev.type == "cuda" else (2, 256))
    model = build_model("llama3-debug", device=dev, dtype=dt)
    x = example_inputs("llama3-debug", batch=batch, seq=seq, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timer = Timer(dev)

    def fwd_bwd():
        model(*x).backward()

    t_fb = timer(fwd_bwd, 3 if quick else 10, warmup=2)
    t_opt = timer(opt.step, 3 if quick else 10, warmup=1)
    return {
        "model": "llama3-debug",
        "batch": batch,
        "seq": seq,
        "dtype": str(dt).replace("torch.", ""),
        "fwd_bwd_s": t_fb,
        "optimizer_s": t_opt,
    }


def executor_step(dev, quick) -> dict:
    """autopar's graph executor next to eager PyTorch on world 1 (NCCL on a GPU, gloo elsewhere): the same
    llama3-debug, weights and batch; median forward+backward seconds each (timed alternately), the loss difference,
    and the collectives of one step (none are expected on one rank)."""
    import copy
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, ROOT)
    import autopar
    from autopar.backends.counter import CollectiveCounter
    from autopar.models import build_model, example_inputs

    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("dp",))
        batch, seq = (1, 128) if quick else ((8, 2048) if dev.type == "cuda" else (2, 256))
        model = build_model("llama3-debug", device="cpu", seed=0)
        x = tuple(t.to(dev) for t in example_inputs("llama3-debug", batch=batch, seq=seq))
        t0 = time.perf_counter()
        pm = autopar.parallelize(model, mesh, x)
        plan_s = time.perf_counter() - t0
        ref = copy.deepcopy(model).to(dev)
        timer = Timer(dev)
        with CollectiveCounter(mesh) as counter:
            lp = pm(*x)
            lp.backward()
        lr = ref(*x)
        lr.backward()
        reps = 3 if quick else 10
        t_pm, t_ref = [], []
        for _ in range(reps):  # alternate so both see the same device state
            t_pm.append(timer(lambda: pm(*x).backward(), 1, warmup=1))
            t_ref.append(timer(lambda: ref(*x).backward(), 1, warmup=1))
        return {
            "model": "llama3-debug",
            "batch": batch,
            "seq": seq,
            "dtype": "float32",
            "backend": dist.get_backend(),
            "plan_s": plan_s,
            "executor_fwd_bwd_s": statistics.median(t_pm),
            "eager_fwd_bwd_s": statistics.median(t_ref),
            "loss_diff": abs(lp.item() - lr.item()),
            "collectives": len(counter.collectives()),
            "predicted_collectives": len(pm.plan.collectives()),
        }
    finally:
        dist.destroy_process_group()


def predict(step: dict, cluster) -> dict:
    import autopar
    from autopar.models import build_model, example_inputs

    dt = getattr(torch, step["dtype"])
    m = build_model("llama3-debug", device="meta", dtype=dt)
    x = example_inputs("llama3-debug", batch=step["batch"], seq=step["seq"], device="meta")
    # one rank: every placement is Replicate, so ops without a sharding rule are fine as they are
    p = autopar.plan(m, autopar.MeshSpec((1,), ("dp",)), x, cluster=cluster, allow_replicate=True)
    return {
        "compute_s": p.predicted["compute_s"],
        "step_s": p.predicted["step_s"],
        "recompute_s": p.predicted.get("recompute_s", 0.0),
    }


def _rate(v: float) -> str:
    return f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.2f} GFLOP/s"


def compare(out_json: str, md_path: str, base: str) -> list[str]:
    d = json.load(open(out_json))
    base = d["calibration"].get("base", base)
    step = d["calibration"]["debug_step"]
    lines = [
        f"# Device calibration: {d['calibration']['device']} (torch {d['calibration']['torch']})",
        "",
        f"command: `{d['calibration'].get('command', '')}`  commit: `{d['calibration'].get('commit', '')}`",
        "",
    ]
    c = d["calibration"]
    lines += ["| measurement | value |", "|---|---|"]
    for k, v in c["matmul"].items():
        lines.append(f"| matmul {k} best | {_rate(v['best_flops_per_s'])} |")
    lines.append(f"| copy bandwidth | {c['copy']['bytes_per_s'] / 1e9:.0f} GB/s |")
    a = c["attention"]
    lines.append(
        f"| SDPA fwd+bwd {a['dtype']} {a['shape_bhsd']} | {_rate(a['flops_per_s'])} "
        f"(torch's formula, no causal discount) = {a['ratio_to_matmul']:.2f}x matmul |"
    )
    if c.get("launch"):
        lines.append(f"| eager op, back to back (dispatch + launch) | {c['launch']['s_per_op'] * 1e6:.1f} us |")
    if c.get("preset_device"):
        pd = c["preset_device"]
        key = c.get("compute_key", "bf16")
        lines.append(
            f"| preset {base} achievable {key} (peak x matmul_eff) | "
            f"{_rate(pd['peak_flops'].get(key, 0) * pd['matmul_eff'])} |"
        )
        lines.append(
            f"| preset {base} achievable bandwidth (mem_bw x mem_eff) | {pd['mem_bw'] * pd['mem_eff'] / 1e9:.0f} GB/s |"
        )
    lines += [
        "",
        f"## {step['model']} one step on world 1 (batch {step['batch']} x seq {step['seq']}, {step['dtype']})",
        "",
        "| | seconds | predicted / measured |",
        "|---|---|---|",
        f"| measured forward+backward (median) | {step['fwd_bwd_s']:.4f} | |",
        f"| measured AdamW step | {step['optimizer_s']:.4f} | |",
    ]
    from dataclasses import replace

    from autopar.cost import get_cluster

    cal = get_cluster(out_json)
    flat = replace(cal, device=replace(cal.device, op_overhead=0.0))
    for label, cl in (
        (f"calibrated spec ({cal.device.op_overhead * 1e6:.1f} us per op)", cal),
        ("calibrated spec, no per-op cost (roofline only)", flat),
        (f"preset '{base}'", base),
    ):
        try:
            p = predict(step, cl)
            lines.append(
                f"| predicted compute, {label} | {p['compute_s']:.4f} | {p['compute_s'] / step['fwd_bwd_s']:.2f}x |"
            )
        except Exception as e:  # noqa: BLE001
            lines.append(f"| predicted compute, {label} | not available: {type(e).__name__}: {e} | |")
    ex = c.get("executor_step")
    if ex and "error" not in ex:
        lines += [
            "",
            f"## autopar's graph executor vs eager, world 1 ({ex['backend']}, {ex['model']} batch "
            f"{ex['batch']} x seq {ex['seq']}, {ex['dtype']})",
            "",
            "| | seconds |",
            "|---|---|",
            f"| eager forward+backward (median) | {ex['eager_fwd_bwd_s']:.4f} |",
            f"| autopar executor forward+backward (median) | {ex['executor_fwd_bwd_s']:.4f} |",
            f"| ratio executor / eager | {ex['executor_fwd_bwd_s'] / ex['eager_fwd_bwd_s']:.2f}x |",
            f"| plan + parallelize | {ex['plan_s']:.2f} |",
            "",
            f"loss difference {ex['loss_diff']:.3e}; collectives in one step: {ex['collectives']} measured, "
            f"{ex['predicted_collectives']} predicted",
        ]
    elif ex:
        lines += ["", f"autopar's graph executor on world 1 failed: {ex['error']}"]
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--base", default="h200", help="preset whose links (and reference figures) are kept")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_gpu_cluster.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "bench_gpu.md"))
    ap.add_argument(
        "--executor", action="store_true", help="also time autopar's graph executor vs eager on world 1 (NCCL on a GPU)"
    )
    ap.add_argument("--compare", metavar="JSON", help="only the prediction vs measurement report from a JSON")
    args = ap.parse_args(argv)
    if args.compare:
        print("\n".join(compare(args.compare, args.md, args.base)))
        return
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_calibrate: --device cuda but torch.cuda.is_available() is False")
    if dev.type == "cpu" and args.device is None:
        print("gpu_calibrate: no GPU found; calibrating the CPU instead (pass --device cpu to silence this)")
    spec = calibrate(dev, args.quick, args.base)
    spec["calibration"]["commit"] = provenance.commit()
    spec["calibration"]["command"] = "python benchmarks/gpu_calibrate.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(spec, f, indent=1)

    save()  # the device measurements are kept whatever happens next
    try:
        spec["calibration"]["debug_step"] = run_debug_step(dev, args.quick)
    except ImportError as e:
        save()
        sys.exit(
            f"wrote {args.out} (device measurements); the debug-model step needs autopar's model zoo, which "
            f"does not import here: {e}"
        )
    save()
    if args.executor:
        try:
            spec["calibration"]["executor_step"] = executor_step(dev, args.quick)
        except Exception as e:  # noqa: BLE001  (reported in the markdown, the calibration is kept)
            import traceback

            traceback.print_exc()
            spec["calibration"]["executor_step"] = {"error": f"{type(e).__name__}: {e}"}
        save()
    print(f"wrote {args.out}")
    try:
        print("\n".join(compare(args.out, args.md, args.base)))
        print(f"wrote {args.md}")
    except ImportError as e:
        print(
            f"autopar's planner is not importable here ({e}); run: python benchmarks/gpu_calibrate.py "
            f"--compare {args.out}"
        )


if __name__ == "__main__":
    main()
