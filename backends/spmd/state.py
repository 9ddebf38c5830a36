"""One model state on every rank: parameters and buffers from rank 0, one agreed seed, a replica checksum.

A script that builds its model on every rank without seeding them alike holds a different model on each rank. As
DDP (broadcast at construction) and `distribute_tensor(src_data_rank=0)` do, `parallelize` makes every rank hold
rank 0's values before the first step:

* `sync_from_rank0` sends each rank the local shard it keeps. Per tensor, the cheaper of two ways (bytes received
  by the other ranks, the figure stated in `init_comm`): a broadcast of the full tensor (B x (world - 1)), or a
  scatter of every rank's own shard (the sum of the other ranks' shards: B x (world - 1) / k for a tensor split k
  ways). A replicated tensor is broadcast, a sharded one scattered. The tensors of one way and one dtype travel in
  ONE collective over the world group. DTensor's distribute_tensor(src_data_rank=0) issues one scatter /
  broadcast per mesh dim per tensor, each from coordinate 0 of that dim's groups, so the groups off rank 0 first
  pass on their own values: measured on a 2x2 gloo mesh (bytes received, tensor of B bytes), [R, R] 4 B in 2
  broadcasts where one world broadcast takes 3 B; [S0, R] 2 B (a scatter, a broadcast) where one scatter takes
  1.5 B; [S0, S0] 1.5 B in 2 scatters where one takes 0.75 B.
* `agreed_seed`: rank 0's `torch.initial_seed()` (reading it leaves the generator as it is), broadcast.
* `check_replicas`: per parameter / buffer a (sum, sum |x|) float64 checksum of the local shard, max- and
  min-reduced in one all_reduce per mesh dim over the ranks that hold replicas of it on that dim; a mismatch
  raises ReplicaMismatchError on every rank, naming the tensors.

The collectives here are one-time (construction, first step): they run outside any TorchDispatchMode, so the
counter of a step's collectives (backends/counter.py CollectiveCounter) sees only the plan's own.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from autopar.strategies._torch_adapter import outside_local_tensor_mode

SRC = 0  # the global rank whose values every rank takes


class ReplicaMismatchError(RuntimeError):
    """Ranks that should hold the same values of a parameter or buffer (replicas) hold different ones."""


def simulated_world() -> bool:
    """One process simulates every rank (fake process group, LocalTensorMode): there is one model state."""
    return not dist.is_initialized() or dist.get_backend() == "fake"


def _coords(mesh) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate on the mesh."""
    grid = mesh.mesh
    out = {}
    for flat, r in enumerate(grid.reshape(-1).tolist()):
        c = []
        for s in reversed(grid.shape):
            c.append(flat % s)
            flat //= s
        out[int(r)] = tuple(reversed(c))
    return out


def shard_of(full: torch.Tensor, placements, coord, mesh_shape) -> torch.Tensor:
    """The local shard a rank at `coord` holds of `full` at `placements` ("R" / "S<k>" per mesh dim), split as
    DTensor's Shard does (torch.chunk per mesh dim in order; missing trailing chunks empty)."""
    x = full
    for d, p in enumerate(placements):
        if p[0] != "S" or mesh_shape[d] == 1:
            continue
        k, n = int(p[1:]), mesh_shape[d]
        pieces = torch.chunk(x, n, dim=k)
        x = pieces[coord[d]] if coord[d] < len(pieces) else x.narrow(k, 0, 0)
    return x


def _way(shape, placements, mesh_shape) -> str:
    """'scatter' when the plan splits the tensor (each rank then needs only its shard), else 'broadcast'; a
    partial placement (never planned for state, but possible) takes the full tensor by broadcast."""
    if any(p[0] == "P" for p in placements):
        return "full"
    split = math.prod(mesh_shape[d] for d, p in enumerate(placements) if p[0] == "S")
    return "scatter" if split > 1 else "broadcast"


