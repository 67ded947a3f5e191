"""This machine measured in the α–β model (reference.planner.measure): the fit recovers α and β from times that
follow the model, shrugs off one size a descheduled rank made several times too slow, and refuses data it cannot
fit; on two live ranks the ping-pong sends exactly the sizes it claims to time, and the link it builds holds
positive figures.  No test asserts on the measured times themselves."""
from __future__ import annotations

import pytest

from reference.planner import measure
from reference.planner.thresholds import Link

SIZES = (8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20)


def model(alpha, beta, sizes=SIZES):
    return [alpha + n / beta for n in sizes]


@pytest.mark.parametrize("alpha,beta", [(50e-6, 3e9), (2.9e-6, 367.6e9), (0.0, 1e9)])
def test_fit_recovers_alpha_and_beta_from_times_that_follow_the_model(alpha, beta):
    a, b = measure.fit_alpha_beta(SIZES, model(alpha, beta))
    assert a == pytest.approx(alpha, rel=1e-9, abs=1e-15) and b == pytest.approx(beta, rel=1e-9)


def test_fit_leaves_out_a_size_measured_several_times_too_slow():
    times = model(80e-6, 4e9)
    times[2] *= 40                                   # 512 B: 3.2 ms instead of 80 µs, in every repeat
    a, b = measure.fit_alpha_beta(SIZES, times)
    assert a == pytest.approx(80e-6, rel=1e-6) and b == pytest.approx(4e9, rel=1e-6)


def test_fit_weighs_relative_error_so_latency_is_not_drowned_by_large_messages():
    """Noise of ±10 % on every point: α still comes out within 20 % (an absolute least squares would fit the
    milliseconds of the 4 MiB point and leave α to chance)."""
    times = [t * f for t, f in zip(model(100e-6, 3e9), (1.1, 0.9, 1.1, 0.9, 1.1, 0.9, 1.1, 0.9))]
    a, b = measure.fit_alpha_beta(SIZES, times)
    assert a == pytest.approx(100e-6, rel=0.2) and b == pytest.approx(3e9, rel=0.2)


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two"):
        measure.fit_alpha_beta([8], [1e-4])
    with pytest.raises(ValueError, match="positive"):
        measure.fit_alpha_beta([8, 64], [1e-4, 0.0])
    with pytest.raises(ValueError, match="bandwidth"):
        measure.fit_alpha_beta([8, 1 << 20], [2e-4, 1e-4])        # larger messages faster: no β


def test_pingpong_sends_the_sizes_it_times_between_ranks_0_and_1(world):
    sizes = (8, 4096, 65536)
    res = world(2).run(measure.pingpong_worker, sizes, 2)
    assert set(res.values[0]) == set(sizes) and res.values[1] == {}
    assert all(t > 0 for t in res.values[0].values())
    for rank, peer in ((0, 1), (1, 0)):
        sent = [e.nbytes for e in res.trace.filter(op="send", rank=rank) if e.meta.get("what") in ("ping", "pong")]
        assert sent == [n for n in sizes for _ in range(3)] and \
            {e.peer for e in res.trace.filter(op="send", rank=rank)} == {peer}   # a warm-up + 2 repeats each


def test_measure_link_builds_a_link_from_a_live_world(world):
    m = measure.measure_link(world(2), sizes=(8, 4096, 1 << 20, 4 << 20), repeats=2)
    link = m["link"]
    assert isinstance(link, Link) and link.alpha >= 0 and link.beta > 0 and link.flops > 0 and link.hbm_bw > 0
    assert len(m["pingpong"]) == len(m["all_reduce"]) == 4 and m["p"] == 2
    assert link.flops == min(m["flops_per_rank"]) and "2 ranks" in link.name
    with pytest.raises(ValueError, match="at least 2"):
        measure.measure_link(type("W", (), {"world_size": 1})())
