"""Pass: pipeline stages (Alpa-style inter-op pass) jointly with the per-op plan inside each stage.

Layer clusters: "pre" (everything before the first block of the model's layer list: embedding, RoPE tables),
one cluster per block, "post" (final norm, head, loss). For each candidate stage submesh and micro-batch shape
the intra-op passes (regions, candidates, costs, solve, redistribute) plan a representative sub-model (the model
with its layer list cut to one block per distinct block signature) at the micro-batch shape, under a few memory
budgets (time-optimal ... most sharded). That gives per cluster: forward F, input-backward B, weight-backward W
(seconds per micro-batch, compute + activation redistributes), data-parallel comm per step (param gathers, grad
reductions; FSDP with pipelining gathers once per step), model-state bytes, saved-activation bytes per micro-batch,
and per cluster boundary the activations that cross it.

A boundary is a legal cut when the forward tensors crossing it (produced before, consumed after; tensors that
depend on no input or parameter, like RoPE tables, are recomputed by each stage, inputs go straight to the stage
that reads them) are at least one, all with static shapes; their bytes, on the link between the two stages'
ranks, cost one p2p transfer forward (activation) and one backward (its gradient) per micro-batch.

`partition` is the dynamic program over contiguous cluster ranges: it minimizes the closed form of
autopar/pipeline_model.py (T = (m v - 1) max_k c_k + sum_k f_k) under per-stage memory (state + in-flight
micro-batches x saved activations, the in-flight count taken from torch's action order of the schedule). Like Alpa
(Zheng et al. OSDI'22, section 5.2) it enumerates the bottleneck t = max c_k in increasing order, solves
min sum f subject to c_k <= t exactly for each, and stops once (m v - 1) t alone exceeds the best total.
`plan_pipeline` runs it for every (pp degree, stage submesh, micro-batch count, schedule, stages per rank) and
keeps the best by simulated step time (torch's action order, list-scheduled).
"""
from __future__ import annotations

import itertools
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from autopar import pipeline_model as pm
from autopar.cost import collective_time
from autopar.mesh import MeshSpec
from autopar.strategies import num_shards

INF = float("inf")


# ---- per-cluster costs ---------------------------------------------------------------------------------------
@dataclass
class Costs:
    """One intra-op variant, per full-model cluster (arrays of length n) and boundary (length n - 1)."""
    name: str
    F: np.ndarray
    B: np.ndarray
    W: np.ndarray
    dp: np.ndarray          # data-parallel comm seconds per step
    state: np.ndarray       # model-state bytes per rank
    act: np.ndarray         # saved-activation bytes per rank per micro-batch
    xbytes: np.ndarray      # bytes per rank crossing boundary b (between cluster b and b+1)
    legal: np.ndarray       # bool per boundary
    ntensors: np.ndarray    # tensors crossing each boundary


