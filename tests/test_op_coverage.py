"""Op coverage: ops third-party models use get a placement rule or torch's decomposition into ops that have one,
and every candidate a rule offers is one the executor runs (under LocalTensorMode: all ranks of a 2x2 mesh
simulated in one process, real values).

- losses with no rule of their own (mse_loss, smooth_l1 / huber, binary_cross_entropy, soft_margin; l1_loss and
  kl_div are composites) plan with allow_replicate=False and train equal to one device;
- a ViT-style patch embedding (Conv2d with stride = kernel) runs at the batch-on-both-mesh-dims placement
  [S0, S0] that DTensor's convolution handler refuses ("hybrid sharding");
- test_every_candidate_executes: each candidate of each op's rule, over the ops of a set of small models, run
  once through the executor's own path for that op and compared with the op on full tensors.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from _clusters import SHAPES
from _simulated import simulated
from autopar.testing import train_and_compare
from autopar.strategies._torch_adapter import outside_local_tensor_mode

pytest.importorskip("torch.distributed._local_tensor")
pytestmark = pytest.mark.timeout(600)
aten = torch.ops.aten
MESH = (2, 2)


def _check_trains(model, inputs, steps=2, **plan_kw):
    """Plan on the 2x2 mesh with a cluster on which sharding pays, run `steps` SGD steps under LocalTensorMode
    next to the single-device model; returns (plan, state, report)."""
    plan, state = autopar.plan(
        model, MESH, inputs, cluster=SHAPES, overlap=False, return_state=True, time_limit=20, **plan_kw
    )
    ref = copy.deepcopy(model)
    with simulated(MESH) as mesh:
        pm = autopar.parallelize(model, mesh, inputs, planned=(plan, state))
        rep = train_and_compare(pm, ref, inputs, steps=steps, lr=0.1)
    assert not rep.failures, "\n".join(rep.failures[:10])
    assert not rep.collective_diff, rep.collective_diff
    assert rep.measured, "nothing communicated: the plan is not sharded"
    return plan, state, rep


class Regression(nn.Module):
    def __init__(self, d=128, h=512, loss="mse"):
        super().__init__()
        self.l1, self.l2, self.loss = nn.Linear(d, h), nn.Linear(h, d), loss

    def forward(self, x, y):
        out = self.l2(F.relu(self.l1(x)))
        if self.loss == "mse":
            return F.mse_loss(out, y)
        p = torch.sigmoid(out)
        return (
            F.l1_loss(out, y)
            + F.smooth_l1_loss(out, y)
            + F.huber_loss(out, y, delta=0.5)
            + F.binary_cross_entropy(p, y)
            + F.soft_margin_loss(out, y * 2 - 1)
            + F.kl_div(F.log_softmax(out, -1), y.softmax(-1), reduction="batchmean")
        )


def test_mse_regression_mlp():
    """The plain MLP regression model the issue names: refused before (no rule for mse_loss), now planned with
    allow_replicate=False (the default), sharded, and equal to one device."""
    torch.manual_seed(0)
    model = Regression()
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    plan, state, rep = _check_trains(model, (x, y))
    assert any(p != "R" for pl in plan.params.values() for p in pl), plan.params
    assert not plan.coverage, plan.coverage  # no op fell back to Replicate-only
    ops = {str(n.target) for n in state.graph.ops()}
    assert "aten.mse_loss.default" not in ops and "aten.mse_loss_backward.default" not in ops  # decomposed
    origins = {str(n.origin) for n in state.graph.ops() if n.origin is not None}
    assert origins == {"aten.mse_loss.default", "aten.mse_loss_backward.default"}, origins


def test_other_losses():
    torch.manual_seed(0)
    model = Regression(loss="many")
    x, y = torch.randn(256, 128), torch.rand(256, 128)
    plan, _, _ = _check_trains(model, (x, y))
    assert not plan.coverage, plan.coverage
    assert any(p != "R" for pl in plan.params.values() for p in pl), plan.params


class PatchEmbed(nn.Module):
    """A ViT's stem: Conv2d(stride = kernel) -> tokens, one MLP block, mean-pooled classifier."""

    def __init__(self, d=64, patch=4, classes=10):
        super().__init__()
        self.pe = nn.Conv2d(3, d, patch, stride=patch)
        self.fc1, self.fc2, self.head = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, classes)

    def forward(self, x, y):
        h = self.pe(x).flatten(2).transpose(1, 2)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h.mean(1)), y)


