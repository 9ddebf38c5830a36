"""Tensor-parallel recognition: the plan's placements on its tensor-parallel mesh dim as ParallelStyles.

Per module with parameters (placements on the tp dim t):
  nn.Linear     weight Shard(0) -> ColwiseParallel, Shard(1) -> RowwiseParallel
  nn.Embedding  weight Shard(0) -> RowwiseParallel (vocab-sharded), Shard(1) -> ColwiseParallel
  replicated parameters, activations sequence-sharded (Shard(1)) in and out -> SequenceParallel
  replicated parameters, a sequence-sharded input the plan gathers first -> PrepareModuleInput
Layouts come from the activations at the module boundary: what the producer outside the module holds (have) and
what the first op inside wants; for outputs, what the first consumer outside that changes the placement wants
(following views/casts, which compute on local shards as the plan does). Several colwise Linears gathering the
same sequence-sharded tensor get one PrepareModuleInput on their common parent (torchtitan's attention /
feed_forward), so the tensor is gathered once and its gradient reduce-scattered once.

Every forward redistribute on t must be one of these (a style's input gather, output reduction or gather);
anything else (an activation resharded inside plain code, a weight gathered on t) is a reason the engines
cannot express the plan, naming the op and module.
"""

from __future__ import annotations

import inspect
from fnmatch import fnmatch
from collections import defaultdict

import torch.nn as nn

from .lowering import _PASS_THROUGH, EngineLoweringError, Style


def _kind(M, modules, G, members) -> str:
    if modules is not None and M in modules:
        mod = modules[M]
        return "linear" if isinstance(mod, nn.Linear) else "embedding" if isinstance(mod, nn.Embedding) else "other"
    ops = {G.rec(i).op for i in members}
    return "embedding" if "embedding" in ops else "linear" if ops & {"mm", "addmm", "bmm"} else "other"


def param_style(kind: str, pls: dict, tn: str, what: str | None = None) -> tuple[str | None, str]:
    """The table above for one module: the ParallelStyle class that shards a module of `kind` ("linear",
    "embedding", "other"; `what` names it in messages) whose parameters are placed `pls` ({parameter name: "R",
    "S0", "S1", ...}) on the tensor-parallel dim `tn`. Returns (class, why); (None, "") when every parameter is
    replicated there (no sharding style); (None, reason) when no ParallelStyle shards the module that way.
    Used by `recognize_tp` and by the pipeline runtime (backends/pipeline.py) for the modules of each stage."""
    w = pls.get("weight")
    if kind == "linear" and w in ("S0", "S1"):
        bias = pls.get("bias")
        if bias not in (None, "S0" if w == "S0" else "R"):
            return None, (
                f"weight {w} but bias {bias} on {tn}: Colwise shards the bias with the weight, Rowwise replicates it"
            )
        return (
            ("ColwiseParallel", f"weight Shard(0) on {tn}")
            if w == "S0"
            else ("RowwiseParallel", f"weight Shard(1) on {tn}")
        )
    if kind == "embedding" and w in ("S0", "S1"):
        return (
            "RowwiseParallel" if w == "S0" else "ColwiseParallel",
            f"embedding weight {'vocab' if w == 'S0' else 'dim'}-sharded on {tn}",
        )
    if all(v == "R" for v in pls.values()):
        return None, ""
    return None, (
        f"{what or kind} with parameters {pls} on {tn}: ParallelStyles shard only nn.Linear and nn.Embedding weights"
    )


def recognize_tp(low, G, plan, model, forced) -> None:
    """low.styles (module FQN -> Style), low.loss_parallel and low.tp_roles from the plan's placements on the
    tensor-parallel dim; a reason for whatever no ParallelStyle does (module docstring)."""
    _TensorParallel(low, G, plan, model).run()
    if forced:
        _check_forced(low, forced, low.mesh_names[low.tp_dim])


