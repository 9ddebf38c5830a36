"""Bad input to the planner gets a clear error naming what is at fault."""

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import models as M


@torch.library.custom_op("autopar_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


mystery.register_autograd(lambda ctx, g: g * 2)


class Mystery(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return mystery(self.lin(x)).sum()


def test_op_without_rule_is_listed_and_can_be_forced_replicate():
    m, x = Mystery(), torch.randn(4, 8)
    with pytest.raises(autopar.NoStrategyError, match=r"autopar_test\.mystery.*module '<root>'"):
        autopar.plan(m, (2,), (x,))
    p = autopar.plan(m, (2,), (x,), replicate_ops=["autopar_test.mystery.default"])
    assert p.coverage == {"autopar_test.mystery.default": 1}  # its backward is a plain mul
    assert all(n["placement"]["out"][0] == ["R"] for n in p.nodes if "mystery" in n["name"])


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.inner(x)).sum()


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


def test_data_dependent_control_flow_names_module():
    # on real example values such a check is specialized and guarded (tests/test_model_contract.py); on meta
    # inputs there is nothing to specialize on
    with pytest.raises(autopar.CaptureError, match=r"data-dependent control flow.*module 'gate'.*input 'x'"):
        autopar.plan(Branchy(), (2,), (torch.randn(4, 8, device="meta"),))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x).sum()


class WeightBump(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.lin.bias.add_(1)
        return self.lin(x).sum()


def test_buffer_mutation_is_a_state_update():
    p, st = autopar.plan(Counter(), (2,), (torch.randn(4, 8),), return_state=True)
    g = st.graph
    r = g.state_updates["steps"]
    assert (
        g.nodes[r.node].target is torch.ops.aten.add.Tensor and g.nodes[r.node].inputs()[0].node == g.buffers["steps"]
    )


def test_parameter_mutation_is_rejected():
    with pytest.raises(autopar.CaptureError, match=r"mutates parameter 'lin\.bias' in place.*module '<root>'.*add_"):
        autopar.plan(WeightBump(), (2,), (torch.randn(4, 8),))


def test_non_scalar_output_needs_loss_fn():
    lin = nn.Linear(8, 8)
    with pytest.raises(autopar.CaptureError, match="scalar loss"):
        autopar.plan(lin, (2,), (torch.randn(4, 8),))
    p = autopar.plan(lin, (2,), (torch.randn(4, 8),), loss_fn=lambda y: y.pow(2).mean())
    assert set(p.params) == {"weight", "bias"}


def test_forced_shard_that_does_not_divide_names_parameter():
    m = M.build_model("mlp-tiny")  # hidden 128, dim 32, vocab 64
    with pytest.raises(ValueError, match=r"layers\.0\.fc1\.bias.*\(128,\).*mesh"):
        autopar.plan(m, (3,), M.example_inputs("mlp-tiny", device="meta"), force={"layers.0.fc1.bias": ("S0",)})
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        autopar.plan(m, (2,), M.example_inputs("mlp-tiny", device="meta"), force={"nope": ("S0",)})
    with pytest.raises(ValueError, match="one placement per mesh dim"):
        autopar.plan(m, (2, 2), M.example_inputs("mlp-tiny", device="meta"), force={"layers.0.fc1.bias": ("S0",)})


@pytest.mark.parametrize(
    "shape,names,msg",
    [
        ((0, 4), None, "positive ints"),
        ((2, 2), ("dp",), "2 dims"),
        ((2, 2), ("dp", "dp"), "distinct"),
        ((2.5,), None, "positive ints"),
    ],
)
def test_bad_mesh_spec(shape, names, msg):
    with pytest.raises(ValueError, match=msg):
        autopar.MeshSpec(shape, names)


def test_bad_mesh_string_and_cluster():
    with pytest.raises(ValueError, match="must look like"):
        autopar.MeshSpec.parse("8by8")
    with pytest.raises(ValueError, match="h100"):
        autopar.get_cluster("tpu-v9")


def test_unused_parameter_gets_no_gradient():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x).sum()

    p, state = autopar.plan(Unused(), (2,), (torch.randn(2, 4),), return_state=True)
    assert "b.weight" in p.params and "b.weight" not in state.graph.grads and "a.weight" in state.graph.grads


def test_parallelize_points_pipeline_plans_to_the_pipeline_runner():
    """A mesh with a pp dim (or a finished pipeline plan) makes pipeline stages, which parallelize does not run:
    the error says what does (PipelineRunner), before anything is planned or captured."""
    import types

    from autopar import models

    m = models.build_model("llama-tiny", device="meta", n_layers=2)
    x = models.example_inputs("llama-tiny", batch=4, device="meta", n_layers=2)
    with pytest.raises(ValueError, match=r"mesh dim pp makes pipeline stages.*PipelineRunner\(model, plan, mesh\)"):
        autopar.parallelize(m, types.SimpleNamespace(mesh_dim_names=("pp", "dp")), x)
    plan = autopar.plan(m, autopar.MeshSpec((2,), ("pp",)), x, cluster="h100", pipeline={"schedules": ["GPipe"]})
    with pytest.raises(ValueError, match=r"the plan makes pipeline stages.*step_model"):
        autopar.parallelize(m, types.SimpleNamespace(mesh_dim_names=("dp",)), x, plan=plan)


def test_a_timed_out_plan_on_three_mesh_dims_points_to_the_pipeline_search():
    """A per-op plan over 3 mesh dims with two free of them is a large search (llama-tiny on (2, 2, 2) with no dim
    named dp* / cp*: a 1.1M-column LP, a minute or two in all; T5 on (dp, x, tp) past 60 s): its time-out says so,
    naming the free dims; a 2-dim one only says to raise the limit. (An MLP under a 1 us limit stands in for the
    slow solve.)"""
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x, loss = torch.randn(32, 64), lambda y: y.sum()
    with pytest.raises(
        autopar.SolverTimeLimitError,
        match=r"3 mesh dims \(dp=2, x=2, tp=2\) with 2 free of them \(x, tp\).*pipeline='auto'",
    ):
        autopar.plan(m, autopar.MeshSpec((2, 2, 2), ("dp", "x", "tp")), (x,), time_limit=1e-6, loss_fn=loss)
    with pytest.raises(autopar.SolverTimeLimitError) as e:
        autopar.plan(m, autopar.MeshSpec((2, 4), ("dp", "tp")), (x,), time_limit=1e-6, loss_fn=loss)
    assert "pipeline" not in str(e.value) and "time_limit=" in str(e.value)
