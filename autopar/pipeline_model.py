"""Pipeline schedules as a cost model: which schedules exist, where their stages live, the closed-form step time
the stage partitioner minimizes, and an exact simulation of torch's own action order (for the step time, the
bubble, activation memory in flight and the text timeline that the plan reports).

Notation: p pipeline ranks, v stages per rank (S = p*v stages), m micro-batches; per stage k and micro-batch:
F_k forward, B_k backward for the input gradient, W_k backward for the weight gradients, c_k = F_k + B_k + W_k.

Closed form the partitioner minimizes (Alpa's inter-op objective generalized):

    T = (m*v - 1) * max_k c_k  +  sum_k (c_k + (p - 1) * b_k) / (p * v)

* GPipe, 1F1B (v = 1, b_k = c_k): T = sum_k c_k + (m - 1) * max_k c_k, Alpa's eq. (2) (Zheng et al., OSDI'22:
  one micro-batch crosses every stage, the other m-1 are paced by the slowest). Uniform stages: (m + p - 1) c,
  bubble fraction (p - 1)/(m + p - 1) (GPipe, Huang et al. 2019; Narayanan et al. SC'21 eq. 1).
* Interleaved1F1B (v chunks per rank, b_k = c_k): uniform stages give m*v*c + (p - 1)*c, i.e. bubble fraction
  (p - 1)/(v*m) of the ideal time, Narayanan et al. SC'21 section 2.2.2 (t_pb = (p-1)(t_f+t_b)/v per rank).
* Zero-bubble family (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; backward split into B and W): the
  weight-gradient passes fill the drain, so a stage contributes b_k = max(0, F_k + B_k - 2 W_k) to the bubble
  instead of c_k; uniform stages with v = 1 give m*c + (p - 1)(F + B - 2W), the ZB-H1 bubble of Qi et al.
  ("Zero Bubble Pipeline Parallelism", ICLR'24, section 3).

The closed form only ranks partitions. The reported step time is `simulate`: list scheduling of the exact per-rank
action order torch's schedule class generates (`torch.distributed.pipelining`'s own generator, through the adapter),
each action starting when its rank is free and its inputs arrived (F after the previous stage's F plus the p2p
transfer; B/I after its own F and the next stage's B/I plus the transfer; W after its own I).

Activation memory in flight: a micro-batch's saved activations of stage k live from its F until its backward is
complete (B, or W when the backward is split). The count follows from each rank's action order alone, so it is
exact for torch's schedules: GPipe holds m, 1F1B holds p - k on stage k (Narayanan et al.: "at most p in flight").

The stage DP (`partition`): over contiguous cluster ranges, each stage also picks an intra-op variant and the fewest
checkpointed blocks that fit its memory (`stage_options`). Like Alpa (Zheng et al. OSDI'22, section 5.2) it
enumerates the bottleneck t = max c_k in increasing order, solves min sum f subject to c_k <= t exactly for each
(dynamic program over the stage index), and stops once (m v - 1) t alone exceeds the best total; `brute_force` is
the reference the tests hold it to.

On clusters with NCCL links a partition is priced as torch's engines run it: autopar/pipeline_engine.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.pipeline_simulation import Simulation, by_order, simulate  # noqa: F401 (the model's simulation)
from autopar.strategies._torch_adapter import pipeline_actions, pipeline_stage_to_rank

INF = float("inf")


@dataclass(frozen=True)
class ScheduleSpec:
    name: str  # torch's name (torch.distributed.pipelining.schedules.get_schedule_class)
    torch_class: str
    stages_per_rank: tuple  # the v values autopar tries
    style: str  # stage -> rank mapping: "loop" or "v"
    split_backward: bool  # runs B (input grad) and W (weight grad) as separate actions

    @property
    def multi(self) -> bool:
        return self.stages_per_rank != (1,)


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("GPipe", "ScheduleGPipe", (1,), "loop", False),
        ScheduleSpec("1F1B", "Schedule1F1B", (1,), "loop", False),
        ScheduleSpec("Interleaved1F1B", "ScheduleInterleaved1F1B", (2, 4), "loop", False),
        ScheduleSpec("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", (2, 4), "loop", True),
        ScheduleSpec("ZBVZeroBubble", "ScheduleZBVZeroBubble", (2,), "v", True),
        ScheduleSpec("DualPipeV", "ScheduleDualPipeV", (2,), "v", True),
    )
}


def get_schedule(name: str) -> ScheduleSpec:
    for k, s in SCHEDULES.items():
        if k.lower() == str(name).lower() or s.torch_class.lower() == str(name).lower():
            return s
    raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")


def stage_ranks(spec: ScheduleSpec, p: int, v: int) -> tuple[int, ...]:
    """pp rank of each of the p*v stages, as torch maps them."""
    if v == 1:
        return tuple(range(p))
    return pipeline_stage_to_rank(p, p * v, spec.style)


def actions(spec: ScheduleSpec, p: int, m: int, v: int) -> tuple:
    """Per rank, torch's compute actions in order: (stage, "F"|"B"|"I"|"W", micro-batch). ValueError if torch
    rejects the combination (e.g. 1F1B needs m >= p)."""
    if not spec.multi:
        if v != 1:
            raise ValueError(f"{spec.name} runs one stage per rank, not {v}")
        return tuple(single_stage_order(spec.name, k, p, m) for k in range(p))
    return pipeline_actions(spec.name, p, m, v)


def single_stage_order(name: str, k: int, p: int, m: int) -> tuple:
    """The order ScheduleGPipe / Schedule1F1B execute on stage k (their `_step_microbatches`; torch's
    `_get_pipeline_order` for 1F1B is a drawing aid that mislabels the last rank's micro-batches, so it is not used).
    GPipe: all forwards, then all backwards. 1F1B: min(m, p - k) warm-up forwards, then backward/forward pairs,
    then the remaining backwards."""
    if name == "GPipe" or p == 1:
        return tuple((k, "F", i) for i in range(m)) + tuple((k, "B", i) for i in range(m))
    if m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: {m} < {p} (torch raises too)")
    warm = min(m, p - k)
    out = [(k, "F", i) for i in range(warm)]
    f, b = warm, 0
    while True:
        out.append((k, "B", b))
        b += 1
        if f == m:
            break
        out.append((k, "F", f))
        f += 1
    out += [(k, "B", i) for i in range(b, m)]
    return tuple(out)


# ---- closed form (what the stage DP minimizes) ----------------------------------------------------------------
def proxy_coef(m: int, v: int) -> float:
    """Weight of max_k c_k in the closed form."""
    return m * v - 1


def proxy_f(c: float, b: float, p: int, v: int) -> float:
    """Additive per-stage term of the closed form."""
    return (c + (p - 1) * b) / (p * v)


def bubble_term(spec: ScheduleSpec, c: float, W: float) -> float:
    """b_k: what a stage adds to the fill/drain bubble (see the module docstring); c = F + B + W (+ transfers)."""
    return max(0.0, c - 3.0 * W) if spec.split_backward else c


def proxy_step(spec: ScheduleSpec, p: int, v: int, m: int, c: list, b: list) -> float:
    return proxy_coef(m, v) * max(c) + sum(proxy_f(ck, bk, p, v) for ck, bk in zip(c, b))


# ---- in-flight activations ------------------------------------------------------------------------------------
# The stage search asks the same order for its in-flight counts once per configuration and DP try (by_order).
_MEMO: dict = {}


def _memo(fn, order: tuple, S: int, split_backward: bool) -> list[int]:
    key = (fn.__name__, id(order), S, split_backward)
    return list(by_order(_MEMO, key, order, lambda: fn(order, S, split_backward), 64))


# The actions after which a micro-batch's saved activations of a stage are freed: its full backward, or, when the
# schedule splits the backward, its weight-gradient pass (a split schedule may still run some backwards whole).
_FREES = {False: ("B",), True: ("B", "W")}


def rank_stages(order: tuple) -> list:
    """Per rank, its stages in the order it first computes them."""
    return _memo(_rank_stages, order, 0, False)


def _rank_stages(order: tuple, S: int, split_backward: bool) -> list:
    return [list(dict.fromkeys(a[0] for a in rank)) for rank in order]


def inflight(order: tuple, S: int, split_backward: bool) -> list[int]:
    """Per stage, the most micro-batches whose activations are held at once (from torch's action order)."""
    return _memo(_inflight, order, S, split_backward)


def _inflight(order: tuple, S: int, split_backward: bool) -> list[int]:
    live, peak = [0] * S, [0] * S
    frees = _FREES[split_backward]
    for rank in order:
        for s, kind, _ in rank:
            if kind == "F":
                live[s] += 1
                peak[s] = max(peak[s], live[s])
            elif kind in frees:
                live[s] -= 1
    return peak


def inflight_at_peak(order: tuple, S: int, split_backward: bool) -> list[int]:
    """Per stage, its micro-batches in flight at the moment its rank holds the most in flight over all its stages
    (= the per-stage peak with one stage per rank). With equal activations per stage, sum over a rank's stages of
    act * this is the rank's peak: what the stage DP charges each stage of an interleaved/V schedule."""
    return _memo(_inflight_at_peak, order, S, split_backward)


def _inflight_at_peak(order: tuple, S: int, split_backward: bool) -> list[int]:
    out = [0] * S
    frees = _FREES[split_backward]
    for rank in order:
        live, best, snap = {}, -1, {}
        for s, kind, _ in rank:
            if kind == "F":
                live[s] = live.get(s, 0) + 1
            elif kind in frees:
                live[s] -= 1
            tot = sum(live.values())
            if tot > best:
                best, snap = tot, dict(live)
        for s, q in snap.items():
            out[s] = q
    return out


def rank_act_peak(order: tuple, act: list[float], split_backward: bool) -> list[float]:
    """Per rank, the peak bytes of saved activations over its action order (act: bytes per micro-batch per stage)."""
    out = []
    frees = _FREES[split_backward]
    for rank in order:
        cur = best = 0.0
        for s, kind, _ in rank:
            if kind == "F":
                cur += act[s]
                best = max(best, cur)
            elif kind in frees:
                cur -= act[s]
        out.append(best)
    return out


def live_rows(actions: tuple, stages: list, split_backward: bool) -> np.ndarray:
    """The distinct in-flight counts of `stages` (columns) right after each forward of one rank's action order:
    rank_act_peak of any activation sizes is max(0, max(rows @ act)), a product per call instead of a pass over
    the order (the stage search prices one rank's order under many checkpointing choices)."""
    col = {k: j for j, k in enumerate(stages)}
    live, rows = [0] * len(stages), []
    frees = _FREES[split_backward]
    for s, kind, _ in actions:
        if kind == "F":
            live[col[s]] += 1
            rows.append(tuple(live))
        elif kind in frees:
            live[col[s]] -= 1
    if not rows:
        return np.zeros((0, len(stages)))
    return np.unique(np.array(rows, dtype=float), axis=0)


# ---- simulation (autopar/pipeline_simulation.py) and its timeline ------------------------------------------
def timeline(sim: Simulation, width: int = 96) -> list[str]:
    """One text row per pp rank: each character is step_s/width seconds, showing the action occupying most of it:
    F forward, B full backward, I input backward, W weight backward, '.' idle. Lower case marks the rank's second
    (or later) stage, so interleaved and V schedules show which chunk runs."""
    T = sim.step_s or 1.0
    rows = []
    for r, ev in enumerate(sim.events):
        first = min((s for *_, s, _, _ in ev), default=0)
        cells = []
        k = 0
        for x in range(width):
            a, b = x * T / width, (x + 1) * T / width
            best, best_ov = ".", 0.0
            while k < len(ev) and ev[k][1] <= a:
                k += 1
            j = k
            while j < len(ev) and ev[j][0] < b:
                ov = min(b, ev[j][1]) - max(a, ev[j][0])
                if ov > best_ov:
                    ch = ev[j][3]
                    best, best_ov = (ch if ev[j][2] == first else ch.lower()), ov
                j += 1
            cells.append(best if best_ov >= 0.5 * (b - a) else ".")
        rows.append(f"rank {r:>3} |{''.join(cells)}|")
    return rows


def first_events(sim: Simulation, n: int = 12) -> list[str]:
    """The first n actions of each rank as torch names them (e.g. 0F0 1B3), with start times."""
    return [
        f"rank {r:>3}: " + " ".join(f"{s}{k}{i}@{t0 * 1e3:.2f}ms" for t0, _, s, k, i in ev[:n])
        for r, ev in enumerate(sim.events)
    ]


# ---- the dynamic program -------------------------------------------------------------------------------------
@dataclass
class Partition:
    bounds: list  # S + 1 cluster indices, 0 = b_0 < ... < b_S = n
    variants: list  # intra-op variant per stage
    proxy_s: float
    recompute: list = None  # checkpointed blocks per stage


def transients(cv) -> tuple:
    """Per cluster of a stage variant's costs (passes/stage_costs.py Costs) the bytes its run holds above what the
    stage model already counts for it (its saved activations per micro-batch in flight): (plain, checkpointed).
    Plain: its peak beyond its saved activations (the loss's bf16 logits, fp32 upcast and log_softmax output, then
    its gradient beside the saved output; a block's backward gradient temporaries). Checkpointed (blocks; the plain
    figure elsewhere): its peak beyond the input it keeps (the recomputed activations and the gradients beside
    them). Costs without a measured peak keep the earlier model: no plain transient, a checkpointed block's
    activations."""
    if getattr(cv, "peak", None) is None:
        return np.zeros(len(cv.act)), np.where(cv.blk, cv.act, 0.0)
    plain = np.maximum(0.0, cv.peak - cv.act)
    return plain, np.where(cv.blk, np.maximum(0.0, cv.peak - (cv.act - cv.save)), plain)


def range_terms(costs: list, xfer, p: int) -> list:
    """What stage_options reads that does not depend on the in-flight count or the cap, per intra-op variant:
    (n+1) x (n+1) matrices over stage ranges [j, i). A partition asks for every in-flight count its stages hold
    (up to p of them under 1F1B), so it builds these once."""
    n = len(costs[0].F)
    j = np.arange(n + 1)[:, None]
    i = np.arange(n + 1)[None, :]
    ok = i > j
    pre = lambda a: np.concatenate([[0.0], np.cumsum(a)])
    out = []
    for vi, cv in enumerate(costs):
        kept = getattr(cv, "kept", None) if p > 1 else None  # engine pricing: FSDP2 keeps the stage gathered
        state = cv.state if kept is None else cv.state + kept
        PF, PB, PW, Pd, Ps, Pa = (pre(a) for a in (cv.F, cv.B, cv.W, cv.dp, state, cv.act))
        Pn, Psv, Prt = pre(cv.blk.astype(float)), pre(cv.save), pre(cv.rtime)
        x = np.pad(np.asarray(xfer[vi], dtype=float), (1, 1))  # x[b]: transfer over boundary b (0, n: none)
        nb = np.maximum(Pn[i] - Pn[j], 1.0)
        # the largest transient in [j, i) (passes/stage_costs.py transients): plain, and with blocks checkpointed
        plain, ckpt = transients(cv)
        tmax = [np.maximum.accumulate(np.where(ok, np.concatenate([[0.0], t])[i], 0.0), axis=1) for t in (plain, ckpt)]
        out.append(
            {
                "ok": ok,
                "comp": (PF[i] - PF[j]) + (PB[i] - PB[j]) + (PW[i] - PW[j]) + x[j] + x[i],
                "state": Ps[i] - Ps[j],
                "act": Pa[i] - Pa[j],
                "nb": nb,
                "blocks": Pn[i] - Pn[j],
                "tmax": tmax,
                "save": (Psv[i] - Psv[j]) / nb,
                "rtime": Prt[i] - Prt[j],
                "dp": Pd[i] - Pd[j],
                "W": PW[i] - PW[j],
            }
        )
    return out


def stage_options(costs, xfer, spec, p: int, v: int, m: int, q: int, cap: float, recompute: bool = True, terms=None):
    """Every stage range [j, i) (as (n+1) x (n+1) matrices, one per intra-op variant) for a stage holding q
    micro-batches in flight: r = the fewest blocks to checkpoint so that state + q * act + the range's largest
    transient (`transients`: the checkpointed one if r > 0) <= cap (blocks of a stage treated as alike: r times
    the average saving and recompute time), c = seconds per micro-batch (compute + transfers on both sides + r
    recomputes; at least its dp comm / m), f = the additive term of the closed form. Returns arrays C, Fm (inf
    where infeasible) and R. terms: range_terms(costs, xfer, p), when the caller has them."""
    Cs, Fs, Rs = [], [], []
    for t in terms if terms is not None else range_terms(costs, xfer, p):
        mem0 = t["state"] + q * t["act"]
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.ceil(np.where(t["save"] > 0, (mem0 + t["tmax"][1] - cap) / (q * t["save"]), INF) - 1e-9)
        r = np.where(mem0 + t["tmax"][0] <= cap, 0.0, np.maximum(need, 1.0) if recompute else INF)
        feas = t["ok"] & (r <= t["blocks"])
        r = np.where(feas, np.maximum(r, 0.0), 0.0)
        comp = t["comp"] + r * t["rtime"] / t["nb"]
        c = np.maximum(comp, t["dp"] / m)
        b = np.maximum(0.0, c - 3.0 * t["W"]) if spec.split_backward else c
        f = (c + (p - 1) * b) / (p * v)
        Cs.append(np.where(feas, c, INF))
        Fs.append(np.where(feas, f, INF))
        Rs.append(r.astype(int))
    return np.stack(Cs), np.stack(Fs), np.stack(Rs)


def partition(
    costs: list,
    xfer,
    spec,
    p: int,
    v: int,
    m: int,
    inflight: list[int],
    cap: float,
    tol: float = 0.0,
    recompute: bool = True,
) -> Partition | None:
    """Exact minimum of the closed form over contiguous partitions of the n clusters into S = p*v stages, an
    intra-op variant per stage and its checkpointed-block count (stage_options), every stage within `cap` bytes
    with inflight[k] micro-batches in flight, legal cuts only. costs: per variant, arrays over clusters (F, B, W,
    dp, state, act, blk, save, rtime, legal per boundary); xfer[variant][b]: seconds of one transfer over boundary b.
    None if nothing fits. tol > 0 stops the scan over bottlenecks once no remaining one can improve the best by
    more than tol (relative)."""
    n, S = len(costs[0].F), p * v
    if S > n:
        return None
    legal = np.ones(n + 1, dtype=bool)
    legal[1:n] = np.all([cv.legal for cv in costs], axis=0)
    cut_ok = legal[:, None] & legal[None, :]
    by_q = {}  # stages with the same in-flight count share their options
    terms = range_terms(costs, xfer, p)
    for q in set(inflight[:S]):
        C, Fm, R = stage_options(costs, xfer, spec, p, v, m, q, cap, recompute, terms)
        C = np.where(cut_ok[None], C, INF)
        by_q[q] = (C, np.where(np.isfinite(C), Fm, INF), R)
    coef = proxy_coef(m, v)
    solve = lambda t, record=False: _min_sum_under(by_q, inflight[:S], n, t, record)
    vals = np.unique(np.concatenate([C[np.isfinite(C)] for C, _, _ in by_q.values()]))
    lo_sum, _ = solve(INF)
    if not np.isfinite(lo_sum):
        return None
    cmin_cluster = np.min([cv.F + cv.B + cv.W for cv in costs], axis=0)
    t_low = max(float(cmin_cluster.sum()) / S, float(cmin_cluster.max())) * (1 - 1e-12)
    lo, hi = int(np.searchsorted(vals, t_low)), len(vals) - 1  # smallest feasible bottleneck
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(solve(vals[mid])[0]):
            hi = mid
        else:
            lo = mid + 1
    best, best_t = INF, None
    for t in vals[lo:]:
        if coef * t + lo_sum >= best * (1 - tol):
            break
        s, _ = solve(t)
        if coef * t + s < best:
            best, best_t = coef * t + s, t
    bounds, variants = _backtrack(solve(best_t, record=True)[1], n)
    rec = [int(by_q[inflight[k]][2][variants[k], bounds[k], bounds[k + 1]]) for k in range(S)]
    cs = [by_q[inflight[k]][0][variants[k], bounds[k], bounds[k + 1]] for k in range(S)]
    fs = [by_q[inflight[k]][1][variants[k], bounds[k], bounds[k + 1]] for k in range(S)]
    return Partition(bounds, variants, float(coef * max(cs) + sum(fs)), rec)


def _min_sum_under(by_q: dict, inflight: list[int], n: int, t: float, record: bool = False):
    """min sum f over partitions of n clusters into len(inflight) stages with every stage's c <= t (dynamic
    program over the stage index), and with record the argmins per stage that _backtrack reads. Stage k (of S) of
    a partition into non-empty stages starts at a cluster in [k, n - S + k] and ends in [k + 1, n - S + k + 1]:
    only that band is computed (a deep pipeline of about one cluster per stage is a few columns wide), the same
    candidates as over every range, the others being empty ranges or starts no partition reaches."""
    S = len(inflight)
    D = np.full(n + 1, INF)
    D[0] = 0.0
    arg, masked = [], {}
    for q in dict.fromkeys(inflight):  # a stage's options, masked at t, over the band of every stage holding q
        ks = [k for k, qk in enumerate(inflight) if qk == q]
        j0, i1 = ks[0], n - S + ks[-1] + 1
        C, Fm, _ = by_q[q]
        cost = np.where(C[:, j0:i1, j0 + 1 : i1 + 1] > t, INF, Fm[:, j0:i1, j0 + 1 : i1 + 1])
        masked[q] = (j0, cost.min(axis=0), cost.argmin(axis=0) if record else None)
    for k, q in enumerate(inflight):
        j0, cmin, vbest = masked[q]
        lo, hi = k - j0, n - S + k + 1 - j0  # this stage's starts (and ends - 1) within the masked block
        tot = D[k : n - S + k + 1, None] + cmin[lo:hi, lo:hi]
        jb = tot.argmin(axis=0)
        new = np.full(n + 1, INF)
        new[k + 1 : n - S + k + 2] = tot[jb, np.arange(hi - lo)]
        D = new
        if record:
            full_jb, full_vb = np.zeros(n + 1, dtype=int), np.zeros((n + 1, n + 1), dtype=int)
            full_jb[k + 1 : n - S + k + 2] = jb + k
            full_vb[k : n - S + k + 1, k + 1 : n - S + k + 2] = vbest[lo:hi, lo:hi]
            arg.append((full_jb, full_vb))
    return D[n], arg


def _backtrack(arg: list, n: int) -> tuple[list[int], list[int]]:
    """(stage bounds, variant per stage) of the partition the recorded dynamic program found."""
    bounds, variants, i = [n], [], n
    for k in range(len(arg) - 1, -1, -1):
        jb, vb = arg[k]
        j = int(jb[i])
        variants.append(int(vb[j, i]))
        bounds.append(j)
        i = j
    bounds.reverse()
    variants.reverse()
    return bounds, variants


def brute_force(costs: list, xfer, spec, p, v, m, inflight, cap, recompute: bool = True) -> Partition | None:
    """Every legal cut set and variant assignment (small models only): `partition` must find the same minimum."""
    n, S = len(costs[0].F), p * v
    opts = {q: stage_options(costs, xfer, spec, p, v, m, q, cap, recompute) for q in set(inflight[:S])}
    legal = [b for b in range(1, n) if all(cv.legal[b - 1] for cv in costs)]
    best = None
    for cuts in itertools.combinations(legal, S - 1):
        bounds = [0, *cuts, n]
        for vs in itertools.product(range(len(costs)), repeat=S):
            cs = [opts[inflight[k]][0][vs[k], bounds[k], bounds[k + 1]] for k in range(S)]
            if not all(np.isfinite(cs)):
                continue
            fs = [opts[inflight[k]][1][vs[k], bounds[k], bounds[k + 1]] for k in range(S)]
            val = proxy_coef(m, v) * max(cs) + sum(fs)
            if best is None or val < best.proxy_s - 1e-15:
                best = Partition(
                    bounds,
                    list(vs),
                    float(val),
                    [int(opts[inflight[k]][2][vs[k], bounds[k], bounds[k + 1]]) for k in range(S)],
                )
    return best
