"""Tensor-parallel styles of a pipeline stage (backends/pipelining/runtime.py applies them with parallelize_module on
the stage's tp submesh): each module's ParallelStyle from its parameters' placements on that dim, Megatron pairs
kept sharded between them, and the head's style where the plan's loss reads the logits class-sharded."""

from __future__ import annotations

import re
from collections import defaultdict

from torch import nn

from ..torch.tp import _kind, param_style


def stage_tp_styles(plan, k: int, mod: nn.Module, t: int, pos_of=None, loss_parallel: bool = True) -> dict:
    """{module FQN in `mod`: ParallelStyle source} for stage k on the tensor-parallel stage-mesh dim t: the style of
    each module from its parameters' placements there (backends/torch/tp.py `param_style`: Linear Shard(0) ->
    ColwiseParallel, Shard(1) -> RowwiseParallel; Embedding Shard(0) -> RowwiseParallel, Shard(1) ->
    ColwiseParallel), with Megatron layouts: where the parameters of a module are exactly those of colwise and
    rowwise Linear children that form Megatron pairs in the plan's forward graph (_megatron_pair: attention
    wq/wk/wv -> wo, feed-forward w1/w3 -> w2, MLP fc1 -> fc2), the activation between them stays sharded (local
    heads / hidden units); every other style input and output is a plain replicated tensor, so the residual
    stream and the stage boundaries (PipelineStage sends plain tensors) are whole on every tp rank. pos_of: per
    block of the model, its block in the plan's representative sub-model (plan.schedule["block_positions"];
    default: all blocks alike). loss_parallel: where the plan's cross entropy
    reads the head's logits class-sharded on this dim (`loss_head`), the head keeps them sharded (LOSS_STYLE,
    torchtitan's output style) for torch's loss_parallel(), which the runner then runs the step under; False (a
    loss function of the user's own) hands the logits over whole. Raises NotImplementedError, naming the stage, the
    parameter and its placement, for a placement no style expresses (never runs it replicated)."""

    sc = plan.schedule
    tn, size = sc["stage_mesh_names"][t], sc["stage_mesh_shape"][t]
    modules = dict(mod.named_modules())
    pls = defaultdict(dict)
    for fqn in plan.stages[k]["params"]:
        m, pn = fqn.rsplit(".", 1) if "." in fqn else ("", fqn)
        pls[m][pn] = plan.params[fqn][t]
    cls = {}
    for m, pl in pls.items():
        kind = _kind(m, modules, None, ())
        if kind == "linear" and pl.get("weight") == "S0" and pl.get("bias") == "R":
            # the replicated bias is added to the sharded output as its local slice: ColwiseParallel shards it
            # instead, the same values (OPT's and Swin's q/k/v as the stage planner places them)
            pl = {**pl, "bias": "S0"}
        c, why = param_style(kind, pl, tn, type(modules[m]).__name__)
        if c is None and why:
            bad = next(n for n, v in pl.items() if v != "R")
            raise NotImplementedError(
                f"stage {k}: parameter '{f'{m}.{bad}' if m else bad}' is placed {pl[bad]} on the tensor-parallel "
                f"stage-mesh dim '{tn}' (size {size}); no ParallelStyle expresses it ({why}). The pipeline runtime "
                f"shards on '{tn}' only nn.Linear weights (Shard(0) colwise, Shard(1) rowwise, bias with them) and "
                f"nn.Embedding weights (Shard(0) vocab, Shard(1) dim)"
            )
        if c is not None:
            cls[m] = c
    prefix = sc["layer_prefix"]
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(?=\.|$)")
    sub = lambda m: pat.sub(lambda mt: f"{prefix}.{pos_of[int(mt.group(1))] if pos_of else 0}", m)
    parent = lambda m: m.rsplit(".", 1)[0] if "." in m else ""
    paired = set()
    for P in {parent(m) for m in cls if m}:
        kids = [m for m in cls if m and parent(m) == P and isinstance(modules[m], nn.Linear)]
        col = [sub(m) for m in kids if cls[m] == "ColwiseParallel"]
        row = [sub(m) for m in kids if cls[m] == "RowwiseParallel"]
        owners = {f.rsplit(".", 1)[0] for f, _ in modules[P].named_parameters(prefix=P)}
        if col and row and owners == set(kids) and _megatron_pair(plan, sub(P), col, row):
            _check_heads(modules[P], size, k, P, tn)
            paired.add(P)
    styles = {}
    head = loss_head(plan, t) if loss_parallel else None
    for m, c in cls.items():
        inside = m and parent(m) in paired
        if m == head and c == "ColwiseParallel" and not inside and isinstance(modules[m], nn.Linear):
            styles[m] = LOSS_STYLE
            continue
        if isinstance(modules[m], nn.Embedding):
            styles[m] = (
                "RowwiseParallel(input_layouts=Replicate())"
                if c == "RowwiseParallel"
                else "ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())"
            )
        elif c == "ColwiseParallel":
            styles[m] = "ColwiseParallel()" if inside else "ColwiseParallel(output_layouts=Replicate())"
        else:
            styles[m] = "RowwiseParallel()" if inside else "RowwiseParallel(input_layouts=Replicate())"
    return styles


