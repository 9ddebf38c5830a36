"""A plan's modeled cost as a sympy function of the global batch size.

For a fixed plan (placements and redistributes), every tensor of a training step either scales linearly with the
batch (activations) or not at all (parameters and their gradients). Capturing the graph at two batch sizes tells
which, node by node, so each compute term max(flops/F, bytes/BW) and each collective's alpha-beta time becomes an
exact expression in the batch symbol `b`:

    f = batch_formula(state, model, example_inputs)      # state from autopar.plan(..., return_state=True)
    f["step_s"].subs(b, 64)                              # modeled seconds at global batch 64, same placements
"""

from __future__ import annotations

import math

import sympy
import torch

from .capture import capture
from .cost import kernels
from .cost import collective_time, global_flops, is_view  # the costs pass's FLOP counts: both agree term by term
from .graph import param_root
from .liveness import recompute_seconds
from .collectives import link_of
from .strategies import num_shards

b = sympy.Symbol("b", positive=True)


def _kernel_times(g1, g2, n1, n2, s, mesh, f1, f2, dev):
    """(seconds at the example batch, at twice it) of a GEMM or attention op the device prices by its shapes
    (autopar/cost/kernels.py, as the costs pass does); None for every other op and for roofline devices."""
    if dev.kernels == "roofline":
        return None
    out = []
    for g, n, f in ((g1, n1, f1), (g2, n2, f2)):
        ins = [g.meta(r) for r in n.inputs()]
        shapes = [kernels.local_shape(m.shape, p, mesh) for m, p in zip(ins, s.ins)]
        pairs = [(m, p) for m, p in zip(n.outs, s.out) if m is not None and p] + list(zip(ins, s.ins))
        nbytes = sum(m.nbytes / num_shards(p, mesh) for m, p in pairs)
        o = next((p for p in s.out if p is not None), None)
        work = math.prod(size for p_, size in zip(o, mesh) if p_ != "R") if o is not None else 1
        dtype = next((m.dtype for m in n.outs if m is not None and m.dtype.is_floating_point), torch.float32)
        t = kernels.kernel_time(n.target, n.args, n.kwargs, shapes, f / work, nbytes, dev, dtype)
        if t is None:
            return None
        out.append(t)
    return out


def _example_batch(state, example_inputs, batch_dim: int) -> int:
    """The example inputs' batch size; a ValueError where the device fuses ops (torch.compile): the formula prices
    each op's own bytes, as eager PyTorch moves them (autopar/cost/fusion.py is not symbolic)."""
    dev = state.cluster.device
    if dev.fusion != "eager":
        raise ValueError(f"batch_formula: device {dev.name!r} has fusion={dev.fusion!r}; only 'eager' is modelled")
    return example_inputs[0].shape[batch_dim]


