"""Pass: pipeline stages (Alpa-style inter-op pass): per-cluster costs from the per-op plan of each stage, and the
evaluation of a partition. The search over pp degree / submesh / schedule / micro-batches is
passes/stage_search.py; the schedule model and the dynamic program are autopar/pipeline_model.py.

Layer clusters: "pre" (everything before the first block of the model's layer list: embedding, RoPE tables),
one cluster per block, "post" (final norm, head, loss). For each candidate stage submesh and micro-batch shape
`StageOps` runs the intra-op passes (regions, candidates, costs, solve, redistribute) on a representative sub-model
(the model with its layer list cut to one block per distinct block signature) at the micro-batch shape: the
time-optimal plan and the plan with parameters sharded over the dp dims; parameter gathers and gradient reductions,
which a stage pays once per step for m micro-batches, are weighted 1/m in their objective. That gives per cluster:
forward F, input-backward B, weight-backward W (seconds per micro-batch, compute + activation redistributes),
data-parallel comm per step, model-state bytes, saved-activation bytes per micro-batch, what checkpointing a block
saves and costs, and per cluster boundary the activations that cross it.

Stage mesh dims: dp* split the batch, cp* the sequence (context parallelism: the token inputs and the embedding
Shard(1), attention's queries Shard(2) with K/V all-gathered, parameters FSDP-sharded over dp x cp; on such a mesh
the data dims keep only batch / sequence splits, autopar/strategies/context_parallel.py), any other dim of size > 1
is tensor parallel.

A boundary is a legal cut when the forward tensors crossing it (produced before, consumed after; tensors that
depend on no input or parameter, like RoPE tables, are recomputed by each stage, inputs go straight to the stage
that reads them) are at least one, all with static shapes (one sweep over the captured graph in topological order
finds them exactly); their bytes, on the link between the two stages' ranks, cost one p2p transfer forward
(activation) and one backward (its gradient) per micro-batch.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from torch import nn

from autopar import pipeline_engine as pe
from autopar import pipeline_model as pm
from autopar.capture import capture
from autopar.capture_error import CaptureError
from autopar.cost import collective_time
from autopar.mesh import MeshSpec
from autopar.model_io import ModelIO
from autopar.passes import PASSES, candidates, solve
from autopar.passmanager import PlanState, run_passes
from autopar.predict import build_plan, engine_priced
from autopar.solver import InfeasibleMemoryError, min_memory
from autopar.strategies import data_parallel as dp
from autopar.strategies.context_parallel import CP_PREFIX, cp_pin, keep_data_splits
from autopar.strategies.pins import overlay_pins

from .stage_metrics import cluster_of_nodes, crossings, node_metrics

INF = float("inf")


# ---- per-cluster costs ---------------------------------------------------------------------------------------
@dataclass
class Costs:
    """One intra-op variant, per full-model cluster (arrays of length n) and boundary (length n - 1)."""

    name: str
    F: np.ndarray
    B: np.ndarray
    W: np.ndarray
    dp: np.ndarray  # data-parallel comm seconds per step
    state: np.ndarray  # model-state bytes per rank
    act: np.ndarray  # saved-activation bytes per rank per micro-batch
    xbytes: np.ndarray  # bytes per rank crossing boundary b (between cluster b and b+1)
    legal: np.ndarray  # bool per boundary
    ntensors: np.ndarray  # tensors crossing each boundary
    base: int = 0  # index of the intra-op plan (StageOps.plans) these costs come from
    blk: np.ndarray = None  # bool per cluster: a block (may be checkpointed)
    save: np.ndarray = None  # bytes per micro-batch a checkpointed block frees (its activations minus its input)
    rtime: np.ndarray = None  # seconds a checkpointed block adds (its forward, run again before its backward)
    # most bytes per micro-batch live while the cluster runs (autopar/liveness.py cluster_peaks), and what the
    # caching allocator holds reserved beyond that over its own buffers (cluster_idle)
    peak: np.ndarray = None
    idle: np.ndarray = None


def find_layers(model: nn.Module) -> str:
    """FQN of the model's layer list: the nn.ModuleList / ModuleDict with the most children (shallowest on ties),
    lists of blocks (children with children) before lists of single layers (DPT's per-feature-map neck convs,
    Speech2Text's conv subsampler are not the stack of blocks)."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0 and name:
            blocks = all(next(c.children(), None) is not None for c in mod.children())
            key = (blocks, len(mod), -name.count("."))
            if best is None or key > best[0]:
                best = (key, name)
    if best is None:
        raise ValueError(
            f"pipeline planning needs a layer list (nn.ModuleList/ModuleDict of blocks) in "
            f"{type(model).__name__}; none found"
        )
    return best[1]


def layer_signature(mod: nn.Module) -> tuple:
    return (
        type(mod).__name__,
        tuple((n, tuple(p.shape), str(p.dtype)) for n, p in mod.named_parameters()),
        tuple(type(m).__name__ for _, m in mod.named_modules()),
    )


@contextmanager
def swap_layers(model: nn.Module, prefix: str, blocks: list):
    parent, _, attr = prefix.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, attr)
    new = (
        nn.ModuleList(blocks)
        if isinstance(old, nn.ModuleList)
        else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
    )
    setattr(owner, attr, new)
    try:
        yield
    finally:
        setattr(owner, attr, old)


