"""Explicit collectives for the SPMD executor: the redistribute steps of a plan run on local shards, and the plan-hash
agreement between ranks (backends/counter.py counts the collectives a step really issues).

Redistribute: `autopar.collectives.steps(src, dst)` lists the single-mesh-dim changes the planner priced; each
runs here as one collective on that mesh dim's process group (or a local chunk / zero / rescale), on the local
shard, through the `_c10d_functional` ops (the ones DTensor uses, and the ones LocalTensorMode simulates):
S->R all_gather, S(i)->S(j) all_to_all (a real all_to_all, also on gloo), P->R all_reduce, P->S reduce_scatter,
S->P all_gather + zero. Partial placements: "P" sum; "Pa" average (DTensor's Partial("avg"): divided by n first
and reduced with SUM, gloo has no AVG); "Pm" the masked partial of a vocab-sharded embedding (unmasked into "P"
right after the embedding). Nested shards (two mesh dims on one tensor dim) follow DTensor's layout; `steps`
orders the changes so each one is a single collective plus local reshuffles.

Byte convention (the plan's, autopar/collectives.py): the full tensor over the group: all_gather output,
reduce_scatter input, all_reduce size, all_to_all size (local input times the group size).
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist

from autopar.collectives import dims_of, steps as plan_steps
from autopar.strategies._torch_adapter import flat_group_name, per_rank

_fn = torch.ops._c10d_functional


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans (or a different mesh); raised on every rank before any collective runs."""


def group_name(mesh, m) -> str:
    """The process group of mesh dim m, or of the flattened group of the mesh dims in m (a list / tuple)."""
    if isinstance(m, (list, tuple)):
        return flat_group_name(mesh, m)
    return mesh.get_group(m).group_name


def group_size(mesh, m) -> int:
    return math.prod(mesh.size(d) for d in dims_of(m))


def _simulated(t) -> bool:
    return type(t).__name__ == "LocalTensor"


def _wait(t, always: bool = False):
    # LocalTensorMode runs gathers / scatters synchronously and its wait_tensor is an aliasing op (~ms each there);
    # its all_reduce goes through the (fake) process group and must be waited on
    return t if _simulated(t) and not always else _fn.wait_tensor(t)


# The reshuffles around collectives use non-aliasing ops (permute_copy, narrow_copy, _unsafe_view): they copy
# where a view + contiguous() would copy anyway, and a view costs milliseconds under LocalTensorMode.
def _to_front(x, d):
    """x with tensor dim d moved to dim 0, contiguous."""
    if d == 0:
        return x.contiguous()
    return torch.permute_copy(x, [d] + [i for i in range(x.dim()) if i != d])


def _from_front(y, d):
    """Inverse of _to_front: dim 0 moved back to position d, contiguous."""
    if d == 0:
        return y
    perm = list(range(1, y.dim()))
    perm.insert(d, 0)
    return torch.permute_copy(y, perm)


def _coord(mesh, m):
    return mesh.get_local_rank(m)  # an int, or a per-rank SymInt under LocalTensorMode


def _exec_str(p: str) -> str:
    return "P" if p == "Pm" else p  # a masked partial is executed as a sum partial once unmasked


def redistribute_local(x: torch.Tensor, src, dst, mesh, flat=None) -> torch.Tensor:
    """Turn local shard `x` (global placements `src`, strings per mesh dim) into the local shard for `dst`,
    one step of `autopar.collectives.steps` at a time. A step into "Pm" (the indices of a vocab-sharded
    embedding) is left to DTensor's embedding rule, which masks the indices itself: the value stays "R".
    `flat`: the mesh dims of a chain of P -> R steps the plan runs as ONE all_reduce over their flattened group
    (autopar.collectives.flat_reduce).

    The result keeps x's memory layout (the order of its strides): the collectives run on x permuted into its
    memory order, as a single-device program would have laid the tensor out (views after it depend on that)."""
    todo = plan_steps(tuple(src), tuple(dst))
    if not todo:
        return x
    order = _memory_order(x)
    if order is None:
        order, x = list(range(x.dim())), x.contiguous()
    if order == sorted(order):  # already in memory order: no permutes (views cost under LocalTensorMode)
        return _run_steps(x, mesh, todo, flat, lambda p: p)
    xp = _run_steps(x.permute(order), mesh, todo, flat, lambda p: _permuted(p, order))
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return xp.permute(inv)


