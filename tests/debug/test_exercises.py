"""Exercises 6.1-6.3 graded on submissions with one classic mistake each: the grader names it.  The
reference's full marks (published and fresh inputs) and the stubs' zero are the course-wide grader tests'
(tests/grading); 6.3's GIVEN step, its body submitted unchanged, must earn nothing, and calling it is switched
off while 6.3 is graded."""
from __future__ import annotations

import inspect
import textwrap

import pytest

from exercises.grading import core
from tests.conftest import grade_package
from reference.debug.accumulate import accumulate_gradients_given

# the given step, its body copied unchanged, as the learner's accumulate_gradients
GIVEN = inspect.getsource(accumulate_gradients_given).replace("def accumulate_gradients_given(",
                                                               "def accumulate_gradients(", 1)

pytestmark = pytest.mark.slow

SUBMISSION = '''
import torch
import torch.nn.functional as F

from reference import comm
from reference.debug.accumulate import IGNORE


def diagnose_hang(report):          # every hang read as a skipped collective, the waiting ranks named
    return {"kind": "skip", "ranks": sorted(int(r) for r, v in report["ranks"].items() if v["state"] == "blocked")}


{given}

def calls_the_given_step(model, microbatches, *, group=None):
    from reference.debug.accumulate import accumulate_gradients_given
    return accumulate_gradients_given(model, microbatches, group=group)


if "{mistake}" == "calls_given":
    accumulate_gradients = calls_the_given_step
'''


def grade(tmp_path, monkeypatch, mistake: str, ids: list[str], only: str | None = None):
    name = f"debug_mutant_{mistake}"
    if only is not None:
        registry = core.load_checks()
        for i in ids:
            monkeypatch.setattr(registry[i], "checks", [c for c in registry[i].checks if c.name.startswith(only)])
    source = textwrap.dedent(SUBMISSION).replace("{mistake}", mistake).replace("{given}", GIVEN)
    return grade_package(tmp_path, monkeypatch, name, {"debug": source}, ids)


def test_the_given_step_submitted_unchanged_earns_nothing_and_is_told_it_is_the_mean_of_means(tmp_path, monkeypatch):
    res = grade(tmp_path, monkeypatch, "given", ["6.3"])["6.3"]
    assert res.score == 0, [(c.name, c.passed) for c in res.checks]
    messages = [c.message for c in res.checks]
    assert any("GIVEN step's gradient" in m for m in messages), messages
    assert any("returned the loss NaN" in m for m in messages), messages   # an empty micro-batch: 0/0


def test_6_1_names_the_waiting_ranks_mistake(tmp_path, monkeypatch):
    res = grade(tmp_path, monkeypatch, "waiting_ranks", ["6.1"], "skip:")["6.1"]
    [check] = res.checks
    assert not check.passed and "FINISHED early" in check.message, check.message


def test_6_3_calling_the_given_step_is_switched_off_and_said_so(tmp_path, monkeypatch):
    res = grade(tmp_path, monkeypatch, "calls_given", ["6.3"], "1 rank, 4 micro-batches")["6.3"]   # one rank: cheapest
    [check] = res.checks
    assert not check.passed and "switched off while exercise 6.3 is graded" in check.message, check.message
