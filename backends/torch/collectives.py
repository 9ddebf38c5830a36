"""Count the collectives a real run issues, with bytes, in the plan's convention, and compare them with a plan.

`CollectiveCounter` is a TorchDispatchMode over both collective paths: the c10d ops FSDP2 calls
(`c10d._allgather_base_`, `c10d._reduce_scatter_base_`, `c10d.allreduce_`, ...) and the functional ops DTensor /
tensor parallelism use (`_c10d_functional.all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce`, ...).
(CommDebugMode counts the same ops but records no bytes.)

Byte convention (the plan's, see autopar/collectives.py): the FULL tensor over the group: all_gather OUTPUT size,
reduce_scatter INPUT size, all_reduce size, all_to_all local input times the group size. Each record also names the
process group's size and, when a DeviceMesh is given, the mesh dim whose group it ran on (a flattened or multi-dim
group gets a tuple).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from autopar.cost import get_cluster
from autopar.cost.comm import collective_time
from autopar.collectives import dims_of, link_of
from autopar.strategies._torch_adapter import resolve_group

from .mixed import within

_c10d = torch.ops.c10d
_fn = torch.ops._c10d_functional

# op packet -> (kind, how to size it)
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
}
_FUNC = {
    "all_gather_into_tensor": ("all_gather", "func_ag"),  # (input, group_size, group_name)
    "all_gather_into_tensor_coalesced": ("all_gather", "func_ag_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "func0"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "func_list"),
    "all_reduce": ("all_reduce", "func0"),
    "all_reduce_": ("all_reduce", "func0"),
    "all_reduce_coalesced": ("all_reduce", "func_list"),
    "all_to_all_single": ("all_to_all", "func0"),
    "broadcast": ("broadcast", "func0"),
}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass
class CommRecord:
    kind: str
    nbytes: int
    group_size: int
    mesh_dim: object  # int, tuple of ints (a group over several mesh dims) or None
    path: str  # "c10d" (FSDP2, eager c10d) or "functional" (DTensor / TP)
    dtype: str

    def to_json(self):
        return [self.kind, self.mesh_dim, self.nbytes, self.group_size, self.path, self.dtype]


class CollectiveCounter(TorchDispatchMode):
    """with CollectiveCounter(mesh) as cc: step(); cc.records, cc.summary()"""

    def __init__(self, mesh=None):
        super().__init__()
        self.records: list[CommRecord] = []
        self._by_name: dict[str, object] = {}
        self._by_ranks: dict[tuple, object] = {}
        if mesh is not None:
            self._index_mesh(mesh)

    # ---- group -> mesh dim ---------------------------------------------------------------------------------
    def _index_mesh(self, mesh):
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        for d in range(mesh.ndim):
            g = mesh.get_group(d)
            self._by_name[g.group_name] = d
            self._by_ranks[tuple(sorted(dist.get_process_group_ranks(g)))] = d
        if mesh.ndim > 1:  # this rank's group over several dims (a flattened group: FSDP, gradient buckets)
            coord = mesh.get_coordinate()
            for k in range(2, mesh.ndim + 1 if coord is not None else 2):
                for dims in itertools.combinations(range(mesh.ndim), k):
                    idx = tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))
                    ranks = tuple(sorted(int(r) for r in mesh.mesh[idx].flatten().tolist()))
                    self._by_ranks.setdefault(ranks, dims)
        self.mesh_dim_names = names

    def _dim_of(self, group) -> object:
        try:
            if isinstance(group, str):
                if group in self._by_name:
                    return self._by_name[group]
                group = resolve_group(group)
            elif not isinstance(group, dist.ProcessGroup):
                group = dist.ProcessGroup.unbox(group)
            if group.group_name in self._by_name:
                return self._by_name[group.group_name]
            return self._by_ranks.get(tuple(sorted(dist.get_process_group_ranks(group))))
        except Exception:
            return None

    @staticmethod
    def _size_of(group) -> int:
        try:
            if isinstance(group, str):
                group = resolve_group(group)
            elif not isinstance(group, dist.ProcessGroup):
                group = dist.ProcessGroup.unbox(group)
            return group.size()
        except Exception:
            return -1

    # ---- the mode ------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run the op with this mode active: its collectives are seen
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        rec = None
        if ns == "c10d" and name in _C10D:
            kind, how = _C10D[name]
            rec = self._c10d(kind, how, args)
        elif ns == "_c10d_functional" and name in _FUNC:
            kind, how = _FUNC[name]
            rec = self._functional(kind, how, args)
        if rec is not None:
            self.records.append(rec)
        return func(*args, **kwargs)

    def _c10d(self, kind, how, args):
        pg = next((a for a in args if not isinstance(a, (torch.Tensor, list, tuple, int, float, bool))), None)
        if how == "out0":
            t, nb = args[0], _nbytes(args[0])
        elif how == "in1":
            t, nb = args[1], _nbytes(args[1])
        elif how == "list0":
            t, nb = args[0][0], _nbytes(args[0])
        elif how == "out_list":
            t, nb = args[0][0], _nbytes(args[0])
        elif how == "in_list":
            t, nb = args[1][0], _nbytes(args[1])
        elif how == "nested_out":
            t, nb = args[0][0][0], _nbytes(args[0][0])
        elif how == "nested_in":
            t, nb = args[1][0][0], _nbytes(args[1][0])
        else:  # nested_in0: alltoall_(outputs, inputs, pg)
            t, nb = args[1][0], _nbytes(args[1])
        n = self._size_of(pg)
        if kind == "all_to_all":  # the plan's convention: the local input times the group size
            nb *= n
        return CommRecord(kind, nb, n, self._dim_of(pg), "c10d", str(t.dtype).replace("torch.", ""))

    def _functional(self, kind, how, args):
        group = args[-1] if isinstance(args[-1], str) else next((a for a in args if isinstance(a, str)), None)
        n = self._size_of(group)
        if how == "func_ag":
            t, nb = args[0], _nbytes(args[0]) * n
        elif how == "func_ag_list":
            t, nb = args[0][0], _nbytes(args[0]) * n
        elif how == "func_list":
            t, nb = args[0][0], _nbytes(args[0])
        else:
            t, nb = args[0], _nbytes(args[0]) * (n if kind == "all_to_all" else 1)
        return CommRecord(kind, nb, n, self._dim_of(group), "functional", str(t.dtype).replace("torch.", ""))

    # ---- views ---------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """{kind: {"count", "bytes"}} over every record with a group of more than one rank."""
        out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
        for r in self.records:
            if r.group_size > 1:
                out[r.kind]["count"] += 1
                out[r.kind]["bytes"] += r.nbytes
        return dict(out)

    def by_dim(self) -> dict:
        """{(kind, mesh_dim): {"count", "bytes"}}"""
        out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
        for r in self.records:
            if r.group_size > 1:
                out[(r.kind, r.mesh_dim)]["count"] += 1
                out[(r.kind, r.mesh_dim)]["bytes"] += r.nbytes
        return dict(out)


def tally(collectives, by_dim: bool = False) -> dict:
    """(kind, mesh dim, bytes) collectives as {kind: {"count", "bytes"}} ({(kind, mesh dim): ...} with by_dim)."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind, d, nb in collectives:
        out[(kind, d) if by_dim else kind]["count"] += 1
        out[(kind, d) if by_dim else kind]["bytes"] += nb
    return dict(out)