def batch_formula(state, model, example_inputs, batch_dim: int = 0, loss_fn=None) -> dict[str, sympy.Expr]:
    """{'compute_s', 'comm_s', 'exposed_comm_s', 'step_s'} in `b` for the plan held by `state`, term by term as
    autopar/predict.py prices it: recomputed blocks' forward counted again, a shared redistribute once, and with
    overlap=True parameter gathers and gradient reductions hidden under compute (step = compute + activation comm
    + Max(0, gathers + reductions - compute))."""
    b0 = _example_batch(state, example_inputs, batch_dim)
    grow = lambda t: t.new_empty(t.shape[:batch_dim] + (2 * b0,) + t.shape[batch_dim + 1 :], device="meta")
    g1 = state.graph
    g2 = capture(model, tuple(grow(t) if hasattr(t, "shape") else t for t in example_inputs), loss_fn)
    if [n.target for n in g1.nodes] != [n.target for n in g2.nodes]:
        raise ValueError("the captured graph changes structure with the batch size; no closed form exists")
    P, mesh, dev = state.placement, state.mesh.shape, state.cluster.device
    k = b / b0 - 1  # relative growth over the example batch

    def size(m1, m2, nbytes):  # nbytes at batch b, from the two captures
        return nbytes * (1 + sympy.Rational(m2.numel - m1.numel, m1.numel) * k) if m1.numel else 0

    compute, fc1, fc2 = sympy.Integer(0), {}, {}
    times = [sympy.Integer(0)] * len(g1.nodes)
    for n1, n2 in zip(g1.nodes, g2.nodes):
        if n1.kind != "op":
            continue
        s = P[n1.idx]
        pairs = list(zip(n1.outs, n2.outs, s.out)) + [(g1.meta(r), g2.meta(r), p) for r, p in zip(n1.inputs(), s.ins)]
        nbytes = sum(
            size(m1, m2, sympy.Rational(m1.nbytes, num_shards(p, mesh)))
            for m1, m2, p in pairs
            if m1 is not None and p is not None
        )
        t = 0 if is_view(n1.target) else nbytes / (dev.mem_bw * dev.mem_eff)
        f1, f2 = global_flops(g1, n1, fc1), global_flops(g2, n2, fc2)
        kt = None if is_view(n1.target) else _kernel_times(g1, g2, n1, n2, s, mesh, f1, f2, dev)
        if kt is not None:  # by kernel shapes: exact at both captured batches, linear between and beyond
            t = kt[0] + (kt[1] - kt[0]) * k
        elif f1:
            o = next(p for p in s.out if p is not None)
            work = 1
            for p_, n in zip(o, mesh):
                work *= n if p_ != "R" else 1
            dtype = next((m.dtype for m in n1.outs if m is not None and m.dtype.is_floating_point), None)
            t = sympy.Max((f1 + (f2 - f1) * k) / work / (dev.flops_for(dtype) * dev.matmul_eff), t)
        times[n1.idx] = t + dev.op_overhead
        compute += times[n1.idx]
    if state.recompute:  # activation checkpointing: checkpointed blocks run their forward twice
        compute += recompute_seconds(state, times)
    comm = {"act": sympy.Integer(0), "param": sympy.Integer(0), "grad": sympy.Integer(0)}
    bucket_of = {f: k for k, bk in enumerate(state.buckets or []) for f in bk["params"] if bk.get("step", 0) == 0}
    bucket_bytes = [sympy.Integer(0) for _ in state.buckets or []]
    for (i, j), (src, dst, cs) in state.redistributes.items():
        if (state.shares or {}).get((i, j)):  # runs its first consumer's redistribute: no collective of its own
            continue
        pick = lambda g: (
            g.grads[g.nodes[i].target]
            if j == "opt"
            else g.loss
            if j == "loss"
            else g.state_updates[g.nodes[i].target]
            if j == "state"
            else g.nodes[i].inputs()[j]
        )
        r1, r2 = pick(g1), pick(g2)
        m1, m2 = g1.meta(r1), g2.meta(r2)
        bk = bucket_of.get(g1.nodes[i].target) if j == "opt" else None
        cls = "grad" if j == "opt" else "act" if j in ("loss", "state") or param_root(g1, r1.node) is None else "param"
        for step, c in enumerate(cs):
            if bk is not None:  # a gradient bucket (chain): one collective of the summed size (below)
                if not isinstance(state.buckets[bk]["mesh_dim"], list) or step == 0:  # a flattened chain: once
                    bucket_bytes[bk + step] += size(m1, m2, c.nbytes)
                continue
            comm[cls] += collective_time(
                c.kind, size(m1, m2, c.nbytes), c.group, link_of(state.cluster, tuple(mesh), c.mesh_dim)
            )
    for bk, nb in zip(state.buckets or [], bucket_bytes):
        comm["grad"] += collective_time(
            bk["kind"], nb, bk["group"], link_of(state.cluster, tuple(mesh), bk["mesh_dim"])
        )
    compute = sympy.expand(compute)
    act, ovl = sympy.expand(comm["act"]), sympy.expand(comm["param"] + comm["grad"])
    exposed = act + (sympy.Max(0, ovl - compute) if state.options.get("overlap", False) else ovl)
    return {"compute_s": compute, "comm_s": act + ovl, "exposed_comm_s": exposed, "step_s": compute + exposed}
