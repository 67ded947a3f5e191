"""Lecture 6's silent bugs and first_divergence: every planted bug is found at its record and on its ranks,
correct runs (float64) report none — on every axis and on composed grids — and the search itself behaves on
runs made by hand (NaN, a missing record, a piece that does not fit, one rank of two, a late first step)."""
from __future__ import annotations

import pytest
import torch

from exercises.grading.checks.debug import divergence_inputs
from reference.debug import Divergence, Record, Run, first_divergence
from reference.debug.oracles import divergence_cases, divergence_table
from reference.debug.records import from_plain
from reference.debug.plants import PLANTS
from reference.debug.recorder import Layout
from reference.debug.runs import record_many, record_single


def _expected(plant: str, where: dict):
    step, phase, module, tensor, ranks = PLANTS[plant].expect
    layer = where.get("layer")
    if module is not None and layer is not None:
        module = module.replace(f"blocks.{PLANTS[plant].where.get('layer', 0)}.", f"blocks.{layer}.")
    return step, phase, module, tensor, ranks


@pytest.mark.slow
def test_every_plant_is_found_at_its_record_and_ranks_and_correct_runs_report_none():
    inputs = divergence_inputs(63)                      # the grader's published cases (one cached run)
    for case, got in zip(inputs, divergence_cases(inputs)):
        answer = got["answer"]
        if case["plant"] is None:
            assert answer is None, (case, answer)
            continue
        step, phase, module, tensor, ranks = _expected(case["plant"], case["where"])
        assert answer is not None, case
        assert (answer["step"], answer["phase"]) == (step, phase), (case, answer)
        if module is not None:
            assert (answer["module"], answer["tensor"]) == (module, tensor), (case, answer)
        assert answer["ranks"] == ranks, (case, answer)
        assert 0 < answer["max_abs"] < float("inf")
        if case["plant"] == "zero_stale":                # the parameters differ only in the stale rank's slice
            assert answer["step"] == 1 and answer["phase"] == "param"


@pytest.mark.slow
def test_the_recorded_table_holds_each_one_process_run_once_and_the_same_answers():
    inputs = divergence_inputs(63)                      # cached by the test above: no run again
    table, cases = divergence_table(inputs), divergence_cases(inputs)
    assert len(table["singles"]) == 5 < len(inputs)     # gpt, gpt 3 steps, MoE, clipping, blocks
    for case, row in zip(cases, table["cases"]):
        assert row["answer"] == case["answer"]
        assert torch.equal(table["singles"][row["single"]]["data"]["float64"], case["single"]["data"]["float64"])


@pytest.mark.slow
def test_composed_grids_of_four_ranks_match_one_process_and_the_balance_loss_bug_shows_at_dp_4_ep_2(world):
    moe = {"num_experts": 4, "top_k": 2, "moe_every": 2}
    cases = [dict(sizes={"dp": 2, "tp": 2}, **moe), dict(sizes={"pp": 2, "cp": 2}, num_microbatches=2),
             dict(sizes={"dp": 4, "ep": 2}, plant="moe_aux_ep", where={"layer": 1}, **moe)]
    cases[2]["batch_size"] = 4                           # a row for each of the 4 dp ranks
    runs = record_many(cases, 4, world(4))
    assert first_divergence(runs[0], record_single("gpt", 2, **moe)) is None
    assert first_divergence(runs[1], record_single("gpt", 2)) is None
    d = first_divergence(runs[2], record_single("gpt", 2, batch_size=4, **moe))
    assert (d.step, d.phase, d.module, d.tensor, d.ranks) == (0, "backward", "blocks.1.mlp.moe.router", "grad_output",
                                                             [0, 1, 2, 3])


def _run(values: dict, world_size: int = 1) -> Run:
    """A run by hand: {(step, phase, module, tensor): [(rank, offsets, block), ...]} for 4-element tensors."""
    return Run([Record(*key, (4,), pieces) for key, pieces in values.items()], world_size)


