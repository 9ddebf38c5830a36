"""Collectives as NCCL runs them (autopar/cost/nccl.py) on the GPU presets, against published nccl-tests figures and
hand-computed points of NCCL's tuning model (src/graph/tuning.cc); the cpu-gloo fit and the seed's ring untouched."""

import dataclasses

import pytest
import sympy

from autopar.cost import CLUSTERS, RING_CLUSTERS, bus_bandwidth, bytes_sent, collective_time, collective_time_expr
from autopar.cost import get_cluster, nccl, ring_steps

GiB = 2**30
H100, A100 = CLUSTERS["h100"], CLUSTERS["a100"]


def test_busbw_1gib_all_reduce_8_gpus_in_published_range():
    """nccl-tests all_reduce_perf busbw at large sizes on one 8-GPU NVSwitch node: 460-480 GB/s on H100 SXM
    (NVLink SHARP, NCCL's default there), 230-250 GB/s on A100 SXM (docs/cost_model.md cites the source)."""
    h = bus_bandwidth("all_reduce", GiB, 8, H100.link_for((8,), 0))
    a = bus_bandwidth("all_reduce", GiB, 8, A100.link_for((8,), 0))
    assert 460e9 <= h <= 480e9 and 230e9 <= a <= 250e9
    assert (
        nccl.choice("all_reduce", GiB, 8, H100.intra)[0] == "nvls"
        and nccl.choice("all_reduce", GiB, 8, A100.intra)[0] == "ring"
    )
    # all_gather has no NVLS in one node here: the ring at 0.8 of NVLink 4's 450 GB/s, less 32 us of latency
    assert bus_bandwidth("all_gather", GiB, 8, H100.intra) == pytest.approx(360e9 * 2.61 / 2.64, rel=0.002)


def test_small_messages_are_latency_bound():
    """8 bytes on 8 H100: ring LL, NCCL's base latency 6.6 us + 14 NVLink hops of 0.6 us = 15.0 us; bus bandwidth
    rises with the size and saturates (nccl-tests' curve)."""
    a, p, t = nccl.choice("all_reduce", 8, 8, H100.intra)
    assert (a, p) == ("ring", "LL") and t == pytest.approx(15.0e-6, rel=1e-3)
    assert collective_time("all_reduce", 8, 8, H100.intra) == pytest.approx(t, rel=1e-9)
    sizes = [2**k for k in range(10, 31, 2)]
    bus = [bus_bandwidth("all_reduce", m, 8, H100.intra) for m in sizes]
    assert all(x < y for x, y in zip(bus, bus[1:]))
    assert bus[0] < 0.01 * bus[-1] and bus[-2] > 0.98 * bus[-1]


def test_ring_vs_tree_crossover():
    """Tree latency grows with log2(nodes), the ring's with the ranks: NCCL picks tree for small all_reduces on many
    nodes and the ring for large ones on few. Hand figures from tuning.cc's constants (us):
    64 nodes x 8, 8 B: tree LL 6.8 + 2 (7 x 0.6 + 6 x 5.0) = 75.2; ring LL 6.6 + 896 x 1.0 + 126 x 2.7 = 1242.8."""
    big = H100.group_link((64, 8), (0, 1))
    assert (big.local, nccl.group_nodes(512, big)) == (8, 64)
    opts = {(a, p): lat for a, p, lat, _ in nccl.options("all_reduce", 512, big)}
    assert opts["tree", "LL"] == pytest.approx(75.2e-6, rel=1e-6) and opts["ring", "LL"] == pytest.approx(
        1242.8e-6, rel=1e-6
    )
    assert nccl.choice("all_reduce", 8, 512, big)[:2] == ("tree", "LL")
    two = H100.group_link((2, 8), (0, 1))
    assert nccl.choice("all_reduce", GiB, 16, two)[:2] == ("ring", "Simple")
    # the crossover on 2 nodes x 8 between tree and ring, both Simple: ring 8.4 + 28 x 3.4 + 2 x 14 = 131.6 us at
    # 380 GB/s bus (8 NICs x 50 GB/s x 0.95) x 16/30; tree 8.4 + 2 (7 x 4.0 + 14) = 92.4 us at 380 x 0.92 / 2
    bus = 8 * 50e9 * 0.95
    ring_bw, tree_bw = bus * 16 / 30, bus * 0.92 * 0.5
    m_star = (131.6e-6 - 92.4e-6) / (1 / tree_bw - 1 / ring_bw)
    simple = {a: (lat, bw) for a, p, lat, bw in nccl.options("all_reduce", 16, two) if p == "Simple"}
    t = lambda a, m: simple[a][0] + m / simple[a][1]
    assert t("tree", 0.9 * m_star) < t("ring", 0.9 * m_star) and t("ring", 1.1 * m_star) < t("tree", 1.1 * m_star)


