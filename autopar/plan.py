"""The Plan: what the passes decided, as plain data. `dump()` is deterministic text meant to be read and diffed;
`save`/`load` round-trip it as JSON; `param_placements()` gives torch Placements per parameter FQN."""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

from .graph import op_name
from .collectives import Collective, dims_of

_KIND_ORDER = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")


def _dim(m):
    """A collective's mesh dim: an int, or a tuple of the mesh dims of a flattened group (a list once in JSON)."""
    return tuple(m) if isinstance(m, (list, tuple)) else m


@dataclass(frozen=True)
class RedistributeRecord:
    """One redistribute into an input of a node (a record of `Plan.nodes[i]["redistribute"]`, written by
    autopar/predict.py), typed: what a backend reads instead of the JSON dict."""

    consumer: int  # the node whose input it feeds
    input: int | str  # that node's tensor input position, "opt" (the gradient into the step), "loss" or "state"
    src: tuple[str, ...]
    dst: tuple[str, ...]
    value_class: str  # "act", "param" (a parameter gather) or "grad" (a gradient reduction)
    collectives: tuple[Collective, ...]
    time_s: float
    param: str | None = None  # the parameter a gather or gradient reduction is for
    bucket: int | None = None  # a bucketed gradient: its bucket's one collective carries it
    shares: tuple | None = None  # (node name, input) whose redistribute of the same value it reuses
    coalesced: int | str | None = None  # the input (or "node:input") whose all_reduce also carries it

    @classmethod
    def from_json(cls, consumer: int, d: dict) -> "RedistributeRecord":
        return cls(
            consumer,
            d["input"],
            tuple(d["src"]),
            tuple(d["dst"]),
            d["class"],
            tuple(Collective(c[0], _dim(c[1]), c[2], c[3]) for c in d["collectives"]),
            d["time_s"],
            d.get("param"),
            d.get("bucket"),
            tuple(d["shares"]) if "shares" in d else None,
            d.get("coalesced"),
        )

    def to_json(self) -> dict:
        d = {
            "input": self.input,
            "src": list(self.src),
            "dst": list(self.dst),
            "class": self.value_class,
            "collectives": [[c.kind, _json_dim(c.mesh_dim), c.nbytes, c.group] for c in self.collectives],
            "time_s": self.time_s,
        }
        optional = {"param": self.param, "bucket": self.bucket, "coalesced": self.coalesced}
        d.update({k: v for k, v in optional.items() if v is not None})
        if self.shares is not None:
            d["shares"] = list(self.shares)
        return d


@dataclass(frozen=True)
class BucketRecord:
    """One gradient bucket (a record of `Plan.buckets`, passes/buckets.py): one collective over its gradients."""

    kind: str
    mesh_dim: int | tuple  # a tuple of mesh dims: one collective over their flattened group
    group: int  # ranks in the group
    src: str  # the gradients' placement on that dim before ("P") and after ("R", "S0")
    dst: str
    dtype: str
    params: tuple[str, ...]
    nbytes: int
    chain: int  # the index of the first bucket of its chain over several mesh dims
    step: int  # its position in that chain

    @classmethod
    def from_json(cls, d: dict) -> "BucketRecord":
        return cls(
            d["kind"],
            _dim(d["mesh_dim"]),
            d["group"],
            d["from"],
            d["to"],
            d["dtype"],
            tuple(d["params"]),
            d["bytes"],
            d["chain"],
            d["step"],
        )

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "mesh_dim": _json_dim(self.mesh_dim),
            "group": self.group,
            "from": self.src,
            "to": self.dst,
            "dtype": self.dtype,
            "params": list(self.params),
            "bytes": self.nbytes,
            "chain": self.chain,
            "step": self.step,
        }


def _json_dim(m):
    return list(m) if isinstance(m, tuple) else m


def _placement(pl):
    return tuple(pl) if pl is not None else None


