"""autopar.parallelize on many gloo ranks of this machine: zoo models (tests/third_party/zoo.py) on a mesh of 8 or
16 ranks, each rank calling parallelize as a user's script does (the mesh's first rank plans, the others run its
plan: autopar/across_ranks.py), one training step against one device: the loss and every gradient within
1e-6 + 1e-4 max|ref| (the ratio to that tolerance is reported), the plan's hash the same on every rank. Cluster
autopar.testing.TP_FRIENDLY (sharding pays on models this small). Appends a section to
benchmarks/results/many_ranks.md.

    python benchmarks/many_ranks.py --models lstm_lm,gru_lm,llama,bert --mesh 2,2,2 --dims dp,cp,tp
    python benchmarks/many_ranks.py --models llama,bert,gpt2 --mesh 2,2,2,2 --dims dp_replicate,dp_shard,cp,tp
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [
    str(ROOT / "tests"),
    str(ROOT / "tests" / "third_party"),
    str(ROOT / "benchmarks"),
]  # ranks run tests/_dist.py

from _dist import launch  # noqa: E402

import provenance  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "many_ranks.md"
ATOL, RTOL = 1e-6, 1e-4


def rank_job(names, shape, dims):
    """One rank: each model parallelized and stepped once beside a single-device copy."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import zoo_check as zc
    from autopar.testing import TP_FRIENDLY, global_value

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(dims))
    out = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            model, args, kwargs, _ = zc.build(name)
            ref = copy.deepcopy(model)
            pm = autopar.parallelize(model, mesh, args, cluster=TP_FRIENDLY, **zc.call_kwargs(kwargs))
            t_plan = time.perf_counter() - t0
            torch.manual_seed(zc.SEED)
            pm.program.manual_seed(zc.SEED)
            loss = zc.loss_of(pm(*args, **kwargs))
            loss.backward()
            torch.manual_seed(zc.SEED)
            loss_ref = zc.loss_of(ref(*args, **kwargs))
            loss_ref.backward()
            worst, grads = 0.0, dict(ref.named_parameters())
            for k, p in pm.named_parameters():
                if p.grad is not None:
                    g, gr = global_value(p.grad), grads[k].grad
                    worst = max(worst, float((g - gr).abs().max() / (ATOL + RTOL * gr.abs().max())))
            loss_val = float(global_value(loss))
            worst = max(worst, abs(loss_val - loss_ref.item()) / (ATOL + RTOL * abs(loss_ref.item())))
            sharded = sum(any(s != "R" for s in v) for v in pm.plan.params.values())
            out[name] = dict(
                ok=True, plan_s=round(t_plan, 1), loss=loss_val, loss_ref=loss_ref.item(), worst=worst,
                sharded=sharded, params=len(pm.plan.params), hash=pm.plan.hash(),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 (recorded per model; every rank raises alike)
            out[name] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return out


def _row(name, recs) -> str:
    r = recs[0]
    same = len({x.get("hash") for x in recs}) == 1
    if not all(x["ok"] for x in recs):
        bad = next(x for x in recs if not x["ok"])
        return f"| {name} |  |  |  |  |  | fail | {bad['error']} |"
    ok = same and all(x["worst"] <= 1 for x in recs)
    return (
        f"| {name} | {r['plan_s']} | {r['loss']:.6f} / {r['loss_ref']:.6f} | {max(x['worst'] for x in recs):.3f} "
        f"| {r['sharded']}/{r['params']} | {'yes' if same else 'no'} | {'**pass**' if ok else 'fail'} |  |"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="comma-separated zoo names")
    ap.add_argument("--mesh", default="2,2,2", help="the mesh shape (default 2,2,2)")
    ap.add_argument("--dims", default="dp,cp,tp", help="the mesh dim names (default dp,cp,tp)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    names, dims = a.models.split(","), a.dims.split(",")
    shape = [int(v) for v in a.mesh.split(",")]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="many_ranks_") as tmp:
        res = launch(rank_job, math.prod(shape), [names, shape, dims], Path(tmp), timeout=1800)
    wall = time.time() - t0
    mesh = " x ".join(f"{d}={n}" for d, n in zip(dims, shape))
    lines = [
        f"## {mesh} ({math.prod(shape)} gloo ranks)",
        "",
        f"`python benchmarks/many_ranks.py --models {a.models} --mesh {a.mesh} --dims {a.dims}` at "
        f"{provenance.commit()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; the launch took "
        f"{wall:.0f} s, every rank sharing this machine's cores).",
        "",
        "| model | parallelize s (rank 0) | loss parallel / one device | worst / tolerance | params sharded | "
        "same plan on every rank | result | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(n, [r[n] for r in res]) for n in names]
    text = "\n".join(lines) + "\n\n"
    out = Path(a.out)
    head = "" if out.exists() else "# Many ranks\n\n" + __doc__.split("\n\n")[0] + "\n\n"
    out.write_text((out.read_text() if out.exists() else head) + text)
    print(text)


if __name__ == "__main__":
    main()
