"""Third-party models, unmodified (issue 23's suite): every architecture of tests/third_party/zoo.py
  * plans on a simulated (8, 8) h100 mesh, and
  * runs through autopar.parallelize on a 2x2 gloo mesh with a cost model on which sharding pays: the first step's
    loss and every gradient, and every parameter and buffer after 3 AdamW steps, equal one device's
    (|diff| <= 1e-6 + 1e-4 max|ref|), at least one parameter sharded, at least one collective in every step.
All models run in one 4-rank launch (tests/third_party/zoo_check.py: the ranks agree on each stage's status, so a
model failing on one rank fails on all and the launch goes on), shared by the tests through a module fixture.

Models that do not pass today are strict xfails naming the stage and error benchmarks/models.py recorded: a fix
shows up as an XPASS failure, and its mark is then removed. The table: benchmarks/results/models.md.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "third_party"))

import zoo_check  # noqa: E402
from zoo import ZOO  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1200)]

LAUNCH_TIMEOUT_S = 1100

# What fails today (python benchmarks/models.py on main at 7adffbb): the stage and the first line of the error.
PLAN_8X8_FAILS: dict[str, str] = {
    'gpt2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'opt': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'llama': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'qwen2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'qwen3': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'mistral': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gemma2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gpt_neox': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'phi': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gptj': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'falcon': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'bloom': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gpt_bigcode': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'phi3': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'stablelm': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'mixtral': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'olmoe': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'qwen2_moe': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'bert': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'roberta': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'distilbert': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'electra': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'albert': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'deberta_v2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    't5': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'bart': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'vit': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'swin': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'resnet': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'convnext': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'mobilenet_v2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'clip': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'titan_llama3': "capture: CaptureError: in-place op aten.add_.Scalar in module 'model.layers.0.attention_n...",
    'titan_qwen3': "capture: CaptureError: in-place op aten.add_.Scalar in module 'model.layers.0.attention_no...",
    'nn_transformer': "capture: CaptureError: in-place op aten.bernoulli_.float in module 'model.transformer.e...",
    'nn_transformer_encoder': "capture: CaptureError: in-place op aten.bernoulli_.float in module 'model.encod...",
    'torchvision_resnet': "capture: CaptureError: in-place op aten.add_.Tensor in module 'model.bn1' mutates a...",
}
CHECK_2X2_FAILS: dict[str, str] = {
    'gpt2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'opt': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'llama': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'qwen2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'qwen3': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'mistral': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gemma2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gpt_neox': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'phi': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gptj': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'falcon': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'bloom': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'gpt_bigcode': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'phi3': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'stablelm': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'mixtral': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'olmoe': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'qwen2_moe': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'bert': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'roberta': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'distilbert': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'electra': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'albert': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'deberta_v2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    't5': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'bart': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'vit': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'swin': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'resnet': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'convnext': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'mobilenet_v2': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'clip': "capture: TypeError: plan() got an unexpected keyword argument 'example_kwargs'",
    'titan_llama3': "capture: CaptureError: in-place op aten.add_.Scalar in module 'model.layers.0.attention_n...",
    'titan_qwen3': "capture: CaptureError: in-place op aten.add_.Scalar in module 'model.layers.0.attention_no...",
    'nn_transformer': 'plan: the ranks planned differently (plan hashes)',
    'torchvision_resnet': "capture: CaptureError: in-place op aten.add_.Tensor in module 'model.bn1' mutates a...",
}
# Fails on some runs only: the 2x2 MILP ends near its 30 s limit (zoo_check.PLAN_TIME_LIMIT_S) under load
FLAKY = {"nn_transformer"}


def _params(known: dict):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=n not in FLAKY, reason=known[n])) if n in known else n
            for n in ZOO]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    recs, why = zoo_check.run_suite(list(ZOO), "as-is", tmp_path_factory.mktemp("zoo"), LAUNCH_TIMEOUT_S)
    if why:         # the models the ranks finished keep their records; the rest fail at stage "launch"
        print(why[-6000:])
    return {r["model"]: r for r in recs}


def test_zoo_size():
    """At least 24 architectures, none of them a duplicate of another under a second name."""
    assert len(ZOO) >= 24, sorted(ZOO)
    assert len(set(ZOO.values())) == len(ZOO)


@pytest.mark.parametrize("name", _params(PLAN_8X8_FAILS))
def test_plan_8x8_h100(records, name):
    p = records[name]["plan8"]
    assert p.get("ok"), f"{name}: (8, 8) h100 plan fails at {p.get('stage')}: {p.get('error')}"
    assert p["placements"]["params"] > 0


@pytest.mark.parametrize("name", _params(CHECK_2X2_FAILS))
def test_2x2_gloo_matches_one_device(records, name):
    r = records[name]
    assert r["ok"], f"{name}: 2x2 check fails at {r['stage']}: {r['error']}; {r.get('problems', [])}"
    # what ok means, stated again where it is read: the comparisons passed and the plan really is parallel
    assert r["placements_2x2"]["sharded"] >= 1 and min(r["collectives"]) >= 1
    assert len(r["losses"]) == zoo_check.STEPS