@dataclass(frozen=True)
class NodeRecord:
    """One node of the plan (a record of `Plan.nodes`, written by node_record), typed: what a backend reads
    instead of the JSON dict. A None output (shape, dtype, placement) is a non-tensor output."""

    idx: int
    name: str
    kind: str  # "input", "param", "op", "output", ...
    target: str  # an op's name ("mm.default"), a parameter's FQN, an input's name
    phase: str  # "fw" or "bw"
    module: str  # the FQN of the module it runs in ("" is the root)
    shapes: tuple  # per output: a shape tuple, or None
    dtypes: tuple  # per output: a dtype name ("float32"), or None
    out: tuple  # per output: its placement per mesh dim ("R", "S0", "P", ...), or None
    ins: tuple  # per tensor input: the placement the node takes it in, per mesh dim
    inputs: tuple  # per tensor input: (producer node idx, producer output)
    consts: tuple | None = None  # an op's scalar positional arguments as (position, value); None: not recorded
    internal: tuple = ()  # collectives inside the op: (kind, mesh dim, bytes, group size) each

    @property
    def op(self) -> str:
        """An op's name without its overload ("mm"); the kind for any other node."""
        return self.target.split(".")[0] if self.kind == "op" else self.kind

    def const(self, position: int, default=None):
        """The op's scalar positional argument at `position` (e.g. nll_loss's ignore_index at 4), or default."""
        return dict(self.consts or ()).get(position, default)

    @classmethod
    def from_json(cls, d: dict) -> "NodeRecord":
        consts = d.get("consts")
        return cls(
            d["idx"],
            d["name"],
            d["kind"],
            d["target"],
            d["phase"],
            d["module"],
            tuple(_placement(s) for s in d["shape"]),
            tuple(d["dtype"]),
            tuple(_placement(p) for p in d["placement"]["out"]),
            tuple(tuple(p) for p in d["placement"]["ins"]),
            tuple(tuple(e) for e in d.get("inputs", ())),
            tuple(sorted((int(k), v) for k, v in consts.items())) if consts is not None else None,
            tuple(tuple(c) for c in d.get("internal", ())),
        )


# the fields of a pipeline plan's stages and schedule that say what runs where (Plan.hash)
_STAGE_RUN = ("index", "modules", "params", "pp_rank", "recompute_blocks", "submesh")
_SCHEDULE_RUN = tuple(
    "name torch_class num_stages stages_per_rank n_microbatches bounds block_positions layer_prefix stage_mesh_names "
    "stage_mesh_shape batch_placement batch_shapes local_batch_shapes microbatch_shapes".split()
)


