"""Views that merge or split dims whose inner dim is sharded: the flatten of a sequence-sharded (batch, seq, ...)
activation into the (batch * seq, ...) rows of a matmul or a loss, and the split back.

DTensor's view rule keeps a shard through a merge only on the group's outermost dim, so a sequence shard (dim 1)
would be all-gathered before every `nn.Linear`. The merged dim is still one contiguous block per rank when every
dim of the group before the innermost sharded one is left with one element per rank (e.g. a batch of one sequence
per rank: batch sharded over dp with one per rank, the sequence over cp), and the mesh dims shard the group's dims
in order (an outer tensor dim by an earlier mesh dim): the output is then Shard(merged dim) on the same mesh dims,
in the same order, and each rank's local view is its local block reshaped. The split of the merged dim back is the
same layout read the other way. These strategies are full-mesh (the condition spans mesh dims), added to DTensor's.
"""

from __future__ import annotations

import itertools
import math

import torch

aten = torch.ops.aten
VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def dim_groups(a: tuple, b: tuple) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Pair the dims of shape `a` with those of shape `b` in groups of equal product, left to right (trailing
    size-1 dims join the last group). None when the element counts differ."""
    if math.prod(a) != math.prod(b):
        return None
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(i)
                pa *= a[i]
                i += 1
            else:
                gb.append(j)
                pb *= b[j]
                j += 1
        groups.append((ga, gb))
    if groups:  # trailing size-1 dims
        groups[-1][0].extend(range(i, len(a)))
        groups[-1][1].extend(range(j, len(b)))
    return [(tuple(ga), tuple(gb)) for ga, gb in groups]


def _block_layout(shards: list[tuple[int, int]], shape: tuple, mesh_shape: tuple) -> bool:
    """Do the (mesh dim, tensor dim) shards of one group's dims leave every rank one contiguous block of the
    merged group? The tensor dims must not decrease in mesh-dim order, and every dim of the group before the
    innermost sharded one must have one element per rank."""
    dims = [d for _, d in sorted(shards)]
    if any(x > y for x, y in zip(dims, dims[1:])):
        return False
    split = {}
    for m, d in shards:
        split[d] = split.get(d, 1) * mesh_shape[m]
    if any(shape[d] % k for d, k in split.items()):
        return False
    inner = max(dims)
    return all(shape[d] // split.get(d, 1) == 1 for d in range(len(shape)) if d < inner)


def merged_view_strategies(in_shape: tuple, out_shape: tuple, float_dtype: bool, mesh_shape: tuple) -> list:
    """(out placements, in placements) of a view from `in_shape` to `out_shape` that DTensor's rule lacks: some
    merge (or split) group sharded on a dim other than its outermost, as a block layout (module docstring). Per
    mesh dim of size > 1: Replicate, Partial (a float view of a partial sum stays one), or Shard of one dim of a
    merge/split group; the other mesh dims Replicate."""
    groups = dim_groups(tuple(in_shape), tuple(out_shape))
    if groups is None:
        return []
    # per mesh dim: ("R",), ("P",) or ("S", group index, the many-sided dim sharded within the group)
    options = [("R",)] + ([("P",)] if float_dtype else [])
    for gi, (ga, gb) in enumerate(groups):
        many = ga if len(ga) > 1 else gb
        if len(ga) > 1 and len(gb) > 1:
            continue  # a regrouping (neither a merge nor a split): DTensor's rule decides
        options += [("S", gi, d) for d in many]
    live = [m for m, n in enumerate(mesh_shape) if n > 1]
    res = []
    for combo in itertools.product(options, repeat=len(live)):
        got = _placements(combo, live, groups, in_shape, out_shape, mesh_shape)
        if got is not None:
            res.append(got)
    return res


def _placements(combo, live, groups, in_shape, out_shape, mesh_shape):
    """The (out, in) placements of one choice per live mesh dim, or None if it is not a new block layout."""
    n = len(mesh_shape)
    pin, pout = ["R"] * n, ["R"] * n
    per_group: dict[int, list] = {}
    for m, c in zip(live, combo):
        if c[0] == "P":
            pin[m] = pout[m] = "P"
        elif c[0] == "S":
            per_group.setdefault(c[1], []).append((m, c[2]))
    new = False
    for gi, shards in per_group.items():
        ga, gb = groups[gi]
        merge = len(ga) > 1
        many, one = (ga, gb[0]) if merge else (gb, ga[0])
        many_shape = in_shape if merge else out_shape
        local = [(m, many.index(d)) for m, d in shards]
        if not _block_layout(local, tuple(many_shape[d] for d in many), mesh_shape):
            return None
        new = new or any(d != many[0] for _, d in shards)
        for m, d in shards:
            (pin if merge else pout)[m] = f"S{d}"
            (pout if merge else pin)[m] = f"S{one}"
    return (tuple(pout), tuple(pin)) if new else None
