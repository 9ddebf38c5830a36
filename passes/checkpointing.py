"""Pass: activation checkpointing per repeated block, decided when the plan is memory-bound.

Runs after `costs`, before `solve`. A block is one layer of a repeated region (`layers.3`). Checkpointing it
  * saves memory: its saved activations are dropped after its forward and only its input is kept (the block
    output of the layer before, counted through the block's own output here); while it is recomputed in the
    backward, one block's activations are live again;
  * costs time: the block's forward compute runs a second time in the backward (its recompute; the collectives
    inside the recomputed forward are not charged).
Both effects are linear in each decision group's strategy, so the solver prices them exactly: with the first k
blocks checkpointed, group g's row of the memory constraint becomes
    state_mem + act_mem - k * L_g + k * I_g + [k > 0] * L_g        (L: one block's saved activations, I: its output)
and its time row gains k * F_g (F: one block's forward compute).

Decision (cheap unless memory is tight): nothing is checkpointed when no assignment can exceed the budget, or
when the smallest memory row without checkpointing is under 90% of the budget (the planner's time is spent only
where memory binds). Otherwise the candidates are k = 0 (when its floor fits), the smallest k whose floor fits,
and k = all blocks; each is solved (with the solve pass's liveness check) and the lowest objective wins (ties:
fewer blocks). The chosen k is applied to `state.cost` for the solve pass,
recorded in `state.recompute` (which the liveness peak and the step-time prediction honour) and in the plan's
meta["checkpointing"]. `allow_checkpointing=False` turns the pass off.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from autopar.liveness import liveness_peak, state_bytes
from autopar.passes.solve import expand_choice
from autopar.solver import InfeasibleMemoryError, SolverTimeLimitError, solve
from autopar.strategies import num_shards


def _block_vectors(state, members: list[int]):
    """Per decision group, per root strategy: (L saved bytes, I output bytes, F forward seconds) of one block."""
    g, S, choice, group_of, rep = state.graph, state.strategies, state.choice, state.group_of, state.rep
    mesh_shape, node_time = state.mesh.shape, state.cost["node_time"]
    K = [len(c) for c in state.cost["compute"]]
    L = defaultdict(lambda: None)
    I, F = {}, {}
    inside = set(members)

    def vec(store, gi):
        if gi not in store or store[gi] is None:
            store[gi] = np.zeros(K[gi])
        return store[gi]

    for i in members:
        n = g.nodes[i]
        if n.kind != "op" or n.phase != "fw":
            continue
        r, gi = rep[i], group_of[i]
        strat = [S[r][int(j)] for j in choice[r]]
        F_g = vec(F, gi)
        for k, s in enumerate(strat):
            F_g[k] += node_time(n, s)
        outs = [o for o, m in enumerate(n.outs) if m is not None]
        if outs and any(g.nodes[u].phase == "bw" for u in n.users):
            L_g = vec(L, gi)
            for k, s in enumerate(strat):
                L_g[k] += sum(n.outs[o].nbytes / num_shards(s.out[o], mesh_shape) for o in outs if s.out[o])
        if any(g.nodes[u].phase == "fw" and u not in inside for u in n.users):
            I_g = vec(I, gi)
            for k, s in enumerate(strat):
                I_g[k] += sum(n.outs[o].nbytes / num_shards(s.out[o], mesh_shape) for o in outs if s.out[o])
    return {k: v for k, v in L.items() if v is not None}, I, F


def _blocks(state) -> list[tuple[str, list[int]]]:
    """(module FQN, node indices) of every block of every repeated region, in execution order."""
    members = defaultdict(list)
    for n in state.graph.nodes:
        key = state.region_of[n.idx]
        if key is not None:
            members[key].append(n.idx)
    out = []
    for reg in state.regions:
        for i in reg["layers"]:
            out.append((f"{reg['prefix']}.{i}", members[(reg["prefix"], i)]))
    return sorted(out, key=lambda b: b[1][0])


def _floors(base_mem, vecs) -> list[float]:
    """min_memory of the memory rows with the first k blocks checkpointed, for every k (incrementally)."""
    mem = {gi: r.copy() for gi, r in enumerate(base_mem)}
    mins = {gi: float(r.min()) if len(r) else 0.0 for gi, r in mem.items()}
    total = sum(mins.values())
    out = [total]
    extra = vecs[0][0] if vecs else {}
    for b, (L, I, F) in enumerate(vecs):
        touched = set(L) | set(I) | (set(extra) if b == 0 else set())
        for gi in touched:
            if gi in L:
                mem[gi] -= L[gi]
            if gi in I:
                mem[gi] += I[gi]
            if b == 0 and gi in extra:
                mem[gi] += extra[gi]
            m = float(mem[gi].min())
            total += m - mins[gi]
            mins[gi] = m
        out.append(total)
    return out


def _rows(base_lin, base_mem, vecs, k):
    """Time and memory rows with the first k blocks checkpointed."""
    lin = [a.copy() for a in base_lin]
    mem = [a.copy() for a in base_mem]
    for b in range(k):
        L, I, F = vecs[b]
        for gi, v in F.items():
            lin[gi] += v
        for gi, v in L.items():
            mem[gi] -= v
        for gi, v in I.items():
            mem[gi] += v
    if k:
        for gi, v in vecs[0][0].items():  # one block's activations live again while it is recomputed
            mem[gi] += v
    return lin, mem


TIGHT = 0.9  # below this fraction of the budget the floor leaves room: checkpointing is not considered


def run(state) -> None:
    state.recompute = None
    decision = {"blocks": [], "why": ""}
    state.extras["checkpointing"] = decision
    if not state.options.get("allow_checkpointing", True):
        decision["why"] = "disabled (allow_checkpointing=False)"
        return
    blocks = _blocks(state) if state.regions else []
    if not blocks:
        decision["why"] = "no repeated blocks"
        return
    c = state.cost
    base_lin = [a + b for a, b in zip(c["compute"], c["comm"])]
    base_mem = [a + b for a, b in zip(c["state_mem"], c["act_mem"])]
    budget = state.budget
    most = float(sum(r.max() for r in base_mem if len(r)))
    if most <= budget:
        decision["why"] = (
            f"not memory-bound: even the largest assignment ({most / 1e9:.3f} GB per rank in the "
            f"memory row) fits the budget {budget / 1e9:.3f} GB"
        )
        return
    floor0 = float(sum(r.min() for r in base_mem if len(r)))
    if floor0 <= TIGHT * budget:
        decision["why"] = (
            f"not memory-bound: a plan fits without checkpointing (smallest memory row "
            f"{floor0 / 1e9:.3f} GB <= {TIGHT:.0%} of the budget {budget / 1e9:.3f} GB)"
        )
        return
    cache: dict = {}
    vecs = []
    for fqn, members in blocks:
        key = state.rep[members[0]]  # blocks of one region share their representative
        if key not in cache:
            rep_members = [state.rep[i] for i in members]
            cache[key] = _block_vectors(state, rep_members)
        vecs.append(cache[key])
    floors = _floors(base_mem, vecs)
    kmin = next((k for k in range(1, len(blocks) + 1) if floors[k] <= budget), None)
    cands = sorted({k for k in ([0] if floors[0] <= budget else []) + ([kmin, len(blocks)] if kmin else [])})
    if not cands:
        raise InfeasibleMemoryError(
            f"no plan fits {budget / 1e9:.3f} GB per rank on mesh {state.mesh}: the smallest achievable (model state "
            f"and saved activations, all maximally sharded) is {floors[0] / 1e9:.3f} GB, and "
            f"{floors[len(blocks)] / 1e9:.3f} GB with activation checkpointing of all {len(blocks)} blocks",
            smallest_bytes=floors[len(blocks)],
        )
    objective = {}
    if len(cands) > 1:
        for k in cands:
            obj = _solve_fits(state, blocks[:k], *_rows(base_lin, base_mem, vecs, k), floors[k])
            if obj is not None:
                objective[k] = obj
    k = min(objective, key=lambda x: (objective[x], x)) if objective else cands[-1]
    decision["candidates"] = {str(x): {"floor_bytes": floors[x], "objective_s": objective.get(x)} for x in cands}
    if k == 0:
        decision["why"] = (
            "memory-bound, but the best plan without checkpointing (objective "
            f"{objective[0] * 1e3:.3f} ms) beats checkpointing"
        )
        return
    lin, mem = _rows(base_lin, base_mem, vecs, k)
    # hand the chosen rows to the solve pass (compute += recompute, act_mem -= dropped activations)
    for gi in range(len(lin)):
        c["compute"][gi] = lin[gi] - c["comm"][gi]
        c["act_mem"][gi] = mem[gi] - c["state_mem"][gi]
    state.recompute = [{"block": fqn, "nodes": members} for fqn, members in blocks[:k]]
    decision["blocks"] = [fqn for fqn, _ in blocks[:k]]
    decision["why"] = (
        f"memory-bound: floor without checkpointing {floors[0] / 1e9:.3f} GB vs budget "
        f"{budget / 1e9:.3f} GB; checkpointing {k} of {len(blocks)} blocks"
        + (f" (objective {objective[k] * 1e3:.3f} ms)" if k in objective else "")
    )


def _solve_fits(state, blocks, lin, mem, floor):
    """The objective of the best plan with these blocks checkpointed whose liveness peak fits the budget (the
    solve pass's tightening loop), or None."""
    recompute = [{"block": fqn, "nodes": members} for fqn, members in blocks] or None
    row = state.budget
    for _ in range(4):
        try:
            res = solve(lin, state.cost["edges"], [(mem, row)], time_limit=state.options.get("time_limit", 60.0))
        except (InfeasibleMemoryError, SolverTimeLimitError):  # this set of blocks: no plan (in time)
            return None
        placement = expand_choice(state, res)
        peak = state_bytes(state.graph, placement, state.mesh.shape, state.precision) + liveness_peak(
            state.graph, placement, state.mesh.shape, recompute
        )
        if peak <= state.budget:
            return res.objective
        row -= 1.05 * (peak - state.budget)
        if row < floor:
            return None
    return None
