"""One code style: ruff's formatter and its lint rules (pyproject.toml [tool.ruff]) hold on every file."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff(*args):
    exe = shutil.which("ruff") or pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return subprocess.run([exe, *args, ROOT], capture_output=True, text=True, timeout=120)


def test_ruff_format_is_clean():
    r = _ruff("format", "--check")
    assert r.returncode == 0, f"run `ruff format .`:\n{r.stdout}{r.stderr}"


def test_ruff_check_is_clean():
    r = _ruff("check")
    assert r.returncode == 0, f"run `ruff check .`:\n{r.stdout}{r.stderr}"
