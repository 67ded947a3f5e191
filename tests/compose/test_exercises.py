"""Exercises 5c.2 (sync_gradients on a composed grid) and 5c.3 (a planner's byte estimate):
the grader gives the reference full marks and names each usual mistake of a wrong submission.

The stubs' zero and the reference's full marks over the whole course are in the course-wide
grader tests; here each mutant is graded and its feedback read.
"""
from __future__ import annotations

import textwrap

import pytest

from exercises.grading import core
from tests.conftest import grade_package

SYNC = '''
from reference import comm

MISTAKE = {mistake!r}


def _mean(params, group, n):
    for p in params:
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group)
            p.grad /= n


def sync_gradients(model):
    g = model.grid
    sp = model.sequence_parallel_params()
    if sp and MISTAKE != "no_sp_sum":
        for p in sp:
            comm.all_reduce(p.grad, group=model.groups["tp"])
    dense = model.dense_params()
    if MISTAKE == "dp_only":                      # the context-parallel ranks forgotten
        _mean(dense, model.groups["dp"], g.dp)          # the group the notebook warns about is offered
    elif MISTAKE == "world":
        _mean(dense, None, g.world_size)
    else:
        _mean(dense, model.groups["dp_cp"], g.dp * g.cp)
    experts = model.expert_params()
    if experts:
        if MISTAKE == "experts_dp_cp":            # averaged with ranks holding other experts
            _mean(experts, model.groups["dp_cp"], g.dp * g.cp)
        elif MISTAKE == "experts_edp_mean":
            _mean(experts, model.groups["edp"], g.edp)
        else:
            for p in experts:
                if p.grad is not None:
                    comm.all_reduce(p.grad, group=model.groups["edp"])
                    p.grad /= g.dp * g.cp


def step_bytes(sizes, coords, *, tokens, d_model, layers, dense_params, num_microbatches=1, bytes_per_element=8):
    s = {{a: sizes.get(a, 1) for a in ("tp", "cp", "dp", "pp")}}
    b, T, d, out = bytes_per_element, tokens, d_model, {{}}
    n = s["dp"] if MISTAKE == "n_is_dp" else s["dp"] * s["cp"]
    if s["dp"] * s["cp"] > 1:
        out["dp_cp"] = 2 * (n - 1) * b * dense_params // n
    if s["cp"] > 1:
        blocks = 2 if MISTAKE == "cp_forward_only" else 6
        out["cp"] = blocks * (s["cp"] - 1) * T * (d // s["tp"]) * b * layers
    if s["pp"] > 1:
        first, last = coords["pp"] == 0, coords["pp"] == s["pp"] - 1
        both = MISTAKE == "pp_both_ways"
        out["pp"] = T * d * b * (2 if both else (not last) + (not first))
    return out
'''


ALL_CHECKS: dict[str, list] = {}      # exercise id -> its checks before any test narrowed them


def grade(tmp_path, monkeypatch, mistake: str | None, ids: list[str], only: str | None = None):
    """Grade the mutant on ``ids`` (only the checks whose name starts with ``only``, if given)."""
    name = f"compose_mutant_{mistake or 'none'}"
    if only is not None:
        registry = core.load_checks()
        for i in ids:
            every = ALL_CHECKS.setdefault(i, list(registry[i].checks))
            monkeypatch.setattr(registry[i], "checks", [c for c in every if c.name.startswith(only)])
    return grade_package(tmp_path, monkeypatch, name, {"compose": textwrap.dedent(SYNC.format(mistake=mistake))}, ids)


def failures(res) -> dict[str, str]:
    return {c.name: c.message for c in res.checks if not c.passed}


def test_a_right_submission_written_outside_the_reference_earns_full_marks(tmp_path, monkeypatch):
    res = grade(tmp_path, monkeypatch, None, ["5c.2", "5c.3"])
    for r in res.values():
        assert r.score == r.max_score, failures(r)


def test_5c2_names_the_forgotten_context_parallel_sync_and_the_missing_tp_sum(tmp_path, monkeypatch):
    res = grade(tmp_path, monkeypatch, "dp_only", ["5c.2"], "dp × cp")["5c.2"]
    bad = failures(res)
    first, second = list(bad)                     # said once; the second check points back to the first
    assert "context-parallel gradient sync is the one most often forgotten" in bad[first], bad
    assert f'the same as in "{first}" above' in bad[second], bad
    res = grade(tmp_path, monkeypatch, "no_sp_sum", ["5c.2"], "dp × tp")["5c.2"]
    bad = failures(res)
    assert list(bad) == ["dp × tp = 2 × 2 with sequence parallelism: LayerNorms and row biases too"], bad
    assert "Sum it over the tp group first" in next(iter(bad.values()))


@pytest.mark.parametrize("mistake,words,only", [("experts_dp_cp", "DIFFERENT experts", "dp × cp × ep"),
                                                ("experts_edp_mean", "averaged over the edp group", "dp × cp × ep"),
                                                ("world", "averaged over every rank of the world", "dp × tp")])
def test_5c2_names_gradients_synced_over_the_wrong_group(tmp_path, monkeypatch, mistake, words, only):
    res = grade(tmp_path, monkeypatch, mistake, ["5c.2"], only)["5c.2"]
    bad = failures(res)
    assert bad and any(words in m for m in bad.values()), bad
    assert res.score < res.max_score


@pytest.mark.parametrize("mistake,words", [("n_is_dp", "N = dp·cp"), ("cp_forward_only", "forward only"),
                                           ("pp_both_ways", "first stage sends no gradient back")])
def test_5c3_names_the_slip_on_each_axis(tmp_path, monkeypatch, mistake, words):
    res = grade(tmp_path, monkeypatch, mistake, ["5c.3"])["5c.3"]
    bad = failures(res)
    assert bad and all(words in m for m in bad.values()), bad
    assert res.score < res.max_score