def _single(steps: int = 3):
    return {(s, "forward", f"m{i}", "output"): [(0, (0,), torch.arange(4.0) + 10 * s + i)]
            for s in range(steps) for i in range(3)}


def _split(single: dict, bug=None):
    """Two ranks, each holding half of every tensor; ``bug(key, rank, block)`` may change a piece."""
    out = {}
    for key, [(_, _, t)] in single.items():
        pieces = [(r, (2 * r,), t[2 * r:2 * r + 2].clone()) for r in range(2)]
        out[key] = [(r, o, bug(key, r, b) if bug else b) for r, o, b in pieces]
    return out


def test_a_correct_split_reports_none_and_rounding_stays_below_the_tolerance():
    single = _single()
    assert first_divergence(_run(_split(single), 2), _run(single)) is None
    noisy = _split(single, lambda k, r, b: b * (1 + 1e-9))
    assert first_divergence(_run(noisy, 2), _run(single)) is None


def test_the_first_record_of_the_first_differing_step_and_only_the_rank_that_differs():
    single = _single(5)

    def bug(key, rank, block):                           # from step 3's m1 on, rank 1's half is off by 0.5
        late = key[0] > 3 or (key[0] == 3 and key[2] >= "m1")
        return block + 0.5 if late and rank == 1 else block
    d = first_divergence(_run(_split(single, bug), 2), _run(single))
    assert isinstance(d, Divergence)
    assert (d.step, d.phase, d.module, d.tensor, d.ranks) == (3, "forward", "m1", "output", [1])
    assert d.max_abs == pytest.approx(0.5) and d.max_rel == pytest.approx(0.5 / 34) and d.index in ((2,), (3,))


def test_nan_against_a_number_is_infinitely_different_nan_against_nan_is_equal_and_a_missing_record_is_skipped():
    single = _single(1)
    single[(0, "forward", "m2", "output")][0][2][1] = float("nan")
    par = _split(single)
    par.pop((0, "forward", "m0", "output"))              # a record the parallel run does not have
    assert first_divergence(_run(par, 2), _run(single)) is None
    par[(0, "forward", "m1", "output")][0] = (0, (0,), torch.tensor([float("nan"), 11.0]))
    d = first_divergence(_run(par, 2), _run(single))
    assert (d.module, d.ranks, d.max_abs, d.index) == ("m1", [0], float("inf"), (0,))


def test_a_piece_that_does_not_fit_is_a_divergence():
    single = _single(1)
    par = _split(single)
    par[(0, "forward", "m1", "output")][1] = (1, (2,), torch.zeros(3))
    d = first_divergence(_run(par, 2), _run(single))
    assert (d.module, d.ranks) == ("m1", [1])


def test_layouts_place_zigzag_chunks_qkv_heads_and_a_padded_vocabulary():
    layout = Layout(batch=4, seq_len=8, rows=2, first_row=2, positions=(2, 3, 4, 5), tp=2, tp_rank=1,
                    seq_first=True, vocab=27)
    layout.positions = (2, 3, 4, 5)
    assert layout.seq_runs() == [(0, 2, 4)]
    zigzag = Layout(batch=4, seq_len=8, rows=4, positions=(2, 3, 4, 5)[:0] + (0, 1, 6, 7))
    assert zigzag.seq_runs() == [(0, 0, 2), (2, 6, 2)]
    assert layout.feature_runs("qkv", 6) == (12, [(0, 2, 2), (2, 6, 2), (4, 10, 2)])
    assert layout.feature_runs("vocab", 14) == (27, [(0, 14, 13)])
    x = torch.randn(4, 2, 6)                              # (S_local, b, f) on rank (dp 1, tp 1)
    shape, pieces = layout.place(x, "column")
    assert shape == (4, 8, 12) and [o for o, _ in pieces] == [(2, 2, 6)]
    assert torch.equal(pieces[0][1], x.transpose(0, 1))
    assert from_plain({"records": [], "world_size": 1}).records == []