def find_layers(model: nn.Module) -> str:
    """FQN of the model's layer list: the nn.ModuleList / ModuleDict with the most children (shallowest on ties)."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0 and name:
            key = (len(mod), -name.count("."))
            if best is None or key > best[0]:
                best = (key, name)
    if best is None:
        raise ValueError(f"pipeline planning needs a layer list (nn.ModuleList/ModuleDict of blocks) in "
                         f"{type(model).__name__}; none found")
    return best[1]


def layer_signature(mod: nn.Module) -> tuple:
    return (type(mod).__name__, tuple((n, tuple(p.shape), str(p.dtype)) for n, p in mod.named_parameters()),
            tuple(type(m).__name__ for _, m in mod.named_modules()))


@contextmanager
def swap_layers(model: nn.Module, prefix: str, blocks: list):
    parent, _, attr = prefix.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, attr)
    new = nn.ModuleList(blocks) if isinstance(old, nn.ModuleList) else \
        nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
    setattr(owner, attr, new)
    try:
        yield
    finally:
        setattr(owner, attr, old)


def _cluster_of_nodes(g, prefix: str, n_layers: int) -> list:
    """Sub-model cluster position per node: 0 = pre, 1..n_layers = blocks, n_layers + 1 = post, None = free."""
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(?:\.|$)")
    post = n_layers + 1
    where = [None] * len(g.nodes)
    lay = [None] * len(g.nodes)
    for n in g.nodes:
        key = n.target if n.kind == "param" else n.module
        m = pat.match(key) if isinstance(key, str) else None
        lay[n.idx] = int(m.group(1)) + 1 if m else None
    fw_layer = [i for i, n in enumerate(g.nodes) if n.kind == "op" and n.phase == "fw" and lay[i]]
    bw_layer = [i for i, n in enumerate(g.nodes) if n.kind == "op" and n.phase == "bw" and lay[i]]
    fw_first, fw_last = (fw_layer[0], fw_layer[-1]) if fw_layer else (INF, -1)
    bw_first, bw_last = (bw_layer[0], bw_layer[-1]) if bw_layer else (INF, -1)
    cur = 0
    for n in g.nodes:
        if n.kind != "op":
            continue
        if lay[n.idx]:
            where[n.idx] = cur = lay[n.idx]
            continue
        root = n.module == ""
        if n.phase == "fw":
            where[n.idx] = 0 if n.idx < fw_first else post if n.idx > fw_last or not root else cur
        else:
            where[n.idx] = post if n.idx < bw_first else 0 if n.idx > bw_last or not root else cur
    for fqn, i in g.params.items():        # a parameter lives with its first forward consumer
        m = pat.match(fqn)
        if m:
            where[i] = int(m.group(1)) + 1
            continue
        users = sorted(u for u in _fw_consumers(g, i))
        where[i] = where[users[0]] if users else 0
    return where


def _fw_consumers(g, i):
    out, stack, seen = [], list(g.nodes[i].users), set()
    while stack:
        u = stack.pop()
        if u in seen or g.nodes[u].phase != "fw":
            continue
        seen.add(u)
        n = g.nodes[u]
        if n.kind == "op" and len(n.inputs()) == 1 and n.module == g.nodes[i].module and not n.users == []:
            stack.extend(n.users)     # views / casts of the parameter
        out.append(u)
    return out


def cluster_metrics(state, plan, prefix: str, n_sub: int) -> dict:
    """Per sub-model cluster (0 = pre, 1..n_sub blocks, n_sub + 1 = post) F/B/W/dp/state/act, and per boundary after
    position q (0..n_sub) the crossing tensors' local bytes and count."""
    g, P, mesh_shape = state.graph, state.placement, state.mesh.shape
    where = _cluster_of_nodes(g, prefix, n_sub)
    K = n_sub + 2
    F, B, W, dp, st, act = (np.zeros(K) for _ in range(6))
    bpp = state.precision.bytes_per_param
    # weight-gradient work: backward nodes whose results never reach an earlier cluster's backward
    feeds = [False] * len(g.nodes)
    for n in reversed(g.nodes):
        if n.kind != "op" or n.phase != "bw":
            continue
        c = where[n.idx]
        feeds[n.idx] = any(g.nodes[u].phase == "bw" and where[u] is not None and
                           (where[u] < c or (where[u] == c and feeds[u])) for u in n.users)
    coll = [{"act": {}, "dp": {}} for _ in range(K)]
    for rec in plan.nodes:
        i = rec["idx"]
        c = where[i]
        if c is None:
            continue
        n = g.nodes[i]
        t_act = sum(r["time_s"] for r in rec.get("redistribute", []) if r["class"] == "act")
        dp[c] += sum(r["time_s"] for r in rec.get("redistribute", []) if r["class"] != "act")
        for r in rec.get("redistribute", []):
            d = coll[c]["act" if r["class"] == "act" else "dp"]
            for kind, _, nbytes, _ in r["collectives"]:
                cnt = d.setdefault(kind, [0, 0])
                cnt[0] += 1
                cnt[1] += nbytes
        t = (rec.get("time_s") or 0.0) + t_act
        if n.kind == "param":
            st[c] += n.out.numel * bpp / num_shards(P[i].out[0], mesh_shape)
        elif n.phase == "fw":
            F[c] += t
            if any(g.nodes[u].phase == "bw" for u in n.users):
                act[c] += sum(m.nbytes / num_shards(p, mesh_shape) for m, p in zip(n.outs, P[i].out)
                              if m is not None and p is not None)
        elif feeds[i]:
            B[c] += t
        else:
            W[c] += t
    # data dependence: recomputable tensors (no input/param upstream) never cross a boundary
    dep = [False] * len(g.nodes)
    for n in g.nodes:
        dep[n.idx] = n.kind in ("param", "input", "buffer") or any(dep[r.node] for r in n.inputs())
    cross_bytes, cross_n = np.zeros(K - 1), np.zeros(K - 1, dtype=int)
    for n in g.nodes:
        if n.kind != "op" or n.phase != "fw" or not dep[n.idx]:
            continue
        c = where[n.idx]
        for o, m in enumerate(n.outs):
            if m is None:
                continue
            last = max((where[u] for u in n.users if g.nodes[u].phase == "fw" and where[u] is not None
                        and any(r.node == n.idx and r.out == o for r in g.nodes[u].inputs())), default=c)
            for q in range(c, last):          # crosses boundaries after positions c .. last-1
                cross_bytes[q] += m.nbytes / num_shards(P[n.idx].out[o], mesh_shape)
                cross_n[q] += 1
    ops = np.zeros(K, dtype=int)
    for n in g.ops():
        if where[n.idx] is not None:
            ops[where[n.idx]] += 1
    param_pos = {fqn: where[i] for fqn, i in g.params.items()}
    return {"F": F, "B": B, "W": W, "dp": dp, "state": st, "act": act, "xbytes": cross_bytes, "xn": cross_n,
            "coll": coll, "ops": ops, "param_pos": param_pos}


