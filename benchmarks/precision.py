"""How far apart float32 runs of one zoo model are on their own, next to the suite's 2x2 comparison: is a failed
compare a bug of the program or the model's float32 noise?

Runs the zoo model's training check (the first step's loss and gradients, then the parameters and floating buffers
after 3 AdamW steps, as tests/third_party/zoo_check.py does) as:
  one device, fp32, 1 thread          the suite's reference (its ranks run with OMP_NUM_THREADS=1)
  one device, fp32, 2 threads         the same model, another summation order inside the CPU kernels
  one device, fp32, channels_last     another memory layout, so other convolution kernels
  one device, fp64                    the model in float64: "the exact answer" to float32's precision
  program, fp32, 2x2                  autopar.parallelize with the suite's 2x2 plan, simulated in one process
  program, fp64, 2x2                  the same plan and program, the model in float64
and counts, per pair, the tensors outside the suite's tolerance (|diff| <= 1e-6 + 1e-4 max|ref|). A bug of the
program shows up in fp64 too; float32 noise does not (fp64's noise is ~1e9 times smaller). The 2x2 mesh is
simulated (LocalTensorMode, tests/_simulated.py); its fp32 losses equal the gloo launch's bit for bit.

    python benchmarks/precision.py                     # mobilenet_v2 -> benchmarks/results/precision.md
    python benchmarks/precision.py --model resnet --out /tmp/p.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "third_party"))

from zoo_check import ADAM_EPS, ATOL, LR, RTOL, SEED, STEPS, build, fsdp_pins, loss_of  # noqa: E402


def _cast(v, dtype, cl):
    if torch.is_tensor(v) and v.is_floating_point():
        v = v.to(dtype)
        return v.to(memory_format=torch.channels_last) if cl and v.ndim == 4 else v
    return v


def _steps(model, call, full=lambda t: t, seed=lambda: None) -> dict:
    """STEPS AdamW steps as the suite takes them: losses, the first step's grads, the final params and buffers."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    torch.manual_seed(SEED)
    seed()
    out = {"losses": []}
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(call())
        loss.backward()
        out["losses"].append(full(loss).item())
        if s == 0:
            out["grads"] = {n: full(p.grad).double() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    out["params"] = {n: full(p).detach().double() for n, p in model.named_parameters()}
    out["buffers"] = {n: full(b).double() for n, b in model.named_buffers() if b.is_floating_point()}
    return out


def one_device(name, dtype=torch.float32, threads=1, cl=False) -> dict:
    torch.set_num_threads(threads)
    model, args, kwargs, _ = build(name)
    model = model.to(dtype)
    if cl:
        model = model.to(memory_format=torch.channels_last)
    args = tuple(_cast(a, dtype, cl) for a in args)
    kwargs = {k: _cast(v, dtype, cl) for k, v in kwargs.items()}
    return _steps(model, lambda: model(*args, **kwargs))


def program(name, dtype=torch.float32) -> dict:
    """The suite's 2x2 plan (SHAPES, parameters pinned FSDP on dp) and program, all 4 ranks in this process."""
    import autopar
    from _clusters import SHAPES
    from _simulated import simulated
    from torch.distributed.tensor import DTensor

    model, args, kwargs, _ = build(name)
    model = model.to(dtype)
    args = tuple(_cast(a, dtype, False) for a in args)
    kwargs = {k: _cast(v, dtype, False) for k, v in kwargs.items()}
    kw = {"example_kwargs": kwargs} if kwargs else {}
    with simulated((2, 2)) as mesh:
        planned = autopar.plan(
            model,
            mesh,
            example_inputs=args,
            cluster=SHAPES,
            overlap=False,
            return_state=True,
            force=fsdp_pins(model, (2, 2)),
            time_limit=60,
            **kw,
        )
        pm = autopar.parallelize(model, mesh, args, planned=planned, **kw)
        return _steps(
            pm,
            lambda: pm(*args, **kwargs),
            lambda t: t.full_tensor() if isinstance(t, DTensor) else t,
            lambda: pm.program.manual_seed(SEED),
        )


def compare(run: dict, ref: dict) -> dict:
    """Per kind of tensor: (tensors outside the suite's tolerance, of how many, max |diff|)."""
    out = {"loss": max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))}
    for kind in ("grads", "params", "buffers"):
        fails, worst = 0, 0.0
        for n, r in ref[kind].items():
            err = (run[kind][n] - r).abs().max().item() if r.numel() else 0.0
            fails += err > ATOL + RTOL * (r.abs().max().item() if r.numel() else 0.0)
            worst = max(worst, err)
        out[kind] = (fails, len(ref[kind]), worst)
    return out


def _row(label, vs, c) -> str:
    cells = [f"{c[k][0]}/{c[k][1]} ({c[k][2]:.2g})" for k in ("grads", "params", "buffers")]
    return f"| {label} | {vs} | {c['loss']:.2g} | " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "precision.md"))
    a = ap.parse_args()
    t = time.perf_counter()
    runs = {
        "one device, fp32, 1 thread": one_device(a.model),
        "one device, fp32, 2 threads": one_device(a.model, threads=2),
        "one device, fp32, channels_last": one_device(a.model, cl=True),
        "one device, fp64": one_device(a.model, torch.float64),
    }
    torch.set_num_threads(1)
    runs["program, fp32, 2x2"] = program(a.model)
    runs["program, fp64, 2x2"] = program(a.model, torch.float64)
    ref32, ref64 = runs["one device, fp32, 1 thread"], runs["one device, fp64"]
    rows = [
        _row(k, "one device fp32, 1 thread", compare(r, ref32))
        for k, r in runs.items()
        if r is not ref32 and "fp64" not in k
    ]
    rows += [_row(k, "one device fp64", compare(r, ref64)) for k, r in runs.items() if r is not ref64]
    zero = sorted(n for n, g in ref64["grads"].items() if g.abs().max().item() < 1e-10)
    lines = [
        f"# Float32 noise of `{a.model}` next to the suite's 2x2 check",
        "",
        "Written by `python benchmarks/precision.py --model " + a.model + "` "
        f"({time.perf_counter() - t:.0f} s). Each row: one run against a reference, the tensors outside the "
        f"suite's tolerance (|diff| <= {ATOL:g} + {RTOL:g} max|ref| per tensor) of how many, and the max "
        f"|diff| in brackets; gradients of the first step, parameters and floating buffers after {STEPS} AdamW "
        "steps (lr 1e-3, eps 1e-4, as the suite). The 2x2 program runs simulated in one process "
        "(LocalTensorMode): its fp32 losses equal the gloo launch's bit for bit.",
        "",
        "| run | against | max loss diff | grads outside tol | params outside tol | buffers outside tol |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Losses of the 3 steps:",
        "",
        *[f"- {k}: " + ", ".join(f"{x:.7f}" for x in r["losses"]) for k, r in runs.items()],
        "",
        f"Gradients that are zero in fp64 (max |grad| < 1e-10; {len(zero)}): " + ", ".join(f"`{n}`" for n in zero),
        "",
    ]
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
