"""Golden tests of the localize step (backends/spmd/localize.py): a plan of one linear layer on 2 ranks, data
parallel and tensor parallel, localized into the per-rank program and printed as text, compared with the program
written out below (in the style of TVM's assert_structural_equal tests). Each line: an op with its local arguments,
how it runs, the placement of its outputs; then the redistributes before it and the values freed after it."""

from __future__ import annotations

import textwrap

import torch
import torch.nn as nn

import autopar
from _clusters import SHAPES
from autopar.backends.spmd.localize import localize
from autopar.execution import from_plan


class Linear(nn.Module):
    def __init__(self, flatten: bool):
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)
        self.flatten = flatten

    def forward(self, x):
        y = self.proj(x)
        return (y.view(-1) if self.flatten else y).sum()


def _dp_pin(n):
    """Rows sharded: the input and the forward matmul on S0, the weight's gradient left partial (all-reduced)."""
    if n.kind == "input":
        return {0: "S0"}
    if n.kind == "op" and "mm" in n.name:
        return {(0, 0): "S0" if n.phase == "fw" else "P"}
    return None


def _tp_pin(n):
    """Output features sharded: the forward matmul's output column-sharded (the weight is S0 by force)."""
    return {(0, 0): "S1"} if n.kind == "op" and n.phase == "fw" and "mm" in n.name else None


def _localized(model, force, pin):
    x = torch.randn(64, 8)
    plan, state = autopar.plan(model, (2,), (x,), cluster=SHAPES, force=force, pin=pin, return_state=True)
    ex = from_plan(plan, state.graph)
    return plan, ex, localize(ex, (2,), torch.device("cpu"), math=False)


def _expect(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def test_data_parallel_linear_localizes_to_row_shards():
    plan, ex, local = _localized(Linear(flatten=True), {"proj.weight": ("R",)}, _dp_pin)
    before = next(n for n in ex.graph.nodes if n.name.endswith("view.default") and n.phase == "fw")
    assert before.args[1] == [-1]  # the global graph's view; its local size below is this rank's 128 of 256
    assert plan.collectives() == [("all_reduce", 0, 4), ("all_reduce", 0, 128)]  # the loss, the weight's gradient
    assert local.text() == _expect(
        """
        forward
          %2:t.default(%0)  local -> [R]
          %3:mm.default(%1, %2:t.default)  local -> [S0]
            free %2:t.default
          %4:view.default(%3:mm.default, [128])  local -> [S0]
            free %3:mm.default
          %5:sum.default(%4:view.default)  local -> [P]
            free %4:view.default
        backward
          %6:ones_like.default(%5:sum.default, pin_memory=False, memory_format=torch.preserve_format)  seed -> [R]
          %7:expand.default(%6:ones_like.default, [256])  local -> [R]
            free %6:ones_like.default
          %8:view.default(%7:expand.default, [64, 4])  local -> [R]
            free %7:expand.default
          %9:t.default(%8:view.default)  local -> [R]
            free %8:view.default
          %10:mm.default(%9:t.default, %1)  local -> [P]
            input 0: [R] -> [S1]
            free %9:t.default
          %11:t.default(%10:mm.default)  local -> [P]
            free %10:mm.default
          %12:t.default(%11:t.default)  local -> [P]
            free %11:t.default
        """
    )


def test_tensor_parallel_linear_localizes_to_column_shards():
    plan, _, local = _localized(Linear(flatten=False), {"proj.weight": ("S0",)}, _tp_pin)
    assert plan.collectives() == [("all_reduce", 0, 4)]  # the partial loss; the gradient stays at S0, no collective
    assert local.text() == _expect(
        """
        forward
          %2:t.default(%0)  local -> [S1]
          %3:mm.default(%1, %2:t.default)  local -> [S1]
            free %2:t.default
          %4:sum.default(%3:mm.default)  local -> [P]
            free %3:mm.default
        backward
          %5:ones_like.default(%4:sum.default, pin_memory=False, memory_format=torch.preserve_format)  seed -> [R]
          %6:expand.default(%5:ones_like.default, [64, 4])  local -> [R]
            free %5:ones_like.default
          %7:t.default(%6:expand.default)  local -> [R]
            free %6:expand.default
          %8:mm.default(%7:t.default, %1)  local -> [S0]
            input 0: [R] -> [S0]
            free %7:t.default
          %9:t.default(%8:mm.default)  local -> [S1]
            free %8:mm.default
          %10:t.default(%9:t.default)  local -> [S0]
            free %9:t.default
        """
    )


def test_the_executor_runs_the_localized_program():
    """Program builds its instructions from localize's output, in its order."""
    from _simulated import simulated

    model = Linear(flatten=True).to("cpu")
    x = torch.randn(64, 8)
    with simulated((2,)) as mesh:
        pm = autopar.parallelize(model, mesh, (x,), cluster=SHAPES, force={"proj.weight": ("R",)}, pin=_dp_pin)
        prog = pm.program
        assert [it.node.idx for it in prog.fw] == [op.node.idx for op in prog.local.forward]
        assert [it.node.idx for it in prog.bw] == [op.node.idx for op in prog.local.backward]
        loss = pm(x)
        assert torch.allclose(loss.reconcile() if hasattr(loss, "reconcile") else loss, model(x))
