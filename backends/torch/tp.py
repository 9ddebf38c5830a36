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
from collections import defaultdict

import torch.nn as nn

from .lowering import _PASS_THROUGH, EngineLoweringError, Style
from .batch import _op


def _kind(M, modules, G, members) -> str:
    if modules is not None and M in modules:
        mod = modules[M]
        return "linear" if isinstance(mod, nn.Linear) else "embedding" if isinstance(mod, nn.Embedding) else "other"
    ops = {_op(G.rec(i)) for i in members}
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
    t, tn = low.tp_dim, low.mesh_names[low.tp_dim]
    modules = dict(model.named_modules()) if model is not None else None
    mods: dict = defaultdict(dict)
    for fqn, pl in plan.params.items():
        if fqn in G.param_node:
            m, pn = fqn.rsplit(".", 1) if "." in fqn else ("", fqn)
            mods[m][pn] = pl[t]
    members = defaultdict(set)
    for n in plan.nodes:
        if n["kind"] == "op" and n["phase"] == "fw":
            for M in mods:
                if M == "" or n["module"] == M or n["module"].startswith(M + "."):
                    members[M].add(n["idx"])
    out_of = lambda p, o: G.rec(p)["placement"]["out"][o][t]
    in_of = lambda i, j: G.rec(i)["placement"]["ins"][j][t]
    explained, styles, gathers, sp_outputs = {}, {}, defaultdict(list), {}  # explained: (node, input) -> role

    def ext_in(M):
        return [
            (i, j, p, o)
            for i in sorted(members[M])
            for j, (p, o) in enumerate(G.rec(i)["inputs"])
            if p not in members[M] and G.rec(p)["kind"] in ("op", "input")
        ]

    def ext_out(M):
        return sorted(
            {(i, o) for i in members[M] for u, j, o in G.users[i] if G.rec(u)["phase"] == "fw" and u not in members[M]}
        )

    def downstream(i, o, inside):
        """Consumers outside `inside` where the tensor's placement changes or it is used as is by a real op:
        [(consumer, input, have, want)], following views/casts (they compute on local shards)."""
        ends, stack, seen = [], [(i, o)], set()
        while stack:
            a, ao = stack.pop()
            for u, j, uo in G.users[a]:
                ur = G.rec(u)
                if uo != ao or ur["phase"] != "fw" or u in inside or (u, j) in seen:
                    continue
                seen.add((u, j))
                have, want = out_of(a, ao), in_of(u, j)
                if want == have and _op(ur) in _PASS_THROUGH and len(ur["inputs"]) == 1:
                    stack += [(u, k) for k, pl in enumerate(ur["placement"]["out"]) if pl is not None]
                else:
                    ends.append((u, j, have, want))
        return ends

    def reason(M, text):
        low.reasons.append((f"module {M or '<root>'}", text))

    def output_layout(M, shard_have):
        """output_layouts for a module whose output is `shard_have` on t, from what consumers want."""
        outs = ext_out(M)
        ends = [e for i, o in outs for e in downstream(i, o, members[M])]
        moved = [e for e in ends if e[2] != e[3]]  # consumers that need another placement
        wants = {w for _, _, _, w in moved}
        if not moved:
            if any(_op(G.rec(u)) == "_log_softmax" for u, _, _, _ in ends):
                low.loss_parallel = True
                return "loss", ends
            return None, ends
        ends = moved
        if wants == {"R"}:
            return "Replicate()", ends
        if wants == {"S1"}:
            return "Shard(1)", ends
        reason(
            M,
            f"its output ({shard_have} on {tn}) is wanted as {sorted(wants)} by "
            f"{[G.rec(u)['name'] for u, _, _, _ in ends][:4]}: one ParallelStyle output layout cannot serve them",
        )
        return "bad", ends

    kinds = {M: _kind(M, modules, G, members[M]) for M in mods}
    sharded_first = lambda kv: (
        kinds[kv[0]] not in ("linear", "embedding") or all(v == "R" for v in kv[1].values()),
        kv[0],
    )
    for M, pls in sorted(mods.items(), key=sharded_first):  # sharded modules first: they fix boundaries
        kind = kinds[M]
        w = pls.get("weight")
        xs = [(i, j, p, o) for i, j, p, o in ext_in(M) if G.rec(p)["kind"] != "param"]
        acts = sorted({(p, o) for _, _, p, o in xs})
        cls, why = param_style(kind, pls, tn, type(modules[M]).__name__ if modules and M in modules else kind)
        if cls is None and why:
            reason(M, why)
            continue
        if kind == "linear" and cls:
            if len(acts) != 1:
                reason(M, f"a Linear with {len(acts)} activation inputs")
                continue
            (i, j, p, o) = next(x for x in xs)
            have, want = out_of(p, o), in_of(i, j)
            kw = {}
            if w == "S0":  # colwise: replicated input, Shard(-1) output
                if want != "R":
                    reason(M, f"colwise weight (Shard(0) on {tn}) but its input is used as {want}, not replicated")
                    continue
                if have == "S1":
                    gathers[(p, o)].append(M)
                    explained[(i, j)] = "in_gather"
                elif have != "R":
                    reason(
                        M,
                        f"input is {have} on {tn}; ColwiseParallel takes a replicated or sequence-sharded "
                        f"(Shard(1)) input",
                    )
                    continue
                else:
                    explained[(i, j)] = "in_repl"  # backward: the input gradient is all-reduced
                outs = ext_out(M)
                lay, ends = output_layout(M, out_of(*outs[0]) if outs else "S2")
                if lay == "bad":
                    continue
                if lay == "loss":
                    kw.update(output_layouts="Shard(-1)", use_local_output="False")
                elif lay:
                    kw["output_layouts"] = lay
                    explained.update({(u, jj): "out" for u, jj, _, _ in ends})
                styles[M] = Style(cls, kw, why)
            else:  # rowwise: Shard(-1) input, partial output
                last = f"S{len(G.rec(p)['shape'][o]) - 1}"
                if have == "R" and want == last:
                    kw["input_layouts"] = "Replicate()"
                    explained[(i, j)] = "chunk"
                elif not (have == want == last):
                    reason(
                        M,
                        f"rowwise weight (Shard(1) on {tn}) but its input is {have} -> {want}; RowwiseParallel "
                        f"takes the input sharded on its last dim",
                    )
                    continue
                lay, ends = output_layout(M, "P")
                if lay in ("bad", None, "loss"):
                    if lay != "bad":
                        reason(M, f"rowwise output stays partial on {tn} downstream")
                    continue
                if lay != "Replicate()":
                    kw["output_layouts"] = lay
                explained.update({(u, jj): "out_reduce" for u, jj, _, _ in ends})
                styles[M] = Style(cls, kw, why)
        elif kind == "embedding" and cls:
            kw = {"input_layouts": "Replicate()"}
            if any(out_of(p, o) != "R" for p, o in acts):
                reason(M, f"embedding indices are sharded on {tn}")
                continue
            if w == "S0":
                explained.update({(i, j): "indices" for i, j, p, o in xs})  # indices masked by the style itself
            lay, ends = output_layout(M, "Pm" if w == "S0" else "S2")
            if lay in ("bad", "loss") or (lay is None and w == "S0"):
                if lay != "bad":
                    reason(M, f"vocab-sharded embedding output stays partial on {tn} downstream")
                continue
            if lay:
                if not (w == "S0" and lay == "Replicate()"):  # RowwiseParallel's default output
                    kw["output_layouts"] = lay
                explained.update({(u, jj): "out_reduce" for u, jj, _, _ in ends})
            styles[M] = Style(cls, kw, why)
        else:  # every parameter replicated on t
            # an input another style already redistributes (e.g. a rowwise output reduce-scattered) arrives as wanted
            pairs = {(in_of(i, j) if (i, j) in explained else out_of(p, o), in_of(i, j)) for i, j, p, o in xs}
            if all(h == wnt == "R" for h, wnt in pairs):
                continue  # replicated compute, nothing to do
            if all(h == wnt for h, wnt in pairs) and {h for h, _ in pairs} <= {"S1", "R"}:
                styles[M] = Style(
                    "SequenceParallel", {}, f"parameters replicated, activations sequence-sharded (Shard(1)) on {tn}"
                )
                sp_outputs[M] = [e for i, o in ext_out(M) for e in downstream(i, o, members[M])]
            elif pairs == {("S1", "R")} and modules is not None:
                n_in = _arity(modules.get(M))
                styles[M] = Style(
                    "PrepareModuleInput",
                    {
                        "input_layouts": _tup(["Shard(1)"] + ["None"] * (n_in - 1)),
                        "desired_input_layouts": _tup(["Replicate()"] + ["None"] * (n_in - 1)),
                        "use_local_output": "True",
                    },
                    f"gathers its sequence-sharded input on {tn} (plan)",
                )
                explained.update({(i, j): "pmi" for i, j, p, o in xs})
            else:
                reason(
                    M,
                    f"replicated parameters on {tn} but activations {sorted(pairs)} (have, want) at its "
                    f"inputs: neither SequenceParallel nor replicated compute",
                )

    for (p, o), linears in gathers.items():  # sequence-parallel gathers
        if len(linears) == 1:
            styles[linears[0]].kwargs = {"input_layouts": "Shard(1)", **styles[linears[0]].kwargs}
            continue
        parent = _common_parent(linears)
        if (
            parent
            and parent not in styles
            and not any(parent == m or m.startswith(parent + ".") for m in [G.rec(p)["module"]] if m)
        ):
            n_in = _arity(modules.get(parent)) if modules is not None else 1
            styles[parent] = Style(
                "PrepareModuleInput",
                {
                    "input_layouts": _tup(["Shard(1)"] + ["None"] * (n_in - 1)),
                    "desired_input_layouts": _tup(["Replicate()"] + ["None"] * (n_in - 1)),
                },
                f"{len(linears)} colwise Linears gather the same sequence-sharded input: once here",
            )
            low.notes.append(
                f"the plan gathers {G.rec(p)['name']} once per consumer ({len(linears)} all_gathers on "
                f"{tn}); PrepareModuleInput on '{parent}' gathers it once"
            )
        else:
            for m in linears:
                styles[m].kwargs = {"input_layouts": "Shard(1)", **styles[m].kwargs}

    gathered_in = [
        m
        for m, st in styles.items()
        if st.cls == "PrepareModuleInput" or "Shard(1)" in st.kwargs.get("input_layouts", "")
    ]
    for M, ends in sp_outputs.items():  # SP output into plain code: hand a local shard
        if any(not any(G.in_module(u, g) for g in gathered_in) for u, _, _, _ in ends):
            styles[M].kwargs["use_local_output"] = "True"
    for n in plan.nodes:  # every forward redistribute on t explained?
        if n["phase"] != "fw":
            continue
        for r in n.get("redistribute", []):
            if not isinstance(r["input"], int) or r["src"][t] == r["dst"][t] or (n["idx"], r["input"]) in explained:
                continue
            if r["class"] == "param":
                low.reasons.append(
                    (
                        f"parameter {r.get('param')}",
                        f"gathered on {tn} ([{','.join(r['src'])}] -> "
                        f"[{','.join(r['dst'])}]) before {n['name']}: a parameter sharded on the tensor-"
                        f"parallel dim must be used sharded",
                    )
                )
            else:
                low.reasons.append(
                    (
                        f"op {n['name']}",
                        f"in module '{n['module'] or '<root>'}' redistributes input "
                        f"{r['input']} [{','.join(r['src'])}] -> [{','.join(r['dst'])}] on {tn}, which no "
                        f"ParallelStyle does",
                    )
                )
    low.styles = dict(sorted(styles.items(), key=lambda kv: _order(kv[0], plan)))
    low.tp_roles = explained
    if forced:
        _check_forced(low, forced, tn)


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
    from fnmatch import fnmatch

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
