"""The command line as a user runs it: `autopar plan` on a zoo model and on a factory of one's own, `--list-models`,
`explain` (the runner-up of each decision), `diff` (two plans side by side), one-line errors for bad arguments,
and `--help` that answers in under a second without importing torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _clusters import SHAPES  # a cost model on which the tiny model's sharding pays

from autopar.cli import main
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parents[1]

FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.down(self.up(x).relu()), y)


def build():
    return Net(), (torch.randn(512, 256), torch.randn(512, 256))


def build_kwargs():
    return Net(), (torch.randn(512, 256),), {"y": torch.randn(512, 256)}


def not_a_pair():
    return Net()
"""


def _run(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors and --help
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of the factory's model on a 2x2 mesh: autopar's own and one with `up` pinned replicated."""
    d = tmp_path_factory.mktemp("cli")
    (d / "tiny_factory.py").write_text(FACTORY)
    SHAPES.save(str(d / "cluster.json"))
    common = ["--mesh", "2x2", "--cluster", str(d / "cluster.json")]
    base = ["plan", "--model", f"{d / 'tiny_factory.py'}:build", *common]
    outputs = {}
    for name, extra in (("auto", []), ("hand", ["--force", "up.*=R,R"])):
        rc = main([*base, *extra, "--dump", str(d / f"{name}.dump.txt"), "-o", str(d / f"{name}.json")])
        assert rc == 0
        outputs[name] = d / f"{name}.json"
    return d, outputs


def test_plan_own_factory_saves_a_plan(plans, capsys, monkeypatch):
    d, files = plans
    auto, hand = Plan.load(files["auto"]), Plan.load(files["hand"])
    assert (d / "auto.dump.txt").read_text().startswith("autopar plan  mesh [dp=2 x tp=2]")
    assert hand.params["up.weight"] == ["R", "R"] and hand.params["up.bias"] == ["R", "R"]
    assert auto.params["up.weight"] != ["R", "R"], "on this cost model autopar shards `up`: the diff is not empty"
    # the factory may return (model, args, kwargs), and a module:factory is imported from the working directory
    monkeypatch.chdir(d)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the working directory on it
    rc, out, err = _run(capsys, "plan", "--model", "tiny_factory:build_kwargs", "--mesh", "2", "--dump", "k.txt")
    assert rc == 0, err
    assert "planned tiny_factory:build_kwargs" in out and (d / "k.txt").exists()


def test_plan_zoo_model(tmp_path, capsys):
    rc, out, err = _run(
        capsys, "plan", "--model", "mlp-tiny", "--mesh", "2", "--cluster", "cpu-gloo",
        "--dump", str(tmp_path / "m.txt"), "-o", str(tmp_path / "m.json"),
    )  # fmt: skip
    assert rc == 0, err
    assert out.startswith("autopar plan  mesh [dp=2]  cluster cpu-gloo") and "planned mlp-tiny" in out
    assert Plan.load(tmp_path / "m.json").hash() in out


def test_list_models(capsys):
    from autopar import models

    rc, out, _ = _run(capsys, "plan", "--list-models")
    lines = out.strip().splitlines()
    assert rc == 0 and [ln.split()[0] for ln in lines] == list(models.CONFIGS)
    assert any("torchtitan llama3 debugmodel" in ln for ln in lines)


def test_explain_gives_each_decision_its_runner_up(plans, capsys):
    _, files = plans
    plan = Plan.load(files["auto"])
    groups = plan.meta["alternatives"]["groups"]
    # the chosen candidates' compute adds up to the plan's predicted compute (each group counts its repeats)
    assert sum(g["chosen"]["compute_s"] for g in groups) == pytest.approx(plan.predicted["compute_s"], rel=1e-9)
    up = next(g for g in groups if plan.nodes[g["node"]]["name"] == "param:up.weight")
    assert up["chosen"]["placement"] == "out [" + ",".join(plan.params["up.weight"]) + "]"
    assert up["runner_up"]["placement"] != up["chosen"]["placement"]
    rc, out, err = _run(capsys, "explain", str(files["auto"]))
    assert rc == 0, err
    assert f"plan {plan.hash()}" in out and out.count("\n    runner-up  ") == sum(
        g["runner_up"] is not None for g in groups
    )
    block = out[out.index("param:up.weight") :].split("\n")[:4]
    assert "chosen" in block[1] and up["chosen"]["placement"] in block[1]
    assert "runner-up" in block[2] and block[3].startswith("    why: ")
    rc, out, _ = _run(capsys, "explain", str(files["auto"]), "--module", "down", "--nodes")
    assert rc == 0 and "param:down.weight" in out and "param:up.weight" not in out
    assert "of module down" in out and "addmm" in out  # --nodes: the module's nodes under their decision
    rc, out, _ = _run(capsys, "explain", str(files["auto"]), "--closest", "2")
    margins = sorted(abs(g["runner_up"]["cost_s"] - g["chosen"]["cost_s"]) for g in groups if g["runner_up"])
    shown = [ln for ln in out.splitlines() if ln.startswith("    runner-up  ")]
    assert rc == 0 and len(shown) == 2 and f"the 2 closest of {len(groups)} decisions" in out
    cost = lambda kind: [float(x) for x in re.findall(rf"^    {kind} +out .*? ([\d.]+) us \(compute", out, re.M)]
    printed = [abs(r - c) for c, r in zip(cost("chosen"), cost("runner-up"))]  # in us, to 2 decimals
    assert printed == pytest.approx([m * 1e6 for m in margins[:2]], abs=0.011), out  # nearest first


def test_diff_shows_placements_collectives_time_memory(plans, capsys):
    _, files = plans
    a, b = Plan.load(files["auto"]), Plan.load(files["hand"])
    rc, out, err = _run(capsys, "diff", str(files["auto"]), str(files["hand"]))
    assert rc == 0, err
    for label in ("predicted step", "exposed comm", "peak memory per rank", "model state", "collectives per step"):
        assert label in out, label
    assert a.hash() in out and b.hash() in out
    up = next(ln for ln in out.splitlines() if ln.strip().startswith("up.weight "))
    assert up.split()[1:] == ["[" + ",".join(a.params["up.weight"]) + "]", "->", "[R,R]"]
    section = out.split("parameter placements that differ (A -> B)\n")[1].split("\n\n")[0].splitlines()
    listed = {ln.split()[0] for ln in section if "->" in ln}
    assert listed == {k for k in a.params if a.params[k] != b.params[k]}, out  # and only those
    kinds = {k for k, _, _ in a.collectives()} | {k for k, _, _ in b.collectives()}
    assert all(k in out for k in kinds)
    assert "nodes placed differently:" in out
    other = json.loads(files["hand"].read_text())
    other["nodes"] = other["nodes"][:-1]  # another graph: everything but the nodes is still compared
    (files["hand"].parent / "other.json").write_text(json.dumps(other))
    rc, out, err = _run(capsys, "diff", str(files["auto"]), str(files["hand"].parent / "other.json"))
    n = len(a.nodes)
    assert rc == 0 and f"the graphs differ ({n} vs {n - 1} nodes)" in out and "predicted step" in out, out


def test_explain_without_runner_ups_lists_placements(plans, capsys):
    """Plans that record no runner-ups (pipeline plans) still explain: each node's placement."""
    _, files = plans
    bare = json.loads(files["auto"].read_text())
    del bare["meta"]["alternatives"]
    path = files["auto"].parent / "bare.json"
    path.write_text(json.dumps(bare))
    rc, out, err = _run(capsys, "explain", str(path), "--module", "up")
    assert rc == 0, err
    assert "records no runner-ups" in out and "param:up.weight" in out and "param:down.weight" not in out


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["plan", "--dtype", "fp16"], "--dtype 'fp16' is not one of bf16, fp32"),
        (["plan", "--model", "llama3-8"], "did you mean llama3-8b"),
        (["plan", "--model", "mlp-tiny", "--mesh", "8y8"], "mesh '8y8' must look like"),
        (["plan", "--model", "mlp-tiny", "--cluster", "h300"], "--cluster 'h300' is not one of h100"),
        (["plan", "--model", "mlp-tiny", "--mesh", "2", "--force", "nothing.*=R"], "matches no parameter"),
        (["plan", "--model", "mlp-tiny", "--mesh", "2", "--force", "layers.*=R,R"], "one placement per mesh dim"),
        (["plan", "--model", "no_such_module:build"], "no module named 'no_such_module'"),
        (["plan", "--batch", "many"], "argument --batch: 'many' is not a positive integer"),
        (["plan", "--layers", "0"], "argument --layers: '0' is not a positive integer"),
        (["explain", "missing.json"], "missing.json: no such file"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, expect):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and not out
    assert err.count("\n") == 1 and "Traceback" not in err and expect in err, err


