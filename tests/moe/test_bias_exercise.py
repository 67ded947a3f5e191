"""Exercise 5b.5 (loss_free_bias_update): its inputs can tell the classic mistakes from the truth, every detector
names its mistake and stays quiet on the truth, and the grader end to end names the mistakes of wrong
submissions (own counts only, the world for the group, a tie moved, a copy updated instead of the bias).
The reference's full marks and the stub's zero are tests/moe/test_lecture.py's, with 5b.1–5b.4."""
from __future__ import annotations

import textwrap

import pytest
import torch

from exercises.grading import feedback as fb
from exercises.grading.checks import moe as checks
from reference.moe import loss_free_bias_update
from tests.conftest import grade_mutant


def test_the_drawn_counts_sum_to_loads_with_ties_at_an_exact_mean_and_split_over_the_ranks():
    for W, E, ties in ((1, 8, 2), (3, 6, 2), (4, 8, 2), (2, 6, 0)):
        per_rank, total = checks._bias_loads(W, E, seed=7, ties=ties)
        assert len(per_rank) == W and all((c >= 0).all() and c.shape == (E,) for c in per_rank)
        assert torch.equal(sum(per_rank), total)
        mean = total.double().mean()
        assert int((total.double() == mean).sum()) == ties
        if ties == 0:
            assert mean != mean.round()                                # a mean no count can equal


@pytest.mark.parametrize("groups,W,seed", [([[0, 1], [2, 3]], 4, 56), ([[0, 1, 2]], 3, 55), ([[0, 2], [1]], 3, 583)])
def test_the_drawn_counts_give_another_bias_for_own_counts_the_world_or_averaged_biases_on_every_rank(groups, W,
                                                                                                       seed):
    per_rank = checks._bias_draw(groups, W, 8, seed=seed, ties=2)
    bias, rate = torch.zeros(8), 1e-2
    for g in groups:
        load = sum(per_rank[q] for q in g)
        truth = loss_free_bias_update(bias.clone(), load, rate)
        assert int((load.double() == load.double().mean()).sum()) == 2           # ties in the group's loads
        if len(groups) > 1:                                                       # the world counted instead
            assert not torch.equal(truth, loss_free_bias_update(bias.clone(), sum(per_rank), rate))
        if len(g) > 1:
            for r in g:                                                           # this rank's counts alone
                assert not torch.equal(truth, loss_free_bias_update(bias.clone(), per_rank[r], rate))
            averaged = sum(loss_free_bias_update(bias.clone(), per_rank[q], rate) for q in g) / len(g)
            assert not torch.allclose(truth, averaged)


def _mismatch(got, *, W=2, rank=0):
    per_rank = checks._bias_draw([list(range(W))], W, 8, seed=54, ties=2)
    bias0, rate = torch.linspace(-0.05, 0.05, 8), 1e-2
    load = sum(per_rank).double()
    want = loss_free_bias_update(bias0.clone(), load, rate)
    local = [loss_free_bias_update(bias0.clone(), c, rate) for c in per_rank]
    averaged = [sum(checks.bias._step(bias0, c, rate) for c in per_rank) / W] * W
    extra = {"W": W, "local": local, "world": None, "averaged": averaged, "groups": [list(range(W))],
             "bias": bias0, "load": load, "rate": rate, "dtype": torch.float32, "ties": load == load.mean()}
    value = got(bias0, load, rate, want, local) if callable(got) else got
    return fb.Mismatch("bias after the update", value, want, rank=rank, world_size=W, extra=extra), want


@pytest.mark.parametrize("mistake,words", [
    (lambda b, load, r, want, local: local[0], "own counts only"),
    (lambda b, load, r, want, local: checks.bias._step(b, load, r, "reversed").float(), "wrong sign"),
    (lambda b, load, r, want, local: checks.bias._step(b, load, r, "proportional").float(), "γ·(mean − load_e)"),
    (lambda b, load, r, want, local: want + r * (load == load.mean()).float(), "sign(0) = 0"),
    ("averaged", "average of the ranks' biases"),
])
def test_each_detector_names_its_mistake_and_none_speaks_on_the_truth(mistake, words):
    if mistake == "averaged":
        m, want = _mismatch(None)
        m = fb.Mismatch(m.what, m.extra["averaged"][0].float(), want, rank=0, world_size=2, extra=m.extra)
    else:
        m, want = _mismatch(mistake)
    said = [d(m) for d in checks.BIAS_DETECT]
    assert any(s and words in s for s in said), said
    truth = fb.Mismatch(m.what, want.clone(), want, rank=0, world_size=2, extra=m.extra)
    assert all(d(truth) is None for d in checks.BIAS_DETECT)


def test_counting_the_world_is_named_where_the_group_is_part_of_it():
    m, want = _mismatch(None)
    world = torch.full_like(want, 0.123)
    extra = {**m.extra, "world": [world] * 2, "groups": [[0, 1], [2, 3]]}
    msg = checks.counted_wrong_ranks(fb.Mismatch(m.what, world.clone(), want, rank=1, world_size=4, extra=extra))
    assert "EVERY rank in the world" in msg and "group=group" in msg


# ----------------------------------------------------------------------------------------------
# The grader, end to end

HEADER = "import torch\nfrom reference import comm\n"
MUTANTS = {
    "own_counts": ('''
        def loss_free_bias_update(bias, tokens_per_expert, rate, *, group=None):
            load = tokens_per_expert.double()
            with torch.no_grad():
                bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
            return bias
        ''', "own counts only"),
    "world_group": ('''
        def loss_free_bias_update(bias, tokens_per_expert, rate, *, group=None):
            load = tokens_per_expert.double().clone()
            if group is not None:
                comm.all_reduce(load)                         # the default group: the world
            with torch.no_grad():
                bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
            return bias
        ''', "EVERY rank in the world"),
    "tie_moves": ('''
        def loss_free_bias_update(bias, tokens_per_expert, rate, *, group=None):
            load = tokens_per_expert.double().clone()
            if group is not None:
                comm.all_reduce(load, group=group)
            with torch.no_grad():
                bias.add_(torch.where(load > load.mean(), -rate, rate).to(bias.dtype))
            return bias
        ''', "sign(0) = 0"),
    "copy": ('''
        def loss_free_bias_update(bias, tokens_per_expert, rate, *, group=None):
            load = tokens_per_expert.double().clone()
            if group is not None:
                comm.all_reduce(load, group=group)
            return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)
        ''', "IN PLACE"),
    "megatron": ('''
        def loss_free_bias_update(bias, tokens_per_expert, rate, *, group=None):
            from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias    # a production shortcut
            bias.copy_(get_updated_expert_bias(tokens_per_expert, bias, rate))
            return bias
        ''', "switched off while exercise 5b.5 is graded"),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_grader_names_the_mistake_of_a_wrong_submission(tmp_path, monkeypatch, mutant):
    body, words = MUTANTS[mutant]
    failed = grade_mutant(tmp_path, monkeypatch, f"bias_mutant_{mutant}", "moe", HEADER + textwrap.dedent(body),
                          "5b.5", hidden=False)
    assert any(words in m for m in failed), failed
