"""The ring's scaling model (reference.sequence.scaling): pure arithmetic, checked against the
lecture's formulas; one quick measurement on this machine feeds the fit."""
import pytest

from reference.sequence import scaling as S

FIT = S.BlockFit(0.0, 1e10)                                   # 10 GFLOP/s, no per-call overhead
KW = dict(heads=32, heads_kv=8, head_dim=128, bytes_per_value=2)


def test_overlap_threshold_is_the_lectures_n_star():
    link = S.Link(0.0, 1e10 / 2200)
    n_star = S.overlap_threshold(FIT, link, 32, 8, 128, 2)
    want = (8 / 32) * 2 * 2200 / 2                             # (H_kv/H) · b · (F/β) / 2
    assert abs(n_star - want) <= 1
    assert abs(S.overlap_threshold(FIT, link, 32, 8, 128, 2, causal=True) - 2 * want) <= 1   # causal doubles it


def test_ring_scales_as_one_over_w_above_n_star_and_stops_below():
    link = S.Link(0.0, 1e10 / 19800)                          # n* ≈ 4,950
    L, Ws = 131072, [1, 2, 4, 8, 16, 32, 64, 128]
    ring = S.step_times(L, Ws, FIT, link, **KW)["ring"]
    n_star = S.overlap_threshold(FIT, link, 32, 8, 128, 2)
    for W, t in zip(Ws, ring):
        if L // W >= n_star:
            assert t == pytest.approx(ring[0] / W, rel=1e-12)     # linear: compute-bound
        else:
            assert t == pytest.approx(W * link(2 * (L // W) * 8 * 128 * 2), rel=0.05)   # link-bound
    assert ring[-1] == pytest.approx(ring[-2], rel=0.01)          # flat: ≈ 2·L·H_kv·D·b/β


def test_ulysses_needs_w_to_divide_the_kv_heads_and_all_gather_never_beats_the_ring():
    link = S.Link(1e-5, 1e10 / 2200)
    st = S.step_times(65536, [1, 2, 4, 8, 16], FIT, link, **KW)
    assert st["ulysses"][-1] is None and all(t is not None for t in st["ulysses"][:-1])
    assert all(a >= r for a, r in zip(st["all-gather"], st["ring"]))
    assert st["ring"][0] == st["ulysses"][0] == st["all-gather"][0] == st["compute only"][0]


def test_fit_recovers_the_flop_rate_of_exact_block_times_and_measures_this_machine():
    F = 3e9
    times = {n: 4 * n * n * 2 * 64 / F for n in (256, 512, 1024)}
    assert S.fit_block_times(times, 2, 64).flops == pytest.approx(F, rel=1e-12)
    measured = S.measure_block_times(sizes=(128, 256), heads=1, head_dim=32, repeats=1)
    assert set(measured) == {128, 256} and all(t > 0 for t in measured.values())