@dataclass
class Plan:
    mesh_shape: tuple
    mesh_names: tuple
    cluster: str
    nodes: list[dict]
    params: dict[str, list[str]]
    predicted: dict
    solver: dict
    timings: list = field(default_factory=list)  # [pass, seconds] in run order
    regions: list = field(default_factory=list)
    coverage: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    schedule: dict = field(default_factory=dict)
    buckets: list = field(default_factory=list)  # gradient buckets (passes/buckets.py): one collective each
    # what the graph executor needs beyond `nodes` to run the plan without planning again (execution_record)
    execution: dict = field(default_factory=dict)
    # what the prediction needs beyond `nodes` and `buckets` (autopar/predict.py pricing_record): the cluster's
    # figures, the overlap option, the precision, checkpointed blocks, the graph's outputs
    pricing: dict = field(default_factory=dict)

    # ---- queries --------------------------------------------------------------------------------------------
    def param_placements(self) -> dict:
        from .strategies._torch_adapter import to_placement

        return {k: tuple(to_placement(p) for p in v) for k, v in self.params.items()}

    def collectives(self) -> list[tuple[str, int, int]]:
        """Every planned collective of one step as (kind, mesh_dim, bytes), in graph order (a node's redistributes,
        then those inside the op), then the gradient buckets in the order they are issued."""
        out = []
        for n in self.nodes:
            for r in n.get("redistribute", []):
                if "bucket" not in r:  # bucketed gradient reductions: their bucket's collective
                    out += [(c[0], _dim(c[1]), c[2]) for c in r["collectives"]]
            out += [(c[0], c[1], c[2]) for c in n.get("internal", [])]
        return out + [(b["kind"], _dim(b["mesh_dim"]), b["bytes"]) for b in self.buckets]

    def redistribute_records(self) -> tuple[RedistributeRecord, ...]:
        """Every redistribute of the plan, typed, in node order (each node's in its recorded order)."""
        return tuple(RedistributeRecord.from_json(n["idx"], r) for n in self.nodes for r in n.get("redistribute", []))

    def node_records(self) -> tuple[NodeRecord, ...]:
        """The nodes, typed, in graph order (node_records()[i].idx == i)."""
        return tuple(NodeRecord.from_json(n) for n in self.nodes)

    def bucket_records(self) -> tuple[BucketRecord, ...]:
        """The gradient buckets, typed, in the order they are issued."""
        return tuple(BucketRecord.from_json(b) for b in self.buckets)

    def graph_signature(self) -> list[tuple]:
        """Per node (kind, target, phase, output shapes, dtypes, producers): what a captured graph must repeat for
        this plan to run on it (`graph_signature` of a Graph gives the same)."""
        return [
            (r["kind"], r["target"], r["phase"], _tuples(r["shape"]), tuple(r["dtype"]), _tuples(r["inputs"]))
            for r in self.nodes
        ]

    def hash(self) -> str:
        """What the ranks run, as 16 hex digits: placements, redistributes, buckets and, for a pipeline plan, its
        stages and schedule (not the figures the search recorded on the way, which vary run to run)."""
        body = {
            "mesh": self.mesh_shape,
            "params": self.params,
            "buckets": self.buckets,
            "nodes": [[n["placement"], n.get("redistribute", [])] for n in self.nodes],
        }
        if self.stages:
            body["stages"] = [{k: st.get(k) for k in _STAGE_RUN} for st in self.stages]
            body["schedule"] = {k: self.schedule.get(k) for k in _SCHEDULE_RUN}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    # ---- persistence ----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)

    @classmethod
    def load(cls, path) -> "Plan":
        with open(path) as f:
            return cls.from_json(json.load(f), source=str(path))

    @classmethod
    def from_json(cls, d: dict, source: str = "the record") -> "Plan":
        """The Plan of `to_json()`'s record once through JSON (lists for tuples), as `save` wrote it."""
        d = dict(d, mesh_shape=tuple(d["mesh_shape"]), mesh_names=tuple(d["mesh_names"]))
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{source} is not an autopar plan of this version: unknown fields {unknown}")
        return cls(**d)

    # ---- text -----------------------------------------------------------------------------------------------
    def summary(self, timings: bool = True) -> str:
        """The plan's headline numbers and module placements; `timings=False` leaves out the wall-clock lines
        (pass times, solve seconds) so the text is identical for identical plans."""
        p = self.predicted
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_names, self.mesh_shape))
        lines = [
            f"autopar plan  mesh [{mesh}]  cluster {self.cluster}  plan {self.hash()}",
            f"predicted step {p['step_s'] * 1e3:.3f} ms = compute {p['compute_s'] * 1e3:.3f} ms + exposed comm "
            f"{p['exposed_comm_s'] * 1e3:.3f} ms (all comm {p['comm_s'] * 1e3:.3f} ms)",
            f"peak memory per rank {p['peak_mem_bytes'] / 2**30:.3f} GiB (model state "
            f"{p['state_mem_bytes'] / 2**30:.3f} GiB, activation peak {p['act_peak_bytes'] / 2**30:.3f} GiB)",
            "collectives per step: "
            + (
                ", ".join(
                    f"{k} x{v['count']} {v['bytes'] / 1e6:.3f} MB"
                    for k, v in sorted(p["collectives"].items(), key=lambda kv: _KIND_ORDER.index(kv[0]))
                )
                or "none"
            ),
            f"solver {self.solver['status']}  objective {self.solver['objective'] * 1e3:.4f} ms  gap "
            f"{self.solver['gap']:.2e}  {self.solver['n_vars']} vars"
            + (f"  {self.solver['seconds']:.2f} s" if timings else ""),
        ]
        if self.meta.get("precision_decision"):  # passes/precision.py choose: what was compared, why this one
            d = self.meta["precision_decision"]
            lines.append(f"precision {d['chosen']}: {d['why']}")
        if self.meta.get("replicated_why"):
            lines += _replicated_why(self.meta["replicated_why"])
        if self.meta.get("float8"):
            lines.append(_float8_line(self.meta["float8"]))
        if p.get("async_tp_hidden_s"):
            lines.append(
                f"async TP: {p['async_tp_hidden_s'] * 1e3:.3f} ms of the TP collectives run under their matmuls "
                "(counted off the exposed comm)"
            )
        if timings:
            lines.append("pass times " + "  ".join(f"{k} {v:.2f}s" for k, v in self.timings))
        if self.coverage:
            lines.append(
                "replicate-only ops (no placement rule, accepted by the user): "
                + ", ".join(f"{k} x{v}" for k, v in sorted(self.coverage.items()))
            )
        if self.stages:
            lines += self.stage_summary()
        lines.append("")
        lines.append("module placements (parameter: placement per mesh dim)")
        lines += self.module_summary()
        return "\n".join(lines)

    def stage_summary(self) -> list[str]:
        """Pipeline plans: the schedule, one row per stage (clusters, modeled time and memory), the timeline."""
        sc, gib = self.schedule, 2**30
        mb = " ".join("x".join(map(str, s)) for s in sc.get("microbatch_shapes", []))
        ev = sc.get("even_split")
        lines = [
            f"pipeline: {sc['num_stages']} stages on pp={sc['pp']} ({sc['stages_per_rank']} per rank), stage "
            f"submesh {'x'.join(map(str, sc['stage_mesh_shape']))}({','.join(sc['stage_mesh_names'])}), "
            f"schedule {sc['name']}, {sc['n_microbatches']} micro-batches of {mb}",
            f"  step {sc['step_s'] * 1e3:.3f} ms (pipeline {sc['pipeline_s'] * 1e3:.3f} ms + exposed dp comm "
            f"{sc['exposed_dp_s'] * 1e3:.3f} ms; closed form "
            f"{'-' if sc['proxy_step_s'] is None else format(sc['proxy_step_s'] * 1e3, '.3f')} ms), bubble "
            f"{sc['bubble_fraction'] * 100:.1f}%"
            + (f"; even layer split {ev['step_s'] * 1e3:.3f} ms, bubble {ev['bubble'] * 100:.1f}%" if ev else ""),
            f"  {'stage':>5} {'rank':>4} {'clusters':<30} {'params':>9} {'F ms':>9} {'B ms':>9} {'W ms':>9} "
            f"{'dp ms':>8} {'state GiB':>9} {'act/mb GiB':>10} {'in-flight':>9} {'rank GiB':>9}  send",
        ]
        for st in self.stages:
            cl = st["clusters"]
            where = cl[0] if len(cl) == 1 else f"{cl[0]}..{cl[-1]} ({len(cl)})"
            t, m = st["time"], st["memory"]
            send = (
                f"{st['send']['bytes'] / 1e6:.2f} MB {st['send']['link']} {st['send']['time_s'] * 1e3:.3f} ms"
                if "send" in st
                else "-"
            )
            lines.append(
                f"  {st['index']:>5} {st['pp_rank']:>4} {where:<30} {st['n_params'] / 1e6:>8.2f}M "
                f"{t['F_s'] * 1e3:>9.3f} {t['B_s'] * 1e3:>9.3f} {t['W_s'] * 1e3:>9.3f} "
                f"{t['dp_comm_s'] * 1e3:>8.3f} {m['state_bytes'] / gib:>9.3f} "
                f"{m['act_bytes_per_microbatch'] / gib:>10.4f} {m['inflight_microbatches']:>9} "
                f"{m['rank_peak_bytes'] / gib:>9.3f}  {send}"
            )
        lines.append(
            "  timeline (one row per pp rank; F forward, B backward, I input-grad, W weight-grad, lower case: "
            "the rank's later stage, '.' idle)"
        )
        lines += ["  " + r for r in sc.get("timeline", [])]
        return lines

    def module_summary(self) -> list[str]:
        """Module FQN (repeated layers folded to '*') -> a readable description of its parameters' placements."""
        rows = defaultdict(set)
        shapes = {n["target"]: n["shape"][0] for n in self.nodes if n["kind"] == "param"}
        if self.stages:  # pipeline plans: placements are on the stage submesh; nodes hold representative blocks
            folded = {re.sub(r"\.(\d+)\.", ".*.", g): s for g, s in shapes.items()}
            for f in self.params:
                shapes.setdefault(f, folded.get(re.sub(r"\.(\d+)\.", ".*.", f)))
        for fqn, pl in self.params.items():
            key = re.sub(r"\.(\d+)\.", ".*.", fqn)
            rows[key].add(tuple(pl))
        out = []
        for key in sorted(rows):
            variants = sorted(rows[key])
            shape = next(
                (shapes[f] for f in self.params if f in shapes and re.sub(r"\.(\d+)\.", ".*.", f) == key), []
            )  # a tied alias (e.g. lm_head.weight) has no parameter node of its own
            desc = "; ".join(_describe(key, shape, v, self._param_mesh_names()) for v in variants)
            out.append(f"  {key:<44} {desc}")
        return out

    def _param_mesh_names(self) -> tuple:
        return tuple(self.schedule.get("stage_mesh_names", self.mesh_names)) if self.stages else self.mesh_names

    def _dim_name(self, d) -> str:
        """A collective's mesh dim by name; a flattened group of dims (one all_reduce over them) as "dp+tp"."""
        names = self._param_mesh_names()
        return "+".join(names[x] for x in dims_of(d))

    def dump(self) -> str:
        """Deterministic annotated graph: identical plans give identical text (no wall-clock figures)."""
        lines = [
            self.summary(timings=False),
            "",
            "graph (one line per node: op, phase, module, output shapes, placement; "
            "then the redistributes its inputs need, and the collectives inside the op)",
        ]
        f8 = {r[0]: "x".join(r[1:3]) for r in self.meta.get("float8", {}).get("nodes", [])}  # float8 GEMMs

        def calls(cs) -> str:
            return ", ".join(f"{c[0]}(dim {self._dim_name(c[1])}, {c[2] / 1e6:.3f} MB)" for c in cs)

        for n in self.nodes:
            outs = " ".join("x".join(map(str, s)) if s is not None else "-" for s in n["shape"])
            pl = " ".join("[" + ",".join(p) + "]" if p is not None else "-" for p in n["placement"]["out"])
            ins = " ".join("[" + ",".join(p) + "]" for p in n["placement"]["ins"])
            where = n["module"] or "<root>"
            lines.append(
                f"{n['name']:<44} {n['phase']} {where:<32} {outs:<18} out {pl} in {ins}"
                + (f"  t={n['time_s'] * 1e6:.2f}us" if n.get("time_s") else "")
                + (f"  float8 {f8[n['idx']]}" if n["idx"] in f8 else "")
            )
            for r in n.get("redistribute", []):
                cs = calls(r["collectives"])
                lines.append(
                    f"    input {r['input']}: [{','.join(r['src'])}] -> [{','.join(r['dst'])}]"
                    + (
                        f"  in gradient bucket {r['bucket']}"
                        if "bucket" in r
                        else f"  {cs}"
                        if cs
                        else f"  (shares {r['shares'][0]} input {r['shares'][1]})"
                        if "shares" in r
                        else f"  (in {_co(r['coalesced'])}'s all_reduce)"
                        if "coalesced" in r
                        else "  (local)"
                    )
                    + (f"  async TP hides {r['hidden_s'] * 1e6:.2f}us" if r.get("hidden_s") else "")
                )
            if n.get("internal"):  # collectives the op issues itself (a class-sharded loss's row reductions)
                lines.append(f"    inside the op: {calls(n['internal'])}")
        if self.buckets:
            lines += ["", "gradient buckets (one collective each, issued after the backward in this order)"]
            names = self._param_mesh_names()
            for k, b in enumerate(self.buckets):
                dim = "+".join(names[d] for d in dims_of(b["mesh_dim"]))
                lines.append(
                    f"  bucket {k}: {b['kind']}(dim {dim}, {b['bytes'] / 1e6:.3f} MB) "
                    f"[{b['from']}] -> [{b['to']}] {b['dtype']}, {len(b['params'])} gradients: "
                    + ", ".join(b["params"][:6])
                    + (" ..." if len(b["params"]) > 6 else "")
                )
        return "\n".join(lines) + "\n"


