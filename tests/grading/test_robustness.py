"""Grading survives broken and hostile submissions (fixtures in tests/submissions/).

Each fixture is graded on exercises 0.1 and 0.2 through the real command line, with a short
per-check time limit, writing Gradescope's results.json.  Every test proves three things: the
misbehaving checks fail with a message that says what happened, the checks the submission really
passes still earn their points (exercise 0.2 is implemented honestly in every fixture but two),
and the score in results.json is the grader's, whatever the submission did.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exercises.grading import core, sandbox

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5   # seconds per check: a hang or a deadlock costs this much


def grade(tmp_path: Path, fixture: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "exercises.grade", "0.1", "0.2", "--solutions", f"tests.submissions.{fixture}",
         "--timeout", str(TIMEOUT), "--quiet", "--gradescope", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def by_exercise(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for t in doc["tests"]:
        out.setdefault(t["extra_data"]["exercise"], []).append(t)
    return out


def full_marks(tests: list[dict]) -> bool:
    return all(t["score"] == t["max_score"] and t["status"] == "passed" for t in tests)


def assert_score_is_sum(doc: dict) -> None:
    assert doc["score"] == pytest.approx(sum(t["score"] for t in doc["tests"]))
    for t in doc["tests"]:
        assert t["score"] in (0, t["max_score"])
        if t["max_score"] > 0:                 # feedback-only checks (0 points) may fail at 0/0
            assert (t["status"] == "passed") == (t["score"] == t["max_score"])


def test_multi_rank_deadlock_is_reported_as_deadlock_with_blocked_ranks_and_operation(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "deadlock")
    ex = by_exercise(doc)
    assert_score_is_sum(doc)
    failed = [t for t in ex["0.1"] if t["status"] == "failed"]
    assert failed, "a send-then-recv ring must fail"
    first = failed[0]
    assert "deadlock" in first["output"]
    assert "rank 0: blocked in send to rank 1" in first["output"]
    assert "blocking ring" in first["output"]          # the misconception by name
    # a deadlock costs one time limit: the exercise's later checks are skipped, saying why
    later = ex["0.1"][ex["0.1"].index(first) + 1:]
    assert later and all(t["status"] == "failed" and "ran out of time" in t["output"] for t in later)
    assert full_marks(ex["0.2"])                         # and the run went on to the next exercise


@pytest.mark.timeout(240)      # a safety net: the check's own limit is what the assertions below show
def test_infinite_loop_fails_only_its_check_within_the_time_limit(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "hang")
    ex = by_exercise(doc)
    assert_score_is_sum(doc)
    failed = [t for t in ex["0.1"] if t["status"] == "failed"]
    assert failed[0]["name"] == next(t["name"] for t in ex["0.1"] if "single rank" in t["name"])
    assert "did not finish within" in failed[0]["output"] and "loop" in failed[0]["output"]
    assert all("ran out of time" in t["output"] for t in failed[1:])
    assert full_marks(ex["0.2"])


def test_segfault_on_one_rank_names_the_rank_and_the_signal(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "segfault")
    ex = by_exercise(doc)
    assert_score_is_sum(doc)
    failed = [t for t in ex["0.1"] if t["status"] == "failed"]
    assert failed and all("rank 1" in t["output"] and "SIGSEGV" in t["output"] for t in failed)
    assert all("3 ranks" in t["name"] for t in failed)   # only the checks on 3 ranks crash
    assert any(t["status"] == "passed" for t in ex["0.1"])
    assert full_marks(ex["0.2"])


def test_sys_exit_and_os_exit_fail_their_checks_and_grading_goes_on(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "exits")
    ex = by_exercise(doc)
    assert_score_is_sum(doc)
    on2 = [t for t in ex["0.1"] if "on 2 ranks" in t["name"]]
    on3 = [t for t in ex["0.1"] if "3 ranks" in t["name"]]
    assert on2 and all(t["status"] == "failed" and "sys.exit(0)" in t["output"] for t in on2)
    assert on3 and all(t["status"] == "failed" and "exited with code 0" in t["output"] for t in on3)
    others = [t for t in ex["0.1"] if t not in on2 + on3]
    assert others and full_marks(others)
    assert full_marks(ex["0.2"])


def test_exit_at_import_scores_zero_not_success(tmp_path, no_orphans):
    doc, stdout = grade(tmp_path, "early_exit")
    assert doc["score"] == 0
    assert all(t["status"] == "failed" and "sys.exit" in t["output"] for t in doc["tests"])
    assert "Exercise 0.2" in stdout                       # the grader finished and reported everything


def test_printing_warnings_to_stderr_costs_no_points(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "noisy")
    assert full_marks(doc["tests"])
    assert doc["score"] == sum(t["max_score"] for t in doc["tests"])


def test_submission_cannot_write_results_json_even_from_a_detached_daemon(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "tamper_results", "--junit", str(tmp_path / "junit.xml"))
    ex = by_exercise(doc)
    assert doc["score"] < 1000 and all(t["name"] != "tampered" for t in doc["tests"])
    assert_score_is_sum(doc)
    assert not full_marks(ex["0.1"]) and full_marks(ex["0.2"])
    # The daemon the submission detached (double fork + setsid) was killed with its exercise:
    time.sleep(0.5)
    assert json.loads((tmp_path / "results.json").read_text()) == doc
    assert (tmp_path / "junit.xml").read_text().startswith("<?xml")


def test_monkeypatching_allclose_feedback_and_reference_changes_no_verdict(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "monkeypatch")
    ex = by_exercise(doc)
    assert_score_is_sum(doc)
    failed = [t for t in ex["0.1"] if t["status"] == "failed"]
    # patching the reference while it runs is refused, naming the change (the frozen given code);
    # patching torch.allclose or the feedback module changes no verdict: those are the grader's own
    assert len(failed) >= 3 and all("changed the course's given code" in t["output"] for t in failed)
    assert "reference.collectives.ring_all_reduce was replaced" in failed[0]["output"]
    assert full_marks(ex["0.2"])


def test_submitting_the_reference_functions_scores_zero(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "calls_reference")
    assert doc["score"] == 0
    assert all("calls the reference solution" in t["output"] for t in doc["tests"])


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch users")
def test_submitted_code_can_run_as_an_unprivileged_user_and_cannot_touch_root_files(tmp_path, no_orphans,
                                                                                     monkeypatch):
    monkeypatch.setenv("GRADER_RUN_AS", "nobody")
    try:
        sandbox.preflight("tests")
    except core.SetupError as e:     # this clone lies where nobody cannot reach (e.g. a mode-700 home folder)
        out = tmp_path / "results.json"
        proc = subprocess.run([sys.executable, "-m", "exercises.grade", "0.2", "--solutions", "tests.submissions.hang",
                               "--quiet", "--gradescope", str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 2 and "GRADER_RUN_AS='nobody' cannot" in proc.stderr and str(e)[:40] in proc.stderr
        assert json.loads(out.read_text())["score"] == 0
        return
    doc, _ = grade(tmp_path, "tamper_results")
    assert_score_is_sum(doc)
    assert full_marks(by_exercise(doc)["0.2"]) and not full_marks(by_exercise(doc)["0.1"])
    assert (tmp_path / "results.json").stat().st_uid == 0


def test_feedback_names_the_classic_ring_mistakes(tmp_path, no_orphans):
    doc, _ = grade(tmp_path, "mistakes")
    ex = by_exercise(doc)
    assert_score_is_sum(doc)
    rs = [t for t in ex["0.1"] if "reduce-scatter" in t["name"]]
    assert full_marks(rs)                                   # the correct half earns its point
    sums = [t for t in ex["0.1"] if "sums on" in t["name"] and "int64" not in t["name"]]
    assert sums and all(t["status"] == "failed" for t in sums) and "all-gather pass" in sums[0]["output"]
    assert all('the same as in "sums on 2 ranks" above' in t["output"] for t in sums[1:])   # said once
    uneven = [t for t in ex["0.2"] if "uneven" in t["name"]]
    assert uneven and "SIGABRT" in uneven[0]["output"] and "does not fit the buffer" in uneven[0]["output"]


def test_time_limits_grow_on_a_slow_or_busy_machine_unless_a_limit_is_given(monkeypatch):
    """Headroom: a check's limit was set on the course's idle 2-core machine; a laptop twice as slow, or
    a machine running two other jobs per core, gets twice as long (at most 3×), a given limit stays."""
    from exercises.grading import machine, session
    monkeypatch.delenv("GRADER_SLOWDOWN", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * (os.cpu_count() or 1), 0.0, 0.0))
    assert machine.machine_factor() == 3.0                                       # capped
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(machine, "PROBE_SECONDS", 1e-9)
    assert machine.machine_factor() == 3.0                                       # the probe is slow
    monkeypatch.setattr(machine, "PROBE_SECONDS", 1e3)
    assert machine.machine_factor() == 1.0                                       # never less than the limit
    monkeypatch.setenv("GRADER_SLOWDOWN", "2")
    assert machine.machine_factor() == 2.0
    seen = []
    ex = core.Exercise("9.9", "limits", "collectives", ["ring_all_reduce"])
    ex.check("records its limit", timeout=20)(lambda ctx: seen.append(ctx.timeout))
    session._grade_exercise(ex, "exercises", runner=None, include_hidden=False, progress=None, timeout=60,
                            factor=machine.machine_factor())
    session._grade_exercise(ex, "exercises", runner=None, include_hidden=False, progress=None, timeout=5)
    assert seen == [40.0, 5.0]


def test_grading_in_process_spares_the_callers_own_kept_alive_world(world):
    """The sweep after each exercise kills what the submission left behind, not what the caller ran before
    grading began (a notebook's kept-alive World, this session's worlds): the World still runs afterwards."""
    from exercises.grading import session
    from tests.workers import launch_workers as W
    w = world(2)
    assert session.contain()           # as the command line does: adopt what a submission detaches
    (res,) = session.grade("reference", ["5c.1"], include_hidden=False)
    assert res.score == res.max_score
    time.sleep(0.5)
    assert w.alive, "the sweep killed the caller's own ranks"
    assert w.run(W.rank_and_size, 7).values == [(0, 2, 7), (1, 2, 7)]