def _conv_at(state, op):
    return [state.placement[n.idx] for n in state.graph.ops() if n.target is op]


def test_vit_patch_embed_batch_on_both_mesh_dims():
    """The convolution pinned to the batch split over both mesh dims ([S0, S0]), forward and backward: DTensor's
    convolution handler cannot run it; the executor runs it on the local batch shards."""
    torch.manual_seed(0)
    model = PatchEmbed()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    pin = lambda n: {0: "S0", 1: "S0"} if n.target is aten.convolution.default else None
    _, state, _ = _check_trains(model, (x, y), pin=pin)
    (fw,), (bw,) = _conv_at(state, aten.convolution.default), _conv_at(state, aten.convolution_backward.default)
    assert fw.ins[0] == ("S0", "S0") and fw.out[0] == ("S0", "S0")
    assert bw.ins[1] == ("S0", "S0"), bw  # backward on the same batch shards, not gathered
    assert bw.out[1] == ("P", "P"), bw  # grad_weight: this rank's partial sum


def test_vit_for_image_classification():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )

    class Wrapped(nn.Module):  # positional inputs, the loss out: the unwrapped path is another test's
        def __init__(self):
            super().__init__()
            self.m = transformers.ViTForImageClassification(cfg)

        def forward(self, pixels, labels):
            return self.m(pixel_values=pixels, labels=labels).loss

    torch.manual_seed(0)
    model = Wrapped()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    pin = lambda n: {0: "S0", 1: "S0"} if n.target is aten.convolution.default else None
    plan, state, _ = _check_trains(model, (x, y), steps=1, pin=pin)
    assert not plan.coverage, plan.coverage
    (fw,) = _conv_at(state, aten.convolution.default)
    assert fw.ins[0] == ("S0", "S0")


class GroupedMoE(nn.Module):
    """transformers' grouped_mm experts (integrations/moe.py) in miniature: top-k routing, tokens sorted by expert,
    per-expert counts by histc (of the ids as int off the CPU, as that code chooses by device: capture records the
    int form), int32 offsets, two torch._grouped_mm in float32 (the second on a transposed weight) and the inverse
    permutation. N=24 is 16-byte aligned whole but not in quarters: the executor realigns such local shards."""

    def __init__(self, d=16, h=24, experts=4, k=2, classes=10):
        super().__init__()
        self.k, self.e = k, experts
        self.router = nn.Linear(d, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, d, h) * d**-0.5)  # (G, K, N)
        self.down = nn.Parameter(torch.randn(experts, d, h) * h**-0.5)  # (G, N, K), used transposed
        self.head = nn.Linear(d, classes)

    def forward(self, x, y):
        b, s, d = x.shape
        t = x.reshape(-1, d)
        w, ids = self.router(t).softmax(-1).topk(self.k, -1)
        ids_g, perm = torch.sort(ids.reshape(-1))
        counts = torch.histc(
            ids_g.float() if ids_g.device.type == "cpu" else ids_g.int(), bins=self.e, min=0, max=self.e - 1
        )
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(t[perm // self.k], self.up, offs=offs))
        o = torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offs) * w.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=x.device)
        o = o[inv].view(b * s, self.k, d).sum(1)
        return F.cross_entropy(self.head(o.view(b, s, d).mean(1)), y)


class Pooled(nn.Module):
    """Swin's pooler: adaptive_avg_pool1d(h.transpose(1, 2), 1) over tokens. torch computes a mean and restrides it
    in place for the channels-last input (as_strided_); its backward is as_strided_scatter + as_strided."""

    def __init__(self, d=16, classes=10):
        super().__init__()
        self.proj, self.head = nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, x, y):
        p = F.adaptive_avg_pool1d(self.proj(x).transpose(1, 2), 1)
        return F.cross_entropy(self.head(p.flatten(1)), y)