def sync_from_rank0(items, mesh) -> dict:
    """items: [(name, full, placements, local)]: this rank's full value of a parameter / buffer (read on rank 0
    only), its placement strings, and the local shard this rank keeps, which is overwritten in place with rank
    0's values ('full' items: `full` itself is overwritten, the caller splits it again). Returns the one-time
    cost: {"broadcast_bytes", "scatter_bytes", "collectives", "tensors"}."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = tuple(mesh.shape)
    coord = _coords(mesh)
    groups = defaultdict(list)  # (way, dtype) -> items
    for it in items:
        groups[(_way(it[1].shape, it[2], shape), it[1].dtype)].append(it)
    cost = {"broadcast_bytes": 0, "scatter_bytes": 0, "collectives": 0, "tensors": len(items)}
    with torch.no_grad(), _disable_current_modes():
        for (way, dtype), its in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            if way in ("broadcast", "full"):
                dst = [it[3] if way == "broadcast" else it[1] for it in its]
                flat = (
                    torch.cat([t.reshape(-1) for t in dst])
                    if rank == SRC
                    else torch.empty(sum(t.numel() for t in dst), dtype=dtype, device=dst[0].device)
                )
                dist.broadcast(flat, src=SRC)
                _unflatten(flat, dst)
                cost["broadcast_bytes"] += flat.numel() * flat.element_size() * (world - 1)
                cost["collectives"] += 1
            else:
                cost["scatter_bytes"] += _scatter(its, mesh, coord, rank, world)
                cost["collectives"] += 2  # the padded length (8 bytes), then the scatter
    return cost


def _scatter(its, mesh, coord, rank, world) -> int:
    """One world scatter from SRC of every rank's local shards of `its` (one dtype), padded to the longest."""
    shape, locals_ = tuple(mesh.shape), [it[3] for it in its]
    mine = sum(t.numel() for t in locals_)
    sizes = None
    if rank == SRC:
        per = [torch.cat([shard_of(it[1], it[2], coord[r], shape).reshape(-1) for it in its]) for r in range(world)]
        sizes = [p.numel() for p in per]
        if sizes[rank] != mine:
            raise AssertionError(f"rank {rank}'s shards hold {mine} elements, the split gives {sizes[rank]}")
    width = torch.tensor([max(sizes) if sizes else 0], dtype=torch.int64, device=locals_[0].device)
    dist.broadcast(width, src=SRC)  # one 8-byte message: the padded length
    width = int(width.item())
    out = torch.empty(width, dtype=locals_[0].dtype, device=locals_[0].device)
    scatter_list = None
    if rank == SRC:
        scatter_list = [torch.cat([p, p.new_zeros(width - p.numel())]) for p in per]
    dist.scatter(out, scatter_list, src=SRC)
    _unflatten(out[:mine], locals_)
    return width * out.element_size() * (world - 1)


def _unflatten(flat, dst) -> None:
    at = 0
    for t in dst:
        n = t.numel()
        t.copy_(flat[at : at + n].view(t.shape))
        at += n


# ---- agreed seed -------------------------------------------------------------------------------------------------


def agreed_seed(device) -> int:
    """Rank 0's torch.initial_seed(), on every rank (one 8-byte broadcast; the generators are not advanced)."""
    with outside_local_tensor_mode():  # LocalTensorMode hands out a per-rank seed
        s = int(torch.initial_seed())
    if simulated_world():
        return s
    t = torch.tensor([s - 2**64 if s >= 2**63 else s], dtype=torch.int64, device=device)
    with _disable_current_modes():
        dist.broadcast(t, src=SRC)
    v = int(t.item())
    return v + 2**64 if v < 0 else v


# ---- replica checksum --------------------------------------------------------------------------------------------


