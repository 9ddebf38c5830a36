"""Collectives as NCCL runs them: the (algorithm, protocol) NCCL's tuner would pick for a message, and its time.

NCCL prices every (algorithm, protocol) pair of a collective as `latency + nBytes / bandwidth` and runs the
fastest (src/graph/tuning.cc: ncclTopoTuneModel fills the tables, ncclTopoGetAlgoTime prices one pair). This
module reproduces that model for the groups a plan makes, with NCCL's own latency constants and bandwidth
rules; the aggregate bus bandwidth of the group (what NCCL derives from its topology search as
nChannels x per-channel bandwidth) comes from the link instead:

- inside one node (NVSwitch): `link.bw * link.bus_eff`;
- across nodes with one rank per node (`link.local == 1`, the group of a rail-optimized fabric): the rank's own
  NIC, `link.bw * link.bus_eff`;
- across nodes with k > 1 ranks per node (hierarchical): NCCL's rings leave each node through all k NICs, so
  k NICs carry the ring's bytes while NVLink carries the other (k-1)/k of them:
  `min(k * link.bw * link.bus_eff, link.node_bw * k / (k - 1))`.

Algorithms: ring (every kind), tree (all_reduce: a chain inside each node, a double binary tree across nodes;
NCCL picks it for small messages on many nodes), NVLink SHARP ("nvls", all_reduce inside one node where the
link has `nvls_eff` > 0). Protocols: LL, LL128, Simple. M is the full size in bytes as in autopar/cost/comm.py
(NCCL's nBytes: ncclFuncMaxSendRecvCount counts all ranks' data for all_gather / reduce_scatter). all_to_all and
send_recv are NCCL's grouped point-to-point calls, which the tuner does not price: Simple's ring latency and the
group's bus bandwidth (the off-node share of an all_to_all on the NICs).
Left out: NCCL's per-channel bandwidth caps (nChannels depends on the topology search), the tree correction
factors for medium sizes and the ring plateau factor (size-dependent, they would break the plain Min of linear
terms the symbolic batch formula relies on), CollNet / SHARP in the network, PAT.
"""

from __future__ import annotations

import functools
import math

import sympy

PROTOCOLS = ("LL", "LL128", "Simple")
# ncclTunerConstantsDefaults, microseconds, per protocol (LL, LL128, Simple)
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0)}
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
# llMaxBws (GB/s): one node by GPU generation; several nodes by CPU (Intel: 2 nodes, more than 2)
LL_MAX_BW_NODE = {"ampere": 87.7, "hopper": 141.0}
LL_MAX_BW_NET = (39.0, 20.4)
NET_OVERHEAD_US = 1.0  # getNetOverhead on x86 Intel hosts; x3 for Simple


def _is_sym(x) -> bool:
    return isinstance(x, sympy.Basic) and not x.is_number


def group_nodes(n: int, link) -> int:
    """Nodes a group of n ranks spans on `link` (1 on an in-node link)."""
    return max(1, math.ceil(n / max(1, link.local))) if link.net else 1


def bus_bw(link, n: int) -> float:
    """Simple-protocol bus bandwidth (bytes/s) of a group of n ranks on `link` (the module docstring)."""
    k = max(1, link.local)
    if not link.net or k == 1:
        return link.bw * link.bus_eff
    return min(k * link.bw * link.bus_eff, link.node_bw * k / (k - 1))


def _ring_lat(kind: str, p: int, n: int, nodes: int, link) -> float:
    """Ring latency (us) of protocol p: nsteps hops, the ones that cross nodes at the network's latency."""
    nsteps = 2 * (n - 1) if kind == "all_reduce" else n - 1 if kind in ("all_gather", "reduce_scatter") else n
    lat = BASE_LAT["ring"][p]
    if kind == "broadcast":  # a pipelined chain: one hop's latency
        return lat + HW_LAT["net" if nodes > 1 else "nvlink"]["ring"][p]
    intra = HW_LAT["nvlink"]["ring"][p]
    if nodes == 1:
        return lat + nsteps * intra
    intra = max(intra, NET_OVERHEAD_US * (3 if PROTOCOLS[p] == "Simple" else 1))
    ppn = n / nodes
    inter = HW_LAT["net"]["tree" if ppn == 1 else "ring"][p]  # with one rank per node every hop is exposed
    n_inter = 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1
    return lat + (nsteps - n_inter) * intra + n_inter * inter


