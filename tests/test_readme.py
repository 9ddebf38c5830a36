"""The README as a user reads it: its quickstart runs as written (torchrun, 2 gloo ranks) and trains one device's
model, the file stays short, its lines stay readable, and every relative link points to a file in the repo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _text() -> str:
    return README.read_text()


def quickstart() -> str:
    """The first ```python block after the '## Quickstart' heading."""
    text = _text()
    at = text.index("\n## Quickstart")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    assert m, "README.md: no ```python block after '## Quickstart'"
    return m.group(1)


def test_readme_is_short_and_readable():
    lines = _text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200: details go to docs/)"
    long = [(i + 1, len(ln)) for i, ln in enumerate(lines) if len(ln) > 200]
    assert not long, f"README.md lines over 200 characters (line, length): {long}"
    # history goes to CHANGELOG.md: no commit hashes (7-12 hex digits with a digit and a letter)
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,12}\b", _text()) if re.search(r"\d", w) and re.search("[a-f]", w)]
    assert not hashes, f"README.md names commits {hashes}: history belongs in CHANGELOG.md"
    code = quickstart().strip().splitlines()
    assert len(code) <= 15, f"the quickstart is {len(code)} lines (at most 15)"


def test_readme_relative_links_exist():
    links = re.findall(r"\]\(([^)\s]+)\)", _text())
    assert links, "README.md has no links"
    missing = []
    for link in links:
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            continue  # web addresses and anchors in the page itself
        if not (README.parent / link.split("#")[0]).exists():
            missing.append(link)
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_commands_match_ci():
    """The test command the README gives is the one .ci/run runs (its four steps, in order: Chromium when missing,
    torch, the package with its test extra, pytest), less the quiet flags."""
    text = _text()
    cmd = (
        "(command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)) && "
        'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]" && python -m pytest -q'
    )
    assert cmd in text
    ci = [
        re.sub(r" -qq\b", "", ln).replace(" -q ", " ").replace("pip install -q", "pip install")
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln.startswith(("python", "(command -v"))
    ]
    assert " && ".join(ci) == cmd, ci


@pytest.mark.timeout(300)
def test_quickstart_runs_as_written(tmp_path):
    """Run the block with the command the README gives; rank 0's last loss equals one device's after the same 3
    AdamW steps, and the plan is the data-parallel one the README describes."""
    code = quickstart()
    assert "torchrun --standalone --nproc-per-node 2 quickstart.py" in _text()
    (tmp_path / "quickstart.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "quickstart.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "mesh [dp=2]" in out and "collectives per step: all_reduce x2" in out, out
    assert re.search(r"up\.weight\s+\[R\] replicate on dp", out), out
    got = float(re.search(r"^loss (\S+)$", out, re.M).group(1))

    # one device: the same seed, the same model and batch, the same 3 steps
    ns: dict = {}
    exec(compile(code.split("dist.init_process_group")[0], "quickstart-head", "exec"), ns)  # imports, Net
    torch.manual_seed(0)
    x, y = torch.randn(2048, 64), torch.randn(2048, 64)
    model = ns["Net"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
    assert abs(got - loss.item()) <= 1e-6 + 1e-4 * abs(loss.item()), (got, loss.item())
