"""benchmarks/results/training.md: the training-in-practice figures (issue 24) in one file.

    python benchmarks/training.py            # joins the three section files as they are
    python benchmarks/training.py --run      # runs the three section scripts first (~5-10 min on 2 cores)

Each section is written by its own script, which states the command that made it:
  training_compile.py -> training_compile.md (eager vs compiled graph backend)
  training_shapes.py  -> training_shapes.md  (first step of a new shape, accumulation's collectives per micro-step)
  training_ckpt.py    -> training_ckpt.md    (checkpoint, kill and resume under torchrun)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SECTIONS = ("training_compile", "training_shapes", "training_ckpt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run each section's script before joining")
    args = ap.parse_args()
    parts = [
        "# Training in practice: compile, changing shapes, accumulation, checkpoint and resume\n",
        "Joined by `python benchmarks/training.py` from the section files below; each section names the command"
        " that made it.\n",
    ]
    for name in SECTIONS:
        if args.run:
            subprocess.run([sys.executable, os.path.join(HERE, name + ".py")], check=True)
        path = os.path.join(RESULTS, name + ".md")
        if not os.path.exists(path):
            parts.append(f"## {name}\n\nnot made yet: run `python benchmarks/{name}.py`\n")
            continue
        with open(path) as f:
            text = f.read().strip()
        if text.startswith("# "):  # a section file's own title becomes a section title here
            text = "#" + text
        parts.append(f"<!-- from benchmarks/results/{name}.md -->\n{text}\n")
    with open(os.path.join(RESULTS, "training.md"), "w") as f:
        f.write("\n".join(parts))
    print(os.path.join(RESULTS, "training.md"))


if __name__ == "__main__":
    main()
