"""Lecture 4b's bytes, measured on 4 real ranks against the formulas (reference.pipeline.lecture.stage_bytes).

Activation memory: the peak of what autograd keeps saved on each rank over one step (SavedTensorMeter,
parameters left out) equals the micro-batches in flight × the stage's layers' activations — GPipe m,
1F1B min(m, p − s), interleaved 1F1B Megatron-LM's warm-up plus one, on stage 0 (1 + (p − 1)/(p·v)) times
1F1B's (Korthikanti et al. 2022, §4.2.3).  Every saved tensor is counted, so the tolerance is 0 bytes.
Messages: every stage boundary carries m micro-batch activations forward and m gradients back, exactly.
"""
from __future__ import annotations

import pytest

from reference.pipeline import lecture, schedule
from reference.pipeline.schedules import peak_stash

P, M, LAYERS, WIDTH, ROWS = 4, 8, 8, 16, 2
MICROBATCH = ROWS * WIDTH * 8                 # one micro-batch's (rows, width) float64 activation, bytes
NAMES = ("gpipe", "1f1b", "interleaved_1f1b")


@pytest.fixture(scope="module")
def measured(world):
    return lecture.stage_bytes(P, M, LAYERS, WIDTH, ROWS, worlds={P: world(P)})


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_in_flight_formula_is_each_orders_peak_stash(p):
    for m in range(1, 4 * p + 1):
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)):
            if (name == "1f1b" and m < p) or (name == "interleaved_1f1b" and m % p):
                continue
            want = peak_stash(schedule(name, p, m, virtual_stages=v))
            assert [lecture.in_flight(name, p, m, s, v) for s in range(p)] == want, (name, p, m, v)


@pytest.mark.parametrize("name", NAMES)
def test_peak_saved_activation_bytes_per_stage_equal_the_formula(measured, name):
    run = measured["runs"][name]
    assert run["peak"] == run["formula"], (name, run["peak"], run["formula"])      # tolerance: 0 bytes


def test_1f1b_holds_min_m_p_minus_s_microbatches_where_gpipe_holds_m(measured):
    per_stage = 2 * (LAYERS // P) * MICROBATCH            # one micro-batch through the stage's L/p blocks
    one_f_one_b, gpipe = measured["runs"]["1f1b"]["peak"], measured["runs"]["gpipe"]["peak"]
    assert one_f_one_b == [min(M, P - s) * per_stage for s in range(P)] == [4 * per_stage, 3 * per_stage,
                                                                             2 * per_stage, per_stage]
    assert gpipe == [M * per_stage] * P
    assert all(a < b for a, b in zip(one_f_one_b, gpipe))


def test_interleaving_multiplies_stage_0_by_one_plus_p_minus_1_over_p_v(measured):
    v = measured["runs"]["interleaved_1f1b"]["virtual_stages"]
    inter, plain = measured["runs"]["interleaved_1f1b"]["peak"][0], measured["runs"]["1f1b"]["peak"][0]
    assert inter * P * v == plain * (P * v + P - 1)       # inter / plain = 1 + (p − 1)/(p·v) = 11/8, exactly


@pytest.mark.parametrize("name", NAMES)
def test_every_boundary_carries_m_activations_forward_and_m_gradients_back(measured, name):
    run = measured["runs"][name]
    K = P * run["virtual_stages"]
    assert list(run["boundaries"]) == [(k, k + 1) for k in range(K - 1)]
    for cell in run["boundaries"].values():
        assert cell["activation"] == cell["gradient"] == M * MICROBATCH
