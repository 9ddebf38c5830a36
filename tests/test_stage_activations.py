"""The pipeline stage search's saved-activation bytes per block against what eager PyTorch keeps for backward:
one block of a small Llama run on CPU, its saved tensors counted once per storage, parameters left out."""

from __future__ import annotations

import torch

from autopar import models
from autopar.cost import get_cluster
from autopar.mesh import MeshSpec

from _stage import stage_context
from autopar.models.llama import rope_cos_sin
from autopar.passes.stage_costs import StageOps, find_layers

BATCH, SEQ = 4, 64


def _measured_block_bytes(block, dim: int, head_dim: int, theta: float) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward of `block`."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(BATCH, SEQ, dim, requires_grad=True)
    cos, sin = rope_cos_sin(SEQ, head_dim, theta, "cpu", torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    return sum(seen.values())


def test_block_activation_bytes_match_eager_saved_tensors():
    over = dict(n_layers=2)
    meta = models.build_model("llama-tiny", device="meta", **over)
    x = models.example_inputs("llama-tiny", batch=BATCH, seq=SEQ, device="meta", **over)
    ctx = stage_context(get_cluster("h100"), n_variants=1)
    ops = StageOps(meta, find_layers(meta), [0], [0, 0], x, MeshSpec((1,), ("dp",)), ctx)
    predicted = float(ops.costs()[0].act[1])  # cluster 1: the first block

    real = models.build_model("llama-tiny", device="cpu", **over)
    blk = real.get_submodule(find_layers(real))[0]
    a = real.layers[0].attention
    measured = _measured_block_bytes(blk, a.wq.in_features, a.head_dim, 10000.0)
    print(f"\nblock saved activations: predicted {predicted:.0f} B, eager {measured} B")
    assert abs(predicted - measured) <= 0.15 * measured
