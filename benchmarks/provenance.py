"""Which code made a result file: the commit, and whether the code it measures differed from it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what a result depends on, from the repository root; the results themselves change with every run
CODE = ("autopar", "passes", "backends", "benchmarks", "tests/third_party", ":(exclude)benchmarks/results")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def commit() -> str:
    """The short HEAD commit, with " + uncommitted changes" where the measured code differs from it; "unknown"
    without git (the lent GPU machine's copy of the tree)."""
    try:
        sha = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", *CODE) if sha else ""
    except OSError:
        return "unknown"
    return (sha or "unknown") + (" + uncommitted changes" if dirty else "")
