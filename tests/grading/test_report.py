"""The grader's outputs and feedback: Gradescope results.json (its published fields), JUnit XML,
messages that name rank, tensor, max error and where, detectors as a shared hook, and the time
it takes to grade the whole course with the reference as the submission."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch

from exercises.grading import core, feedback, report
from exercises.grading.core import CheckResult, Exercise, ExerciseResult

VISIBILITY = {"visible", "hidden", "after_due_date", "after_published"}


def _results() -> list[ExerciseResult]:
    a = Exercise("9.1", "A", "mod", ["f"])
    b = Exercise("9.2", "B", "mod", ["g"])
    return [
        ExerciseResult(a, [CheckResult("9.1", "one", True, 2.0, 2.0, "", 0.5),
                           CheckResult("9.1", "two", False, 0.0, 3.0, "out on rank 1 differs: max error 0.5", 0.2),
                           CheckResult("9.1", "secret", True, 1.0, 1.0, "", 0.1, hidden=True)]),
        ExerciseResult(b, [CheckResult("9.2", "three", False, 0.0, 1.0, "not implemented yet: Exercise 9.2", 0.0),
                           CheckResult("9.2", "secret fail", False, 0.0, 4.0, "hidden message", 0.1, hidden=True)]),
    ]


def test_gradescope_results_follow_the_published_fields_with_partial_credit_and_hidden_checks(tmp_path):
    doc = report.gradescope(_results(), tmp_path / "results.json", execution_time=12.345)
    assert json.loads((tmp_path / "results.json").read_text()) == doc
    assert doc["score"] == 3.0 and doc["execution_time"] == 12.35
    assert isinstance(doc["output"], str) and "hidden message" not in doc["output"] and "secret" not in doc["output"]
    assert [t["number"] for t in doc["tests"]] == ["9.1.1", "9.1.2", "9.1.3", "9.2.1", "9.2.2"]
    for t in doc["tests"]:
        assert set(t) >= {"name", "score", "max_score", "output", "visibility", "status", "number"}
        assert isinstance(t["name"], str) and isinstance(t["output"], str) and t["output"]
        assert isinstance(t["score"], (int, float)) and isinstance(t["max_score"], (int, float))
        assert t["visibility"] in VISIBILITY and t["status"] in ("passed", "failed")
    vis = {t["name"].split(": ", 1)[1]: t["visibility"] for t in doc["tests"]}
    assert vis == {"one": "visible", "two": "visible", "secret": "hidden", "three": "visible", "secret fail": "hidden"}
    # points per exercise: the visible part of each exercise is summarised
    assert "9.1 — A: 2/5" in doc["output"] and "9.2 — B: 0/1" in doc["output"]


def test_results_file_replaces_a_planted_symlink_instead_of_following_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "results.json"
    link.symlink_to(victim)
    report.gradescope(_results(), link)
    assert victim.read_text() == "keep me" and not link.is_symlink()
    assert json.loads(link.read_text())["score"] == 3.0


def test_junit_xml_has_one_testcase_per_check_failures_and_points(tmp_path):
    report.junit(_results(), tmp_path / "r.xml")
    root = ET.parse(tmp_path / "r.xml").getroot()
    assert root.tag == "testsuites" and root.get("tests") == "5" and root.get("failures") == "3"
    suites = root.findall("testsuite")
    assert [s.get("tests") for s in suites] == ["3", "2"]
    cases = root.iter("testcase")
    got = {c.get("name"): (c.find("failure") is not None,
                           {p.get("name"): p.get("value") for p in c.iter("property")}) for c in cases}
    assert got["two"][0] and got["two"][1]["points"] == "0/3"
    assert not got["one"][0] and got["one"][1]["points"] == "2/2"
    assert got["secret"][1]["visibility"] == "hidden"


def test_summary_text_can_hide_hidden_checks():
    text = report.summary_text(_results(), show_hidden=False)
    assert "secret" not in text and "hidden message" not in text and "two" in text


def test_compare_names_tensor_rank_max_error_and_index():
    want = torch.zeros(2, 3, dtype=torch.float64)
    got = want.clone()
    got[1, 2] = 0.25
    msg = feedback.compare(got, want, "dq", rank=2, world_size=4, case="causal")
    assert "dq on rank 2 (world size 4) [causal]" in msg and "max error 0.25" in msg and "(1, 2)" in msg
    assert feedback.compare(want.clone(), want, "dq") is None
    assert "shape (3,), expected (2, 3)" in feedback.compare(torch.zeros(3), want, "dq")


def test_detectors_are_a_shared_hook_lecture_ones_first_generic_ones_when_none_names_it_and_never_fatal():
    want = torch.arange(1.0, 7.0, dtype=torch.float64)

    def lecture(m: feedback.Mismatch):
        return "lecture hint" if m.case == "ring" else None

    def broken(m):
        raise RuntimeError("a buggy detector")

    msg = feedback.compare(want * 4, want, "grad", world_size=4, case="ring", detectors=[broken, lecture])
    assert "Likely mistake: lecture hint" in msg and "Also" not in msg    # one precise diagnosis
    msg = feedback.compare(want * 4, want, "grad", world_size=4, case="other", detectors=[broken, lecture])
    assert "Likely mistake: your grad is exactly 4× the true one (= the world size 4)" in msg
    msg = feedback.compare(torch.full_like(want, float("nan")), want, "out")
    assert "NaN or inf" in msg
    msg = feedback.compare(torch.zeros_like(want), want, "out")
    assert "all zeros" in msg


def test_exercise_ids_sort_in_course_order():
    ids = ["5b.10", "5a.2", "0.2", "5b.2", "0.1", "10.1", "5a.1"]
    assert sorted(ids, key=core.exercise_order) == ["0.1", "0.2", "5a.1", "5a.2", "5b.2", "5b.10", "10.1"]


@pytest.mark.slow
def test_grading_the_whole_course_with_the_reference_gives_full_marks(course_grades):
    results, seconds = course_grades("reference")
    lost = [(r.exercise.id, c.name, c.message[:300]) for r in results for c in r.checks if not c.passed]
    assert not lost
    assert len(results) == len(core.load_checks()) and all(r.max_score > 0 for r in results)
    # how long it took is a benchmark's figure (benchmarks/grading.py), not a test's: a loaded machine is slower
    print(f"\ngraded {len(results)} exercises ({sum(len(r.checks) for r in results)} checks) in {seconds:.1f} s")


def test_the_untouched_stubs_score_zero_on_every_exercise(course_grades):
    results, _ = course_grades("exercises")
    assert results and all(r.score == 0 for r in results), [(r.exercise.id, r.score) for r in results if r.score]
    for r in results:                                  # and they say what to do, not a traceback
        assert r.checks[0].message.startswith("not implemented yet"), (r.exercise.id, r.checks[0].message[:200])
