"""Grades that mean the learner wrote it (issue: grader round 2).

One fixture per attack under ``tests/submissions/``: each earns nothing on the checks it attacks,
graded as the autograder grades (fresh inputs).  The reference earns full marks with and without
fresh inputs; every check that carries points draws different inputs under another seed; the
autograder bundle is refused when its reference does not score full marks.
"""
from __future__ import annotations

import os

import pytest

from exercises.grading import session
from tests.conftest import COURSE_REQUESTS, grade_recording

# fixture -> (exercise it attacks, what stops it, the most it may score)
ATTACKS = {
    # the attacks of the issue
    "dtensor_fg": ("4.1", "DTensor's entry points and functional collectives switched off", 0),
    "dtensor_linears": ("4.2", "DTensor's entry points and functional collectives switched off", 0),
    "loss_parallel": ("4.3", "loss_parallel and DTensor switched off", 0),
    "gather_logits": ("4.3", "no all-gather in 4.3; an all-reduce carries a few numbers per token", 0),
    "torch_1f1b": ("4.4", "torch.distributed.pipelining's schedules switched off", 0),
    "given_bubble": ("4.6", "the planner's bubble and the schedules' rules switched off (mirrors)", 0),
    "no_overlap": ("3.2", "overlap shown in values: a bucket reduced only in finish_buckets carries the wrong "
                   "gradients", 7),
    "grader_tables": ("3.2", "no fixed tables; the grader's checks are not importable where code runs", 0),
    # invented against 3.1, 3.3, 3.4, 5c.1-5c.3
    "seed_replay": ("3.1", "fresh inputs: the published seeds are not the autograder's", 0),
    "zero_redundancy": ("3.3", "ZeroRedundancyOptimizer switched off; its broadcasts refused at the dispatcher", 0),
    "patched_driver": ("3.3", "the given driver frozen: restored before every call", 0),
    "patched_class": ("3.2", "the given class frozen: a changed method is restored and the result refused", 0),
    "fsdp2_driver": ("3.4", "the given driver frozen; FSDP's entry points switched off", 0),
    "rank_grid": ("5c.1", "RankGrid's group listing switched off (a mirror)", 0),
    "composed_average": ("5c.2", "the composed run's dense average is the graded function's own body", 0),
    "planner_bytes": ("5c.3", "the planner and the grader's case builder switched off (mirrors)", 0),
}


@pytest.mark.parametrize("fixture", sorted(ATTACKS))
def test_an_attack_earns_nothing_on_what_it_attacks(fixture, fresh, no_orphans):
    ex_id, stopped_by, most = ATTACKS[fixture]
    fresh(os.urandom(32))
    (res,) = session.grade(f"tests.submissions.{fixture}", [ex_id], include_hidden=True, timeout=30)
    earned = [(c.name, c.score) for c in res.checks if c.score]
    assert res.score <= most, (stopped_by, earned)
    assert res.score < res.max_score, stopped_by


def test_the_no_overlap_attack_loses_exactly_the_overlap_check_and_is_told_why(fresh, no_orphans):
    fresh(os.urandom(32))
    (res,) = session.grade("tests.submissions.no_overlap", ["3.2"], include_hidden=False, timeout=30)
    lost = [c for c in res.checks if not c.passed and c.max_score > 0]
    assert [c.name for c in lost] == [c.name for c in res.checks if c.name.startswith("overlap, shown in values")]
    # the runner counted the posts against grad_ready's marks: the message says which call left a bucket unposted
    assert "had not been posted" in lost[0].message and "finish_buckets is no overlap" in lost[0].message


def test_the_reference_earns_full_marks_on_fresh_inputs_and_every_check_draws_new_ones(course_grades,
                                                                                      fresh_course_grades, no_orphans):
    published_results, _ = course_grades("reference")          # the published inputs, graded once per session
    published = COURSE_REQUESTS["reference"]
    points = {(r.exercise.id, c.name): c.max_score for r in published_results for c in r.checks}
    runs = [fresh_course_grades]                                # fresh inputs, graded once per session
    fixed = {key for key, digests in published.items() if points.get(key, 0) > 0 and runs[0][1].get(key) == digests}
    # A draw from a small set (e.g. 5 head counts) repeats by chance: those exercises alone draw again, up to five
    # times; a check whose inputs never change stays fixed (the chance of 6 chance repeats in 5 is 1 in 15,625).
    for _ in range(5):
        if not fixed:
            break
        print(f"drawing again for {len(fixed)} check(s) whose draw repeated: {sorted(fixed)}")
        runs.append(grade_recording("reference", os.urandom(32), sorted({ex for ex, _ in fixed})))
        fixed = {key for key in fixed if runs[-1][1].get(key) == published[key]}
    for results, _ in [(published_results, None), *runs]:
        lost = [(r.exercise.id, c.name, c.message[:200]) for r in results for c in r.checks if not c.passed]
        assert not lost, lost
    assert not fixed, f"checks whose inputs do not change with the seed: {sorted(fixed)}"
    assert len(published) >= 100 and runs[0][1]   # the digests were recorded


def test_make_autograder_refuses_a_bundle_whose_reference_loses_points_on_fresh_inputs(tmp_path):
    from exercises.grading import release
    with pytest.raises(RuntimeError, match="does not score full marks on fresh inputs"):
        release.build_autograder(tmp_path, verify_ids=["3.1"], verify_with="tests.submissions.seed_replay")
    assert not (tmp_path / "autograder.zip").exists()