def cluster_metrics(state, plan, prefix: str, n_sub: int) -> dict:
    """Per sub-model cluster (0 = pre, 1..n_sub blocks, n_sub + 1 = post) F/B/W/dp/state/act, and per boundary after
    position q (0..n_sub) the crossing tensors' local bytes and count."""
    g = state.graph
    where = cluster_of_nodes(g, prefix, n_sub)
    K = n_sub + 2
    metrics = node_metrics(state, plan, where, K)
    cross_bytes, cross_n = crossings(state, where, K)
    ops = np.zeros(K, dtype=int)
    for n in g.ops():
        if where[n.idx] is not None:
            ops[where[n.idx]] += 1
    param_pos = {fqn: where[i] for fqn, i in g.params.items()}
    eng = {}
    if engine_priced(state.cluster):
        eng = pe.engine_terms(g, state.placement, where, K, state.mesh, state.precision, state.cluster)
    return {
        **{
            k: metrics[k]
            for k in ("F", "B", "W", "dp", "state", "act", "state_dp", "peak", "idle", "sac_time", "sac_bytes")
        },
        **eng,
        "xbytes": cross_bytes,
        "xn": cross_n,
        "coll": metrics["coll"],
        "ops": ops,
        "param_pos": param_pos,
    }


def expand(metrics: dict, pos_of: list[int], n_sub: int, name: str, ac: str = "block") -> Costs:
    """Sub-model metrics -> full-model clusters: pre, block i (costed as its representative pos_of[i]), post.
    ac: what checkpointing a block means: "block" reruns its forward, "op" is torchtitan's selective op SAC."""
    idx = [0] + [1 + p for p in pos_of] + [n_sub + 1]
    arr = lambda k: np.array([metrics[k][j] for j in idx], dtype=float)
    xb = np.array([metrics["xbytes"][j] for j in idx[:-1]])
    xn = np.array([metrics["xn"][j] for j in idx[:-1]])
    c = Costs(name, arr("F"), arr("B"), arr("W"), arr("dp"), arr("state"), arr("act"), xb, xn > 0, xn)
    c.blk = np.array([False] + [True] * len(pos_of) + [False])
    kept_in = np.concatenate([[0.0], xb])  # a checkpointed block keeps its input
    if ac == "op":  # torchtitan's op SAC (stage_metrics.SAC_SAVED): the saved ops' outputs stay, the rest reruns
        c.save = np.where(c.blk, np.maximum(0.0, c.act - kept_in - arr("sac_bytes")), 0.0)
        c.rtime = np.where(c.blk, np.maximum(0.0, c.F - arr("sac_time")), 0.0)
    else:  # the whole block reruns
        c.save = np.where(c.blk, np.maximum(0.0, c.act - kept_in), 0.0)
        c.rtime = np.where(c.blk, c.F, 0.0)
    c.peak = arr("peak") if "peak" in metrics else None
    c.idle = arr("idle") if "idle" in metrics else None
    c.coll = [metrics["coll"][j] for j in idx]
    for k in ("ag", "ag_bw", "rs", "kept", "opt_s"):  # the engines' terms (autopar/pipeline_engine.py engine_step)
        setattr(c, k, arr(k) if k in metrics else None)
    c.state_dp = arr("state_dp")  # the part of `state` sharded over the dp dims (passes/stage_estimate.py)
    c.ops = [int(metrics["ops"][j]) for j in idx]
    c.param_pos = metrics["param_pos"]
    return c