def expand(metrics: dict, pos_of: list[int], n_sub: int, name: str) -> Costs:
    """Sub-model metrics -> full-model clusters: pre, block i (costed as its representative pos_of[i]), post."""
    idx = [0] + [1 + p for p in pos_of] + [n_sub + 1]
    arr = lambda k: np.array([metrics[k][j] for j in idx], dtype=float)
    xb = np.array([metrics["xbytes"][j] for j in idx[:-1]])
    xn = np.array([metrics["xn"][j] for j in idx[:-1]])
    c = Costs(name, arr("F"), arr("B"), arr("W"), arr("dp"), arr("state"), arr("act"), xb, xn > 0, xn)
    c.coll = [metrics["coll"][j] for j in idx]
    c.ops = [int(metrics["ops"][j]) for j in idx]
    c.param_pos = metrics["param_pos"]
    return c


# ---- the dynamic program -------------------------------------------------------------------------------------
@dataclass
class Partition:
    bounds: list            # S + 1 cluster indices, 0 = b_0 < ... < b_S = n
    variants: list          # intra-op variant per stage
    proxy_s: float


def stage_terms(costs: list[Costs], xfer: np.ndarray, spec, p: int, v: int, m: int):
    """Per variant, (n+1)x(n+1) matrices over stage ranges [j, i): c (seconds per micro-batch incl. transfers and
    dp comm / m when that dominates), f (additive term of the closed form), state and act bytes."""
    out = []
    n = len(costs[0].F)
    j = np.arange(n + 1)[:, None]
    i = np.arange(n + 1)[None, :]
    ok = i > j
    for vi, cv in enumerate(costs):
        pre = lambda a: np.concatenate([[0.0], np.cumsum(a)])
        PF, PB, PW, Pd, Ps, Pa = (pre(a) for a in (cv.F, cv.B, cv.W, cv.dp, cv.state, cv.act))
        x = np.pad(np.asarray(xfer[vi], dtype=float), (1, 1))       # x[b]: transfer over boundary b (0, n: none)
        comp = (PF[i] - PF[j]) + (PB[i] - PB[j]) + (PW[i] - PW[j]) + x[j] + x[i]
        c = np.maximum(comp, (Pd[i] - Pd[j]) / m)
        W = PW[i] - PW[j]
        b = np.maximum(0.0, c - 3.0 * W) if spec.split_backward else c
        f = (c + (p - 1) * b) / (p * v)
        out.append((np.where(ok, c, INF), np.where(ok, f, INF), Ps[i] - Ps[j], Pa[i] - Pa[j]))
    return out