class _TensorParallel:
    """One recognition: the modules with parameters, their forward ops, and what has been decided so far
    (styles; explained: (node, input) -> the role of a forward redistribute on t that a style performs)."""

    def __init__(self, low, G, plan, model):
        self.low, self.G, self.plan = low, G, plan
        self.t, self.tn = low.tp_dim, low.mesh_names[low.tp_dim]
        self.modules = dict(model.named_modules()) if model is not None else None
        self.mods: dict = defaultdict(dict)
        for fqn, pl in plan.params.items():
            if fqn in G.param_node:
                m, pn = fqn.rsplit(".", 1) if "." in fqn else ("", fqn)
                self.mods[m][pn] = pl[self.t]
        self.members = defaultdict(set)
        for n in G.nodes:
            if n.kind == "op" and n.phase == "fw":
                for M in self.mods:
                    if M == "" or n.module == M or n.module.startswith(M + "."):
                        self.members[M].add(n.idx)
        self.explained, self.styles, self.gathers, self.sp_outputs = {}, {}, defaultdict(list), {}

    def out_of(self, p, o):
        return self.G.rec(p).out[o][self.t]

    def in_of(self, i, j):
        return self.G.rec(i).ins[j][self.t]

    def ext_in(self, M):
        G, inside = self.G, self.members[M]
        return [
            (i, j, p, o)
            for i in sorted(inside)
            for j, (p, o) in enumerate(G.rec(i).inputs)
            if p not in inside and G.rec(p).kind in ("op", "input")
        ]

    def ext_out(self, M):
        G, inside = self.G, self.members[M]
        return sorted({(i, o) for i in inside for u, j, o in G.users[i] if G.rec(u).phase == "fw" and u not in inside})

    def downstream(self, i, o, inside):
        """Consumers outside `inside` where the tensor's placement changes or it is used as is by a real op:
        [(consumer, input, have, want)], following views/casts (they compute on local shards)."""
        ends, stack, seen = [], [(i, o)], set()
        while stack:
            a, ao = stack.pop()
            for u, j, uo in self.G.users[a]:
                ur = self.G.rec(u)
                if uo != ao or ur.phase != "fw" or u in inside or (u, j) in seen:
                    continue
                seen.add((u, j))
                have, want = self.out_of(a, ao), self.in_of(u, j)
                if want == have and ur.op in _PASS_THROUGH and len(ur.inputs) == 1:
                    stack += [(u, k) for k, pl in enumerate(ur.out) if pl is not None]
                else:
                    ends.append((u, j, have, want))
        return ends

    def beside_nll(self, lsm) -> list[str]:
        """Forward consumers of the log_softmax nodes `lsm` other than nll_loss (through views), by name."""
        ends = [e for u in lsm for e in self.downstream(u, 0, set())]
        return [self.G.rec(u).name for u, _, _, _ in ends if not self.G.rec(u).op.startswith("nll_loss")]

    def reason(self, M, text):
        self.low.reasons.append((f"module {M or '<root>'}", text))

    def output_layout(self, M, shard_have):
        """output_layouts for a module whose output is `shard_have` on t, from what consumers want."""
        ends = [e for i, o in self.ext_out(M) for e in self.downstream(i, o, self.members[M])]
        moved = [e for e in ends if e[2] != e[3]]  # consumers that need another placement
        wants = {w for _, _, _, w in moved}
        if not moved:
            lsm = [u for u, _, _, _ in ends if self.G.rec(u).op == "_log_softmax"]
            if lsm:
                other = self.beside_nll(lsm)
                if other:  # torch's loss_parallel fuses nll_loss's backward with log_softmax's: nothing may join
                    self.reason(
                        M,
                        f"its vocab-sharded log-probabilities also feed {other[:3]}: loss_parallel runs "
                        "a plain cross_entropy only (no label smoothing, no other use of the log-probs)",
                    )
                    return "bad", ends
                self.low.loss_parallel = True
                return "loss", ends
            return None, ends
        if wants == {"R"}:
            return "Replicate()", moved
        if wants == {"S1"}:
            return "Shard(1)", moved
        self.reason(
            M,
            f"its output ({shard_have} on {self.tn}) is wanted as {sorted(wants)} by "
            f"{[self.G.rec(u).name for u, _, _, _ in moved][:4]}: one ParallelStyle output layout cannot serve them",
        )
        return "bad", moved

    def run(self) -> None:
        kinds = {M: _kind(M, self.modules, self.G, self.members[M]) for M in self.mods}
        sharded_first = lambda kv: (
            kinds[kv[0]] not in ("linear", "embedding") or all(v == "R" for v in kv[1].values()),
            kv[0],
        )
        for M, pls in sorted(self.mods.items(), key=sharded_first):  # sharded modules first: they fix boundaries
            self.module(M, kinds[M], pls)
        self.sequence_gathers()
        self.local_outputs()
        self.unexplained_redistributes()
        self.low.styles = dict(sorted(self.styles.items(), key=lambda kv: _order(kv[0], self.plan)))
        self.low.tp_roles = self.explained

    def module(self, M, kind, pls) -> None:
        xs = [(i, j, p, o) for i, j, p, o in self.ext_in(M) if self.G.rec(p).kind != "param"]
        what = type(self.modules[M]).__name__ if self.modules and M in self.modules else kind
        cls, why = param_style(kind, pls, self.tn, what)
        if cls is None and why:
            self.reason(M, why)
        elif kind == "linear" and cls:
            self.linear(M, cls, why, pls.get("weight"), xs)
        elif kind == "embedding" and cls:
            self.embedding(M, cls, why, pls.get("weight"), xs)
        else:  # every parameter replicated on t
            self.replicated(M, xs)

    def linear(self, M, cls, why, w, xs) -> None:
        acts = sorted({(p, o) for _, _, p, o in xs})
        if len(acts) != 1:
            self.reason(M, f"a Linear with {len(acts)} activation inputs")
            return
        (i, j, p, o) = xs[0]
        kw = self.colwise(M, i, j, p, o) if w == "S0" else self.rowwise(M, i, j, p, o)
        if kw is not None:
            self.styles[M] = Style(cls, kw, why)

    def colwise(self, M, i, j, p, o):
        """A colwise Linear's keywords (replicated input, Shard(-1) output), or None with a reason."""
        tn, (have, want), kw = self.tn, (self.out_of(p, o), self.in_of(i, j)), {}
        if want != "R":
            self.reason(M, f"colwise weight (Shard(0) on {tn}) but its input is used as {want}, not replicated")
            return None
        if have == "S1":
            self.gathers[(p, o)].append(M)
            self.explained[(i, j)] = "in_gather"
        elif have != "R":
            self.reason(
                M, f"input is {have} on {tn}; ColwiseParallel takes a replicated or sequence-sharded (Shard(1)) input"
            )
            return None
        else:
            self.explained[(i, j)] = "in_repl"  # backward: the input gradient is all-reduced
        outs = self.ext_out(M)
        lay, ends = self.output_layout(M, self.out_of(*outs[0]) if outs else "S2")
        if lay == "bad":
            return None
        if lay == "loss":
            kw.update(output_layouts="Shard(-1)", use_local_output="False")
        elif lay:
            kw["output_layouts"] = lay
            self.explained.update({(u, jj): "out" for u, jj, _, _ in ends})
        return kw

    def rowwise(self, M, i, j, p, o):
        """A rowwise Linear's keywords (Shard(-1) input, partial output), or None with a reason."""
        tn, (have, want), kw = self.tn, (self.out_of(p, o), self.in_of(i, j)), {}
        last = f"S{len(self.G.rec(p).shapes[o]) - 1}"
        if have == "R" and want == last:
            kw["input_layouts"] = "Replicate()"
            self.explained[(i, j)] = "chunk"
        elif not (have == want == last):
            self.reason(
                M,
                f"rowwise weight (Shard(1) on {tn}) but its input is {have} -> {want}; RowwiseParallel "
                f"takes the input sharded on its last dim",
            )
            return None
        lay, ends = self.output_layout(M, "P")
        if lay in ("bad", None, "loss"):
            if lay != "bad":
                self.reason(M, f"rowwise output stays partial on {tn} downstream")
            return None
        if lay != "Replicate()":
            kw["output_layouts"] = lay
        self.explained.update({(u, jj): "out_reduce" for u, jj, _, _ in ends})
        return kw

    def embedding(self, M, cls, why, w, xs) -> None:
        kw = {"input_layouts": "Replicate()"}
        if any(self.out_of(p, o) != "R" for p, o in {(p, o) for _, _, p, o in xs}):
            self.reason(M, f"embedding indices are sharded on {self.tn}")
            return
        if w == "S0":
            self.explained.update({(i, j): "indices" for i, j, p, o in xs})  # indices masked by the style itself
        lay, ends = self.output_layout(M, "Pm" if w == "S0" else "S2")
        if lay in ("bad", "loss") or (lay is None and w == "S0"):
            if lay != "bad":
                self.reason(M, f"vocab-sharded embedding output stays partial on {self.tn} downstream")
            return
        if lay:
            if not (w == "S0" and lay == "Replicate()"):  # RowwiseParallel's default output
                kw["output_layouts"] = lay
            self.explained.update({(u, jj): "out_reduce" for u, jj, _, _ in ends})
        self.styles[M] = Style(cls, kw, why)

    def replicated(self, M, xs) -> None:
        """A module whose parameters are replicated on t: replicated compute, SequenceParallel, or a gather of
        its sequence-sharded input (PrepareModuleInput)."""
        tn, ex = self.tn, self.explained
        # an input another style already redistributes (e.g. a rowwise output reduce-scattered) arrives as wanted
        pairs = {(self.in_of(i, j) if (i, j) in ex else self.out_of(p, o), self.in_of(i, j)) for i, j, p, o in xs}
        if all(h == wnt == "R" for h, wnt in pairs):
            return  # replicated compute, nothing to do
        if all(h == wnt for h, wnt in pairs) and {h for h, _ in pairs} <= {"S1", "R"}:
            self.styles[M] = Style(
                "SequenceParallel", {}, f"parameters replicated, activations sequence-sharded (Shard(1)) on {tn}"
            )
            self.sp_outputs[M] = [e for i, o in self.ext_out(M) for e in self.downstream(i, o, self.members[M])]
        elif pairs == {("S1", "R")} and self.modules is not None:
            n_in = _arity(self.modules.get(M))
            self.styles[M] = Style(
                "PrepareModuleInput",
                {**_gather_first(n_in), "use_local_output": "True"},
                f"gathers its sequence-sharded input on {tn} (plan)",
            )
            ex.update({(i, j): "pmi" for i, j, p, o in xs})
        else:
            self.reason(
                M,
                f"replicated parameters on {tn} but activations {sorted(pairs)} (have, want) at its "
                f"inputs: neither SequenceParallel nor replicated compute",
            )

    def sequence_gathers(self) -> None:
        """Colwise Linears that gather a sequence-sharded input: input_layouts=Shard(1), or one
        PrepareModuleInput on their common parent when several gather the same tensor."""
        G, styles = self.G, self.styles
        for (p, o), linears in self.gathers.items():
            parent = _common_parent(linears) if len(linears) > 1 else ""
            producer = G.rec(p).module
            if (
                not parent
                or parent in styles
                or (producer and (producer == parent or producer.startswith(parent + ".")))
            ):
                for m in linears:
                    if m in styles:  # (a module whose output no style serves has a reason instead)
                        styles[m].kwargs = {"input_layouts": "Shard(1)", **styles[m].kwargs}
                continue
            n_in = _arity(self.modules.get(parent)) if self.modules is not None else 1
            styles[parent] = Style(
                "PrepareModuleInput",
                _gather_first(n_in),
                f"{len(linears)} colwise Linears gather the same sequence-sharded input: once here",
            )
            self.low.notes.append(
                f"the plan gathers {G.rec(p).name} once per consumer ({len(linears)} all_gathers on "
                f"{self.tn}); PrepareModuleInput on '{parent}' gathers it once"
            )

    def local_outputs(self) -> None:
        """A SequenceParallel output consumed by plain code (no style gathers it) is handed over as a local shard."""
        gathered_in = [
            m
            for m, st in self.styles.items()
            if st.cls == "PrepareModuleInput" or "Shard(1)" in st.kwargs.get("input_layouts", "")
        ]
        for M, ends in self.sp_outputs.items():
            if any(not any(self.G.in_module(u, g) for g in gathered_in) for u, _, _, _ in ends):
                self.styles[M].kwargs["use_local_output"] = "True"

    def loss_parallel_reduces(self, n, r) -> bool:
        """Under loss_parallel, torch's nll_loss handler all-reduces the loss over t itself (its output is
        Replicate there): the plan's P -> R on t of an nll_loss_forward output is that all_reduce."""
        p, _ = n.inputs[r.input]
        return (
            self.low.loss_parallel
            and (r.src[self.t], r.dst[self.t]) == ("P", "R")
            and self.G.rec(p).op.startswith("nll_loss")
        )

    def unexplained_redistributes(self) -> None:
        """Every forward redistribute on t that no style performs is a reason."""
        t, tn = self.t, self.tn
        for r in self.plan.redistribute_records():
            n = self.G.rec(r.consumer)
            if (
                n.phase != "fw"
                or not isinstance(r.input, int)
                or r.src[t] == r.dst[t]
                or (n.idx, r.input) in self.explained
            ):
                continue
            if self.loss_parallel_reduces(n, r):
                self.explained[(n.idx, r.input)] = "loss_parallel"
                continue
            move = f"[{','.join(r.src)}] -> [{','.join(r.dst)}]"
            if r.value_class == "param":
                why = (
                    f"gathered on {tn} ({move}) before {n.name}: a parameter sharded on the tensor-"
                    f"parallel dim must be used sharded"
                )
                self.low.reasons.append((f"parameter {r.param}", why))
            else:
                why = (
                    f"in module '{n.module or '<root>'}' redistributes input {r.input} {move} on {tn}, "
                    f"which no ParallelStyle does"
                )
                self.low.reasons.append((f"op {n.name}", why))


