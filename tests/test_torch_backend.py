"""The torch backend's shape (backends/torch/): `lower` applies with torch's own calls exactly what `render` prints
(the same modules, ParallelStyles with the same layouts, FSDP units with the same options, the same checkpointed
blocks and hooks), checked by recording the calls on a plan's model and reading the printed code's syntax tree (the
code is never executed); and target="torch" is decided in the planner (autopar/targets.py). No processes: the
mesh is a stand-in that only names its dims. Runs on gloo: tests/test_engines_dist.py."""

from __future__ import annotations

import ast

import pytest

import autopar
import autopar.backends.torch as torch_backend
from autopar import models as M
from autopar.backends.torch import apply as apply_mod
from autopar.backends.torch.lowering import _layout_value
from autopar.backends.torch.recognize import recognize
from _bench import batch_pin, torchtitan_placements
from _clusters import SHAPES

B, S = 8, 64


class _Mesh:
    """A DeviceMesh as apply.py reads it: shape, dim names, a sub-mesh by name (returned as its name)."""

    def __init__(self, shape, names):
        self.shape, self.mesh_dim_names = shape, names

    def __getitem__(self, key):
        return key


def _plan(mesh, names, checkpoint=False):
    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=B, seq=S, device="meta")
    force, pin = torchtitan_placements(m, names, "dp" if "dp" in names else None, "tp", (B, S))
    p = autopar.plan(m, autopar.MeshSpec(mesh, names), x, cluster=SHAPES, overlap=False, force=force, pin=pin)
    if checkpoint:  # the planner's checkpointing decision, as plan.meta records it
        p.meta["checkpointing"] = {"blocks": ["layers.0", "layers.1"]}
    return p, m


def _record(monkeypatch):
    calls = {"tp": [], "fsdp": [], "checkpoint": [], "buckets": [], "loss": []}
    monkeypatch.setattr(apply_mod, "parallelize_module", lambda model, mesh, plan: calls["tp"].append((mesh, plan)))
    monkeypatch.setattr(apply_mod, "fully_shard", lambda module, **kw: calls["fsdp"].append((module, kw)))
    monkeypatch.setattr(apply_mod, "checkpoint_block", lambda block: calls["checkpoint"].append(block))
    monkeypatch.setattr(apply_mod, "reduce_grads_in_buckets", lambda *a: calls["buckets"].append(a[2:]))
    monkeypatch.setattr(apply_mod, "weigh_mean_loss", lambda *a: calls["loss"].append(a[2:]))
    return calls


def _assigned(tree, name):
    return next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == name)


def _style_key(style):
    """What a ParallelStyle does: its class and layouts (the attributes parallelize_module reads)."""
    keys = ("input_layouts", "output_layouts", "desired_input_layouts", "use_local_output", "sequence_sharding")
    return type(style).__name__, {k: repr(getattr(style, k)) for k in keys if hasattr(style, k)}


def _printed_styles(tree, blocks):
    """{module FQN: style key} from the printed parallelize_plan, its wildcards expanded over the blocks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel

    out = {}
    plan = _assigned(tree, "parallelize_plan")
    for k, v in zip(plan.keys, plan.values):
        kw = {a.arg: _layout_value(a.value, {"Shard": Shard, "Replicate": Replicate}) for a in v.keywords}
        style = getattr(parallel, v.func.id)(**kw)
        fqns = [k.value.replace("*", b.rsplit(".", 1)[1]) for b in blocks] if "*" in k.value else [k.value]
        out.update({f: _style_key(style) for f in fqns})
    return out


@pytest.mark.parametrize("mesh,names", [((2,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_lower_applies_what_render_prints(mesh, names, monkeypatch):
    plan, m = _plan(mesh, names, checkpoint=True)
    calls = _record(monkeypatch)
    code = torch_backend.render(plan, m)
    assert torch_backend.lower(m, plan, _Mesh(mesh, names)) is m
    tree = ast.parse(code)  # printed, never executed
    low = m._autopar_lowering
    [(tp_mesh, applied)] = calls["tp"]
    assert tp_mesh == "tp" and f'parallelize_module(model, mesh["{tp_mesh}"], parallelize_plan)' in code
    assert {f: _style_key(s) for f, s in applied.items()} == _printed_styles(tree, low.block_fqns)
    units = [
        (e.elts[0].value, {k.arg: k.value.value for k in e.elts[1].keywords})
        for e in _assigned(tree, "fsdp_units").elts
    ]
    assert [(mod, {"reshard_after_forward": kw["reshard_after_forward"]}) for mod, kw in calls["fsdp"]] == [
        (m.get_submodule(fqn), kw) for fqn, kw in units
    ]
    assert len(units) == (3 if "dp" in names else 0)  # one unit per block, the root last
    assert all(kw["mesh"] == "dp" for _, kw in calls["fsdp"]) and ('dp_mesh = mesh["dp"]' in code) == ("dp" in names)
    printed_ckpt = ast.literal_eval(_assigned(tree, "checkpoint_blocks"))
    assert calls["checkpoint"] == [m.get_submodule(f) for f in printed_ckpt] and printed_ckpt == [
        "layers.0",
        "layers.1",
    ]
    assert calls["checkpoint"] and "checkpoint_block(model.get_submodule(fqn))" in code
    assert bool(calls["buckets"]) == ("reduce_grads_in_buckets(model" in code)
    assert bool(calls["loss"]) == ("weigh_mean_loss(model" in code)
    assert "exec(" not in open(apply_mod.__file__).read()


def test_lower_refuses_a_plan_it_cannot_express():
    plan, m = _plan((2,), ("tp",))
    low = recognize(plan, m)
    assert low.expressible
    with pytest.raises(torch_backend.EngineLoweringError, match="mesh"):
        torch_backend.lower(m, plan, _Mesh((4,), ("tp",)))


def test_torch_target_keeps_a_pinned_plan_and_finds_the_data_dims():
    """target="torch" with the caller's own pins solves once (the plan is the caller's), and its data dims are the
    ones the backend's recognition feeds batch-sharded."""
    from autopar.targets import data_dims

    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=B, seq=S, device="meta")
    spec = autopar.MeshSpec((2, 2), ("dp", "tp"))
    kw = dict(cluster=SHAPES, overlap=False, force={k: ("S0", "R") for k, _ in m.named_parameters()})
    free = autopar.plan(m, spec, x, pin=batch_pin([0], (B, S)), **kw)
    pinned = autopar.plan(m, spec, x, pin=batch_pin([0], (B, S)), target="torch", **kw)
    assert pinned.hash() == free.hash() and pinned.meta["target"] == "torch" and "engine_replan" not in pinned.meta
    low = recognize(pinned, m)
    assert data_dims(pinned) == low.replicate_dims + low.shard_dims == [0]
    with pytest.raises(ValueError, match="target must be one of"):
        autopar.plan(m, spec, x, target="tpu", **kw)