def partition(costs: list[Costs], xfer: np.ndarray, spec, p: int, v: int, m: int, inflight: list[int],
              budget: float) -> Partition | None:
    """Exact minimum of the closed form over contiguous partitions into S = p*v stages and a variant per stage,
    with state + inflight[k] * act <= budget / v on every stage k. None if nothing fits."""
    n, S = len(costs[0].F), p * v
    if S > n:
        return None
    legal = np.ones(n + 1, dtype=bool)
    legal[1:n] = np.all([cv.legal for cv in costs], axis=0)
    cut_ok = legal[:, None] & legal[None, :]
    terms = stage_terms(costs, xfer, spec, p, v, m)
    cap = budget / v
    C = np.stack([t[0] for t in terms])                        # V x (n+1) x (n+1)
    Fm = np.stack([t[1] for t in terms])
    memok = np.stack([[t[2] + inflight[k] * t[3] <= cap for t in terms] for k in range(S)])   # S x V x ..
    base = np.where(cut_ok[None], Fm, INF)
    coef = pm.proxy_coef(m, v)

    def solve(t):
        D = np.full(n + 1, INF)
        D[0] = 0.0
        arg = []
        for k in range(S):
            cost = np.where(memok[k] & (C <= t), base, INF)        # V x (n+1) x (n+1)
            vbest = cost.argmin(axis=0)
            cmin = np.take_along_axis(cost, vbest[None], 0)[0]
            tot = D[:, None] + cmin
            jb = tot.argmin(axis=0)
            D = tot[jb, np.arange(n + 1)]
            arg.append((jb, vbest))
        return D[n], arg

    vals = np.unique(C[np.isfinite(C) & np.broadcast_to(cut_ok, C.shape)])
    lo_sum, _ = solve(INF)
    if not np.isfinite(lo_sum):
        return None
    lo, hi = 0, len(vals) - 1                                  # smallest feasible bottleneck
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(solve(vals[mid])[0]):
            hi = mid
        else:
            lo = mid + 1
    best, best_arg, best_t = INF, None, None
    for t in vals[lo:]:
        if coef * t + lo_sum >= best:
            break
        s, arg = solve(t)
        if coef * t + s < best:
            best, best_arg, best_t = coef * t + s, arg, t
    bounds, variants, i = [n], [], n
    for k in range(S - 1, -1, -1):
        jb, vb = best_arg[k]
        j = int(jb[i])
        variants.append(int(vb[j, i]))
        bounds.append(j)
        i = j
    bounds.reverse()
    variants.reverse()
    # the proxy with the true max of the chosen partition (<= best_t)
    cs = [C[variants[k], bounds[k], bounds[k + 1]] for k in range(S)]
    fs = [Fm[variants[k], bounds[k], bounds[k + 1]] for k in range(S)]
    return Partition(bounds, variants, coef * max(cs) + sum(fs))


