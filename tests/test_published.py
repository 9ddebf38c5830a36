"""The published-runs harness (benchmarks/published.py): the FLOP formulas against the papers' own figures, the row
table against published_runs.md's layouts, and the fit's re-pricing against planning again."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import published as P  # noqa: E402
import published_rows as R  # noqa: E402


def test_megatron_equation_3_matches_the_papers_1t_training_time():
    # SC21 section 5.1: eq. 3 per token is about 8 P (eq. 4's approximation), and eq. 4 gives "about 84 days" for
    # the 1T model on 450B tokens at 163 TFLOP/s on 3072 GPUs
    per_token = R.megatron_flops(3072, 2048, 128, 25600, 51200) / (3072 * 2048)
    assert per_token == pytest.approx(8 * 1008e9, rel=0.02)
    days = per_token * 450e9 / (3072 * 163e12) / 86400
    assert 80 <= days <= 86


def test_row_table_holds_every_published_row_with_its_layout():
    src = {r.source.split(" Table")[0]: 0 for r in R.ROWS}
    for r in R.ROWS:
        src[r.source.split(" Table")[0]] += 1
        pp, dp, tp, cp = r.layout
        assert pp * dp * tp * cp == r.gpus, r.name
        assert sum(r.layers_per_stage) in (r.over.get("n_layers"), 32, 80, 126), r.name
    assert src == {"Megatron-LM SC21": 10, "TorchTitan": 18, "Llama 3": 3}
    a1 = next(r for r in R.ROWS if r.name.startswith("A1 "))
    assert (a1.gpus, a1.batch, a1.published, a1.layout) == (32, 512, 137, (1, 32, 1, 1))
    c2 = next(r for r in R.ROWS if r.name.startswith("C2 "))
    assert (c2.batch * c2.seq, c2.layers_per_stage) == (2048 * 8192, (1,) + (2,) * 62 + (1,))
    # rows with techniques autopar does not price are kept out of the fit and of the hold-out
    assert all(not r.fitted for r in R.ROWS if not r.strict)


def test_titan_metric_is_tokens_per_second_per_gpu():
    row = next(r for r in R.ROWS if r.name.startswith("B1.1 "))
    assert R.metric_of(row, 2.0, None) == pytest.approx(16 * 8192 / 2.0 / 8)


def test_fitted_presets_load_with_their_figures():
    for base, name in P.FITTED_PRESETS.items():
        cl = P.get_cluster(name)
        ref = P.get_cluster(base)
        assert cl.device.peak_flops == ref.device.peak_flops and cl.gpus_per_node == 8
        assert 0 < cl.device.gemm_eff_max <= 1 and 0 < cl.inter.bus_eff <= 1
    assert P.get_cluster("a100-selene").device.attention == "unfused"


def test_repricing_matches_planning_again():
    """One probe at 0.8 x gemm_eff_max re-prices the step at 0.9 x within 2% of planning at 0.9 x."""
    small = dict(R._GPT, n_heads=4, dim=256, n_layers=2, vocab_size=4096, max_seq_len=256)
    row = dataclasses.replace(
        R.ROWS[0], name="tiny", over=small, gpus=4, layout=(2, 2, 1, 1), batch=8, seq=256, schedule="1F1B", v=1,
        microbatches=(2,), layers_per_stage=(1, 1),
    )  # fmt: skip
    at = lambda k: P.plan_row(row, P.row_cluster(row, None, {"gemm": k} if k != 1 else None), use_cache=False)
    base, probe, check = at(1), at(P.PROBE), at(0.9)
    assert probe["step_s"] > base["step_s"] * 1.05  # GEMMs are a real share of this step
    repriced = P.repriced_step({"": base, "gemm": probe}, {"gemm": 0.9})
    assert repriced == pytest.approx(check["step_s"], rel=0.02)
