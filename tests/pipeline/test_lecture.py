"""Lecture 4b as a learner meets it: the grader on the reference (full marks), on the stubs (zero,
"not implemented"), and on the classic mistakes, each named in the feedback."""
from __future__ import annotations

import sys
import textwrap

import pytest

from exercises.grading import session
from tests.conftest import grade_mutant

IDS = ["4.4", "4.5", "4.6"]

MUTANT = '''
import torch
from reference.pipeline.schedules import Action


def one_f_one_b(num_stages, num_microbatches, stage):      # MISTAKE: one warm-up forward too many
    p, m, s = num_stages, num_microbatches, stage
    w = min(m, p - s)
    order = [Action("F", i) for i in range(w)]
    for i in range(m - w):
        order += [Action("F", w + i), Action("B", i)]
    return order + [Action("B", i) for i in range(m - w, m)]


def forward_step(module, microbatch, link, stash, *, inputs=None, target=None, loss_fn=None, num_microbatches=1):
    x = inputs if link.is_first else link.recv_activation(microbatch).requires_grad_()
    y = module(x)
    if link.is_last:
        loss = loss_fn(y, target)                          # MISTAKE: not divided by m
        stash[microbatch] = (x, loss, module)
        return loss.detach()
    link.send_activation(y.detach(), microbatch)
    stash[microbatch] = (x, y, module)
    return None


def backward_step(microbatch, link, stash):
    x, y, module = stash.pop(microbatch)
    dy = None if link.is_last else link.recv_gradient(microbatch)
    torch.autograd.backward(y, dy)
    if not link.is_first:
        link.send_gradient(x.grad, microbatch)


def bubble_fraction(name, num_stages, num_microbatches, *, virtual_stages=1):
    p, m, v = num_stages, num_microbatches, virtual_stages
    if name not in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") or (name in ("1f1b", "zb_h1") and m < p) \
            or (name == "interleaved_1f1b") != (v > 1) or (name == "interleaved_1f1b" and m % p):
        raise ValueError(name)
    return (num_stages - 1) / (virtual_stages * num_microbatches)      # MISTAKE: relative to the ideal time
'''

NOT_ACCUMULATED = '''
import torch


def forward_step(module, microbatch, link, stash, *, inputs=None, target=None, loss_fn=None, num_microbatches=1):
    x = inputs if link.is_first else link.recv_activation(microbatch).requires_grad_()
    y = module(x)
    if link.is_last:
        loss = loss_fn(y, target) / num_microbatches
        stash[microbatch] = (x, loss, module)
        return loss.detach()
    link.send_activation(y.detach(), microbatch)
    stash[microbatch] = (x, y, module)
    return None


def backward_step(microbatch, link, stash):                       # MISTAKE: .grad replaced, not accumulated
    x, y, module = stash.pop(microbatch)
    for p in module.parameters():
        p.grad = None
    dy = None if link.is_last else link.recv_gradient(microbatch)
    torch.autograd.backward(y, dy)
    if not link.is_first:
        link.send_gradient(x.grad, microbatch)
'''