def _describe(key: str, shape, pl, names) -> str:
    leaf = key.rsplit(".", 1)[-1]
    parts = []
    for p, name in zip(pl, names):
        if p == "R":
            parts.append(f"replicate on {name}")
        elif (
            len(shape) == 2 and leaf == "weight" and not key.endswith(("embeddings.weight", "wte.weight", "wpe.weight"))
        ):
            parts.append(f"{'colwise' if p == 'S0' else 'rowwise'} on {name}")
        elif key.endswith(("embeddings.weight", "wte.weight", "wpe.weight")):
            parts.append(f"{'vocab-sharded' if p == 'S0' else 'dim-sharded'} on {name}")
        else:
            parts.append(f"sharded dim {p[1:]} on {name}")
    return f"[{','.join(pl)}] " + ", ".join(parts)


def dump_state(state) -> str:
    """A short text view of a PlanState between passes (what exists so far)."""
    g = state.graph
    lines = [f"{len(g.nodes)} nodes"]
    for n in g.nodes:
        extra = ""
        if state.strategies is not None:
            extra += f" cands={len(state.strategies[n.idx])}"
        if state.placement is not None:
            s = state.placement[n.idx]
            extra += " out=" + " ".join("[" + ",".join(p) + "]" if p else "-" for p in s.out)
        lines.append(f"{n.name} {n.phase} {n.module}{extra}")
    return "\n".join(lines)


