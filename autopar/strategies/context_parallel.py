"""Context parallelism as a mesh dim's meaning: a dim named cp* (cp, cp2, ...) splits every sequence of the step over
its ranks (torchtitan's and Llama 3's CP). Plans read the name (autopar/api.py; pipeline stage plans too, the way
they read dp* as batch parallel: passes/stage_costs.py): on a cp dim the step's token inputs are Shard(1) (the
sequence), every attention keeps its queries' sequence sharded (Shard(2) of (batch, heads, seq, head_dim)) with K and
V whole there, so the per-op plan prices their all-gather before each attention and the reduce-scatter of dK / dV
after its backward as redistributes (the all-gathered-KV form of torch's context_parallel;
autopar/strategies/__init__.py `_attention_fw`). Everything between is the solver's choice on that dim (in practice
the sequence shard is kept: it moves nothing).
"""

from __future__ import annotations

from ..capture_modes import SDPA, SDPA_BW
from .pins import overlay_pins

CP_PREFIX = "cp"


def cp_dims(names, shape) -> list[int]:
    """The context-parallel mesh dims (named cp*, of size > 1)."""
    return [d for d, (nm, n) in enumerate(zip(names, shape)) if nm.startswith(CP_PREFIX) and n > 1]


def pin_takes_dims(pin, graph, dims) -> bool:
    """Whether the user's pin places any node on one of `dims` (the dim is then theirs: no sequence split added)."""
    if pin is None or not dims:
        return False
    for n in graph.nodes:
        for k in pin(n) or {}:
            if (k[0] if isinstance(k, tuple) else k) in dims:
                return True
    return False


def sequence_length(graph) -> int:
    """The sequence length the cp dims split: the query length of the graph's first forward attention (dim 2 of
    its output), else (attention decomposed into matmuls and a softmax, as capture on CPU leaves it under an
    explicit mask) dim 1 of the first (batch, seq) integer input, the token ids."""
    for n in graph.nodes:
        if n.kind == "op" and n.target is SDPA:
            return int(n.outs[0].shape[2])
    for n in graph.nodes:
        o = n.outs[0] if n.kind == "input" and n.outs else None
        if o is not None and len(o.shape) == 2 and not (o.dtype.is_floating_point or o.dtype.is_complex):
            return int(o.shape[1])
    raise ValueError(
        "a context-parallel mesh dim (named cp*) splits the sequence, but the model's graph has neither a "
        "scaled_dot_product_attention nor a (batch, seq) token input: name the dim otherwise"
    )


def cp_pin(graph, names, shape, base=None, carried=frozenset()):
    """A pin (passes/candidates.py) adding, on every cp dim, the sequence split of the step's token inputs (inputs
    of rank >= 2 whose dim 1 is the sequence length), of the nodes in `carried` shaped so (what a pipeline stage's
    representative block reads: the embedding before it stands for the previous block's output, which is a
    sequence shard) and of attention's queries to `base`'s pins (which win where both name a node's output). None
    without cp dims. A sequence that does not divide over the cp ranks is refused here, naming the dim."""
    dims = cp_dims(names, shape)
    if not dims:
        return base
    seq = sequence_length(graph)
    n_cp = 1
    for d in dims:
        n_cp *= shape[d]
    if seq % n_cp:
        raise ValueError(
            f"sequence length {seq} does not divide over the context-parallel mesh dims "
            f"{ {names[d]: shape[d] for d in dims} } ({n_cp} ranks)"
        )

    def pin(n):
        if (n.kind == "input" or n.idx in carried) and _sequence_second(n, seq):
            return {d: "S1" for d in dims}
        if n.kind == "op" and n.target in (SDPA, SDPA_BW):
            return {(d, 0): "S2" for d in dims}
        return None

    return overlay_pins(pin, base)


def _sequence_second(n, seq: int) -> bool:
    """Whether every tensor output of n is (batch, seq, ...)."""
    outs = [o for o in n.outs if o is not None]
    return bool(outs) and all(len(o.shape) >= 2 and o.shape[1] == seq for o in outs)


def _data_split(strategy, outs, dims, batch_dims, tokens: int, seq: int, ones) -> bool:
    """Whether every tensor output of `strategy` is, on each cp dim, a shard of a sequence-long dim (seq, or a
    (batch, seq) flatten of it) and, on each batch dim, a shard of dim 0 (the batch, or a flatten that starts
    with it) or of a dim of `tokens` (batch x seq) rows (the transposed activation of a weight gradient), else
    replicated or partial: not a split of heads or hidden units over a data dim; and replicated on the dims of
    size 1 (`ones`), where every placement holds the same data."""
    for pls, meta in zip(strategy.out, outs):
        if pls is None or meta is None:
            continue
        if any(pls[d] != "R" for d in ones):
            return False
        for d in dims:
            p = pls[d]
            if p[0] == "S" and not _sequence_long(meta.shape[int(p[1:])], seq, tokens):
                return False
        for d in batch_dims:
            p = pls[d]
            if p[0] == "S" and p != "S0" and meta.shape[int(p[1:])] % tokens:
                return False
    return True


def _sequence_long(n: int, seq: int, tokens: int) -> bool:
    """Whether a dim of n elements can hold the sequence: n == seq, or a multiple of all the tokens (batch x seq
    rows, or those rows repeated: an MoE's top-k dispatch). Not merely a multiple of seq: a recurrence's hidden
    units (192 of a GRU over 16 steps) are not a sequence."""
    return n == seq or n % tokens == 0


def keep_data_splits(state, batch_dims, batch: int) -> None:
    """On a mesh (or stage mesh) with a cp* dim: drop the strategies that split an output along anything but the sequence
    on a cp dim, or anything but the batch (dim 0, or the batch x seq rows) on the batch dims `batch_dims` (heads,
    hidden units: tensor parallelism on a data dim), or that are not replicated on a dim of size 1 (CP 1 of a
    published layout), where a node keeps at least one. A rank then holds its batch and sequence shard of every
    activation (or a replicated / partial copy: the K/V it gathers, dK/dV before their reduce-scatter), as
    torchtitan's and Llama 3's CP do, and a 3-D (dp, cp, tp) stage plan keeps a handful of candidates per node
    on the data dims instead of every split: small enough for the solver. batch: the sequences of the step
    (per-op plans) or of the micro-batch (stage plans)."""
    names, shape = state.mesh.names, state.mesh.shape
    if not any(nm.startswith(CP_PREFIX) for nm in names):
        return
    dims = cp_dims(names, shape)
    ones = [d for d, n in enumerate(shape) if n == 1]
    seq = sequence_length(state.graph) if dims else 1
    for n in state.graph.nodes:
        strats = state.strategies[n.idx]
        if n.kind not in ("op", "param", "input", "buffer") or not strats:
            continue
        if n.kind == "op":
            kept = [s for s in strats if _data_split(s, n.outs, dims, batch_dims, batch * seq, seq, ones)]
        else:  # parameters keep every split (FSDP shards them over dp x cp), inputs their pins
            kept = [s for s in strats if _data_split(s, n.outs, (), (), 1, 1, ones)]
        if kept and len(kept) < len(strats):
            state.strategies[n.idx] = kept