def _with_user_pin(stage_pin, user_pin, graph):
    """The stage's own pins (what the pipeline runtime and cp require) over the caller's plan(pin=) (an object with
    for_graph is bound to this stage's captured graph first): the stage's placement wins on a mesh dim both name."""
    if hasattr(user_pin, "for_graph"):
        user_pin = user_pin.for_graph(graph)
    return overlay_pins(user_pin, stage_pin)


def _capture_sub_model(model, call, loss_fn, prefix: str, n: int, total: int):
    """capture() of the representative sub-model, a failure of the model's forward on it said as such."""
    try:
        return capture(model, call, loss_fn)
    except Exception as e:  # the whole model captured: say on what this ran, and the likely cause
        hint = (  # the whole model captured, so the forward needs all of the list
            f" (a forward that reads every block's output, as a multi-scale head, cannot be cut at '{prefix}')"
        )
        if isinstance(e, IndexError):
            hint = (
                f" (a forward that loops over its own layer count across parallel module lists, as XLM's "
                f"attentions / ffns, cannot be cut at '{prefix}')"
            )
        elif "more than 1 value per channel" in str(e):
            hint = " (a BatchNorm of one row: fewer micro-batches, pipeline=dict(n_microbatches=[...]))"
        raise CaptureError(
            f"pipeline planning runs {type(model).__name__} with {n} of the {total} blocks of '{prefix}' (the "
            f"stages' representative sub-model) on one micro-batch, and its forward raised {type(e).__name__}: "
            f"{e}{hint}"
        ) from e


