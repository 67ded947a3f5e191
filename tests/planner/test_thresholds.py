"""Each axis's compute-bound threshold (reference.planner.thresholds) is the point where the compute and the
communication it must hide take the same time — checked against the time of each side written out on its own,
the collectives timed by the planner's own α–β model (reference.planner.collectives)."""
from __future__ import annotations

import math

import pytest

from reference.planner import Cluster
from reference.planner import thresholds as th
from reference.planner.collectives import collective_time


@pytest.fixture(scope="module")
def h100():
    c = Cluster.preset("h100-80gb-sxm", 64)
    return c, th.link_of(c, "intra"), th.link_of(c, "inter")


def test_links_take_the_presets_achievable_figures(h100):
    c, intra, inter = h100
    assert intra.flops == pytest.approx(c.flops * c.gemm_ceiling) and intra.flops < c.flops   # the best GEMM
    assert inter.beta == pytest.approx(c.inter_bw * c.inter_efficiency) and inter.alpha == c.alpha_inter
    assert intra.beta == pytest.approx(c.intra_bw * c.intra_efficiency) and intra.alpha == c.alpha_intra
    assert intra.hbm_bw == pytest.approx(c.hbm_bw * c.memory_efficiency) and intra.hbm_bw < c.hbm_bw
    with pytest.raises(ValueError, match="link"):
        th.link_of(c, "nvlink")


def test_dp_and_fsdp_thresholds_balance_backward_against_their_collectives(h100):
    c, _, inter = h100
    N = 7e9                                                       # any model size: N cancels
    for p in (2, 8, 64):
        T = th.dp_tokens(inter, p)
        backward = 4 * N * T / inter.flops
        sync = collective_time("all_reduce", 2 * N, p, c, "inter") - 2 * (p - 1) * c.alpha_inter   # β part only
        assert backward == pytest.approx(sync, rel=1e-9)
        T = th.fsdp_tokens(inter, p)
        forward = 2 * N * T / inter.flops
        gather = collective_time("all_gather", 2 * N, p, c, "inter") - (p - 1) * c.alpha_inter
        assert forward == pytest.approx(gather, rel=1e-9)
    assert th.dp_tokens(inter, 1) == 0


def test_tp_threshold_is_where_the_layers_matmuls_take_as_long_as_its_all_reduces(h100):
    _, intra, _ = h100
    for t in (2, 4, 8):
        h = th.tp_hidden(intra, t)
        S = 4096                                                   # tokens: cancel
        matmuls = 24 * h * h * S / t / intra.flops
        all_reduces = 2 * th.ring_all_reduce(S * h * 2, t, 0.0, intra.beta)
        assert matmuls == pytest.approx(all_reduces, rel=1e-9)
    assert 4e3 < th.tp_hidden(intra, 8) < 6e3                        # an H100 node: h ≈ 5k at t = 8


def test_ep_thresholds_roofline_and_all_to_all(h100):
    _, intra, inter = h100
    m = th.ep_tokens_per_expert(intra)
    h = f = 1 << 20                                                # m ≪ h, f: intensity → 2m/b
    intensity = 2 * m * h * f / (2 * (m * h + h * f + m * f))
    assert intensity == pytest.approx(intra.flops / intra.hbm_bw, rel=1e-3)
    for ep, gated in ((8, True), (64, False)):
        f = th.ep_expert_ffn(inter, ep, gated=gated)
        compute = 2 * (3 if gated else 2) * 7168 * f / inter.flops
        a2a = 2 * (ep - 1) / ep * 7168 * 2 / inter.beta
        assert compute == pytest.approx(a2a, rel=1e-9)
    assert th.ep_expert_ffn(intra, 8) < 2048 < th.ep_expert_ffn(inter, 8)   # DeepSeek-V3's experts: in node only
    with pytest.raises(ValueError, match="memory bandwidth"):
        th.ep_tokens_per_expert(th.Link(alpha=0, beta=1e9, flops=1e12))


def test_cp_threshold_solves_block_time_against_the_hop_with_and_without_latency(h100):
    _, intra, _ = h100
    H, Hkv, D = 64, 8, 128
    no_latency = th.Link(alpha=0.0, beta=intra.beta, flops=intra.flops)
    n0 = th.cp_tokens(no_latency, H, Hkv, D)
    assert n0 == pytest.approx(Hkv / H * 2 * intra.flops / (2 * intra.beta))
    assert th.cp_tokens(no_latency, H, Hkv, D, causal=True) == pytest.approx(2 * n0)
    for causal in (False, True):
        n = th.cp_tokens(intra, H, Hkv, D, causal=causal)
        block = 4 * n * n * H * D / intra.flops / (2 if causal else 1)
        hop = intra.alpha + 2 * n * Hkv * D * 2 / intra.beta
        assert block == pytest.approx(hop, rel=1e-9) and n > th.cp_tokens(no_latency, H, Hkv, D, causal=causal)


def test_collective_formulas_bus_bandwidth_and_the_latency_floor():
    a, b = 5e-6, 50e9
    assert th.ring_all_reduce(1e6, 1024, a, b) > 10 * th.tree_all_reduce(1e6, 1024, a, b)   # small: latency wins
    assert th.ring_all_reduce(1e10, 8, a, b) < th.tree_all_reduce(1e10, 8, a, b)             # large: the ring
    alg, bus = th.bus_bandwidth("all_reduce", 1e9, 0.01, 8)
    assert alg == pytest.approx(1e11) and bus == pytest.approx(1e11 * 14 / 8)
    with pytest.raises(ValueError):
        th.bus_bandwidth("broadcast", 1, 1, 2)
    link = th.Link(alpha=a, beta=b, flops=1e15)
    B = th.bucket_bytes(link, 64, 0.1)
    assert 2 * 63 * a == pytest.approx(0.1 * 2 * 63 / 64 * B / b)
    assert math.isclose(th.all_gather(64e6, 4, 0, b), 0.75 * 64e6 / b)


def test_threshold_table_has_every_axis_on_its_usual_link(h100):
    _, intra, inter = h100
    rows = th.threshold_table(intra, inter)
    assert [r["axis"] for r in rows] == ["DP", "FSDP", "TP", "EP", "EP", "EP", "CP"]
    assert all(r["threshold"] > 0 for r in rows)