def _gather_first(n_in) -> dict:
    """PrepareModuleInput's layouts: the first input gathered from Shard(1), the others left alone."""
    return {
        "input_layouts": _tup(["Shard(1)"] + ["None"] * (n_in - 1)),
        "desired_input_layouts": _tup(["Replicate()"] + ["None"] * (n_in - 1)),
    }


def _tup(items) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _arity(mod) -> int:
    if mod is None:
        return 1
    ps = [
        p
        for p in inspect.signature(mod.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return max(1, len(ps))


def _common_parent(fqns) -> str:
    parts = [f.split(".")[:-1] for f in fqns]
    common = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        common.append(xs[0])
    return ".".join(common)


def _order(fqn, plan) -> int:
    first = {}
    for n in plan.nodes:
        first.setdefault(n["module"], n["idx"])
    return min((i for m, i in first.items() if m == fqn or m.startswith(fqn + ".")), default=1 << 30)


def _check_forced(low, forced, tn) -> None:
    for key, style in forced.items():
        want = style if isinstance(style, str) else type(style).__name__
        hits = [m for m in low.styles if fnmatch(m, key) or m == key]
        if not hits:
            raise EngineLoweringError(
                f"style {want} forced on '{key}', but the plan gives that module no "
                f"ParallelStyle on {tn} (its parameters are replicated there)"
            )
        for m in hits:
            if low.styles[m].cls != want:
                raise EngineLoweringError(
                    f"style {want} forced on '{m}' contradicts the plan, which places it as "
                    f"{low.styles[m].code()} ({low.styles[m].why})"
                )
