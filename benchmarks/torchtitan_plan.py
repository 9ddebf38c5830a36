"""torchtitan's hand plan for Llama (torchtitan/models/llama3/infra/parallelize.py: parallelize_llama, apply_tp,
apply_fsdp), in autopar's terms, for the side-by-side comparison and for tests:

  * `torchtitan_styles`: its parallelize_module plan, written for autopar's Llama (same module names; `layers`
    is a ModuleList here, and attention takes (x, cos, sin), so PrepareModuleInput has three input layouts);
  * `torchtitan_placements`: the same plan as planner constraints, to price it with autopar's cost model:
    parameter placements (`force`: colwise wq/wk/wv/w1/w3/output and vocab-sharded tok_embeddings = Shard(0) on
    tp, rowwise wo/w2 = Shard(1), norms replicated; FSDP = Shard(0) on dp) and pinned activations (`pin`: inputs
    batch-sharded on dp and replicated on tp, the norms and the residual stream sequence-sharded (Shard(1)) on
    tp, the loss input replicated on tp). The rest (attention internals, backward) is left to the solver, which
    fills it in the only consistent way.

Both of torchtitan's loss variants: `loss_parallel=True` (its default: the logits stay vocab-sharded into a
class-sharded cross entropy, autopar/strategies/vocab_parallel.py, lowered to torch's loss_parallel()) and
`loss_parallel=False` (the output gathered to Replicate). `loss_parallel_delta` prices the difference analytically
on a loss_parallel=False plan.
"""

from __future__ import annotations

import re

_COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
_ROWWISE = ("attention.wo", "feed_forward.w2")
_NORMS = ("attention_norm", "ffn_norm")


def torchtitan_styles(loss_parallel: bool = False) -> dict:
    """torchtitan's apply_tp plan as {module FQN: ParallelStyle source}."""
    out = {
        "tok_embeddings": "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))",
        "norm": "SequenceParallel()",
        "output": (
            "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)"
            if loss_parallel
            else "ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())"
        ),
        "layers.*.attention_norm": "SequenceParallel()",
        "layers.*.attention": (
            "PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))"
        ),
        "layers.*.attention.wq": "ColwiseParallel()",
        "layers.*.attention.wk": "ColwiseParallel()",
        "layers.*.attention.wv": "ColwiseParallel()",
        "layers.*.attention.wo": "RowwiseParallel(output_layouts=Shard(1))",
        "layers.*.ffn_norm": "SequenceParallel()",
        "layers.*.feed_forward": (
            "PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))"
        ),
        "layers.*.feed_forward.w1": "ColwiseParallel()",
        "layers.*.feed_forward.w2": "RowwiseParallel(output_layouts=Shard(1))",
        "layers.*.feed_forward.w3": "ColwiseParallel()",
    }
    return out


def batch_pin(data_dims, batch_shape=None):
    """A `pin` for autopar.plan: inputs batch-sharded (Shard(0)) on `data_dims`, and with batch_shape (batch, seq)
    every activation whose leading dim is the batch (or batch*seq) too, as data parallelism computes it."""
    lead = {batch_shape[0], batch_shape[0] * batch_shape[1]} if batch_shape else set()

    def pin(n):
        if n.kind == "input":
            return {d: "S0" for d in data_dims}
        if (
            n.kind == "op"
            and lead
            and n.outs
            and n.outs[0] is not None
            and len(n.outs[0].shape) >= 2
            and all(m is None or (m.shape and m.shape[0] in lead) for m in n.outs)
        ):
            return {d: "S0" for d in data_dims}
        return None

    return pin


def torchtitan_placements(
    model,
    mesh_names,
    dp: str | None = "dp",
    tp: str | None = "tp",
    batch_shape=None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
):
    """(force, pin) for autopar.plan: torchtitan's FSDP(dp) x TP+SP(tp) plan as planner constraints
    (sequence_parallel=False: Megatron TP without SP, norms and the residual stream replicated on tp).
    batch_shape (batch, seq): with a dp dim, every activation whose leading dim is the batch (or batch*seq) is
    pinned batch-sharded on dp, as data parallelism computes it. loss_parallel: the cross entropy on the
    vocab-sharded logits (torchtitan's default), else replicated on tp."""
    dp_pin = batch_pin([mesh_names.index(dp)] if dp in mesh_names else [], batch_shape)
    d_dp = mesh_names.index(dp) if dp in mesh_names else None
    d_tp = mesh_names.index(tp) if tp in mesh_names else None
    force = {}
    for fqn, p in model.named_parameters():
        pl = ["R"] * len(mesh_names)
        if d_dp is not None:
            pl[d_dp] = "S0"
        if d_tp is not None:
            mod = fqn.rsplit(".", 1)[0]
            if mod.endswith(_COLWISE) or mod in ("output", "tok_embeddings"):
                pl[d_tp] = "S0"
            elif mod.endswith(_ROWWISE):
                pl[d_tp] = "S1"
        force[fqn] = tuple(pl)

    def pin(n):
        want = dict(dp_pin(n) or {})
        if n.kind == "input":
            if d_tp is not None:
                want[d_tp] = "R"
            return want
        if n.kind != "op":
            return None
        if d_tp is None or n.phase != "fw":
            return want or None
        mod, op = n.module, str(n.target)
        if mod == "norm" or mod.endswith(_NORMS) or (re.fullmatch(r"layers\.\d+", mod) and op == "aten.add.Tensor"):
            want[d_tp] = "S1" if sequence_parallel else "R"
        elif op == "aten._log_softmax.default":
            want[d_tp] = "S1" if loss_parallel else "R"  # loss_parallel=False: the loss runs replicated on tp
        elif op == "aten.nll_loss_forward.default":
            if loss_parallel:  # on the vocab-sharded log-probs: a partial loss, the whole count of targets
                want.update({(d_tp, 0): "P", (d_tp, 1): "R"})
            else:
                want[d_tp] = "R"
        elif op == "aten.embedding.default":  # vocab-parallel embedding: masked partial output
            want[d_tp] = "Pm"
        elif mod == "output" and op == "aten.mm.default":  # colwise output projection: vocab-sharded logits
            want[d_tp] = "S1"
        return want or None

    return force, pin


def loss_parallel_delta(plan, tp_dim: int, cluster) -> dict:
    """What torchtitan's loss_parallel=True changes against the pinned loss_parallel=False plan: the logits stay
    vocab-sharded, so the collectives the plan runs on tp inside the loss code (the root module: the logits
    gather before log_softmax and whatever the backward does there) disappear; the sharded cross-entropy instead
    all-reduces three per-token fp32 values (max, sum of exp, target logit) on tp in the forward."""
    from autopar.cost import collective_time

    link = cluster.link_for(plan.mesh_shape, tp_dim)
    removed, dropped = 0.0, []
    for rec in plan.nodes:
        if rec["kind"] != "op" or rec["module"] != "":
            continue
        for r in rec.get("redistribute", []):
            for kind, d, nb, grp in r["collectives"]:
                if d == tp_dim and r["class"] == "act":
                    removed += collective_time(kind, nb, grp, link)
                    dropped.append((rec["name"], kind, nb))
    inp = next(x for x in plan.nodes if x["kind"] == "input")
    tokens = int(inp["shape"][0][0]) * int(inp["shape"][0][1])
    for d, pl in enumerate(inp["placement"]["out"][0]):
        if pl == "S0":
            tokens //= plan.mesh_shape[d]
    added = 3 * collective_time("all_reduce", tokens * 4, plan.mesh_shape[tp_dim], link)
    return {"removed_s": removed, "removed": dropped, "added_s": added, "delta_s": added - removed}
