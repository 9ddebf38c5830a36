"""The plan the engines run: autopar's plan, solved again where the engines would compute something otherwise.

An engine rank runs the user's module on its own batch shard. Where the plan computes a value replicated over
the data-parallel dims from inputs it gathers there, the engines cannot: they compute it on the shard and reduce
it afterwards. Two such values matter in practice:
  * the loss: the plan may gather the log-probabilities and compute nll_loss on the whole batch (cheaper under
    its cost model than reducing the loss sum and count); the engines compute it on the shard and reduce
    (weighted loss, count) in the loss hook (backends/engines_loss.py);
  * a parameter gradient: the plan may gather a backward input (the embedding's output gradient) and compute
    the gradient replicated instead of reducing it; the engines reduce every replicated gradient in buckets.
The lowering would run without those gathers, so its collectives would differ from the plan's prediction. Where
the plan has them, `plan_for_engines` solves it again with those nodes pinned to partial sums on the data dims
(the nll_loss forward, the node making each parameter gradient): the best plan among the ones the engines run
as planned, whose prediction is what they issue.
"""

from __future__ import annotations

from autopar.capture import NLL_LOSSES


def engine_pins(state, data: list[int]) -> dict:
    """{node name: pin} for the nodes the plan computes replicated over a data dim where the engines compute a
    partial sum: a mean loss's nll_loss, the nodes whose output is a parameter gradient. Empty when none."""
    g, P = state.graph, state.placement
    want, differ = {}, False
    for r in g.grads.values():
        pin = want.setdefault(g.nodes[r.node].name, {})
        for d in data:
            pin[(d, r.out)] = "P"
            differ |= P[r.node].out[r.out][d] != "P"
    for n in g.ops():
        if n.target in NLL_LOSSES:  # a loss nll_loss (capture records a mean one as nll_loss(sum))
            want[n.name] = {d: "P" for d in data}
            differ |= any(o is not None and o[d] != "P" for o in P[n.idx].out for d in data)
    return want if differ else {}


def plan_for_engines(model, mesh, example_inputs, **plan_kwargs):
    """((plan, state), note): autopar's plan, or where it computes a loss or gradient replicated from gathered
    inputs over the data-parallel dims, the plan solved again with those nodes partial on them (module
    docstring). The note says which nodes were pinned and what it cost (None when the first plan is kept)."""
    import autopar
    from .recognize import recognize

    first = autopar.plan(model, mesh, example_inputs, return_state=True, **plan_kwargs)
    low = recognize(first[0], model)
    data = low.replicate_dims + low.shard_dims
    if not low.expressible or not data or plan_kwargs.get("pin") is not None:
        return first, None
    want = engine_pins(first[1], data)
    if not want:
        return first, None
    try:
        again = autopar.plan(
            model, mesh, example_inputs, return_state=True, pin=lambda n: want.get(n.name), **plan_kwargs
        )
    except (ValueError, autopar.InfeasibleMemoryError) as e:
        return (
            first,
            f"not re-planned for the engines ({type(e).__name__}: {str(e)[:200]}); the lowering differs "
            f"from the plan where the plan gathers over the data dims",
        )
    if not recognize(again[0], model).expressible:
        return first, "not re-planned for the engines: the re-solved plan is not expressible by them"
    pinned = [k for k in want if "nll_loss" in k]
    p0, p1 = first[0].predicted["step_s"], again[0].predicted["step_s"]
    note = (
        f"re-planned for the engines (they compute the loss and every parameter gradient on each rank's batch "
        f"shard): {len(want)} nodes pinned partial on the data dims"
        f"{' (loss ' + ', '.join(pinned) + ')' if pinned else ''}; predicted step {p1 * 1e3:.3f} ms, "
        f"{p0 * 1e3:.3f} ms with the gathers the engines cannot run"
    )
    again[0].meta["engine_replan"] = note
    return again, note
