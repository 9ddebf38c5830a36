"""Count the collectives a real step issues, with bytes, in the plan's convention, and compare them with a plan.

`CollectiveCounter` is a TorchDispatchMode over both collective paths: the `c10d` process-group ops FSDP2 and
`torch.distributed` calls issue (`c10d._allgather_base_`, `c10d._reduce_scatter_base_`, `c10d.allreduce_`, ...) and
the `_c10d_functional` ops DTensor, tensor parallelism and the graph executor issue (`all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_reduce`, ...). DTensor ops are let through first (NotImplemented), so the collectives
DTensor issues inside an op are counted too. (CommDebugMode counts the same ops but records no bytes.) Under
LocalTensorMode one record stands for the whole simulated group. Both backends (spmd, torch) count with it.

Byte convention (the plan's, autopar/collectives.py): the FULL tensor over the group: all_gather OUTPUT size,
reduce_scatter INPUT size, all_reduce size, all_to_all local input times the group size. Each record names the
process group's size and, when a DeviceMesh is given, the mesh dim whose group it ran on (a flattened or
multi-dim group gets the sorted tuple of its dims; a group the mesh does not know gets None).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.strategies._torch_adapter import FLAT_GROUPS, resolve_group

# c10d op name -> (kind, where its size is): the plan's convention applied to each op's argument layout
_C10D = {
    "_allgather_base_": ("all_gather", "out0"),  # (output, input, pg, ...)
    "allgather_into_tensor_coalesced_": ("all_gather", "out_list"),
    "allgather_": ("all_gather", "nested_out"),  # ([[out per rank]], [in], pg)
    "_reduce_scatter_base_": ("reduce_scatter", "in1"),  # (output, input, pg, op, ...)
    "reduce_scatter_": ("reduce_scatter", "nested_in"),  # ([out], [[in per rank]], pg, ...)
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "in_list"),
    "allreduce_": ("all_reduce", "list0"),  # ([tensors], pg, ...)
    "allreduce_coalesced_": ("all_reduce", "list0"),
    "alltoall_base_": ("all_to_all", "in1"),
    "alltoall_": ("all_to_all", "nested_in0"),
    "broadcast_": ("broadcast", "list0"),
    "scatter_": ("scatter", "list0"),
}
# _c10d_functional (and _dtensor) op name -> (kind, where its size is)
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", "times_group"),  # (input, group_size, group_name)
    "all_gather_into_tensor_coalesced": ("all_gather", "list_times_group"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "list"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "list"),
    "all_to_all_single": ("all_to_all", "times_group"),
    "shard_dim_alltoall": ("all_to_all", "times_group"),  # _dtensor: (input, gather_dim, shard_dim, group_name)
    "broadcast": ("broadcast", "input"),
}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str
    mesh_dim: object  # int, sorted tuple of ints (a group over several mesh dims) or None (a group the mesh lacks)
    nbytes: int
    group_size: int  # -1 when the group could not be resolved
    path: str  # "c10d" (FSDP2, eager c10d) or "functional" (DTensor, TP, the graph executor)
    dtype: str

    @property
    def collective(self) -> tuple:
        """(kind, mesh dim, bytes): the form of `Plan.collectives()`."""
        return (self.kind, self.mesh_dim, self.nbytes)

    def to_json(self):
        return [self.kind, self.mesh_dim, self.nbytes, self.group_size, self.path, self.dtype]


class CollectiveCounter(TorchDispatchMode):
    """with CollectiveCounter(mesh) as cc: step(); cc.collectives(), cc.summary(), cc.records"""

    def __init__(self, mesh=None):
        super().__init__()
        self.records: list[CollectiveRecord] = []
        self._by_name: dict[str, object] = {}
        self._by_ranks: dict[tuple, object] = {}
        self.mesh = mesh
        if mesh is not None:
            self._index_mesh(mesh)

    def _index_mesh(self, mesh):
        for d in range(mesh.ndim):
            g = mesh.get_group(d)
            self._by_name[g.group_name] = d
            self._by_ranks[tuple(sorted(dist.get_process_group_ranks(g)))] = d
        coord = mesh.get_coordinate() if mesh.ndim > 1 else None
        if coord is not None:  # this rank's groups over several dims (flattened: FSDP, gradient buckets)
            for k in range(2, mesh.ndim + 1):
                for dims in itertools.combinations(range(mesh.ndim), k):
                    idx = tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))
                    ranks = tuple(sorted(int(r) for r in mesh.mesh[idx].flatten().tolist()))
                    self._by_ranks.setdefault(ranks, dims)

    @staticmethod
    def _process_group(group):
        if isinstance(group, str):
            return resolve_group(group)
        if isinstance(group, dist.ProcessGroup):
            return group
        return dist.ProcessGroup.unbox(group)

    def _dim_of(self, group) -> object:
        if isinstance(group, str) and group in self._by_name:
            return self._by_name[group]
        if isinstance(group, str) and group in FLAT_GROUPS and self.mesh is not None:
            return FLAT_GROUPS[group]  # the executor's flattened group over several mesh dims
        try:
            pg = self._process_group(group)
            if pg.group_name in self._by_name:
                return self._by_name[pg.group_name]
            return self._by_ranks.get(tuple(sorted(dist.get_process_group_ranks(pg))))
        except (RuntimeError, ValueError, TypeError, AttributeError, KeyError):
            return None

    def _size_of(self, group) -> int:
        try:
            return self._process_group(group).size()
        except (RuntimeError, ValueError, TypeError, AttributeError, KeyError):
            return -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run the op with this mode active: its collectives are seen
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D:
            self.records.append(self._c10d(*_C10D[name], args))
        elif ns in ("_c10d_functional", "_dtensor") and name in _FUNCTIONAL:
            self.records.append(self._functional(*_FUNCTIONAL[name], args))
        return func(*args, **kwargs)

    def _c10d(self, kind, where, args) -> CollectiveRecord:
        pg = next((a for a in args if not isinstance(a, (torch.Tensor, list, tuple, int, float, bool))), None)
        first, nb = {
            "out0": lambda: (args[0], _nbytes(args[0])),
            "in1": lambda: (args[1], _nbytes(args[1])),
            "list0": lambda: (args[0][0], _nbytes(args[0])),
            "out_list": lambda: (args[0][0], _nbytes(args[0])),
            "in_list": lambda: (args[1][0], _nbytes(args[1])),
            "nested_out": lambda: (args[0][0][0], _nbytes(args[0][0])),
            "nested_in": lambda: (args[1][0][0], _nbytes(args[1][0])),
            "nested_in0": lambda: (args[1][0], _nbytes(args[1])),  # alltoall_(outputs, inputs, pg)
        }[where]()
        n = self._size_of(pg)
        if kind == "all_to_all":  # the plan's convention: the local input times the group size
            nb *= n
        return CollectiveRecord(kind, self._dim_of(pg), nb, n, "c10d", _dtype(first))

    def _functional(self, kind, where, args) -> CollectiveRecord:
        group = args[-1] if isinstance(args[-1], str) else next((a for a in args if isinstance(a, str)), None)
        n = self._size_of(group)
        if where in ("list", "list_times_group"):
            first, nb = args[0][0], _nbytes(args[0])
        else:
            first, nb = args[0], _nbytes(args[0])
        if where.endswith("times_group"):
            nb *= n
        return CollectiveRecord(kind, self._dim_of(group), nb, n, "functional", _dtype(first))

    # ---- views ---------------------------------------------------------------------------------------------
    def collectives(self) -> list[tuple]:
        """(kind, mesh dim, bytes) of each collective over more than one rank, in issue order: the form of
        `Plan.collectives()` (compare them with `compare`)."""
        return [r.collective for r in self.records if r.group_size != 1]

    def summary(self) -> dict:
        """{kind: {"count", "bytes"}} over every collective of more than one rank."""
        return tally(self.collectives())

    def by_dim(self) -> dict:
        """{(kind, mesh_dim): {"count", "bytes"}}"""
        return tally(self.collectives(), by_dim=True)


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else "?"


def tally(collectives, by_dim: bool = False) -> dict:
    """(kind, mesh dim, bytes) collectives as {kind: {"count", "bytes"}} ({(kind, mesh dim): ...} with by_dim)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind, d, nb in collectives:
        out[(kind, d) if by_dim else kind]["count"] += 1
        out[(kind, d) if by_dim else kind]["bytes"] += nb
    return dict(out)


def compare(measured, predicted) -> str:
    """'' when the multisets of (kind, mesh_dim, bytes) are equal, else a readable difference. `measured` is a
    counter's `collectives()` (or its records), `predicted` a plan's `collectives()`."""
    as_tuple = lambda c: c.collective if isinstance(c, CollectiveRecord) else tuple(c)
    a, b = Counter(map(as_tuple, measured)), Counter(map(as_tuple, predicted))
    if a == b:
        return ""
    extra, missing = a - b, b - a
    return (
        f"measured {sum(a.values())} collectives, plan predicts {sum(b.values())}; "
        f"not in the plan: {sorted(extra.items(), key=str)[:12]}; "
        f"planned but not run: {sorted(missing.items(), key=str)[:12]}"
    )