def check_replicas(entries, mesh, device, what: str = "") -> int:
    """entries: [(name, local shard, placement strings over `mesh`)], the same list on every rank. Raises
    ReplicaMismatchError on every rank when ranks holding replicas of one (placement "R" on a mesh dim) hold
    different values. Returns the number of collectives issued (one per mesh dim of size > 1, plus one)."""
    if simulated_world():
        return 0
    n = 0
    detail: dict[str, str] = {}
    with torch.no_grad(), _disable_current_modes():
        for d in range(mesh.ndim):
            if mesh.size(d) == 1:
                continue
            mine = [(name, t) for name, t, pl in entries if pl[d] == "R" and t.numel()]
            if not mine:
                continue
            # a complex tensor (a RoPE table as torchtitan keeps it) is checked on its real and imaginary parts
            real = [torch.view_as_real(t) if t.is_complex() else t for _, t in mine]
            c = torch.stack([torch.stack([t.double().sum(), t.double().abs().sum()]) for t in real])
            both = torch.cat([c, -c])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
            n += 1
            hi, lo = both[: len(mine)], -both[len(mine) :]
            tol = 1e-12 * hi[:, 1].abs() + 1e-300
            off = ((hi - lo).abs() > tol[:, None]).any(dim=1)
            dim = (mesh.mesh_dim_names or [str(i) for i in range(mesh.ndim)])[d]
            for (name, _), o, high, low in zip(mine, off.tolist(), hi.tolist(), lo.tolist()):
                if o:
                    detail.setdefault(
                        name,
                        f"on mesh dim {dim}, checksum sum from {low[0]:.9g} to {high[0]:.9g}, "
                        f"sum|x| from {low[1]:.9g} to {high[1]:.9g}",
                    )
        # every rank names every tensor that disagrees anywhere, not only the ones in its own groups
        flags = torch.tensor(
            [float(name in detail) for name, _, _ in entries] or [0.0], dtype=torch.float64, device=device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        n += 1
    bad = [name for (name, _, _), f in zip(entries, flags.tolist()) if f > 0]
    if bad:
        named = "; ".join(f"'{b}'" + (f" ({detail[b]})" if b in detail else "") for b in bad[:8])
        raise ReplicaMismatchError(
            f"{what}replicas of {len(bad)} parameter(s)/buffer(s) disagree between ranks: {named}. Every rank must "
            f"hold the same value of a replicated tensor: a change made on one rank only (an in-place edit, a "
            f"rank-dependent initialization after parallelize) makes the ranks train different models. Apply such "
            f"changes on every rank alike, before parallelize (which takes rank 0's values), or pass "
            f"check_replicas=False to skip this check."
        )
    return n


# ---- the torch engines' modules ----------------------------------------------------------------------------------


def broadcast_module(model, mesh) -> dict:
    """Rank 0's values of every parameter and buffer of the plain `model`, in place, before the engines shard it
    (fully_shard keeps each rank's own chunk and does not broadcast; parallelize_module then scatters its shards
    from the tp dim's first rank): one broadcast per dtype of the full tensors."""
    seen, items = set(), []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            items.append((name, t.detach(), ("R",) * mesh.ndim, t.detach()))
    return sync_from_rank0(items, mesh)


def engine_entries(model, mesh) -> list:
    """[(name, local tensor, placement strings over `mesh`)] of a module the engines parallelized: a DTensor's
    placements mapped onto `mesh` by dim name (mesh dims its own mesh lacks hold replicas), a plain tensor
    replicated everywhere. A DTensor whose mesh dims are not dims of `mesh` (a flattened dim) is left out."""
    from torch.distributed.tensor import DTensor

    names = list(mesh.mesh_dim_names or ())
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not isinstance(t, DTensor):
            out.append((name, t.detach(), ("R",) * mesh.ndim))
            continue
        own = list(t.device_mesh.mesh_dim_names or ())
        if len(own) != t.device_mesh.ndim or any(n not in names for n in own):
            continue
        pl = ["R"] * mesh.ndim
        for n, p in zip(own, t.placements):
            pl[names.index(n)] = "R" if p.is_replicate() else "S"
        out.append((name, t.to_local().detach(), tuple(pl)))
    return out


def install_first_step_check(model, mesh, device) -> None:
    """The replica checksum once, before the first forward of a module the engines parallelized."""

    def hook(module, args, kwargs=None):
        handle.remove()
        with torch.no_grad():
            entries = engine_entries(module, mesh)
        check_replicas(entries, mesh, device, what=f"autopar {type(module).__name__}: ")

    handle = model.register_forward_pre_hook(hook)


def prepare_engine_model(model, mesh, device, assume_identical: bool, check_replicas: bool) -> str:
    """Before the engines shard `model`: rank 0's state on every rank (model.autopar_init_comm), the agreed seed
    (model.autopar_rng_seed), the first-step replica check; returns the dump's line saying what it cost."""
    if assume_identical or simulated_world():
        model.autopar_init_comm = {
            "skipped": "assume_identical=True" if assume_identical else "one process",
            "broadcast_bytes": 0,
            "scatter_bytes": 0,
            "collectives": 0,
        }
        line = f"state from rank 0: skipped ({model.autopar_init_comm['skipped']})"
    else:
        c = model.autopar_init_comm = broadcast_module(model, mesh)
        line = (
            f"state from rank 0: {c['broadcast_bytes']:,d} B once (parameters and buffers broadcast before the "
            f"engines shard them, {c['collectives']} collectives)"
        )
    model.autopar_rng_seed = agreed_seed(device)
    if check_replicas:
        install_first_step_check(model, mesh, device)
    return line
