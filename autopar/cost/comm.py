"""Collective times: the ring alpha-beta model, or NCCL's model (autopar/cost/nccl.py) on links that name one.

M is the FULL tensor size in bytes (unsharded over this group): the gathered output for all_gather, the input
for reduce_scatter / all_reduce / all_to_all. n is the group size. Per rank:
    time = link.launch + ring_steps(kind, n) * link.alpha + bytes_sent(kind, M, n) / link.bw
(launch, alpha and bw per collective kind where the link has its own fit for it: LinkSpec.of / launch_of, a
calibrated link; launch is 0 on the analytic presets).
A link with `nccl` set (the GPU presets) is priced by autopar/cost/nccl.py instead; the analytic ring links
(RING_CLUSTERS, the seed figures) and the calibrated cpu-gloo link keep the formula above.
The arithmetic is plain +-*/ so the same functions accept sympy symbols for M and/or n
(collective_time_expr wraps the result in a sympy expression).
"""

from __future__ import annotations
import sympy
from . import nccl
from .cluster import LinkSpec

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def _is_sym(*xs) -> bool:
    for x in xs:
        if isinstance(x, sympy.Basic) and not x.is_number:
            return True
    return False


def _trivial(n) -> bool:
    return n <= 1 if type(n) is int else (not _is_sym(n) and n <= 1)


def bytes_sent(kind: str, M, n):
    """Per-rank bytes put on the wire by a ring implementation."""
    _check(kind)
    if _trivial(n):
        return 0.0
    if kind == "all_reduce":
        return 2 * M * (n - 1) / n  # reduce-scatter + all-gather
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return M * (n - 1) / n
    return M  # broadcast (pipelined chain), send_recv


def ring_steps(kind: str, n):
    """Number of sequential message steps (latency terms) of the ring algorithm."""
    _check(kind)
    if _trivial(n):
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "send_recv":
        return 1
    return n - 1  # AG, RS, A2A, broadcast


def collective_time(kind: str, M, n, link: LinkSpec, latency_share=1):
    """Seconds for one collective over a group of n ranks on `link`; 0.0 for n == 1. latency_share: the part of its
    latency (launch + ring steps) it pays, e.g. a gradient's share of its bucket's (autopar/collectives.py)."""
    if _trivial(n):
        return 0.0
    if link.nccl:
        return nccl.collective_time(kind, M, n, link, latency_share)
    alpha, bw = link.of(kind)
    latency = link.launch_of(kind) + ring_steps(kind, n) * alpha
    t = (latency if latency_share == 1 else latency_share * latency) + bytes_sent(kind, M, n) / bw
    return float(t) if type(t) is float or not _is_sym(t) else t


def collective_time_expr(kind: str, M, n, link: LinkSpec) -> sympy.Expr:
    """Same formula as collective_time, as a sympy expression (M, n may be symbols, e.g. M = k*batch)."""
    return sympy.sympify(collective_time(kind, M, n, link))


def bus_bandwidth(kind: str, M: float, n: int, link: LinkSpec) -> float:
    """nccl-tests' busbw of one collective (bytes/s): the ring's per-rank bytes over the time, so 1 GiB all_reduces
    of different group sizes compare with the link's bandwidth (nccl-tests doc/PERFORMANCE.md)."""
    return bytes_sent(kind, M, n) / collective_time(kind, M, n, link)