def test_grouped_mm_meta_shapes():
    """Capture's meta function for _grouped_mm (torch's own refuses float32) gives the CPU kernel's output shape and
    dtype for each layout: 2d x 3d (experts), 2d x 2d (its weight gradient), 3d x 2d, 3d x 3d."""
    from autopar.strategies import meta_kernel

    fn, offs = meta_kernel(aten._grouped_mm.default), torch.tensor([3, 3, 8], dtype=torch.int32)
    for a, b, o in [
        ((8, 16), (3, 16, 12), offs),
        ((16, 8), (8, 12), offs),
        ((3, 8, 16), (16, 12), offs),
        ((3, 8, 16), (3, 16, 12), None),
    ]:
        x, w = torch.randn(a), torch.randn(b)
        want = aten._grouped_mm.default(x, w, o)
        got = fn(x.to("meta"), w.to("meta"), None if o is None else o.to("meta"))
        assert (got.shape, got.dtype) == (want.shape, want.dtype), (a, b)
    with pytest.raises(RuntimeError, match="int32"):
        fn(torch.empty(8, 16, device="meta"), torch.empty(3, 16, 12, device="meta"), offs.long().to("meta"))


def test_grouped_mm_moe_trains_sharded():
    """The MoE model captures (its backward is _grouped_mm again: dgrad 2d x 3d, wgrad 2d x 2d), plans with no op
    replicated for want of a rule, and trains equal to one device on the 2x2 mesh with the experts' weights
    sharded column-wise (N) on tp: out sharded on N."""
    torch.manual_seed(0)
    model = GroupedMoE()
    x, y = torch.randn(8, 8, 16), torch.randint(0, 10, (8,))
    plan, state, _ = _check_trains(model, (x, y), force={"up": ("R", "S2")})
    assert not plan.coverage, plan.coverage
    gmm = [n for n in state.graph.ops() if n.target is aten._grouped_mm.default]
    layouts = sorted(
        (len(state.graph.meta(n.inputs()[0]).shape), len(state.graph.meta(n.inputs()[1]).shape)) for n in gmm
    )
    assert layouts == [(2, 2), (2, 2), (2, 3), (2, 3), (2, 3)], layouts  # fw x2, dgrad x1 (x needs none), wgrad x2
    assert plan.params["up"][1] == "S2", plan.params


def test_layout_only_as_strided_is_a_view():
    """Swin's pooler: the as_strided torch's adaptive pooling restrides with, and the as_strided_scatter /
    as_strided of its backward, select the tensor's own elements in order: recorded as views (which have rules),
    and the model trains equal to one device. A genuine strided window stays as_strided and is refused by name."""
    from autopar.capture import capture

    torch.manual_seed(0)
    model = Pooled(d=128)
    x, y = torch.randn(64, 16, 128), torch.randint(0, 10, (64,))
    g = capture(model, (x, y))
    ops = {n.target for n in g.ops()}
    assert not ops & {aten.as_strided.default, aten.as_strided_scatter.default}, sorted(map(str, ops))
    assert {str(n.origin) for n in g.ops() if n.origin is not None} >= {
        "aten.as_strided.default",
        "aten.as_strided_scatter.default",
    }
    plan, state, _ = _check_trains(model, (x, y))
    assert not plan.coverage, plan.coverage
    views = [state.placement[n.idx].ins[0] for n in state.graph.ops() if n.origin is aten.as_strided.default]
    assert views and all(any(p[0] == "S" for p in pl) for pl in views), views  # run on shards

    class Window(nn.Module):  # every other feature: not a view of the tensor's elements in order
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x).as_strided((x.shape[0], 8), (16, 2)).pow(2).mean()

    with pytest.raises(autopar.NoStrategyError, match=r"aten.as_strided.default: .* called from as_strided in module"):
        autopar.plan(Window(), MESH, (torch.randn(8, 16),), cluster=SHAPES)