def plan_by_dim(plan) -> dict:
    """The plan's predicted collectives of one step as {(kind, mesh_dim): {"count", "bytes"}}."""
    return tally(plan.collectives(), by_dim=True)


def format_compare(expected: dict, measured: dict, mesh_names) -> str:
    """A table of expected vs measured (count, bytes) per (kind, mesh dim)."""
    keys = sorted(set(expected) | set(measured), key=lambda k: (k[0], str(k[1])))
    lines = [f"{'collective':<16}{'dim':<10}{'expected':>22}{'measured':>22}"]
    for k in keys:
        e, m = expected.get(k, {"count": 0, "bytes": 0}), measured.get(k, {"count": 0, "bytes": 0})
        d = k[1]
        dn = (
            mesh_names[d] if isinstance(d, int) else "+".join(mesh_names[i] for i in d) if isinstance(d, tuple) else "?"
        )
        lines.append(f"{k[0]:<16}{dn:<10}{e['count']:>6} x {e['bytes']:>12,d} B{m['count']:>6} x {m['bytes']:>12,d} B")
    return "\n".join(lines)


# ---- what the engines will issue for a lowered plan ------------------------------------------------------------


def _nb(shape, dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def engine_collectives(plan, low) -> tuple[list, list]:
    """The collectives fully_shard / parallelize_module issue for one step of `low` (a TorchLowering of `plan`),
    derived from the plan: (list of (kind, mesh dim or tuple of dims, bytes), notes on how it differs from the
    plan's own per-edge prediction). Rules, each checked against measured runs:
      * FSDP2 unit u: one all_gather of its parameters in the forward (and again in the backward when
        reshard_after_forward), one reduce_scatter of its gradients (reduce dtype), HSDP: one all_reduce of the
        reduce-scattered gradients on the replicate dim; sizes are the (tensor-parallel local) unsharded sizes.
      * replicated parameters outside FSDP: one all_reduce per step of each gradient bucket (TorchLowering.
        grad_buckets: the plan's own buckets where they reduce over exactly the data-parallel dims, a tuple of
        dims being one collective over their flattened group), sized by the local gradients.
      * tensor-parallel dim, forward: the plan's redistributes, once per produced tensor (a style redistributes
        a module's input or output once, however many ops consume it); backward: autograd's mirror of each:
        an input gather of a colwise Linear -> reduce_scatter, a reduce_scatter -> all_gather, a gather to a
        replicated output or an all_reduce -> nothing; a colwise Linear fed a replicated tensor all-reduces its
        input gradient (each colwise module on its own: three for wq/wk/wv).
      * parameters of SequenceParallel modules (replicated, used on sequence shards): their gradient is partial
        on the tp dim and is all-reduced once (DTensor), at the size autograd produced it (before FSDP sharding).
    """
    notes = []
    pnode = {n["target"]: n for n in plan.nodes if n["kind"] == "param"}
    t = low.tp_dim
    tp_n = plan.mesh_shape[t] if t is not None else 1

    def local_param(f, dtype):
        shape = list(pnode[f]["shape"][0])
        if t is not None and plan.params[f][t][0] == "S":
            shape[int(plan.params[f][t][1:])] //= tp_n
        return _nb(shape, dtype)

    out = _data_parallel_collectives(plan, low, pnode, local_param, notes)
    out += _redistribute_collectives(plan, low, notes)
    parts = getattr(low, "parts", {})
    for part in {id(p): p for p in parts.values()}.values():  # each part's own plan, per instance
        out += part.plan.collectives() * len(part.instances)
    out += _tp_backward_collectives(plan, low, pnode, local_param)
    return out, notes


def _data_parallel_collectives(plan, low, pnode, local_param, notes) -> list:
    """FSDP2 units' gathers and reduce-scatters, the gradient buckets' all_reduces, the loss hook's."""
    out = []
    grad_dtype = lambda f: (low.mixed_precision or {}).get("reduce_dtype") or pnode[f]["dtype"][0]
    shard_key = low.shard_dims[0] if len(low.shard_dims) == 1 else tuple(low.shard_dims)
    n_shard = 1
    for d in low.shard_dims:
        n_shard *= plan.mesh_shape[d]
    for u in low.units:
        if not u.params:
            continue
        ag = sum(local_param(f, pnode[f]["dtype"][0]) for f in u.params)
        rs = sum(local_param(f, grad_dtype(f)) for f in u.params)
        out += [("all_gather", shard_key, ag)] * (2 if u.reshard_after_forward else 1)
        out.append(("reduce_scatter", shard_key, rs))
        for d in low.replicate_dims:
            out.append(("all_reduce", d, rs // n_shard))
    for b in getattr(low, "grad_buckets", []):  # replicated parameters: one all_reduce per bucket step
        for dims in b.steps:
            out.append(("all_reduce", dims[0] if len(dims) == 1 else tuple(dims), b.nbytes))
        if b.planned is None:
            notes.append(
                f"gradients {b.params[:3]}{' ...' if len(b.params) > 3 else ''}: the plan reduces them "
                f"otherwise; the engines all-reduce them in an extra bucket ({b.nbytes:,d} B)"
            )
    if getattr(low, "mean_loss", None):  # the loss hook: (weighted loss, count) over the data dims
        dims = tuple(low.replicate_dims + low.shard_dims)
        out.append(("all_reduce", dims[0] if len(dims) == 1 else dims, low.mean_loss["nbytes"]))
    return out


def _data_dim_note(plan, low, n, r) -> str | None:
    """How the engines replace a redistribute the plan runs over the data dims (None: nothing to say)."""
    cs = r["collectives"]
    if not isinstance(r["input"], int):  # e.g. "loss": the plan reduces the loss value itself
        if not cs:
            return None
        return f"{n['name']} {r['input']}: the plan reduces it ({r['src']} -> {r['dst']}); the engines " + (
            "reduce (weighted loss, count) in the loss hook" if low.mean_loss else "leave each rank its local loss"
        )
    src = n["inputs"][r["input"]]
    shape = plan.nodes[src[0]]["shape"][src[1]]
    pair = any(q.get("coalesced") == r["input"] for q in n.get("redistribute", []))
    if r["class"] == "act" and pair and low.mean_loss and len(cs) == 1:
        return (
            f"{n['name']}: the plan's all_reduce of (loss sum, count) over the data dims is the "
            f"loss hook's all_reduce of (weighted loss, count)"
        )
    if r["class"] == "act":
        return (
            f"{n['name']}: the plan redistributes {'a scalar' if not shape else 'a loss input'} "
            f"({r['src']} -> {r['dst']}) over the data dims; "
            + (
                "the engines reduce (weighted loss, count) in the loss hook instead"
                if low.mean_loss
                else "each engine rank averages its own equal batch shard instead"
            )
        )
    return None


def _redistribute_collectives(plan, low, notes) -> list:
    """The plan's forward redistributes on the tensor-parallel dim, once per produced tensor, and their
    backward mirrors; notes for the redistributes over the data dims the engines do otherwise."""
    out, seen, t = [], set(), low.tp_dim
    data = set(low.replicate_dims + low.shard_dims)
    parts = getattr(low, "parts", {})
    for n in plan.nodes:
        if parts and within(n["module"], parts):
            continue  # run by the graph backend (mixed.py)
        for r in n.get("redistribute", []):
            cs = r["collectives"]
            if r["input"] == "opt":
                continue
            if not isinstance(r["input"], int) or any(set(dims_of(c[1])) & data for c in cs):
                note = _data_dim_note(plan, low, n, r)  # (over a flattened group of dims too)
                if note:
                    notes.append(note)
                continue
            if t is None or n["phase"] != "fw" or not any(c[1] == t for c in cs):
                continue
            role = low.tp_roles.get((n["idx"], r["input"]))
            key = (tuple(n["inputs"][r["input"]]), tuple(r["src"]), tuple(r["dst"]))
            if key in seen:
                notes.append(
                    f"{n['name']}: the plan redistributes {plan.nodes[key[0][0]]['name']} again for this "
                    f"consumer; the style does it once"
                )
                continue
            seen.add(key)
            for kind, d, nb, _ in cs:
                if d != t:
                    continue
                out.append((kind, t, nb))
                if kind == "all_gather" and role == "in_gather":
                    out.append(("reduce_scatter", t, nb))
                elif kind == "reduce_scatter":
                    out.append(("all_gather", t, nb))
    return out


def _tp_backward_collectives(plan, low, pnode, local_param) -> list:
    """SequenceParallel parameters' partial gradients all-reduced; the backward of a rowwise Linear fed a
    replicated input (gather) and of a colwise Linear fed one (all_reduce of the input gradient)."""
    out, t = [], low.tp_dim
    parts = getattr(low, "parts", {})
    sp = [m for m, st in low.styles.items() if st.cls == "SequenceParallel"]
    for f in pnode:  # SequenceParallel params: partial gradients, all-reduced
        if t is not None and any(f.startswith(m + ".") for m in sp):
            out.append(("all_reduce", t, local_param(f, pnode[f]["dtype"][0])))
    for (i, j), role in low.tp_roles.items():
        if parts and within(plan.nodes[i]["module"], parts):
            continue
        p, o = plan.nodes[i]["inputs"][j]
        pl = plan.nodes[p]["placement"]["out"][o]
        local = _nb(plan.nodes[p]["shape"][o], plan.nodes[p]["dtype"][o])
        for d, x in enumerate(pl):
            if x[0] == "S" and d != t:
                local //= plan.mesh_shape[d]
        if role == "chunk":  # RowwiseParallel(input_layouts=Replicate()): backward gathers
            out.append(("all_gather", t, local))
        elif role == "in_repl":  # ColwiseParallel on a replicated input: its gradient is partial
            out.append(("all_reduce", t, local))  # and all-reduced in the backward (Megatron's f operator)
    return out


def engine_step_time(plan, low, cluster) -> float:
    """Predicted step of `low` as the engines run it: the plan's compute plus each collective engine_collectives
    lists, priced by the cost model (autopar/cost/comm.py) on its group's link, every one exposed (as the plan's own
    prediction on a cluster whose collectives block). Comparable with plan.predicted["step_s"]."""

    cl, shape = get_cluster(cluster), tuple(plan.mesh_shape)
    comm = sum(
        collective_time(kind, nbytes, math.prod(shape[d] for d in dims_of(dim)), link_of(cl, shape, dim))
        for kind, dim, nbytes in engine_collectives(plan, low)[0]
    )
    return plan.predicted["compute_s"] + comm


def measured_list(counter) -> list:
    return [(r.kind, r.mesh_dim, r.nbytes) for r in counter.records if r.group_size != 1]