@pytest.fixture(scope="module")
def mutants(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_mutants")
    for name, src in (("pipe_mutant", MUTANT), ("pipe_mutant_acc", NOT_ACCUMULATED)):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("")
        (root / name / "pipeline.py").write_text(textwrap.dedent(src))
    sys.path.insert(0, str(root))
    try:
        yield {"mutant": {r.exercise.id: r for r in session.grade("pipe_mutant", IDS, include_hidden=False)},
               "acc": {r.exercise.id: r for r in session.grade("pipe_mutant_acc", ["4.5"], include_hidden=False)}}
    finally:
        sys.path.remove(str(root))
        for name in ("pipe_mutant", "pipe_mutant_acc"):
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                sys.modules.pop(mod)


def test_reference_scores_full_marks_and_stubs_score_zero(course_grades):
    ref = {r.exercise.id: r for r in course_grades("reference")[0]}
    for i in IDS:
        assert ref[i].score == ref[i].max_score > 0, [c.message for c in ref[i].checks if not c.passed]
    stubs = {r.exercise.id: r for r in course_grades("exercises")[0]}
    for i in IDS:
        assert stubs[i].score == 0
        assert any("not implemented" in c.message for c in stubs[i].checks)


@pytest.mark.parametrize("who,ex_id,words", [
    ("mutant", "4.4", "1F1B warms up with min(m, p − s − 1)"),
    ("mutant", "4.5", "each micro-batch's loss must be divided by m"),
    ("acc", "4.5", "gradients must accumulate over micro-batches"),
    ("mutant", "4.6", "Megatron-LM's convention (the bubble relative to the ideal time"),
])
def test_the_grader_names_the_classic_mistake(mutants, who, ex_id, words):
    res = mutants[who][ex_id]
    failed = [c.message for c in res.checks if not c.passed]
    assert any(words in m for m in failed), failed
    assert res.score < res.max_score


def test_the_bubble_feedback_nudges_without_giving_the_formula(mutants):
    """(p−1)/m is Megatron-LM's convention, not a slip: the feedback names it and asks for the fraction of the
    step, without writing the answer's denominator."""
    failed = [c.message for c in mutants["mutant"]["4.6"].checks if not c.passed]
    assert any("fraction of the step" in m for m in failed), failed
    assert not any("slip" in m or "m + p − 1" in m or "m+p−1" in m for m in failed), failed


ORDER_ONLY = '''
from reference.pipeline.schedules import Action


def one_f_one_b(num_stages, num_microbatches, stage):
    p, m, s = num_stages, num_microbatches, stage
    w = min(m, p - s - 1)
    order = [Action("F", i) for i in range(w)]
    for i in range(m - w):
        order += [Action("F", w + i), Action("B", i)]
    return order + [Action("B", i) for i in range(m - w, m)]


def forward_step(*args, **kwargs):
    raise NotImplementedError("Exercise 4.5 (forward_step): not written yet")


def backward_step(*args, **kwargs):
    raise NotImplementedError("Exercise 4.5 (backward_step): not written yet")
'''


def test_a_right_1f1b_order_earns_full_marks_before_exercise_4_5_is_written(tmp_path, monkeypatch):
    """4.4 is graded on the order alone: its real-rank check runs the order with the grader's own steps."""
    pkg = tmp_path / "order_only"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pipeline.py").write_text(ORDER_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        (res,) = session.grade("order_only", ["4.4"], include_hidden=True)
    finally:
        sys.modules.pop("order_only", None)
    assert res.score == res.max_score, [(c.name, c.message[:300]) for c in res.checks if not c.passed]


def test_a_forgotten_requires_grad_is_named_and_the_learners_own_line_shown(tmp_path, monkeypatch):
    src = ORDER_ONLY.replace('''def forward_step(*args, **kwargs):
    raise NotImplementedError("Exercise 4.5 (forward_step): not written yet")


def backward_step(*args, **kwargs):
    raise NotImplementedError("Exercise 4.5 (backward_step): not written yet")''', '''import torch


def forward_step(module, microbatch, link, stash, *, inputs=None, target=None, loss_fn=None, num_microbatches=1):
    x = inputs if link.is_first else link.recv_activation(microbatch)      # MISTAKE: no requires_grad_()
    y = module(x)
    if link.is_last:
        loss = loss_fn(y, target) / num_microbatches
        stash[microbatch] = (x, loss)
        return loss.detach()
    link.send_activation(y.detach(), microbatch)
    stash[microbatch] = (x, y)


def backward_step(microbatch, link, stash):
    x, y = stash.pop(microbatch)
    dy = None if link.is_last else link.recv_gradient(microbatch)
    torch.autograd.backward(y, dy)
    if not link.is_first:
        link.send_gradient(x.grad, microbatch)''')
    failed = grade_mutant(tmp_path, monkeypatch, "no_requires_grad", "pipeline", src, "4.5", hidden=False)
    first = next(m for m in failed if "send_gradient" in m)
    assert "requires grad" in first and "in your code:" in first and "no_requires_grad/pipeline.py" in first, first