# ---- intra-op plans of one stage ------------------------------------------------------------------------------
class StageOps:
    """The intra-op plans of the representative sub-model on one stage submesh at one micro-batch shape (see
    `more` for which); the stage DP picks one per stage."""

    def __init__(self, model, prefix, reps, pos_of, mb_inputs, stage_mesh: MeshSpec, ctx):
        t0 = time.perf_counter()
        layers = model.get_submodule(prefix)
        blocks = [layers[i] if isinstance(layers, nn.ModuleList) else list(layers.values())[i] for i in reps]
        # keyword inputs: the example's bound call (ctx["io"]) rebuilt around this micro-batch's leaves
        call = ModelIO(model, *ctx["io"].call_args(list(mb_inputs))) if ctx.get("io") else mb_inputs
        with swap_layers(model, prefix, blocks):
            g = _capture_sub_model(model, call, ctx["loss_fn"], prefix, len(blocks), len(layers))
            styled = {
                f"{k}.{n}"
                for k, mod in model.named_modules()
                if isinstance(mod, (nn.Linear, nn.Embedding))
                for n, _ in mod.named_parameters(recurse=False)
            }
        # the pipeline runtime shards only nn.Linear / nn.Embedding weights on a tensor-parallel stage dim (any dim
        # of size > 1 not named dp* or cp*, as backends/pipelining/runtime.py reads it): every other parameter is
        # Replicate there. A cp* dim splits the sequence (autopar/strategies/context_parallel.py).
        tp = {d: "R" for d in model_dims(stage_mesh)}
        pin = (lambda n: tp if n.kind == "param" and n.target not in styled else None) if tp else None
        where = cluster_of_nodes(g, prefix, len(reps))
        pre = {n.idx for n in g.ops() if where[n.idx] == 0 and n.phase == "fw"}
        pin = _with_user_pin(cp_pin(g, stage_mesh.names, stage_mesh.shape, pin, pre), ctx.get("pin"), g)
        data = dp.dp_dims(stage_mesh.names, stage_mesh.shape) if ctx["dp_shards_batch"] else []
        if data:  # the stage's dp* dims split every batched input on dim 0, whatever else is pinned
            pin = overlay_pins(pin, dp.batch_pin(g, stage_mesh.names, stage_mesh.shape, data))
        sub_force = {}
        for fqn, pl in ctx["force"].items():
            m = re.match(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$", fqn)
            if m is None:
                sub_force[fqn] = pl
            elif int(m.group(1)) in reps:
                sub_force[f"{prefix}.{reps.index(int(m.group(1)))}.{m.group(2)}"] = pl
        self.state = PlanState(
            g,
            stage_mesh,
            ctx["cluster"],
            ctx["precision"],
            1e30,
            {
                "force": sub_force,
                "replicate_ops": ctx["replicate_ops"],
                "pin": pin,
                # on a one-device stage every placement is Replicate: no rule is needed to say so
                "allow_replicate": ctx["allow_replicate"] or stage_mesh.size == 1,
                "time_limit": ctx["time_limit"],
                "mixed_precision": None,
                "float8": ctx.get("float8"),
                "allow_checkpointing": False,
            },
        )
        self._k = PASSES.index(solve)
        kc = PASSES.index(candidates) + 1
        run_passes(self.state, PASSES[:kc])
        keep_data_splits(self.state, data, dp.batch_rows(g))
        run_passes(self.state, PASSES[kc : self._k])
        amortize_dp_comm(self.state, int(ctx.get("n_microbatches", 1)))
        c = self.state.cost
        self._rows = [c["state_mem"][i] + c["act_mem"][i] for i in range(len(c["compute"]))]
        self._floor = min_memory(self._rows)
        self.prefix, self.reps, self.pos_of, self.ctx = prefix, reps, pos_of, ctx
        self.variants, self.plans, self.budgets, self._seen = [], [], [], set()
        self._budget, self._left = 1e30, max(1, ctx["n_variants"])
        self.seconds = 0.0
        while self.more():
            pass
        self.seconds = time.perf_counter() - t0
        if ctx.get("drop_state"):  # travels back from a worker process: keep only the results
            self.state = self.ctx = None

    def costs(self) -> list:
        """What the stage DP chooses from (each with any number of checkpointed blocks per stage)."""
        return list(self.variants)

    def more(self) -> bool:
        """Add the next intra-op plan; True if it differs from those so far. Order: time-optimal; parameters
        sharded over the dp dims (FSDP/ZeRO-3: the per-op plan re-solved with unsharded parameter placements
        priced out, an LP); then (n_variants > 2) plans under memory budgets halfway to, and at, the most-sharded."""
        t0 = time.perf_counter()
        st = self.state
        while st is not None and self._left > 0 and self._budget is not None:
            self._left -= 1
            step = self.ctx["n_variants"] - self._left - 1
            budget = st.budget = self._budget if step != 1 else 1e30
            st.placement = st.redistributes = st.solution = None  # re-solve from the same costs
            if budget < 1e29:  # tight budgets make branch-and-bound work; cap it
                st.options["time_limit"] = min(self.ctx["time_limit"], self.ctx.get("lean_time_limit", 10.0))
            pen = self._fsdp_penalty() if step == 1 else None
            if pen == {}:  # nothing left unsharded on dp (or no dp dim): same plan again
                continue
            try:
                if pen is not None:
                    for g, v in pen.items():
                        st.cost["compute"][g] += v
                run_passes(st, PASSES[self._k :])
            except InfeasibleMemoryError:
                self._budget = None
                break
            finally:
                if pen is not None:
                    for g, v in pen.items():
                        st.cost["compute"][g] -= v
            mem = sum(self._rows[i][st.solution.choice[i]] for i in range(len(self._rows)))
            if step >= 1:
                self._budget = (
                    None
                    if mem <= self._floor * 1.0001
                    else self._floor * 1.0001
                    if self._left == 1
                    else (mem + self._floor) / 2
                )
            key = tuple(st.solution.choice)
            if key in self._seen:
                continue
            self._seen.add(key)
            plan = build_plan(st)
            met = cluster_metrics(st, plan, self.prefix, len(self.reps))
            label = (
                "time-optimal" if step == 0 else "params sharded on dp" if step == 1 else f"mem<={budget / 1e9:.4g}GB"
            )
            cv = expand(met, self.pos_of, len(self.reps), f"v{len(self.variants)} {label}", self.ctx.get("ac", "block"))
            cv.base = len(self.plans)
            self.variants.append(cv)
            self.plans.append(plan)
            self.budgets.append(budget)
            self.seconds += time.perf_counter() - t0
            return True
        self.seconds += time.perf_counter() - t0
        return False

    def _fsdp_penalty(self) -> dict:
        """Per decision group, +1 s on strategies that leave a parameter unsharded on some dp or cp dim (when a
        sharded one exists): the next solve then shards every parameter over them, FSDP-style (torchtitan shards
        over dp x cp: a cp rank holds its sequence shard of the same batch, so cp is data parallel for weights)."""
        st = self.state
        dims = sharding_dims(st.mesh)
        pen = {}
        if not dims:
            return pen
        for i in st.graph.params.values():
            r = st.rep[i]
            ch = st.choice.get(r) if isinstance(st.choice, dict) else None
            if ch is None:
                continue
            ok = np.array([all(st.strategies[r][j].out[0][d][0] == "S" for d in dims) for j in ch])
            if ok.any() and not ok.all():
                g = st.group_of[r]
                pen[g] = pen.get(g, 0.0) + np.where(ok, 0.0, 1.0)
        return pen


def model_dims(mesh: MeshSpec) -> list[int]:
    """The stage submesh's tensor-parallel dims: size > 1, named neither dp* (batch) nor cp* (sequence)."""
    return [
        d
        for d, (nm, n) in enumerate(zip(mesh.names, mesh.shape))
        if n > 1 and not nm.startswith("dp") and not nm.startswith(CP_PREFIX)
    ]


def sharding_dims(mesh: MeshSpec) -> list[int]:
    """The dims FSDP shards parameters over: dp* and cp*, of size > 1."""
    return [
        d
        for d, (nm, n) in enumerate(zip(mesh.names, mesh.shape))
        if n > 1 and (nm.startswith("dp") or nm.startswith(CP_PREFIX))
    ]


def amortize_dp_comm(state, m: int) -> None:
    """The sub-model is planned for one micro-batch, but a stage runs m of them per step while parameters are
    gathered and gradients reduced once (FSDP2 under torch's schedules: no resharding between micro-batches,
    gradient sync on the last backward). Scale the parameter-side terms of the solver's objective by 1/m: the edges
    out of a parameter's decision group (gathers), into it (the gradient -> optimizer-step edge) and the
    redistributes inside it."""
    if m <= 1:
        return
    c = state.cost
    pg = {state.group_of[i] for i in state.graph.params.values()}
    for key, mat in c["edges"].items():
        if key[0] in pg or key[1] in pg:
            c["edges"][key] = mat / m
    for g in pg:
        c["comm"][g] = c["comm"][g] / m


def p2p_link(cluster, stage_size: int, a: int, b: int):
    """Link between pp ranks a and b: stage submeshes are consecutive blocks of `stage_size` ranks (row-major mesh
    with pp outermost) and nodes hold `gpus_per_node` consecutive ranks; intra-node iff every rank of a's block and
    its peer in b's block share a node."""
    g = cluster.gpus_per_node
    same = all((a * stage_size + r) // g == (b * stage_size + r) // g for r in (0, stage_size - 1))
    return cluster.intra if same and stage_size <= g else cluster.inter


# ---- evaluation of one partition ------------------------------------------------------------------------------
def stage_transient(cv, a: int, b: int, recompute: int) -> float:
    """The largest transient (autopar/pipeline_model.py transients) of clusters a..b-1, one of which runs at a time,
    with `recompute` blocks checkpointed: what a rank holds beyond its in-flight saved activations."""
    return _stage_peak(cv, a, b, recompute)[0]


def _stage_peak(cv, a: int, b: int, recompute: int) -> tuple[float, float]:
    """(stage_transient, the caching allocator's idle reserved bytes (Costs.idle) of the cluster that sets it): where
    the stage peaks, what memory_reserved (TorchTitan's published figure) adds over the allocated peak."""
    plain, ckpt = pm.transients(cv)
    t = (ckpt if recompute else plain)[a:b]
    k = int(np.argmax(t))
    idle = float(cv.idle[a + k]) if getattr(cv, "idle", None) is not None else 0.0
    return float(t[k]), idle


def _stage_terms(costs, bounds, variants, recompute, rank_of, cluster, stage_size) -> tuple:
    """Per stage k: F, B, W seconds, dp comm, state and saved-activation bytes, its transient and idle bytes, and
    the (bytes, link, seconds) of its send to stage k + 1 (0 s on the same rank)."""
    S = len(bounds) - 1
    F, B, W, dp, st, act, x, trans, idle = [], [], [], [], [], [], [], [], []
    for k in range(S):
        cv, a, b, r = costs[variants[k]], bounds[k], bounds[k + 1], recompute[k]
        nb = max(1, int(cv.blk[a:b].sum()))
        F.append(float(cv.F[a:b].sum()))
        B.append(float(cv.B[a:b].sum() + r * cv.rtime[a:b].sum() / nb))
        W.append(float(cv.W[a:b].sum()))
        dp.append(float(cv.dp[a:b].sum()))
        st.append(float(cv.state[a:b].sum()))
        act.append(float(cv.act[a:b].sum() - r * cv.save[a:b].sum() / nb))
        t, i = _stage_peak(cv, a, b, r)
        trans.append(t)
        idle.append(i)
        if k < S - 1:
            link = p2p_link(cluster, stage_size, rank_of[k], rank_of[k + 1])
            nbytes = float(cv.xbytes[b - 1])
            same = rank_of[k] == rank_of[k + 1]
            x.append((nbytes, link.name, 0.0 if same else collective_time("send_recv", nbytes, 2, link)))
    return F, B, W, dp, st, act, x, trans, idle


def evaluate(
    costs, bounds, variants, recompute, spec, p, v, m, order, cluster, stage_size, budget, detail=False, quick=False
) -> dict:
    """Step time (simulated on torch's action order), bubble and per-rank memory of one partition: stage k holds
    clusters bounds[k]:bounds[k+1] with intra-op plan costs[variants[k]] and recompute[k] checkpointed blocks.
    quick (the search's DP results): a partition whose memory before FSDP's unsharded units is over budget
    returns {step_s: inf, fits: False, peak_mem (that lower bound)} without the simulation."""
    S = p * v
    rank_of = pm.stage_ranks(spec, p, v)
    F, B, W, dp, st, act, x, trans, idle = _stage_terms(
        costs, bounds, variants, recompute, rank_of, cluster, stage_size
    )
    act_peak = pm.rank_act_peak(order, act, spec.split_backward)
    rank_state = [sum(st[k] for k in range(S) if rank_of[k] == r) for r in range(p)]
    tr = [max((trans[k] for k in range(S) if rank_of[k] == r), default=0.0) for r in range(p)]
    mem = [rank_state[r] + act_peak[r] + tr[r] for r in range(p)]
    if quick and max(mem) > budget:  # FSDP's unsharded units only add: it cannot fit, skip the simulation
        return {"step_s": INF, "fits": False, "peak_mem": max(mem), "rank_mem": mem, "recompute": list(recompute)}
    eng = (
        _engine(costs, bounds, variants, recompute, order, rank_of, (F, B, W, x), detail, spec.multi)
        if engine_priced(cluster)
        else None
    )
    if eng is None:
        sim = pm.simulate(order, rank_of, F, B, W, [t for *_, t in x])
        no_p2p = pm.simulate(order, rank_of, F, B, W, [0.0] * len(x)).step_s if detail else sim.step_s
        exposed = [max(0.0, dp[k] - m * (F[k] + B[k] + W[k])) for k in range(S)]
        step, exposed_dp, exposed_p2p = sim.step_s + max(exposed), max(exposed), sim.step_s - no_p2p
    else:
        sim, step, exposed_dp, exposed_p2p = eng["sim"], eng["step_s"], eng["exposed_dp_s"], eng["exposed_p2p_s"]
    if eng is not None:  # FSDP2's unsharded parameters and gradients (autopar/pipeline_engine.py fsdp_unsharded_bytes)
        mem = [
            mem[r] + pe.fsdp_unsharded_bytes([eng["kept"][k] for k in range(S) if rank_of[k] == r], p) for r in range(p)
        ]
    fl = pm.inflight(order, S, spec.split_backward)
    # memory_reserved at the peak: the allocated peak + the idle cached segments of the rank's peaking cluster
    reserved = [mem[r] + max((idle[k] for k in range(S) if rank_of[k] == r), default=0.0) for r in range(p)]
    return {
        **({"optimizer_s": eng["optimizer_s"], "kept": eng["kept"]} if eng is not None else {}),
        "step_s": step,
        "pipeline_s": sim.step_s,
        "exposed_dp_s": exposed_dp,
        "exposed_p2p_s": exposed_p2p,
        "bubble": sim.bubble_fraction,
        "sim": sim,
        "F": F,
        "B": B,
        "W": W,
        "dp": dp,
        "state": st,
        "act": act,
        "xfer": x,
        "inflight": fl,
        "rank_of": rank_of,
        "rank_mem": mem,
        "fits": max(mem) <= budget,
        "recompute": list(recompute),
        "transient": trans,
        "idle": idle,
        "peak_mem": max(mem),
        "reserved_mem": max(reserved),
    }


def _engine(costs, bounds, variants, recompute, order, rank_of, times, detail, multi) -> dict:
    """evaluate's step on an NCCL cluster: FSDP2 under torch's schedule (autopar/pipeline_engine.py engine_step),
    with the stages' kept bytes; exposed_dp_s is what the gathers and reductions add to the schedule simulated
    without them (the optimizer step apart), exposed_p2p_s what the transfers add to that one."""
    F, B, W, x = times
    S, p = len(F), len(order)
    parts = [(costs[variants[k]], bounds[k], bounds[k + 1]) for k in range(S)]
    units = [pe.stage_units(cv, a, b, recompute[k], p == 1) for k, (cv, a, b) in enumerate(parts)]
    opt = [float(cv.opt_s[a:b].sum()) for cv, a, b in parts]
    eng = pe.engine_step(order, rank_of, F, B, W, [t for *_, t in x], units, opt, multi)
    plain, no_p2p = eng["sim"].step_s, eng["sim"].step_s  # the split below only for the plan's record (detail)
    if detail:
        plain = pm.simulate(order, rank_of, F, B, W, [t for *_, t in x]).step_s  # gathers, reductions took 0
        no_p2p = pm.simulate(order, rank_of, F, B, W, [0.0] * len(x)).step_s
    return {
        **eng,
        "exposed_p2p_s": plain - no_p2p,
        "exposed_dp_s": eng["step_s"] - eng["optimizer_s"] - plain,
        "kept": [cv.kept[a:b] for cv, a, b in parts],
    }


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
