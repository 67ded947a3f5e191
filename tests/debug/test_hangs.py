"""Lecture 6's hangs: every case really hangs on real ranks, ends in a named error (the timeout's, or a
rank's own) and leaves no process behind (the launcher's tests hold its ports); its fix finishes; the
course's report of each is diagnosed as the bug was planted (6.1's reference) — and the reports are the
ones the grader hands out (the same cached run)."""
from __future__ import annotations

import re

import pytest

from exercises.grading.checks.debug import hang_cases
from reference.debug import diagnose_hang
from reference.debug.hangs import CASES, default_faulty, hang_program
from reference.debug.oracles import hang_reports

pytestmark = pytest.mark.slow


def _published():
    cases = hang_cases(61)
    return tuple((n, w, f if n != "p2p" else tuple(range(w)), o) for n, w, f, o in cases)


def test_every_case_hangs_for_real_and_ends_in_a_named_error_after_its_timeout_leaving_nothing(no_orphans):
    cases = _published()
    reports = hang_reports(cases)                                 # all worlds start and hang together
    for (name, w, faulty, options), report in zip(cases, reports):
        assert report.get("finished") is False, (name, report)
        if options.get("detail") or name == "shape":
            assert report["kind"] in ("exception", "died"), report["message"]
        else:
            assert report["kind"] == "timeout", report["message"]
            assert re.search(r"^timeout after [\d.]+ s while running: ranks", report["message"]), report["message"]
        named = [r for r, v in report["ranks"].items() if v["state"] not in ("finished", "peer gone")]
        assert named and all(f"rank {r}" in report["message"] for r in named), report["message"]


def test_each_report_is_diagnosed_as_the_bug_was_planted_and_the_reports_are_what_the_course_promises():
    for (name, w, faulty, options), report in zip(_published(), hang_reports(_published())):
        assert diagnose_hang({k: v for k, v in report.items() if k != "truth"}) == report["truth"], (name, report)
        states = {v["state"] for v in report["ranks"].values()}
        if name in ("skip", "pipeline"):
            assert "finished" in states                          # the clue the lecture points at
        if name == "shape":                                      # DETAIL names both shapes on every rank
            assert all("TensorShape" in v["error"] for v in report["ranks"].values() if v["state"] == "raised")
        if name == "group":
            assert states == {"running"}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fix_finishes_on_the_same_ranks(world, name):
    w = world(3)
    res = w.run(hang_program, name, default_faulty(name, 3), fixed=True,
                **({"num_microbatches": 1} if name == "pipeline" else {}))
    assert len(res.values) == 3


def test_diagnosis_of_a_four_stage_pipeline_and_of_an_empty_report():
    report = {"kind": "timeout", "message": "", "world_size": 4, "ranks": {
        0: {"state": "blocked", "blocked_in": "send to rank 1 (step 2)", "error": ""},
        1: {"state": "blocked", "blocked_in": "send to rank 2 (step 1)", "error": ""},
        2: {"state": "blocked", "blocked_in": "send to rank 1 (step 0)", "error": ""},
        3: {"state": "finished", "blocked_in": "", "error": ""}}}
    assert diagnose_hang(report) == {"kind": "pipeline", "ranks": [0, 1]}
    with pytest.raises(ValueError):
        diagnose_hang({"kind": "timeout", "message": "", "world_size": 2, "ranks": {
            0: {"state": "finished", "blocked_in": "", "error": ""},
            1: {"state": "finished", "blocked_in": "", "error": ""}}})