def brute_force(costs: list[Costs], xfer, spec, p, v, m, inflight, budget) -> Partition | None:
    """Every legal cut set and variant assignment (small models only): the reference `partition` must match."""
    n, S = len(costs[0].F), p * v
    terms = stage_terms(costs, xfer, spec, p, v, m)
    legal = [b for b in range(1, n) if all(cv.legal[b - 1] for cv in costs)]
    best = None
    for cuts in itertools.combinations(legal, S - 1):
        bounds = [0, *cuts, n]
        for vs in itertools.product(range(len(costs)), repeat=S):
            cs, fs, ok = [], [], True
            for k in range(S):
                c, f, st, ac = (x[bounds[k], bounds[k + 1]] for x in terms[vs[k]])
                if st + inflight[k] * ac > budget / v:
                    ok = False
                    break
                cs.append(c)
                fs.append(f)
            if ok:
                val = pm.proxy_coef(m, v) * max(cs) + sum(fs)
                if best is None or val < best.proxy_s - 1e-15:
                    best = Partition(bounds, list(vs), val)
    return best


# ---- intra-op plans of one stage ------------------------------------------------------------------------------
class StageOps:
    """The intra-op plans of the representative sub-model on one stage submesh at one micro-batch shape: the
    time-optimal plan first; `more()` adds plans under tighter memory budgets (halfway to the most-sharded plan,
    then the most-sharded itself), computed only when a stage does not fit with the plans so far."""

    def __init__(self, model, prefix, reps, pos_of, mb_inputs, stage_mesh: MeshSpec, ctx):
        from autopar.capture import capture
        from autopar.pipeline import PASSES, PlanState, run_passes
        from autopar.solver import min_memory
        t0 = time.perf_counter()
        layers = model.get_submodule(prefix)
        blocks = [layers[i] if isinstance(layers, nn.ModuleList) else list(layers.values())[i] for i in reps]
        with swap_layers(model, prefix, blocks):
            g = capture(model, mb_inputs, ctx["loss_fn"])
        sub_force = {}
        for fqn, pl in ctx["force"].items():
            m = re.match(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$", fqn)
            if m is None:
                sub_force[fqn] = pl
            elif int(m.group(1)) in reps:
                sub_force[f"{prefix}.{reps.index(int(m.group(1)))}.{m.group(2)}"] = pl
        self.state = PlanState(g, stage_mesh, ctx["cluster"], ctx["precision"], 1e30,
                               {"force": sub_force, "replicate_ops": ctx["replicate_ops"],
                                # on a one-device stage every placement is Replicate: no rule is needed to say so
                                "allow_replicate": ctx["allow_replicate"] or stage_mesh.size == 1,
                                "time_limit": ctx["time_limit"], "mixed_precision": None,
                                "allow_checkpointing": False})
        self._k = PASSES.index("solve")
        run_passes(self.state, PASSES[:self._k])
        c = self.state.cost
        self._rows = [c["state_mem"][i] + c["act_mem"][i] for i in range(len(c["compute"]))]
        self._floor = min_memory(self._rows)
        self.prefix, self.reps, self.pos_of, self.ctx = prefix, reps, pos_of, ctx
        self.variants, self.plans, self.budgets, self._seen = [], [], [], set()
        self._budget, self._left = 1e30, ctx["n_variants"]
        self.seconds = 0.0
        self.more()
        self.seconds = time.perf_counter() - t0

    def more(self) -> bool:
        """Solve under the next tighter budget; True if that gave a new plan."""
        from autopar.pipeline import PASSES, run_passes
        from autopar.predict import build_plan
        from autopar.solver import InfeasibleMemoryError
        t0 = time.perf_counter()
        st = self.state
        while self._left > 0 and self._budget is not None:
            self._left -= 1
            budget = st.budget = self._budget
            st.placement = st.redistributes = st.solution = None     # re-solve from the same costs
            if budget < 1e29:      # tight budgets make branch-and-bound work; cap it
                st.options["time_limit"] = min(self.ctx["time_limit"], self.ctx.get("lean_time_limit", 10.0))
            try:
                run_passes(st, PASSES[self._k:])
            except InfeasibleMemoryError:
                self._budget = None
                break
            mem = sum(self._rows[i][st.solution.choice[i]] for i in range(len(self._rows)))
            self._budget = None if mem <= self._floor * 1.0001 else \
                self._floor * 1.0001 if self._left == 1 else (mem + self._floor) / 2
            key = tuple(st.solution.choice)
            if key in self._seen:
                continue
            self._seen.add(key)
            plan = build_plan(st)
            met = cluster_metrics(st, plan, self.prefix, len(self.reps))
            label = "time-optimal" if budget >= 1e29 else f"mem<={budget / 1e9:.4g}GB"
            self.variants.append(expand(met, self.pos_of, len(self.reps), f"v{len(self.variants)} {label}"))
            self.plans.append(plan)
            self.budgets.append(budget)
            self.seconds += time.perf_counter() - t0
            return True
        self.seconds += time.perf_counter() - t0
        return False


def p2p_link(cluster, stage_size: int, a: int, b: int):
    """Link between pp ranks a and b: stage submeshes are consecutive blocks of `stage_size` ranks (row-major mesh
    with pp outermost) and nodes hold `gpus_per_node` consecutive ranks; intra-node iff every rank of a's block and
    its peer in b's block share a node."""
    g = cluster.gpus_per_node
    same = all((a * stage_size + r) // g == (b * stage_size + r) // g for r in (0, stage_size - 1))
    return cluster.intra if same and stage_size <= g else cluster.inter


# ---- evaluation of one partition ------------------------------------------------------------------------------
def evaluate(costs, bounds, variants, spec, p, v, m, order, cluster, stage_size, budget) -> dict:
    S = p * v
    rank_of = pm.stage_ranks(spec, p, v)
    F, B, W, dp, st, act, x = [], [], [], [], [], [], []
    for k in range(S):
        cv, a, b = costs[variants[k]], bounds[k], bounds[k + 1]
        F.append(float(cv.F[a:b].sum()))
        B.append(float(cv.B[a:b].sum()))
        W.append(float(cv.W[a:b].sum()))
        dp.append(float(cv.dp[a:b].sum()))
        st.append(float(cv.state[a:b].sum()))
        act.append(float(cv.act[a:b].sum()))
        if k < S - 1:
            link = p2p_link(cluster, stage_size, rank_of[k], rank_of[k + 1])
            x.append((float(cv.xbytes[b - 1]), link.name,
                      collective_time("send_recv", float(cv.xbytes[b - 1]), 2, link)
                      if rank_of[k] != rank_of[k + 1] else 0.0))
    sim = pm.simulate(order, rank_of, F, B, W, [t for *_, t in x])
    exposed = [max(0.0, dp[k] - m * (F[k] + B[k] + W[k])) for k in range(S)]
    act_peak = pm.rank_act_peak(order, act, spec.split_backward)
    rank_state = [sum(st[k] for k in range(S) if rank_of[k] == r) for r in range(p)]
    mem = [rank_state[r] + act_peak[r] for r in range(p)]
    fl = pm.inflight(order, S, spec.split_backward)
    return {"step_s": sim.step_s + max(exposed), "pipeline_s": sim.step_s, "exposed_dp_s": max(exposed),
            "bubble": sim.bubble_fraction, "sim": sim, "F": F, "B": B, "W": W, "dp": dp, "state": st, "act": act,
            "xfer": x, "inflight": fl, "rank_of": rank_of, "rank_mem": mem, "fits": max(mem) <= budget,
            "peak_mem": max(mem)}


def even_bounds(n_blocks: int, S: int, has_pre=True, has_post=True) -> list:
    """torchtitan-style split: blocks as even as possible (earlier stages take the extra ones), embedding with the
    first stage, head with the last."""
    q, r = divmod(n_blocks, S)
    sizes = [q + (1 if k < r else 0) for k in range(S)]
    b = [0]
    for k, s in enumerate(sizes):
        b.append(b[-1] + s + (1 if k == 0 and has_pre else 0))
    b[-1] += 1 if has_post else 0
    return b


def layout_bounds(sizes: list[int]) -> list:
    """Bounds for a hand layout: sizes[k] blocks on stage k, the embedding (pre) with stage 0, head (post) last."""
    b = [0]
    for k, s in enumerate(sizes):
        b.append(b[-1] + s + (1 if k == 0 else 0))
    b[-1] += 1
    return b


# ---- the search ------------------------------------------------------------------------------------------------
def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _dp_size(mesh: MeshSpec) -> int:
    return math.prod(s for s, nm in zip(mesh.shape, mesh.names) if nm.startswith("dp"))


def candidate_meshes(mesh: MeshSpec, n_clusters: int, cluster, opts) -> list:
    """(pp, stage submesh) pairs: the mesh's own pp dim, or every factorization of a flat rank set into
    pp x dp x tp with tp inside one node."""
    if "pp" in mesh.names:
        k = mesh.names.index("pp")
        rest = [(s, nm) for j, (s, nm) in enumerate(zip(mesh.shape, mesh.names)) if j != k]
        sub = MeshSpec(tuple(s for s, _ in rest), tuple(nm for _, nm in rest)) if rest else MeshSpec((1,), ("dp",))
        return [(mesh.shape[k], sub)]
    world = mesh.size
    out = []
    for p in opts.get("pp") or _divisors(world):
        if world % p or p > n_clusters:
            continue
        for tp in opts.get("tp") or _divisors(world // p):
            if (world // p) % tp or tp > cluster.gpus_per_node:
                continue
            dp = world // p // tp
            shape, names = [(dp, "dp"), (tp, "tp")], None
            shape = [x for x in shape if x[0] > 1] or [(1, "dp")]
            out.append((p, MeshSpec(tuple(s for s, _ in shape), tuple(nm for _, nm in shape))))
    return out


def microbatch_counts(B: int, p: int, dp: int, opts) -> list:
    if opts.get("n_microbatches"):
        ms = [m for m in opts["n_microbatches"] if B % m == 0 and (B // m) % dp == 0]
    else:
        ms = [m for m in _divisors(B) if (B // m) % dp == 0 and (m >= p if p > 1 else m == 1)]
        ms = sorted(ms, key=lambda m: B // m)[:opts.get("max_microbatch_options", 3)]
    return sorted(ms)


def plan_pipeline(model, mesh, example_inputs, *, cluster, precision, budget, loss_fn=None, force=None,
                  replicate_ops=(), allow_replicate=False, time_limit=60.0, pipeline="auto"):
    """Choose pp degree, stage submesh, micro-batch count, schedule, stages per rank, stage boundaries and each
    stage's per-op plan; returns a Plan with `stages` and `schedule` filled (see module docstring).

    pipeline: "auto"/True, or a dict narrowing the search: pp, tp (lists), n_microbatches, schedules,
    stages_per_rank (lists), layers_per_stage (a hand layout: blocks per stage, no DP), max_microbatch_options,
    n_variants (intra-op memory variants per stage plan, default 3), top (candidates kept in the report)."""
    from autopar.solver import InfeasibleMemoryError
    t_start = time.perf_counter()
    opts = dict(pipeline) if isinstance(pipeline, dict) else {}
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("pipeline planning needs a batched first input (the batch dim 0 is split into micro-batches)")
    Bsz = tensors[0].shape[0]
    prefix = find_layers(model)
    blocks = list(model.get_submodule(prefix).values()) if isinstance(model.get_submodule(prefix), nn.ModuleDict) \
        else list(model.get_submodule(prefix))
    sigs = [layer_signature(b) for b in blocks]
    reps = [i for i, s in enumerate(sigs) if s not in sigs[:i]]
    pos_of = [reps.index(sigs.index(s)) for s in sigs]
    n = len(blocks) + 2
    tied = {a for a, _ in model.named_parameters(remove_duplicate=False)} - {a for a, _ in model.named_parameters()}
    ctx = {"cluster": cluster, "precision": precision, "loss_fn": loss_fn, "force": dict(force or {}),
           "replicate_ops": [str(o) for o in replicate_ops], "allow_replicate": allow_replicate,
           "time_limit": time_limit, "n_variants": int(opts.get("n_variants", 3))}
    names = [k for k in opts.get("schedules") or pm.SCHEDULES]
    specs = [pm.get_schedule(k) for k in names]
    cache: dict = {}
    results = []
    for p, smesh in candidate_meshes(mesh, n, cluster, opts):
        if tied and p > 1:
            raise ValueError(f"tied parameters {sorted(tied)} cannot be split across pipeline stages")
        dp = _dp_size(smesh)
        for m in microbatch_counts(Bsz, p, dp, opts):
            mb = Bsz // m
            key = (smesh.shape, smesh.names, mb)
            if key not in cache:
                mbi = tuple(torch.empty((mb,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta")
                            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == Bsz else x for x in inputs)
                cache[key] = StageOps(model, prefix, reps, pos_of, mbi, smesh, ctx)
            ops = cache[key]
            if not ops.variants:
                continue
            link = cluster.link_for((p,) + smesh.shape, 0) if p > 1 else cluster.intra
            for spec in specs:
                if p == 1 and spec.name != "GPipe":
                    continue
                for v in (opts.get("stages_per_rank") or spec.stages_per_rank) if p > 1 else (1,):
                    if (v > 1) != spec.multi or p * v > n:
                        continue
                    try:
                        order = pm.actions(spec, p, m, v)
                    except ValueError:
                        continue
                    fl = pm.inflight(order, p * v, spec.split_backward)
                    if opts.get("layers_per_stage"):
                        if len(opts["layers_per_stage"]) != p * v:
                            raise ValueError(f"layers_per_stage has {len(opts['layers_per_stage'])} entries for "
                                             f"{p * v} stages")
                        part = Partition(layout_bounds(opts["layers_per_stage"]), [0] * (p * v), float("nan"))
                    else:
                        while True:
                            xfer = np.array([[collective_time("send_recv", float(b), 2, link) for b in cv.xbytes]
                                             for cv in ops.variants])
                            part = partition(ops.variants, xfer, spec, p, v, m, fl, budget)
                            if part is not None or not ops.more():
                                break
                    if part is None:
                        results.append({"p": p, "mesh": smesh, "m": m, "spec": spec, "v": v, "fits": False,
                                        "step_s": INF, "peak_mem": INF, "key": key})
                        continue
                    ev = evaluate(ops.variants, part.bounds, part.variants, spec, p, v, m, order, cluster,
                                  smesh.size, budget)
                    base = evaluate(ops.variants, even_bounds(len(blocks), p * v), [0] * (p * v), spec, p, v, m,
                                    order, cluster, smesh.size, budget) if p * v <= len(blocks) else None
                    results.append({**ev, "p": p, "mesh": smesh, "m": m, "spec": spec, "v": v, "part": part,
                                    "key": key, "even": base})
    t_intra = sum(o.seconds for o in cache.values())
    fitting = [r for r in results if r["fits"]]
    if not fitting:
        low = min((r["peak_mem"] for r in results), default=INF)
        raise InfeasibleMemoryError(f"no pipeline plan fits {budget / 1e9:.3f} GB per rank on {mesh}: smallest "
                                    f"peak found {low / 1e9:.3f} GB over {len(results)} candidates")
    fitting.sort(key=lambda r: (r["step_s"], r["p"] * r["v"], r["m"]))
    best = fitting[0]
    from autopar.pipeline_plan import build_pipeline_plan
    return build_pipeline_plan(best, fitting[:int(opts.get("top", 12))], len(results), cache[best["key"]], model,
                               prefix, reps, pos_of, mesh, inputs, cluster, budget,
                               {"intra_op_s": t_intra, "total_s": time.perf_counter() - t_start})