_DTYPES: dict = {}


def _dtype_name(dt) -> str:
    if dt not in _DTYPES:
        _DTYPES[dt] = str(dt).replace("torch.", "")
    return _DTYPES[dt]


def node_record(n, s, red, time_s, source, internal=()) -> dict:
    """internal: (kind, mesh dim, bytes, group size) of the collectives the op issues inside itself (the row
    reductions of a class-sharded loss: autopar/strategies/vocab_parallel.py), in its time_s."""
    return {
        "idx": n.idx,
        "name": n.name,
        "kind": n.kind,
        "target": n.target if n.kind != "op" else op_name(n.target),
        "phase": n.phase,
        "module": n.module,
        "shape": [list(m.shape) if m is not None else None for m in n.outs],
        "dtype": [_dtype_name(m.dtype) if m is not None else None for m in n.outs],
        "placement": {"out": [list(p) if p is not None else None for p in s.out], "ins": [list(p) for p in s.ins]},
        "redistribute": red,
        "time_s": time_s,
        "source": source,
        "inputs": [[r.node, r.out] for r in n.inputs()],  # producer (node idx, output) per tensor input
        **(
            {"consts": {str(i): a for i, a in enumerate(n.args) if type(a) in (int, float, bool)}}
            if n.kind == "op"
            else {}
        ),
        **({"internal": [list(c) for c in internal]} if internal else {}),
    }  # scalar positional arguments (ignore_index, dims)


