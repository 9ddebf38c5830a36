"""The published-runs harness (benchmarks/published.py): the FLOP formulas against the papers' own figures, the row
table against published_runs.md's layouts, and the fit's re-pricing against planning again."""

from __future__ import annotations

import dataclasses
import json
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


def test_fitted_presets_are_the_fit_files_factors():
    """cluster.py's fitted presets carry the figures of benchmarks/results/published_fit.json (the report plans at
    the fit's factors on the base preset: the two must not drift apart)."""
    path = os.path.join(os.path.dirname(P.__file__), "results", "published_fit.json")
    with open(path) as f:
        fitted = json.load(f)
    for base, factors in fitted.items():
        want = P.scaled(P.get_cluster(base), factors)
        got = P.get_cluster(P.FITTED_PRESETS[base])
        for fig in factors:
            for part, field in P.FIGURES[fig]:
                assert getattr(getattr(got, part), field) == pytest.approx(
                    getattr(getattr(want, part), field), rel=1e-6
                )


def test_cp_rows_force_a_cp_mesh_dim_inside_the_stages():
    b6 = next(r for r in R.ROWS if r.name.startswith("B6.17 "))
    mesh, opts = P._mesh_and_pipeline(b6)
    assert (tuple(mesh.shape), tuple(mesh.names)) == ((8, 2, 4, 8), ("pp", "dp", "cp", "tp"))
    assert opts["layers_per_stage"] == [15] + [16] * 6 + [15] and opts["n_microbatches"] == [8]
    b5 = next(r for r in R.ROWS if r.name.startswith("B5.14 "))
    mesh, opts = P._mesh_and_pipeline(b5)
    assert (tuple(mesh.shape), tuple(mesh.names)) == ((1, 1, 8), ("pp", "dp", "cp"))
    assert opts["recompute"] == "all" and opts["schedules"] == ["GPipe"]
    # compile rows are strict and priced with inductor's fusion; async TP rows with DeviceSpec async_tp
    b17 = next(r for r in R.ROWS if r.name.startswith("B1.2 "))
    assert b17.strict and not b17.fitted and P.row_cluster(b17).device.fusion == "inductor"
    b38 = next(r for r in R.ROWS if r.name.startswith("B3.8 "))
    assert b38.strict and not b38.fitted and P.row_cluster(b38).device.async_tp
    assert not P.row_cluster(next(r for r in R.ROWS if r.name.startswith("B3.7 "))).device.async_tp


def test_run_jobs_caches_plans_and_kills_overlong_ones(tmp_path, monkeypatch):
    """Parallel planning writes what plan_row would, and a plan past its timeout is cached as a TimeoutError."""
    import published_plan as PP

    monkeypatch.setattr(PP, "CACHE", str(tmp_path))
    row = dataclasses.replace(
        R.ROWS[0], name="tiny", over=dict(R._GPT, n_heads=4, dim=128, n_layers=2, vocab_size=1024, max_seq_len=128),
        gpus=2, layout=(1, 2, 1, 1), batch=4, seq=128, microbatches=(1,), layers_per_stage=(2,),
    )  # fmt: skip
    fast, slow = (row, P.row_cluster(row), False), (R.ROWS[0], P.row_cluster(R.ROWS[0]), False)  # slow: seconds
    PP.run_jobs([fast], 2, timeout=300)
    assert PP.plan_row(*fast, cached_only=True)["step_s"] == pytest.approx(
        PP.plan_row(*fast, use_cache=False)["step_s"]
    )
    PP.run_jobs([slow, fast], 2, timeout=0.01)  # fast is cached: only slow runs, and is killed at the first poll
    assert PP.plan_row(*slow, cached_only=True)["error"].startswith("TimeoutError")
    assert "tiny|" in " ".join(PP._walls())


def _tiny_tp_row(metric="megatron_tflops"):
    over = dict(R._GPT, n_heads=4, dim=256, n_layers=2, vocab_size=4096, max_seq_len=256)
    return dataclasses.replace(
        R.ROWS[0], name="tiny-tp", over=over, gpus=4, layout=(1, 2, 2, 1), batch=8, seq=256, microbatches=(1,),
        layers_per_stage=(2,), metric=metric,
    )  # fmt: skip


def test_tp_rows_plan_megatrons_activations_not_fsdp_over_tp():
    """A forced tp row runs Megatron's tensor parallelism: column GEMMs feature-sharded and row GEMMs Partial on tp,
    reduced by activation all-reduces on tp, parameters replicated over dp (DDP); not the blocks data-parallel over
    tp with gathered weights (what tp_force alone gave). The pin reaches the pipeline path's stage plans."""
    import published_plan as PP

    row = _tiny_tp_row()
    m, x = PP._build(row)
    plan, _ = PP._plan_forced(row, m, x, P.row_cluster(row))
    fw = [n for n in plan.nodes if n["kind"] == "op" and n["phase"] == "fw" and n["target"].startswith("addmm")]
    tp_of = {n["module"].rsplit(".", 1)[-1]: n["placement"]["out"][0][1] for n in fw if n["module"].startswith("h.0")}
    assert tp_of == {"c_attn": "S1", "c_proj": "P", "c_fc": "S1"}
    params = {n["target"]: n["placement"]["out"][0] for n in plan.nodes if n["kind"] == "param"}
    assert params["h.0.attn.c_attn.weight"] == ["R", "S0"] and params["h.0.mlp.c_proj.weight"] == ["R", "S1"]
    reduces = [k for k, d, _ in plan.collectives() if k == "all_reduce" and d == 1]
    assert len(reduces) >= 2  # the (representative) block's two forward all-reduces into the stream


def test_qkv_per_head_is_the_same_model_up_to_a_row_permutation():
    import torch

    from autopar.models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(0)
    cfg = dict(dim=64, n_layers=1, n_heads=4, vocab_size=128, max_seq_len=32)
    a, b = GPT2(GPT2Config(**cfg)), GPT2(GPT2Config(**cfg, qkv_per_head=True))
    b.load_state_dict(a.state_dict())
    heads, hd = 4, 16  # [(q, k, v), heads, hd] rows to [heads, (q, k, v), hd]
    perm = torch.arange(3 * 64).view(3, heads, hd).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        b.h[0].attn.c_attn.weight.copy_(a.h[0].attn.c_attn.weight[perm])
        b.h[0].attn.c_attn.bias.copy_(a.h[0].attn.c_attn.bias[perm])
    x = torch.randint(0, 128, (2, 32))
    assert torch.allclose(a.logits(x), b.logits(x), atol=1e-5)
    b.load_state_dict(a.state_dict())  # unpermuted: a different function
    assert not torch.allclose(a.logits(x), b.logits(x), atol=1e-3)


def test_titan_pipelined_rows_take_torchtitans_default_microbatch_count():
    """torchtitan of the paper's and the January 2025 benchmarks' time split the local batch into pp micro-batches
    when the config named none (build_pipeline_schedule until torchtitan#781): Table 4's rows, 1F1B and interleaved
    alike, 16 micro-batches of 2 sequences; Table 6 8 of 1."""
    rows = {r.name.split()[0]: r for r in R.ROWS}
    for name, m, per_micro in (("B4.9", 16, 2), ("B4.10", 16, 2), ("B6.15", 8, 1)):
        _, opts = P._mesh_and_pipeline(rows[name])
        assert opts["n_microbatches"] == [m] and rows[name].batch // rows[name].layout[1] // m == per_micro, name
