"""The planning passes, in the order the pass manager (autopar/passmanager.py) runs them. Each reads and annotates
the PlanState (its module docstring says what it writes); `autopar.plan` runs them all, the stage search
(passes/stages.py) runs them in parts."""

from . import buckets, candidates, checkpointing, costs, precision, redistribute, regions, solve

PASSES = (precision, regions, candidates, costs, checkpointing, solve, redistribute, buckets)