def _run_steps(x, mesh, todo, flat, pl):
    """The steps `todo` on x (laid out in its memory order; `pl` maps a placement to x's dim order), or the one
    all_reduce over the flattened group of mesh dims `flat` that replaces them."""
    if flat is None:
        for m, a, b in todo:
            x = apply_step(x, mesh, m, pl(_exec_str(a)), pl(b))
        return x
    a = _exec_str(todo[0][1])
    if (
        [m for m, _, _ in todo if mesh.size(m) > 1] != list(flat)
        or any(_exec_str(s) != a for _, s, _ in todo)
        or any(b != "R" for _, _, b in todo)
    ):
        raise ValueError(f"one all_reduce over mesh dims {list(flat)} cannot take the steps {list(todo)}")
    x = per_rank(x)
    return _wait(
        _fn.all_reduce((x / group_size(mesh, flat) if a == "Pa" else x).contiguous(), "sum", group_name(mesh, flat)),
        always=True,
    )


def _memory_order(x: torch.Tensor):
    """Dims from outermost to innermost in memory, or None if x is not a dense tensor in some dim order."""
    st, sh = x.stride(), x.shape  # one query each (each is a dispatch under LocalTensorMode)
    order = sorted(range(len(sh)), key=lambda d: -st[d])
    expect = 1
    for d in reversed(order):
        if sh[d] != 1 and st[d] != expect:
            return None
        expect *= sh[d]
    return order


def _permuted(p: str, order) -> str:
    return f"S{order.index(int(p[1:]))}" if p[0] == "S" else p


def executed_placements(src, dst) -> tuple[str, ...]:
    """The placements a value has after `redistribute_local` (dst, except "Pm" targets stay as they were, or
    replicated where they were sharded: the indices of a vocab-sharded table are whole on every rank)."""
    return tuple(("R" if s[0] == "S" else s) if d == "Pm" else d for s, d in zip(src, dst))


def apply_step(x: torch.Tensor, mesh, m: int, a: str, b: str) -> torch.Tensor:
    n = mesh.size(m)
    if a == b or (b == "Pm" and a[0] != "S"):
        return x
    if n == 1:  # a size-1 mesh dim: only the placement label changes
        return x
    name = group_name(mesh, m)
    x = per_rank(x)  # under LocalTensorMode a collective needs every rank's own tensor
    if a[0] == "S":
        d = int(a[1:])
        if b[0] == "S":
            return _all_to_all(x, d, int(b[1:]), n, name)
        x = _all_gather(x, d, n, name)
        return _from_replicate(x, mesh, m, "R" if b == "Pm" else b)  # sharded indices: gathered whole
    if a[0] == "P":
        if a == "Pa":
            x = x / n  # values whose mean is the total -> values whose sum is the total
        if b == "R":
            return _wait(_fn.all_reduce(x.contiguous(), "sum", name), always=True)
        if b[0] == "S":
            return _reduce_scatter(x, int(b[1:]), n, name)
        if b == "Pa":
            return x * n
        if b == "P":
            return x
    if a == "R":
        return _from_replicate(x, mesh, m, b)
    raise NotImplementedError(f"redistribute step {a} -> {b} on mesh dim {m}")


def launch_bucket(xs: list, mesh, chain: list):
    """Issue a gradient bucket (passes/buckets.py) and return without waiting for its last collective: every local
    shard in `xs` takes the steps of `chain`, [(mesh_dim, from, to)]: one P -> R (all_reduce) or P -> S(d)
    (reduce_scatter), or several P -> R on different mesh dims, run one after the other. The shards are copied
    into one flat buffer (rank-major chunks for a reduce_scatter), as DDP copies gradients into its bucket, and
    reduced in place. `finish_bucket` waits and splits the result back (one tensor per shard)."""
    xs = [per_rank(x) for x in xs]
    shapes = [tuple(x.shape) for x in xs]
    if all(b == "R" for _, _, b in chain):
        flat = torch.cat([x.reshape(-1) for x in xs])  # a fresh buffer: reduced in place (no extra copy)
        return launch_filled(flat, mesh, chain, shapes)
    ((m, a, b),) = chain
    n, d = mesh.size(m), int(b[1:])
    fronts = []
    for x in xs:
        if x.shape[d] % n:
            raise ValueError(f"reduce_scatter of dim {d} (size {x.shape[d]}) over {n} ranks does not divide evenly")
        fronts.append(_to_front(x / n if a == "Pa" else x, d))
    flat = torch.cat([f.reshape(n, -1) for f in fronts], dim=1).reshape(-1)  # rank r's chunks, rank by rank
    return b, _fn.reduce_scatter_tensor(flat, "sum", n, group_name(mesh, m)), [tuple(f.shape) for f in fronts], n


def launch_filled(flat: torch.Tensor, mesh, chain: list, shapes: list):
    """Issue an all_reduce bucket whose gradients are already in `flat` (one flat buffer, shards in `shapes`
    one after the other), reduced in place: the executor copies each gradient in as the backward makes it,
    as DDP's reducer does (backends/spmd/program.py)."""
    for k, (m, a, _) in enumerate(chain):
        if a == "Pa":
            flat = flat.div_(group_size(mesh, m))
        flat = _fn.all_reduce_(flat, "sum", group_name(mesh, m))
        if k + 1 < len(chain):
            flat = _wait(flat, always=True)
    return "R", flat, shapes, 1


