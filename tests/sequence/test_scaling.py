"""The ring's scaling model (reference.sequence.scaling): pure arithmetic, checked against the
lecture's formulas and against the one threshold formula (planner.thresholds.cp_tokens); one quick
measurement on this machine feeds the fit."""
import math

import pytest

from reference.planner import thresholds as th
from reference.sequence import scaling as S

KW = dict(heads=32, heads_kv=8, head_dim=128, bytes_per_value=2)


def _hop_and_block(link, n, causal=False):
    block = 4 * n * n * 32 * 128 / link.flops / (2 if causal else 1)
    return link.alpha + 2 * n * 8 * 128 * 2 / link.beta, block


@pytest.mark.parametrize("alpha", [0.0, 3e-6, 1e-4])
def test_cp_tokens_is_where_the_models_block_time_meets_its_hop(alpha):
    link = th.Link(alpha=alpha, beta=1e10 / 19800, flops=1e10)
    for causal in (False, True):
        n_star = th.cp_tokens(link, 32, 8, 128, 2, causal=causal)
        hop, block = _hop_and_block(link, n_star, causal)
        assert block == pytest.approx(hop, rel=1e-9)
        hop, block = _hop_and_block(link, 0.9 * n_star, causal)
        assert block < hop                                     # below n* the hop does not hide
    if alpha == 0.0:                                           # the lecture's closed form, ×2 when causal
        assert th.cp_tokens(link, 32, 8, 128, 2) == pytest.approx((8 / 32) * 2 * 19800 / 2)
        assert th.cp_tokens(link, 32, 8, 128, 2, causal=True) == pytest.approx(2 * (8 / 32) * 2 * 19800 / 2)


def test_ring_scales_as_one_over_w_above_n_star_and_stops_below():
    link = th.Link(alpha=3e-6, beta=1e10 / 19800, flops=1e10)        # n* ≈ 5k tokens
    L, Ws = 131072, [1, 2, 4, 8, 16, 32, 64, 128]
    ring = S.step_times(L, Ws, link, **KW)["ring"]
    n_star = th.cp_tokens(link, 32, 8, 128, 2)
    for W, t in zip(Ws, ring):
        n = L // W
        if n >= n_star:
            assert t == pytest.approx(ring[0] / W, rel=1e-12)         # linear: compute-bound
        else:
            hop, _ = _hop_and_block(link, n)
            assert t == pytest.approx(W * hop, rel=0.05)               # link-bound
    assert ring[-1] == pytest.approx(ring[-2], rel=0.02)               # flat: ≈ 2·L·H_kv·D·b/β + W·α


def test_ulysses_needs_w_to_divide_the_kv_heads_and_all_gather_never_beats_the_ring():
    link = th.Link(alpha=1e-5, beta=1e10 / 2200, flops=1e10)
    st = S.step_times(65536, [1, 2, 4, 8, 16], link, **KW)
    assert st["ulysses"][-1] is None and all(t is not None for t in st["ulysses"][:-1])
    assert all(a >= r for a, r in zip(st["all-gather"], st["ring"]))
    assert st["ring"][0] == st["ulysses"][0] == st["all-gather"][0] == st["compute only"][0]
    W, n = 4, 65536 // 4                                           # Ulysses: four all-to-alls + W blocks
    a2a = lambda rows: (W - 1) * link.alpha + (W - 1) / W * rows * 128 * 2 / link.beta   # noqa: E731
    want = 2 * a2a(n * 32) + 2 * a2a(n * 8) + W * 4 * n * n * 32 * 128 / link.flops
    assert st["ulysses"][2] == pytest.approx(want, rel=1e-12)
    assert not any(math.isnan(t) for t in st["all-gather"])


def test_fit_recovers_the_flop_rate_of_exact_block_times_and_measures_this_machine():
    F = 3e9
    times = {n: 4 * n * n * 2 * 64 / F for n in (256, 512, 1024)}
    assert S.fit_block_times(times, 2, 64).flops == pytest.approx(F, rel=1e-12)
    measured = S.measure_block_times(sizes=(128, 256), heads=1, head_dim=32, repeats=1)
    assert set(measured) == {128, 256} and all(t > 0 for t in measured.values())
