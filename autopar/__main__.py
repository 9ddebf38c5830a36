"""Command line: `python -m autopar plan --model llama3-8b --mesh 8x8 --cluster h100`."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "plan", help="plan a named example model on a (simulated) mesh; print the summary, write the dump"
    )
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--mesh", default="8x8", help="mesh shape, e.g. 8, 8x8, 2x4x8")
    p.add_argument("--names", default=None, help="mesh dim names, e.g. dp,tp")
    p.add_argument("--cluster", default="h100", help="h100 | a100 | h200 | cpu-gloo | path to a cluster JSON")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 for llama3-* shapes, else fp32)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory budget per rank in GB")
    p.add_argument("--dump", default=None, help="write the annotated graph here (default: <model>_<mesh>.dump.txt)")
    p.add_argument("--json", default=None, help="also save the plan as JSON")
    args = ap.parse_args(argv)
    import torch
    import autopar
    from autopar import models
    from autopar.mesh import MeshSpec

    mesh = MeshSpec.parse(args.mesh, args.names)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    if dtype is None:
        dtype = torch.bfloat16 if args.model.startswith("llama3-") and args.model != "llama3-debug" else torch.float32
    over = {"n_layers": args.layers} if args.layers else {}
    model = models.build_model(args.model, device="meta", dtype=dtype, **over)
    inputs = models.example_inputs(args.model, batch=args.batch, seq=args.seq, device="meta", **over)
    t = time.perf_counter()
    pl = autopar.plan(
        model, mesh, inputs, cluster=args.cluster, memory_budget=args.memory_gb * 1e9 if args.memory_gb else None
    )
    dt = time.perf_counter() - t
    print(pl.summary())
    print(
        f"\nplanned {args.model} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, inputs "
        f"{[tuple(x.shape) for x in inputs]}) in {dt:.2f} s"
    )
    path = args.dump or f"{args.model}_{args.mesh}.dump.txt"
    with open(path, "w") as f:
        f.write(pl.dump())
    print(f"annotated graph written to {path}")
    if args.json:
        pl.save(args.json)
        print(f"plan saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
