"""Plan published rows with their layout forced at the fitted preset (benchmarks/published_plan.py, as the harness
does) and print each one's predicted memory: the allocated peak, memory_reserved (the allocated peak + the caching
allocator's idle segments), the published figure, and the peak stage's terms. Nothing is cached or written.

    python benchmarks/memory_rows.py B5.11 B3.7 ...        # row names' first word (benchmarks/published_rows.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import published as P  # noqa: E402
import published_plan as PP  # noqa: E402
import published_rows as R  # noqa: E402

FIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "published_fit.json")


def line(row, fit: dict) -> str:
    """One row planned and summarized (or the error that stopped it)."""
    m, x = PP._build(row)
    t = time.perf_counter()
    try:
        plan, _ = PP._plan_forced(row, m, x, P.fit_cluster(row, fit))
    except Exception as e:  # a row that cannot be planned says why; the others go on
        return f"{row.name.split()[0]} error {type(e).__name__}: {str(e)[:200]}"
    wall, pr = time.perf_counter() - t, plan.predicted
    top = max((st["memory"] for st in plan.stages), key=lambda mm: mm["rank_peak_bytes"])
    gib, gb = 2**30, 1e9
    return (
        f"{row.name.split()[0]} allocated {pr['peak_mem_bytes'] / gib:.1f} GiB, reserved "
        f"{pr.get('reserved_mem_bytes', pr['peak_mem_bytes']) / gib:.1f} GiB (published {row.mem_gib}); "
        f"step {pr['step_s']:.3f} s, plan {wall:.1f} s; blocks checkpointed "
        f"{[st['recompute_blocks'] for st in plan.stages]}; peak stage: state {top['state_bytes'] / gb:.2f} GB, "
        f"activations {top['act_bytes_per_microbatch'] / gb:.2f} GB x {top['inflight_microbatches']}, transient "
        f"{top['transient_bytes'] / gb:.2f} GB, allocator idle {top.get('allocator_idle_bytes', 0.0) / gb:.2f} GB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="row names' first word, e.g. B5.11")
    args = ap.parse_args()
    with open(FIT) as f:
        fit = json.load(f)
    by_name = {r.name.split()[0]: r for r in R.ROWS}
    for name in args.rows:
        print(line(by_name[name], fit), flush=True)


if __name__ == "__main__":
    main()
