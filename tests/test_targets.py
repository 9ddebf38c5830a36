"""target="torch" decided in one place (autopar/targets.py): with the data dims declared (TorchTarget) the engines'
pins are known before solving and the model is solved once; the plan is the one the two-solve path (solve, then
solve again pinned) finds. Solver calls are counted by patching the solve pass. No processes."""

from __future__ import annotations

import pytest

import autopar
import autopar.passes.solve as solve_pass
from autopar import models as M
from autopar import TorchTarget
from _clusters import GLOO_PER_STEP, SHAPES

SEQ = 64


@pytest.fixture
def solves(monkeypatch):
    """The number of times the solver pass ran since the last reset (calls[0] = 0)."""
    calls = [0]
    run = solve_pass.run

    def counting(state):
        calls[0] += 1
        return run(state)

    monkeypatch.setattr(solve_pass, "run", counting)
    return calls


def _plans(solves, batch, mesh, names, cluster, declared):
    """(plan, solver calls) for target="torch" and for TorchTarget(declared), same model and options."""
    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=batch, seq=SEQ, device="meta")
    out = []
    for target in ("torch", TorchTarget(declared)):
        solves[0] = 0
        p = autopar.plan(m, autopar.MeshSpec(mesh, names), x, cluster=cluster, target=target)
        out.append((p, solves[0]))
    return out


def _placements(p):
    return p.params, [n["placement"] for n in p.nodes]


@pytest.mark.parametrize("mesh,names,declared", [((4,), ("dp",), ("dp",)), ((2, 2), ("dp", "tp"), ("dp", "tp"))])
def test_declared_data_dims_solve_once_to_the_two_solve_plan(solves, mesh, names, declared):
    """llama-tiny under GLOO_PER_STEP: the free plan gathers the loss input over the data dims, so target="torch"
    solves twice; with those data dims declared it solves once, to the same placements and prediction."""
    (two, n_two), (one, n_one) = _plans(solves, 16, mesh, names, GLOO_PER_STEP, declared)
    assert (n_two, n_one) == (2, 1)
    assert _placements(one) == _placements(two) and one.hash() == two.hash()
    assert one.predicted["step_s"] == two.predicted["step_s"]
    assert two.meta["engine_replan"].endswith("[two solves: no data dims declared]"), two.meta["engine_replan"]
    note = one.meta["engine_replan"]
    assert note.startswith("planned for the engines in one solve") and "nll_loss_forward" in note, note
    assert f"declared data dims {'+'.join(declared)}" in note and one.meta["target"] == "torch"


def test_declared_dims_the_plan_does_not_keep_fall_back_to_two_solves(solves):
    """Under SHAPES the free 2x2 plan splits the batch over both dims; declaring only dp gives a plan whose data
    dims are not the declared ones, so the two-solve path runs (and says so) and keeps target="torch"'s plan."""
    (free, n_free), (fallback, n_fallback) = _plans(solves, 8, (2, 2), ("dp", "tp"), SHAPES, ("dp",))
    assert (n_free, n_fallback) == (1, 2)
    assert _placements(fallback) == _placements(free) and "engine_replan" not in free.meta
    assert "[two solves: the pins on the declared data dims dp did not hold" in fallback.meta["engine_replan"]


def test_a_declared_dim_the_mesh_lacks_is_named():
    m = M.build_model("llama-tiny", device="meta")
    x = M.example_inputs("llama-tiny", batch=8, seq=SEQ, device="meta")
    with pytest.raises(ValueError, match="'fsdp' is not a dim of the mesh"):
        autopar.plan(m, autopar.MeshSpec((2,), ("dp",)), x, cluster=SHAPES, target=TorchTarget(("fsdp",)))
