"""compile= on every model of the third-party suite (tests/third_party/zoo.py): the compiled program against the
eager one, 2 gloo ranks, one plan each (SHAPES cost model, parameters pinned FSDP-like on the mesh as the suite's
check does: all_gather before use, reduce_scatter of the gradients).

    python benchmarks/training_compile_suite.py [--backend aot_eager] [names...]
        # writes benchmarks/results/training_compile_suite.md

Per model: eager and compiled programs from the same plan and weights, 2 SGD steps each from the same seed
(dropout on: masks from the program's generator, drawn outside the compiled segments); the losses and the first
step's gradients compared (|diff| <= 1e-7 + 1e-5 max|eager| per tensor: 1e-5 relative), the first step's
collectives counted on each side and compared (kind, mesh dim, bytes). Models whose eager 2-rank plan fails for
reasons of their own (benchmarks/results/models.md) fail at "plan" or "eager" here too.
The default backend "aot_eager" checks the segmenting and Dynamo/AOTAutograd capture of every model quickly;
`--backend inductor` also lowers each segment with Inductor (C++ compiles: minutes per model on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SEED = 1234


def _steps(pm, args, kwargs, loss_of, steps=2):
    from autopar.testing import global_value

    pm.program.manual_seed(SEED)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    losses, grads = [], None
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(pm(*args, **kwargs))
        loss.backward()
        losses.append(global_value(loss).item())
        if s == 0:
            grads = {k: global_value(p.grad) for k, p in pm.named_parameters() if p.grad is not None}
        opt.step()
    return losses, grads


def _worst(got, ref):
    pairs = [(f"loss {s}", torch.tensor(a), torch.tensor(b)) for s, (a, b) in enumerate(zip(got[0], ref[0]))]
    pairs += [(f"grad {k}", got[1][k], ref[1][k]) for k in ref[1]]
    return max(
        (((a.double() - b.double()).abs().max() / (1e-7 + 1e-5 * b.double().abs().max())).item(), w)
        for w, a, b in pairs
    )


def _model(name, mesh, backend, SHAPES, CollectiveCounter, compare, zc):
    import autopar
    from autopar.backends.spmd.compiled import summary

    rec = {"model": name}
    ok, built = zc._run_stage(rec, "build", lambda: zc.build(name))
    if not ok:
        return rec
    model, args, kwargs, _ = built
    ok, planned = zc._run_stage(
        rec,
        "plan",
        lambda: autopar.plan(
            model,
            mesh,
            example_inputs=args,
            cluster=SHAPES,
            overlap=False,
            return_state=True,
            force=zc.fsdp_pins(model, tuple(mesh.shape)),
            time_limit=zc.PLAN_TIME_LIMIT_S,
            **zc.call_kwargs(kwargs),
        ),
    )
    if not ok:
        return rec
    rec["sharded"] = sum(any(p != "R" for p in v) for v in planned[0].params.values())
    res = {}
    for side, kw in (("eager", {}), ("compiled", {"compile": backend})):

        def run(kw=kw):
            pm = autopar.parallelize(copy.deepcopy(model), mesh, args, planned=planned, **zc.call_kwargs(kwargs), **kw)
            t0 = time.perf_counter()
            with CollectiveCounter(mesh) as cc:
                zc.loss_of(pm(*args, **kwargs)).backward()
            first = time.perf_counter() - t0
            pm.zero_grad(set_to_none=True)
            seg = None
            if kw:
                p = pm.program
                seg = [summary(p.fw_segments), summary(p.bw_segments)]
            return (
                sorted(map(tuple, cc.collectives())),
                compare(cc.collectives(), pm.plan.collectives()),
                first,
                seg,
                _steps(pm, args, kwargs, zc.loss_of),
            )

        ok, res[side] = zc._run_stage(rec, side, run)
        if not ok:
            return rec
    (ce, de, fe, _, e), (cc_, dc, fc, seg, c) = res["eager"], res["compiled"]
    rec.update(
        collectives=len(cc_),
        same_collectives=ce == cc_,
        plan_diff=dc,
        first_s=[round(fe, 2), round(fc, 1)],
        segments=seg,
        worst=list(_worst(c, e)),
        loss_eager=e[0],
        loss_compiled=c[0],
    )
    rec["pass"] = rec["same_collectives"] and not dc and not de and rec["worst"][0] <= 1.0 and len(cc_) > 0
    return rec


def _rank(rank, world, port, names, backend, out_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "third_party")):
        sys.path.insert(0, p)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    import zoo_check as zc
    from _clusters import SHAPES
    from autopar.backends.counter import CollectiveCounter, compare
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.utils import logging

    logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for name in names:
        t0 = time.perf_counter()
        rec = _model(name, mesh, backend, SHAPES, CollectiveCounter, compare, zc)
        rec["total_s"] = round(time.perf_counter() - t0, 1)
        rows.append(rec)
        if rank == 0:
            print(json.dumps(rec, default=str), flush=True)
            with open(out_path, "w") as f:
                json.dump(rows, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


def _table(rows, cmd, backend) -> str:
    n_ok = sum(bool(r.get("pass")) for r in rows)
    before = [r["model"] for r in rows if r.get("stage") in ("build", "capture", "plan", "eager")]
    lines = [
        f"# compile={backend!r} on the suite's models (2 gloo ranks, CPU)",
        "",
        f"`{cmd}`: {n_ok} of {len(rows)} pass (compiled = eager to 1e-5 relative in the losses of 2 seeded "
        f"steps and every first-step gradient; the same collectives, = the plan's). "
        f"{len(before)} fail before anything is compiled (capture, plan or the eager program: "
        f"{', '.join(before) or 'none'}; see benchmarks/results/models.md).",
        "",
        "| model | pass | sharded params | collectives/step (same) | compiled ops fw / bw (segments) | first step "
        "eager / compiled s | worst (|diff| / (1e-7 + 1e-5 max), where) | failed stage: error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "worst" not in r:
            lines.append(
                f"| {r['model']} | no | {r.get('sharded', '')} | | | | | {r.get('stage')}: "
                f"{str(r.get('error', ''))[:160]} |"
            )
            continue
        seg = " / ".join(f"{s['compiled_ops']} ({s['compiled']})" for s in r["segments"])
        lines.append(
            f"| {r['model']} | {'yes' if r['pass'] else 'NO'} | {r['sharded']} | {r['collectives']} "
            f"({'yes' if r['same_collectives'] and not r['plan_diff'] else 'NO'}) | {seg} | "
            f"{r['first_s'][0]} / {r['first_s'][1]} | {r['worst'][0]:.2f}, {r['worst'][1]} | |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "training_compile_suite.md"))
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "tests", "third_party"))
    from zoo import ZOO

    names = a.names or list(ZOO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = os.path.join(tempfile.mkdtemp(), "rows.json")
    try:
        mp.spawn(_rank, args=(a.world, port, names, a.backend, res), nprocs=a.world)
    finally:
        rows = json.load(open(res)) if os.path.exists(res) else []
        cmd = "python benchmarks/training_compile_suite.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
        text = _table(rows, cmd, a.backend)
        print(text)
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