def finish_bucket(handle) -> list:
    """Wait for a launched bucket; its shards back, contiguous, in launch order."""
    b, out, shapes, n = handle
    if b == "R":
        flat = _wait(out, always=True)
        return [y.view(s) for y, s in zip(torch.split(flat, [math.prod(s) for s in shapes]), shapes)]
    d = int(b[1:])
    mine = _wait(out)
    res = []
    for y, s in zip(torch.split(mine, [math.prod(s) // n for s in shapes]), shapes):
        res.append(_from_front(y.view([s[0] // n] + list(s[1:])), d))
    return res


def _from_replicate(x, mesh, m, b):
    if b == "R" or b == "Pa":
        return x  # the mean of n copies is the value itself
    if b == "P":
        return per_rank(x) * (1 - torch.sym_min(_coord(mesh, m), 1))  # the value on coordinate 0, zeros elsewhere
    if b[0] == "S":
        d = int(b[1:])
        if x.shape[d] % mesh.size(m):
            raise ValueError(
                f"Shard({d}) of a tensor of shape {tuple(x.shape)} over {mesh.size(m)} ranks does not divide evenly"
            )
        size = x.shape[d] // mesh.size(m)
        return torch.narrow_copy(per_rank(x), d, _coord(mesh, m) * size, size)
    raise NotImplementedError(f"redistribute step R -> {b} on mesh dim {m}")


def _all_gather(x, d, n, name):
    y = _wait(_fn.all_gather_into_tensor(_to_front(x, d), n, name))
    return _from_front(y, d)  # contiguous: the layout a single-device op produces (kernels rely on it)


def _reduce_scatter(x, d, n, name):
    if x.shape[d] % n:
        raise ValueError(f"reduce_scatter of dim {d} (size {x.shape[d]}) over {n} ranks does not divide evenly")
    y = _wait(_fn.reduce_scatter_tensor(_to_front(x, d), "sum", n, name))
    return _from_front(y, d)


def _all_to_all(x, d, e, n, name):
    """Local shard of dim d -> shard of dim e: chunk j of dim e goes to group rank j; the pieces received are
    this rank's dim-e chunk of every rank's dim-d shard, concatenated along d in group-rank order."""
    if x.shape[e] % n:
        raise ValueError(f"all_to_all of dim {e} (size {x.shape[e]}) over {n} ranks does not divide evenly")
    xe = _to_front(x, e)  # (x_e, other dims of x in order)
    piece = [xe.shape[0] // n] + list(xe.shape[1:])
    splits = [piece[0]] * n
    y = _wait(_fn.all_to_all_single(xe, splits, splits, name))
    y = torch.ops.aten._unsafe_view(y, [n] + piece)  # (source rank, e-chunk, other dims)
    labels = ["n", e] + [i for i in range(x.dim()) if i != e]  # what each axis of y is
    order = []
    for i in range(x.dim()):  # back to x's dim order, the rank axis before d
        order += ["n", i] if i == d else [i]
    out = torch.permute_copy(y, [labels.index(a) for a in order])
    shape = list(out.shape)
    shape[d : d + 2] = [shape[d] * shape[d + 1]]
    return torch.ops.aten._unsafe_view(out, shape)


# ---- plan agreement ----------------------------------------------------------------------------------------------


def agree_on_plan(mesh, plan_hash: str, device) -> None:
    """All ranks exchange their plan's hash (one all_gather over the whole mesh) before any step runs; any
    difference raises PlanMismatchError on every rank, naming which ranks hold which plan."""
    if dist.get_backend() == "fake":
        return  # one process simulates every rank (LocalTensorMode): one plan
    code = torch.tensor([int(plan_hash[i : i + 8], 16) for i in range(0, 16, 8)], dtype=torch.int64, device=device)
    world = dist.get_world_size()
    table = torch.zeros(world, code.numel(), dtype=torch.int64, device=device)
    table[dist.get_rank()] = code
    dist.all_reduce(table)  # every rank's hash in its own row (a sum of one-row tables)
    got = table.tolist()
    hashes = ["".join(f"{v:08x}" for v in row) for row in got]
    if len(set(hashes)) != 1:
        by = {}
        for r, h in enumerate(hashes):
            by.setdefault(h, []).append(r)
        detail = "; ".join(f"plan {h} on ranks {rs}" for h, rs in sorted(by.items()))
        raise PlanMismatchError(
            f"ranks hold different plans ({detail}); this rank ({dist.get_rank()}) has "
            f"{plan_hash}. Every rank must run the same plan: made with the same model config, example input "
            f"shapes, mesh and plan options, or made once and shared (Plan.save / Plan.load)."
        )
