"""zoo_check.run_suite's relaunch after a lost rank, with the launches faked (the real 4-rank launch is
tests/test_third_party_models.py): the models from the one the first launch was on run again, the ones before keep
their records, a second loss marks the rest failed at stage "launch", and no time means no relaunch."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "third_party"))

import zoo_check  # noqa: E402

NAMES = ["a", "b", "c", "d"]


def _ok(n):
    return {"model": n, "stage": "", "ok": True, "error": ""}


def _results(checks, plans=()):
    return [
        {"rank": r, "checks": list(checks) if r == 0 else [], "plans": list(plans) if r == 1 else []} for r in range(4)
    ]


def _fake(monkeypatch, outcomes):
    calls = []

    def launch(names, variant, tmp, timeout, dims=zoo_check.DIMS):
        calls.append((list(names), timeout))
        return outcomes[len(calls) - 1](names)

    monkeypatch.setattr(zoo_check, "_launch", launch)
    return calls


def _crash_at(model):
    def run(names):
        i = names.index(model)
        broken = [{"model": model, "stage": "agree", "ok": False, "error": "closed"}]
        rest = [{"model": n, "stage": "not run", "ok": False, "error": "broken"} for n in names[i + 1 :]]
        return _results([_ok(n) for n in names[:i]] + broken + rest, [{"model": names[0], "ok": True}]), "rank 2 died"

    return run


def test_relaunch_runs_the_rest_once(monkeypatch):
    calls = _fake(monkeypatch, [_crash_at("b"), lambda names: (_results([_ok(n) for n in names]), "")])
    recs, why = zoo_check.run_suite(NAMES, "as-is", "/tmp", 1000)
    assert [c[0] for c in calls] == [NAMES, ["b", "c", "d"]]
    assert [r["model"] for r in recs] == NAMES and all(r["ok"] for r in recs)
    assert "rank 2 died" in why and "relaunched for 3 models from b" in why
    assert recs[0]["plan8"]["ok"] and recs[1]["plan8"]["stage"] == "not run"  # plans of both launches kept


def test_second_loss_fails_the_rest_at_launch(monkeypatch):
    calls = _fake(monkeypatch, [_crash_at("b"), _crash_at("c")])
    recs, why = zoo_check.run_suite(NAMES, "as-is", "/tmp", 1000)
    assert len(calls) == 2
    assert [(r["model"], r["ok"], r["stage"]) for r in recs] == [
        ("a", True, ""),
        ("b", True, ""),
        ("c", False, "launch"),
        ("d", False, "launch"),
    ]


def test_no_relaunch_without_time(monkeypatch):
    calls = _fake(monkeypatch, [_crash_at("c")])
    recs, _ = zoo_check.run_suite(NAMES, "as-is", "/tmp", zoo_check.RELAUNCH_MIN_S - 1)
    assert len(calls) == 1 and [r["stage"] for r in recs] == ["", "", "launch", "launch"]


def test_error_line_keeps_the_op_a_refusal_lists():
    """The models table's reason column: a NoStrategyError's first line ends in ':' and the op is on the next."""
    from autopar.strategies import NoStrategyError

    e = NoStrategyError("no placement rule for these ops:\n  aten.as_strided.default: 24 node(s)\npass replicate_ops")
    assert (
        zoo_check.error_line(e)
        == "NoStrategyError: no placement rule for these ops: aten.as_strided.default: 24 node(s)"
    )
    assert zoo_check.error_line(ValueError("one line\nmore")) == "ValueError: one line"