def _tree_lat(p: int, n: int, nodes: int) -> float:
    ppn = n // nodes
    inter, intra = HW_LAT["net"]["tree"][p], HW_LAT["nvlink"]["tree"][p]
    return BASE_LAT["tree"][p] + 2 * ((ppn - 1) * intra + int(math.log2(nodes)) * inter)


def _ll_max(link, nodes: int) -> float:
    if nodes == 1:
        return LL_MAX_BW_NODE.get(link.nccl, LL_MAX_BW_NODE["hopper"]) * 1e9
    return LL_MAX_BW_NET[0 if nodes <= 2 else 1] * 1e9


@functools.lru_cache(maxsize=4096)  # a plan prices ~10^6 collectives over a handful of (kind, group, link)
def options(kind: str, n: int, link) -> tuple[tuple[str, str, float, float], ...]:
    """(algorithm, protocol, latency s, algorithm bandwidth bytes/s) of every pair NCCL's tuner considers for
    `kind` over n ranks on `link`: time = latency + M / bandwidth."""
    nodes = group_nodes(n, link)
    bus = bus_bw(link, n)
    scale, out = link.lat_scale * 1e-6, []
    if kind in ("all_to_all", "send_recv"):
        lat = (BASE_LAT["ring"][2] + HW_LAT["net" if nodes > 1 else "nvlink"]["ring"][2]) * scale
        if kind == "send_recv":  # one peer: this rank's own NVLink or NIC
            return (("p2p", "Simple", lat, link.bw * link.bus_eff),)
        off = (n - max(1, link.local)) / n if nodes > 1 else (n - 1) / n  # the bytes that leave the node / the rank
        return (("p2p", "Simple", lat, (link.bw * link.bus_eff if nodes > 1 else bus) / off),)
    nsteps = 2 * (n - 1) if kind == "all_reduce" else n - 1 if kind in ("all_gather", "reduce_scatter") else n
    ring_ratio, llmax = n / nsteps, _ll_max(link, nodes)
    for p, proto in enumerate(PROTOCOLS):
        bw = (min(llmax, bus * 0.5), bus * 0.92, bus)[p]
        out.append(("ring", proto, _ring_lat(kind, p, n, nodes, link) * scale, bw * ring_ratio))
    if kind == "all_reduce":
        tree_bus = bus * 0.92
        for p, proto in enumerate(PROTOCOLS):
            bw = (min(tree_bus / 3.8, llmax), tree_bus * (7 / 9 if nodes == 1 else 120 / 128), tree_bus)[p]
            out.append(("tree", proto, _tree_lat(p, n, nodes) * scale, bw * 0.5))
        if nodes == 1 and link.nvls_eff > 0:
            out.append(("nvls", "Simple", HW_LAT["nvlink"]["nvls"][2] * scale, link.bw * link.nvls_eff * ring_ratio))
    return tuple(out)


def collective_time(kind: str, M, n: int, link, latency_share=1):
    """Seconds for one collective of M bytes over n ranks: the fastest of `options` (NCCL's choice), plus the
    link's per-call `launch`; `latency_share` of each option's latency (a gradient's share of its bucket's: the
    choice then falls on the option the bucket's size would take, since the share scales with the bytes)."""
    if n <= 1:
        return 0.0
    launch = link.launch * latency_share
    times = [latency_share * lat + M / bw for _, _, lat, bw in options(kind, n, link)]
    if _is_sym(M):
        return launch + sympy.Min(*times)
    return float(launch + min(times))


def choice(kind: str, M: float, n: int, link) -> tuple[str, str, float]:
    """(algorithm, protocol, seconds) NCCL's tuner picks for one collective of M bytes over n ranks."""
    a, p, lat, bw = min(options(kind, n, link), key=lambda o: o[2] + M / o[3])
    return a, p, link.launch + lat + M / bw