def test_rail_and_hierarchical_inter_node_groups():
    """One rank per node (dp over an 8x8 mesh of 8-GPU nodes): one rail, one 400 Gb/s NDR NIC per GPU (50 GB/s);
    eight ranks per node (the flattened 64 ranks): NCCL's rings leave each node through all 8 NICs."""
    rail = H100.link_for((8, 8), 0)
    assert rail.net and rail.local == 1 and H100.link_for((8, 8), 1) is H100.intra
    r = bus_bandwidth("all_reduce", GiB, 8, rail)
    assert 40e9 <= r <= 50e9
    hier = H100.group_link((8, 8), (0, 1))
    assert hier.local == 8 and bus_bandwidth("all_reduce", GiB, 64, hier) > 6 * r
    assert H100.link_for((64,), 0).local == 8 and H100.link_for((4, 2, 8), 1).local == 1
    assert H100.group_link((2, 4), (0, 1)) is H100.intra and H100.link_for((16, 4), 0).local == 2
    # Selene's A100: one 200 Gb/s HDR NIC per GPU
    assert bus_bandwidth("all_reduce", GiB, 8, A100.link_for((8, 8), 0)) <= 25e9
    # send/recv between pipeline stages on two nodes: one NIC
    p2p = collective_time("send_recv", 64 * 2**20, 2, H100.inter)
    assert 64 * 2**20 / 50e9 < p2p < 64 * 2**20 / 40e9


def test_free_figures_move_the_prediction():
    """bus_eff and lat_scale are the LinkSpec fields a fit may change; JSON keeps them."""
    slow = dataclasses.replace(H100.intra, bus_eff=0.4, nvls_eff=0.0)
    assert collective_time("all_gather", GiB, 8, slow) == pytest.approx(
        2 * collective_time("all_gather", GiB, 8, H100.intra), rel=0.01
    )
    lazy = dataclasses.replace(H100.intra, lat_scale=2.0)
    assert collective_time("all_reduce", 8, 8, lazy) == pytest.approx(2 * 15.0e-6, rel=1e-3)
    from autopar.cost import ClusterSpec

    assert ClusterSpec.from_json(H100.to_json()) == H100 and hash(ClusterSpec.from_json(H100.to_json())) == hash(H100)


def test_cpu_gloo_and_seed_ring_keep_the_ring_formula():
    gloo = get_cluster("cpu-gloo").intra
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        alpha, bw = gloo.of(kind)
        want = gloo.launch_of(kind) + ring_steps(kind, 4) * alpha + bytes_sent(kind, 2**20, 4) / bw
        assert collective_time(kind, 2**20, 4, gloo) == want
    ring = RING_CLUSTERS["h100-ring"].intra
    assert collective_time("all_reduce", GiB, 8, ring) == 14 * 3e-6 + 2 * GiB * 7 / 8 / 450e9


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all", "send_recv"])
def test_symbolic_size_matches_float(kind):
    """The batch formula (autopar/symbolic.py) passes symbolic sizes: NCCL's choice is a Min of linear terms."""
    b = sympy.Symbol("b", positive=True)
    link = H100.group_link((8, 8), (0, 1))
    e = collective_time_expr(kind, 2**20 * b, 64, link)
    for v in (1, 64, 4096):
        assert float(e.subs(b, v)) == pytest.approx(collective_time(kind, 2**20 * v, 64, link), rel=1e-9)