# ---- every candidate of every rule runs on the executor -------------------------------------------------------------


class _Encoder(nn.Module):
    def __init__(self, enc):
        super().__init__()
        self.enc, self.head = enc, nn.Linear(32, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.enc(x).mean(1)), y)


class _Misc(nn.Module):
    """Ops with rules of autopar's own (glu, cdist, replication-pad backward, torch.where with a scalar, adaptive
    max-pool backward) and ops whose torch decompositions must land on ruled ops (hardswish, logsigmoid)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 64)

    def forward(self, x, y):
        h = self.lin(x)  # (8, 64)
        a = F.glu(h, -1)  # (8, 32)
        d = torch.cdist(a[:, :16].unsqueeze(0), a[:, 16:].unsqueeze(0)).squeeze(0)  # (8, 8)
        img = F.pad(h.view(2, 4, 8, 8), (1, 1, 1, 1), mode="replicate")  # (2, 4, 10, 10)
        p = F.adaptive_max_pool2d(img, 2).flatten(1)  # (2, 16)
        w = torch.where(h > 0, h, 0.5) + F.hardswish(h) + F.logsigmoid(h)
        return F.mse_loss(d, y) + p.pow(2).mean() + w.mean()


def _models():
    """Small models whose ops cover matmuls, convolution, pooling, norms, softmax, embedding, attention (fused and
    GQA), MoE routing (topk, gather/scatter), losses, reductions and views, forward and backward."""
    from autopar.models import build_model, example_inputs

    torch.manual_seed(0)
    out = {
        "mlp-mse": (Regression(d=16, h=32), (torch.randn(8, 16), torch.randn(8, 16))),
        "losses": (Regression(d=16, h=32, loss="many"), (torch.randn(8, 16), torch.rand(8, 16))),
        "patch-embed": (PatchEmbed(d=16), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))),
        "misc": (_Misc(), (torch.randn(8, 16), torch.randn(8, 8))),
        "grouped-moe": (GroupedMoE(), (torch.randn(2, 4, 16), torch.randint(0, 10, (2,)))),
        "pooled": (Pooled(), (torch.randn(4, 6, 16), torch.randint(0, 10, (4,)))),
    }
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 1)
    out["nn-encoder"] = _Encoder(enc), (torch.randn(4, 8, 32), torch.randint(0, 10, (4,)))
    for name, ov in [
        ("llama-tiny", dict(dim=32, n_layers=1, vocab_size=64)),
        ("gpt2-tiny", dict(dim=32, n_layers=1, vocab_size=64)),
        ("moe-tiny", dict(dim=32, n_layers=1, vocab_size=64)),
        ("cnn-tiny", {}),
    ]:
        out[name] = build_model(name, device="cpu", **ov), example_inputs(name, batch=4, seq=8, **ov)
    return out


def _candidates(model, inputs):
    """The captured graph and, per node, the candidates the solver may choose (the planner's own passes)."""
    from autopar.capture import capture
    from autopar.cost import TrainingPrecision, get_cluster
    from autopar.mesh import as_mesh_spec
    from autopar.passes import candidates, precision, regions
    from autopar.passmanager import PlanState, run_passes

    g = capture(model, inputs)
    state = PlanState(
        g, as_mesh_spec(MESH), get_cluster(SHAPES), TrainingPrecision.fp32_adam(), 1e12, {"allow_replicate": True}
    )
    run_passes(state, (precision, regions, candidates))
    return g, state.strategies


def _values(g, model, inputs) -> dict:
    """Every value of the graph computed on one device (full tensors), by Ref."""
    from autopar.backends.spmd.local_ops import LOCAL_IMPL
    from autopar.backends.spmd.interpreter import _to_device
    from autopar.graph import Ref, map_refs

    params, bufs, val, cpu = dict(model.named_parameters()), dict(model.named_buffers()), {}, torch.device("cpu")
    with torch.no_grad():
        for n in g.nodes:
            if n.kind == "op":
                fn = LOCAL_IMPL.get(n.target, n.target)  # histc of int ids: the CPU kernel counts floats
                res = fn(*_to_device(map_refs(n.args, val.get), cpu), **_to_device(map_refs(n.kwargs, val.get), cpu))
            else:
                res = {"param": params, "buffer": bufs, "input": inputs, "constant": g.constants}[n.kind][n.target]
            flat = list(res) if isinstance(res, (tuple, list)) else [res]
            for i, t in enumerate(flat):
                val[Ref(n.idx, i)] = t.detach() if isinstance(t, torch.Tensor) else t
    return val


def _coords(r):
    return divmod(r, MESH[1])


def _shard(full, pl, mode):
    """Each rank's piece of `full` at placements `pl` (a LocalTensor; the plain tensor when replicated). A partial
    value is split into pieces with random noise that cancels in the reduction (zeros on all but one rank would
    hide an op that is wrong on partials, e.g. relu)."""
    if all(p == "R" for p in pl):
        return full
    if "Pm" in pl:
        return None  # a masked partial exists only as DTensor's embedding output, with its mask

    def piece(r):  # run with the mode off (rank_map): plain tensors, the same noise on every rank
        c = _coords(r)
        scale = full.abs().mean() if full.is_floating_point() else 0  # noise of the size of the value
        noise = [torch.randn(full.shape, generator=torch.Generator().manual_seed(m)) * scale for m in range(len(MESH))]
        x = full.clone()
        for m, p in enumerate(pl):
            if p == "P" and c[m]:
                x = torch.zeros_like(x)
        for m, p in enumerate(pl):
            if p in ("P", "Pa"):
                x = x + (noise[m] if c[m] == 0 else -noise[m]).to(x.dtype)
        for m, p in enumerate(pl):
            if p[0] == "S":
                x = x.chunk(MESH[m], int(p[1:]))[c[m]]
        return x.contiguous()

    return mode.rank_map(piece)


_SHARDS: dict = {}


def _shard_cached(val, r, pl, mode):
    key = (id(val), r, tuple(pl))
    if key not in _SHARDS:
        _SHARDS[key] = _shard(val[r], pl, mode)
    return _SHARDS[key]


def _assemble(v, pl):
    """The global value of an executor value at placements `pl`, from the simulated ranks' local tensors."""
    from autopar.backends.spmd.program import Sharded
    from autopar.strategies._torch_adapter import local_of

    lt = torch.distributed._local_tensor
    t = v.t if type(v) is Sharded else local_of(v) if isinstance(v, torch.distributed.tensor.DTensor) else v
    per = t._local_tensors if isinstance(t, lt.LocalTensor) else {r: t for r in range(MESH[0] * MESH[1])}

    def build(prefix):
        if len(prefix) == len(MESH):
            return per[prefix[0] * MESH[1] + prefix[1]]
        parts = [build(prefix + (c,)) for c in range(MESH[len(prefix)])]
        p = pl[len(prefix)]
        if p[0] == "S":
            return torch.cat(parts, int(p[1:]))
        if p in ("P", "Pm", "Pa"):
            return sum(parts[1:], parts[0]) / (len(parts) if p == "Pa" else 1)
        if not all(q.shape == parts[0].shape and torch.equal(q, parts[0]) for q in parts[1:]):
            raise AssertionError(f"a value planned Replicate differs between ranks on mesh dim {len(prefix)}")
        return parts[0]

    return build(())


def _differs(got, want) -> str | None:
    if not want.is_floating_point():
        return None if torch.equal(got, want) else "values differ"
    tol = 1e-6 + 1e-4 * want.abs().max().item() if want.numel() else 0
    err = (got.double() - want.double()).abs().nan_to_num(0.0)
    return f"max abs diff {err.max().item():.3e} > {tol:.1e}" if err.numel() and err.max() > tol else None


def _run_candidate(n, g, val, cand, mesh, mode):
    """Run op node `n` at candidate `cand` through the executor (a Program of this one op, whose inputs are leaves
    already at the candidate's input placements) on the per-rank pieces of its one-device inputs; the error, or
    None when each output equals the op's one-device output."""
    from types import SimpleNamespace
    from autopar.backends.spmd.program import Program, Sharded
    from autopar.graph import Graph, Node, Ref, map_refs
    from autopar.strategies import Strategy

    ins = n.inputs()
    locals_ = [_shard_cached(val, r, pl, mode) for r, pl in zip(ins, cand.ins)]
    if any(x is None for x in locals_):
        return "skip"
    k = len(ins)
    leaves = [Node(j, "input", j, outs=(g.meta(r),)) for j, r in enumerate(ins)]
    pos = iter(range(k))
    op = Node(
        k,
        "op",
        n.target,
        map_refs(n.args, lambda r: Ref(next(pos))),
        map_refs(n.kwargs, lambda r: Ref(next(pos))),
        n.outs,
        "fw",
        n.module,
    )
    first = next(i for i, o in enumerate(n.outs) if o is not None)
    one = Graph(leaves + [op], {}, {}, list(range(k)), Ref(k, first), {}, activation=True)
    state = SimpleNamespace(
        graph=one,
        placement=[Strategy((pl,), ()) for pl in cand.ins] + [cand],
        redistributes={},
        shares={},
        coalesced={},
        fw_order=None,
    )
    try:
        prog = Program(
            state,
            SimpleNamespace(buckets=[], meta={}),
            mesh,
            torch.device("cpu"),
            [torch.empty(m.out.shape, dtype=m.out.dtype, device="meta") for m in leaves],
        )
        env = {
            (j, 0): x if all(p == "R" for p in pl) else Sharded(x, tuple(pl), tuple(leaf.out.shape))
            for j, (x, pl, leaf) in enumerate(zip(locals_, cand.ins, leaves))
        }
        with torch.no_grad():  # what Program.forward runs, without its per-input detach (slow on
            prog.run_fw(env, None, prog._run1)  # LocalTensors): the compiled program, `_run1` per instruction
        for i, pl in enumerate(cand.out):
            if pl is None:
                continue
            got, want = _assemble(env[(k, i)], pl), val[Ref(n.idx, i)]
            if got.shape != want.shape:
                return f"output {i}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            if n.target in (aten.empty_like.default, aten.new_empty.default, aten.empty.memory_format):
                continue
            with outside_local_tensor_mode():
                bad = _differs(got, want)
            if bad:
                return f"output {i}: {bad}"
    except Exception as e:  # noqa: BLE001 -- every failure of a candidate is reported
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def _handmade(op, *tensors):
    """(graph, values, node, candidates) of one op on the given one-device tensors, for ops the recorder does not
    produce yet (aten.copy: what functionalization makes of an in-place copy_), candidates from every leaf
    placement."""
    from autopar.graph import Graph, Node, Ref
    from autopar.strategies import leaf_strategies, node_strategies
    from autopar.graph import TensorMeta

    metas = [TensorMeta(tuple(t.shape), t.dtype) for t in tensors]
    out = op(*tensors)
    nodes = [Node(j, "input", j, outs=(m,)) for j, m in enumerate(metas)]
    nodes.append(
        Node(
            len(tensors),
            "op",
            op,
            tuple(Ref(j) for j in range(len(tensors))),
            {},
            (TensorMeta(tuple(out.shape), out.dtype),),
        )
    )
    g = Graph(nodes, {}, {}, list(range(len(tensors))), Ref(len(tensors)), {})
    val = {Ref(j): t for j, t in enumerate(tensors)} | {Ref(len(tensors)): out}
    cands = [
        [s.out[0] for s in leaf_strategies(m, MESH)] + [("P",) * len(MESH)] * m.dtype.is_floating_point for m in metas
    ]
    return g, val, nodes[-1], node_strategies(nodes[-1], g.meta, MESH, cands)[0]


def _handmade_ops():
    torch.manual_seed(0)
    return [
        _handmade(aten.copy.default, torch.randn(4, 8, 6), torch.randn(8, 6)),
        _handmade(aten.copy.default, torch.zeros(4, 8, dtype=torch.float64), torch.randn(4, 1)),
        _handmade(aten.fill.Tensor, torch.randn(4, 8), torch.tensor(3.0)),
    ]


PER_OP = 2  # nodes per op (of distinct input ranks / dtypes): the same op on other sizes takes the same path


def _meta_device(n) -> bool:
    """An op whose arguments name the capture's meta device (`.to(device=...)`, factories like new_zeros run on
    replicated values): making those on the run device is issue 23 point 4 (forward-made tensors), not a
    placement question."""
    from autopar.graph import flat_args

    return any(isinstance(a, torch.device) and a.type == "meta" for a in flat_args(n.args, n.kwargs))


def test_every_candidate_executes():
    """Each candidate of each op's rule (the planner's candidates pass, 2x2 mesh), over the distinct ops and shapes
    of the models above, runs once through the executor's own path for that op (program.Program: "local" on the
    shards or DTensor's dispatch) and gives the op's one-device result. A candidate that fails is a planner bug."""
    seen, failures, ran, skipped, per_op = set(), [], 0, 0, Counter()
    work = []
    for name, (model, inputs) in _models().items():
        g, strategies = _candidates(model, inputs)
        val = _values(g, model, inputs)
        for n in g.ops():
            if (
                torch.Tag.nondeterministic_seeded in n.target.tags
                or not any(o is not None for o in n.outs)
                or _meta_device(n)
            ):
                continue
            key = (n.target, tuple((len(g.meta(r).shape), g.meta(r).dtype) for r in n.inputs()))
            if key not in seen and per_op[n.target] < PER_OP:
                seen.add(key)
                per_op[n.target] += 1
                work.append((name, g, val, n, strategies[n.idx]))
    work += [("handmade", *w) for w in _handmade_ops()]
    with simulated(MESH) as mesh:
        mode = torch.distributed._local_tensor.enabled_local_tensor_mode()
        for name, g, val, n, cands in work:
            for cand in cands:
                err = _run_candidate(n, g, val, cand, mesh, mode)
                if err == "skip":
                    skipped += 1
                    continue
                ran += 1
                if err is not None:
                    failures.append(
                        f"{name} {n.name} {[g.meta(r).shape for r in n.inputs()]} ins {cand.ins} out {cand.out}: {err}"
                    )
    print(f"{len(work)} distinct ops, {ran} candidates run, {skipped} skipped (masked-partial inputs)")
    assert not failures, f"{len(failures)} of {ran} candidates fail:\n" + "\n".join(failures[:40])
    assert ran > 1000


class _Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return F.hardswish(self.proj(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Act()

    def forward(self, x):
        return self.block(x).sum()


def test_no_rule_error_names_the_users_op(monkeypatch):
    """An op whose torch decomposition holds an op with no rule: the error names the user-level op (here
    hardswish's backward, whose decomposition ends in torch.where, with DTensor's rules for where.self hidden)
    and the user's module, not the internal op alone; replicate_ops takes that name."""
    import autopar.strategies as S

    for name in ("has_single_dim", "has_full"):
        known = getattr(S.adapter, name)
        monkeypatch.setattr(S.adapter, name, lambda op, known=known: op is not aten.where.self and known(op))
    monkeypatch.delitem(S.RULES, aten.where.self, raising=False)
    monkeypatch.setattr(S, "_DECOMP", {aten.where.self: None})
    monkeypatch.setattr(S, "_CACHE", {})
    with pytest.raises(autopar.NoStrategyError) as e:
        autopar.plan(_Net(), MESH, (torch.randn(8, 16),), cluster=SHAPES)
    msg = str(e.value)
    assert "aten.hardswish_backward.default:" in msg and "module 'block'" in msg, msg
    assert "in torch's decomposition of aten.hardswish_backward.default" in msg, msg
    p = autopar.plan(
        _Net(), MESH, (torch.randn(8, 16),), cluster=SHAPES, replicate_ops=["aten.hardswish_backward.default"]
    )
    assert set(p.coverage) == {"aten.hardswish_backward.default"}, p.coverage