def test_factory_errors_are_one_line(plans, capsys):
    d, files = plans
    rc, _, err = _run(capsys, "plan", "--model", f"{d / 'tiny_factory.py'}:not_a_pair")
    assert rc == 2 and "must return (model, example_inputs)" in err and err.count("\n") == 1
    (d / "broken.json").write_text("{not json")
    rc, _, err = _run(capsys, "explain", str(d / "broken.json"))
    assert rc == 2 and "not a plan saved by autopar" in err and err.count("\n") == 1


def test_failure_in_a_command_is_one_line_unless_debug(capsys):
    """A planner error (here: a memory budget nothing fits) is one line, exit 1; --debug re-raises it."""
    argv = ["plan", "--model", "mlp-tiny", "--mesh", "2", "--memory-gb", "1e-9", "--dump", os.devnull]
    rc, _, err = _run(capsys, *argv)
    assert rc == 1 and err.startswith("autopar plan: error: ") and "Traceback" not in err, err
    import autopar

    with pytest.raises(autopar.InfeasibleMemoryError):
        main(["--debug", *argv])


def test_help_is_fast_and_does_not_import_torch():
    """Each --help in a fresh interpreter: under 1 s (best of 3 on this shared machine) and torch never imported."""
    script = textwrap.dedent(
        """
        import sys, time
        t = time.perf_counter()
        from autopar.cli import main
        try:
            main(sys.argv[1:])
        except SystemExit:
            pass
        print(repr(time.perf_counter() - t), "torch" in sys.modules, file=sys.stderr)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    import importlib.util

    commands = [[], ["plan"], ["explain"], ["diff"]] + [["report"]] * bool(importlib.util.find_spec("autopar.report"))
    for argv in commands:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", script, *argv, "--help"], capture_output=True, text=True, env=env, timeout=60
            )
            best = min(best, time.perf_counter() - t)
            assert proc.returncode == 0 and "usage: autopar" in proc.stdout, proc.stderr
            assert proc.stderr.split()[-1] == "False", f"--help of {argv} imported torch"
        assert best < 1.0, f"autopar {' '.join(argv)} --help took {best:.2f} s"
    proc = subprocess.run(
        [sys.executable, "-m", "autopar", "plan", "--dtype", "fp16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "autopar plan: error: --dtype 'fp16' is not one of bf16, fp32"
    ]


def test_report_is_wired(tmp_path, plans, capsys):
    """`autopar report PLAN.json -o plan.html` runs autopar/report.py's main (a clear error where it is absent)."""
    import importlib.util

    _, files = plans
    rc, out, err = _run(capsys, "report", str(files["auto"]), "-o", str(tmp_path / "plan.html"))
    if importlib.util.find_spec("autopar.report") is None:
        assert rc == 2 and "autopar/report.py" in err and err.count("\n") == 1
    else:
        assert rc == 0, err
        assert "<html" in (tmp_path / "plan.html").read_text().lower()


def test_json_flag_still_saves(tmp_path, capsys):
    rc, _, err = _run(
        capsys, "plan", "--model", "mlp-tiny", "--mesh", "2", "--dump", os.devnull, "--json", str(tmp_path / "p.json")
    )
    assert rc == 0, err
    assert json.loads((tmp_path / "p.json").read_text())["mesh_shape"] == [2]