# The head's style under a class-sharded loss: logits stay a DTensor sharded on the class (last) dim, as
# torchtitan's output projection with loss_parallel, so the loss reads them there
LOSS_STYLE = "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)"


def loss_head(plan, t: int) -> str | None:
    """The module whose output the plan's cross entropy reads class-sharded on stage-mesh dim t: the nearest op of
    a module before a forward log_softmax whose log-probs are sharded on their last dim there and read by
    nll_loss only (torch's loss_parallel computes exactly that loss; label smoothing's second use of the log-probs
    it would get wrong). None where the plan keeps the loss whole on t."""
    nodes = plan.nodes
    if not nodes or "inputs" not in nodes[-1]:
        return None
    fw_users = defaultdict(list)
    for n in nodes:
        if n.get("phase") == "fw":
            for q, _ in n.get("inputs", []):
                fw_users[q].append(str(n.get("target", "")))
    for n in nodes:
        if n.get("phase") != "fw" or not str(n.get("target", "")).startswith("_log_softmax"):
            continue
        out, shape = n["placement"]["out"][0], n["shape"][0]
        if out is None or out[t] != f"S{len(shape) - 1}":
            continue
        if not all(u.startswith("nll_loss") for u in fw_users[n["idx"]]):
            return None
        q = n["inputs"][0][0]
        while nodes[q]["kind"] == "op" and not nodes[q]["module"] and nodes[q].get("inputs"):
            q = nodes[q]["inputs"][0][0]  # views and casts of the root's forward, back to the head
        return nodes[q]["module"] or None
    return None


def _megatron_pair(plan, P: str, col: list, row: list) -> bool:
    """Whether, in the plan's forward graph, module P's colwise Linears `col` and rowwise Linears `row`
    (representative sub-model FQNs) form Megatron pairs: every rowwise Linear reads (through ops inside P) the
    output of some colwise one and nothing the colwise ones read from outside P (the module input), no colwise
    Linear reads a rowwise one, and the colwise outputs leave P only through the rowwise ones. Then the activation
    between them can stay sharded; the ops in between (views, RoPE, attention over heads, gating) act per head /
    hidden unit in the model families this runtime knows."""
    nodes = plan.nodes
    if not nodes or "inputs" not in nodes[-1]:
        return False
    within = lambda i, M: nodes[i]["module"] == M or nodes[i]["module"].startswith(M + ".")
    in_any = lambda i, Ms: any(within(i, M) for M in Ms)
    fw = [n["idx"] for n in nodes if n.get("phase") == "fw"]

    def back(Ms, stop):
        start = [i for i in fw if in_any(i, Ms)]
        seen, ext, hit, stack = set(start), set(), False, list(start)
        while stack:
            for q, _ in nodes[stack.pop()].get("inputs", []):
                if q in seen:
                    continue
                seen.add(q)
                if not within(q, P):
                    ext.add(q)
                elif in_any(q, stop):
                    hit = True
                else:
                    stack.append(q)
        return ext, hit

    x_ext, col_reads_row = back(col, row)  # x_ext: what the colwise Linears read from outside P
    if col_reads_row:
        return False
    for r in row:
        ext, fed = back([r], col)
        if not fed or ext & x_ext:
            return False
    users = {}
    for i in fw:
        for q, _ in nodes[i].get("inputs", []):
            users.setdefault(q, []).append(i)
    start = [i for i in fw if in_any(i, col)]
    seen, stack = set(start), list(start)
    while stack:
        for u in users.get(stack.pop(), []):
            if u in seen:
                continue
            seen.add(u)
            if not within(u, P):
                return False
            if not in_any(u, row):
                stack.append(u)
    return True


def _check_heads(mod, tp: int, k: int, fqn: str, tn: str) -> None:
    """Attention with local heads: wq/wk/wv colwise give each tp rank n_heads / tp query heads and n_kv_heads / tp
    key-value heads (the model views them with -1 heads); both must divide."""
    for attr in ("n_heads", "n_kv_heads"):
        n = getattr(mod, attr, None)
        if isinstance(n, int) and n % tp:
            raise NotImplementedError(
                f"stage {k}: '{fqn}' has {attr}={n}, not divisible by the {tp} ranks of "
                f"'{tn}': colwise q/k/v projections would split a head"
            )


def _styles(codes: dict) -> dict:
    """The ParallelStyle objects of stage_tp_styles' source strings."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {
        LOSS_STYLE: lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "ColwiseParallel()": lambda: ColwiseParallel(),
        "ColwiseParallel(output_layouts=Replicate())": lambda: ColwiseParallel(output_layouts=Replicate()),
        "ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())": lambda: ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        ),
        "RowwiseParallel()": lambda: RowwiseParallel(),
        "RowwiseParallel(input_layouts=Replicate())": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {m: make[code]() for m, code in codes.items()}