def _tuples(x):
    """Nested lists (JSON) as nested tuples, so a loaded plan compares equal to a fresh one."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def graph_signature(g) -> list[tuple]:
    """Plan.graph_signature of a captured Graph."""
    return [
        (
            n.kind,
            n.target if n.kind != "op" else op_name(n.target),
            n.phase,
            tuple(tuple(m.shape) if m is not None else None for m in n.outs),
            tuple(_dtype_name(m.dtype) if m is not None else None for m in n.outs),
            tuple((r.node, r.out) for r in n.inputs()),
        )
        for n in g.nodes
    ]


def execution_record(state) -> dict:
    """Plan.execution: the decisions of the redistribute pass that `nodes` do not spell out in executor terms
    (shared and coalesced redistributes, the forward's order of execution) and how the graph was captured, so a
    saved plan runs on a graph captured again (autopar/execution.py)."""
    g, mp = state.graph, state.options.get("mixed_precision")
    pairs = lambda d: sorted([*k, *v] for k, v in (d or {}).items())  # (consumer, input) -> (consumer, input)
    return {
        "capture": {
            "output": "activation" if g.activation else "loss",
            "backward": any(n.phase == "bw" for n in g.nodes),
            "param_dtype": mp["param_dtype"] if mp else None,
            "reduce_dtype": mp["reduce_dtype"] if mp else None,
        },
        "shares": pairs(state.shares),
        "coalesced": pairs(state.coalesced),
        "fw_order": list(state.fw_order) if state.fw_order else None,
    }


def _float8_line(f8: dict) -> str:
    """The summary's float8 line (passes/float8.py): which linears' GEMMs run in float8, what they cost."""
    if "gemms" not in f8:  # a pipeline plan: each stage's plans are priced with it
        return f"float8 linears ({f8['recipe']}, filter_fqns {f8['filter_fqns']}): {f8.get('pipeline', '')}"
    ms = lambda k: f"{f8[k] * 1e3:.3f} ms" if k in f8 else "-"
    skipped = "; ".join(f"{k}: {v}" for k, v in f8["skipped"].items()) or "none"
    return (
        f"float8 ({f8['recipe']}) GEMMs of {len(f8['linears'])} linears ({f8['gemms']} GEMMs): {ms('gemm_s')} "
        f"+ casts {ms('cast_s')} (unconverted {ms('unconverted_gemm_s')}); not converted: {skipped}"
    )


def _co(c) -> str:
    """Where a coalesced input's all_reduce runs: another input of the op, or "<node>:<input>" of a later op."""
    return f"input {c}" if isinstance(c, int) else c


def _replicated_why(why: dict) -> list[str]:
    """Why a plan replicates everything: per mesh dim, the link's figures and what sharding the costliest op on it
    would save against what its collectives would cost (autopar/feasibility.py `replicated_why`, at plan time)."""
    us = lambda s: f"{s * 1e6:.4g} us"
    ops = [d["op"] for d in why["dims"] if "sharded_s" in d.get("op", {})]
    lines = [
        "why replicated: no mesh dim has more than one rank"
        if not why["dims"]
        else "why replicated: on this cluster sharding costs more in collectives than it saves in compute"
        if ops and all(o["comm_s"] >= o["replicated_s"] - o["sharded_s"] for o in ops)
        else "why replicated: the cluster's figures (the solver weighs every op, the costliest is shown)"
    ]
    for d in why["dims"]:
        link = (
            f"{d['link']}: all_gather {us(d['alpha_s'])} per ring step + {us(d['launch_s'])} per call, "
            f"{d['bw'] / 1e9:.2f} GB/s"
        )
        op = d.get("op") or {}
        if "sharded_s" not in op:
            lines.append(f"  {d['dim']} ({d['size']} ranks, {link}): the costliest op has no placement sharded on it")
            continue
        lines.append(
            f"  {d['dim']} ({d['size']} ranks, {link}): sharding the costliest op ({op['op']} in "
            f"'{op['module'] or '<root>'}', {us(op['replicated_s'])} replicated) on {d['dim']} saves "
            f"{us(op['replicated_s'] - op['sharded_s'])} of compute but its collectives cost {us(op['comm_s'])}"
        )
    return lines
