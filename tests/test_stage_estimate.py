"""Estimated stage costs (passes/stage_estimate.py): a key priced from another key of its family against the key's
own intra-op plans, and the search that solves only some keys exactly against the one that solves all of them.
Planning only (meta tensors)."""

from __future__ import annotations


from autopar.mesh import MeshSpec
from autopar.passes.stage_estimate import family, per_rank, representatives

DP_TP = ("dp", "tp")
SMALL = dict(
    n_layers=4, dim=1024, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=32000
)  # llama3-8b's shape, smaller


def _keys_of(*specs):
    return [(MeshSpec(shape, names), mb) for shape, names, mb in specs]


def test_representatives_take_each_familys_smallest_and_largest_per_rank_batch():
    keys = _keys_of(
        ((4, 2), DP_TP, 4),  # tp 2, per rank 1
        ((2, 2), DP_TP, 8),  # tp 2, per rank 4
        ((8, 2), DP_TP, 16),  # tp 2, per rank 2
        ((8,), ("dp",), 8),  # tp 1, per rank 1
        ((2,), ("tp",), 4),  # tp 2 without dp: the same family (dp 1), per rank 4 too
    )
    assert [per_rank(k) for k in keys] == [1, 4, 2, 1, 4]
    assert family(keys[0]) == family(keys[4]) == (("tp", 2),) and family(keys[3]) == ()
    assert representatives(keys) == [keys[0], keys[1], keys[3]]  # the first of the tied largest
