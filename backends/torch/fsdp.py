"""FSDP2 in the recognition: which parameters the data-parallel dims shard (fully_shard units, one per repeated
block, the root last), which stay replicated (their gradients averaged by the bucket hook), and whether a unit
reshards after the forward (the plan gathers its parameters again in the backward)."""

from __future__ import annotations

from .batch import _check_batch_ops
from .lowering import EngineLoweringError, Unit


def blocks(plan) -> list[str]:
    """The plan's repeated blocks ("layers.0", ...)."""
    return [f"{r['prefix']}.{i}" for r in plan.regions for i in r["layers"]]


def _unit_fqns(plan, forced_units) -> list[str]:
    """The unit FQNs, root ("") last: the plan's blocks, or the user's units (each a whole block or more)."""
    plan_blocks = blocks(plan)
    if forced_units is None:
        return plan_blocks + [""]
    for u in forced_units:
        inside = next((b for b in plan_blocks if u.startswith(b + ".")), None)
        if inside:
            raise EngineLoweringError(
                f"FSDP unit '{u}' lies inside the repeated block '{inside}': the plan decides"
                f" per block, so a unit must be a whole block (or a union of blocks, or "
                f"the root)"
            )
    return [u for u in forced_units if u] + [""]


def _mesh_dims(low, ds) -> str:
    return "+".join(low.mesh_names[d] for d in ds)


def _placement_reason(low, fqn, pl) -> str | None:
    """Why the parameter's placement over the data dims is not FSDP2's (None when it is)."""
    if any(pl[d] != "R" for d in low.replicate_dims):
        return (
            f"is {pl} but dims {_mesh_dims(low, low.replicate_dims)} replicate every other "
            f"parameter (HSDP shards on one dim group only)"
        )
    sh = [pl[d] for d in low.shard_dims]
    if not all(p == "R" for p in sh) and len(set(sh)) != 1:
        return f"is {pl}: FSDP2 shards a parameter on one tensor dim over all of {_mesh_dims(low, low.shard_dims)}"
    return None


def _use_reason(low, G, fqn, unit, edges) -> str | None:
    """Why the plan's uses of a sharded parameter are not FSDP2's gather-before-use inside its unit."""
    dn = _mesh_dims(low, low.shard_dims)
    bad = [
        (c, j)
        for c, j, src in edges
        if G.rec(c).kind == "op" and any(G.rec(c).ins[j][d][0] != "R" for d in low.shard_dims)
    ]
    if bad:
        c, j = bad[0]
        user = G.rec(c)
        return (
            f"is used sharded on {dn} by "
            f"{user.name} in module '{user.module}' (input {j} "
            f"{list(user.ins[j])}): FSDP2 gathers a parameter before every use, and a "
            f"ParallelStyle cannot shard it on a mesh dim that also splits the batch (tensor or "
            f"expert parallelism on a data-parallel dim)"
        )
    outside = [c for c, _, _ in edges if unit.fqn and not G.in_module(c, unit.fqn)]
    if outside:
        c = outside[0]
        return (
            f"is used outside its FSDP unit '{unit.fqn}' by {G.rec(c).name} in "
            f"module '{G.rec(c).module or '<root>'}'; FSDP2 unshards it only while the unit runs"
        )
    return None


def _gathered_in_backward(low, G, nodes, edges) -> bool:
    """Whether the plan gathers the parameter (S -> R on a shard dim) for a backward consumer."""
    consumers = edges + [(c, 0, None) for c in nodes[1:]]
    return any(
        G.rec(c).phase == "bw"
        for c, j, _ in consumers
        if (c, j) in G.red
        and any(G.red[(c, j)].src[d][0] == "S" and G.red[(c, j)].dst[d] == "R" for d in low.shard_dims)
    )


def _assign(low, G, plan, per_unit, unit_of) -> None:
    """Each parameter into its unit: sharded, replicated (left to the bucket hook), or a reason."""
    for fqn, pl in plan.params.items():
        if fqn not in G.param_node or fqn in low.part_params:  # an alias of a tied parameter; a graph part's
            continue
        u = per_unit[unit_of(fqn)]
        why = _placement_reason(low, fqn, pl)
        if why is None and all(pl[d] == "R" for d in low.shard_dims):
            u.replicated.append(fqn)
            continue
        nodes, edges = G.chain(fqn) if why is None else ([], [])
        why = why or _use_reason(low, G, fqn, u, edges)
        if why is not None:
            low.reasons.append((f"parameter {fqn}", why))
            continue
        u.params.append(fqn)
        k = int(pl[low.shard_dims[0]][1:])
        if k != 0:
            u.shard_dims[fqn] = k
        if _gathered_in_backward(low, G, nodes, edges):
            u.reshard_after_forward = True


def _collect_units(low, per_unit) -> None:
    dn = _mesh_dims(low, low.shard_dims)
    for u in per_unit.values():
        if u.replicated:
            low.replicated_grads += u.replicated
        if not u.params and u.fqn:
            continue
        gathered = (
            "re-gathered in the backward"
            if u.reshard_after_forward
            else "kept from the forward's gather (no backward gather)"
        )
        u.why = f"{len(u.params)} params sharded on {dn}, gathered before use; {gathered}" + (
            f"; {len(u.replicated)} replicated params left out (ignored_params), grads all-reduced"
            if u.replicated
            else ""
        )
        if low.shard_dims:
            low.units.append(u)


def _note_data_layout(low) -> None:
    shard, rep = _mesh_dims(low, low.shard_dims), _mesh_dims(low, low.replicate_dims)
    if len(low.shard_dims) > 1 and low.replicate_dims:
        low.reasons.append(
            (
                "data-parallel dims",
                f"HSDP with a flattened shard group ({shard}) and a replicate group ({rep}) is not lowered",
            )
        )
    elif low.shard_dims and low.replicate_dims:
        low.notes.append(f"HSDP: replicate over {rep}, shard over {shard}")
    elif not low.shard_dims:
        low.notes.append(
            f"data parallel over {rep} with every parameter replicated: gradients "
            f"averaged in the plan's buckets (one all_reduce per bucket, started when its last "
            f"gradient is ready)"
        )


def recognize_fsdp(low, G, plan, forced_units) -> None:
    """low.units, low.replicated_grads and the reasons / notes of the data-parallel dims (module docstring)."""
    data = low.shard_dims + low.replicate_dims
    if not data:
        return
    unit_fqns = _unit_fqns(plan, forced_units)
    unit_of = lambda f: next((u for u in unit_fqns if u and f.startswith(u + ".")), "")
    per_unit = {u: Unit(u, [], False) for u in unit_fqns}
    _assign(low, G, plan, per_unit, unit_of)
    _check_batch_ops(low, G, plan, data, lambda ds: _mesh_dims(low, ds))
    _collect_units(low, per_unit)
    _note_data_layout(low)
