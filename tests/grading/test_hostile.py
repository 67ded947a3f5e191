"""A submission that wants the points without the work (issue: classroom grading that holds).

Each attack is a fixture in tests/submissions/; each test shows it earns only what honest work
earns, that the grader stays bounded in time and memory, and that a score is always written.
"""
from __future__ import annotations

import io
import json
import os
import pwd
import resource
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from exercises.grading import core, feedback, sandbox, session
from tests.conftest import nobody_who_can_run

ROOT = Path(__file__).resolve().parents[2]
ATTACKS = "tests.submissions.hostile_runner.attacks"


def run_grade(tmp_path: Path, fixture: str, ids=("0.1", "0.2"), *extra: str, env=None, timeout=3):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "exercises.grade", *ids, "--solutions", f"tests.submissions.{fixture}",
         "--timeout", str(timeout), "--quiet", "--gradescope", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def scores(doc: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in doc["tests"]:
        ex = t["extra_data"]["exercise"]
        out[ex] = out.get(ex, 0) + t["score"]
    return out


# ----------------------------------------------------------------------------------------------
# The reply channel: a deadline for the whole message, a size cap, stored records only


def _call(attack: str, timeout: float = 3.0, raises: bool = True):
    """Run ``attack`` where learner code runs (a rank of the runner's) and return what the grader got."""
    runner = sandbox.Runner("tests.submissions.hostile_runner").start()
    try:
        runner.wait_ready(60)
        t0 = time.perf_counter()
        if not raises:
            return runner.call(("local", f"{ATTACKS}:{attack}", "x", (), timeout), timeout + 60, start=60), 0.0
        with pytest.raises(core.CheckFailed) as e:
            runner.call(("local", f"{ATTACKS}:{attack}", "x", (), timeout), timeout, start=60)
        return e.value, time.perf_counter() - t0
    finally:
        runner.kill()


@pytest.mark.timeout(120)      # a safety net; the deadline that fired is in the message
def test_a_reply_that_stops_mid_message_cannot_hang_the_grader(no_orphans):
    err, _ = _call("stall_mid_message")
    assert isinstance(err, core.CheckTimedOut) and "did not finish within 3 s" in str(err)


def test_a_compressed_record_is_refused_before_it_is_loaded(no_orphans):
    # learner code runs in a rank: swapping torch.save there does not reach the runner's own reply ...
    reply, _ = _call("compressed_reply", timeout=30, raises=False)
    assert reply == {"value": 1, "output": ""}
    # ... and a reply that held a compressed record anyway is refused before it is loaded
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * (200 << 20))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(core.CheckFailed, match="compressed record"):
        sandbox.refuse_unsafe_archive(buf.getvalue())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024   # KiB: nothing inflated


def test_a_reply_over_the_size_cap_is_refused(no_orphans):
    err, _ = _call("huge_reply", timeout=30)
    assert "the grader accepts at most 64 MiB" in str(err)


# ----------------------------------------------------------------------------------------------
# Time: a timeout skips the rest of the exercise; the submission has a deadline; a score always


def test_sleeping_at_import_costs_one_time_limit_per_exercise_and_leaves_a_score(tmp_path, no_orphans):
    proc, doc = run_grade(tmp_path, "sleeps_at_import", ("0.1", "0.2"), "--deadline", "60")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert doc["score"] == 0 and doc["tests"]
    skipped = [t for t in doc["tests"] if "ran out of time" in t["output"]]
    assert len(skipped) >= len(doc["tests"]) - 2        # one real timeout per exercise, the rest skipped


def test_the_submission_deadline_fails_what_is_left_saying_so(tmp_path, no_orphans):
    # 2 s: the first check alone (its 1 s limit, after the runner starts) uses it up, however fast the machine
    proc, doc = run_grade(tmp_path, "sleeps_at_import", ("0.1", "0.2"), "--deadline", "2", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert doc["score"] == 0
    assert any("time for grading this submission ran out" in t["output"] for t in doc["tests"])


def test_results_json_is_written_after_each_exercise(tmp_path, no_orphans):
    """A grader killed half-way (Gradescope's limit, a crash) still leaves the score so far."""
    out = tmp_path / "results.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "exercises.grade", "0.2", "0.1", "--solutions", "tests.submissions.hang",
         "--timeout", "3", "--quiet", "--gradescope", str(out)], cwd=ROOT, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    doc = json.loads(out.read_text())
    assert {t["extra_data"]["exercise"] for t in doc["tests"]} == {"0.2"}
    assert doc["score"] == 5 and "stopped before the end" in doc["output"]   # 0.2: 4 visible + 1 hidden point


# ----------------------------------------------------------------------------------------------
# Points: no lookup of answers, no points for raising, values of the right kind


def test_fresh_inputs_make_an_answer_lookup_earn_nothing(tmp_path, no_orphans):
    _, plain = run_grade(tmp_path, "lookup", ("0.2",))
    assert scores(plain)["0.2"] > 0                      # the lookup works on the published seeds...
    _, fresh = run_grade(tmp_path, "lookup", ("0.2",), "--fresh-inputs")
    assert scores(fresh)["0.2"] == 0                     # ...and earns nothing on inputs nobody has seen
    _, honest = run_grade(tmp_path, "hang", ("0.2",), "--fresh-inputs")
    assert honest["score"] == 5                          # honest work keeps every point (4 visible + 1 hidden)


def test_functions_that_only_raise_earn_nothing(tmp_path, no_orphans):
    proc, doc = run_grade(tmp_path, "raises_only", ("5a.2", "5a.4"), timeout=20)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert doc["score"] == 0
    err = [t for t in doc["tests"] if "ValueError" in t["name"]]
    assert err and all("count only once" in t["output"] for t in err)
    # in the learner's summary such a check is neither a pass nor a failure: its points are held
    assert "[HELD] " in proc.stdout and proc.stdout.count("[HELD] ") == len(err), proc.stdout[-3000:]


def test_a_complex_answer_with_the_right_real_part_fails(tmp_path, no_orphans):
    _, doc = run_grade(tmp_path, "complex_out", ("0.2",))
    assert doc["score"] == 0
    assert any("expected a floating-point tensor" in t["output"] for t in doc["tests"])


def test_compare_wants_the_same_kind_and_exactly_the_special_values():
    exp = torch.tensor([1.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    assert feedback.compare(exp.clone(), exp, "x") is None
    for wrong in ([1.0, 5.0, float("-inf"), float("nan")], [1.0, float("inf"), float("inf"), float("nan")],
                  [1.0, float("inf"), float("-inf"), 0.0]):
        assert feedback.compare(torch.tensor(wrong, dtype=torch.float64), exp, "x") is not None, wrong
    assert "dtype" in feedback.compare(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), "x")
    assert "dtype" in feedback.compare(torch.tensor([1.0 + 0j]), torch.tensor([1.0]), "x")
    assert feedback.compare(torch.tensor([1.0], dtype=torch.float32), torch.tensor([1.0], dtype=torch.float64),
                            "x") is None                 # float32 for float64 is a precision, not a kind


# ----------------------------------------------------------------------------------------------
# Files: collect takes regular files only


def test_collect_refuses_symlinks_and_special_files(tmp_path):
    from exercises.grading.release import collect_submission
    sub = tmp_path / "sub"
    (sub / "exercises").mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("root only")
    (sub / "exercises" / "collectives.py").write_text("X = 1\n")
    (sub / "moe.py").symlink_to(secret)
    (sub / "deep").mkdir()
    (sub / "deep" / "link").symlink_to(tmp_path, target_is_directory=True)
    os.mkfifo(sub / "tensor.py")
    found = collect_submission(sub, tmp_path / "out")
    assert found == ["collectives"]
    assert (tmp_path / "out" / "collectives.py").read_text() == "X = 1\n"
    assert "root only" not in (tmp_path / "out" / "moe.py").read_text()


# ----------------------------------------------------------------------------------------------
# GRADER_RUN_AS: checked before grading, one clear message


def _nobody():
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


@pytest.mark.skipif(os.geteuid() != 0 or _nobody() is None, reason="needs root and a user 'nobody'")
def test_a_run_as_user_who_cannot_read_the_submission_gets_one_clear_message(tmp_path, no_orphans):
    private = tmp_path / "private"                   # like a clone or a submission in a mode-700 home folder
    (private / "mysub").mkdir(parents=True)
    (private / "mysub" / "__init__.py").write_text("")
    (private / "mysub" / "collectives.py").write_text("from tests.submissions._ring import *  # noqa\n")
    private.chmod(0o700)
    out = tmp_path / "results.json"
    env = dict(os.environ, GRADER_RUN_AS="nobody", PYTHONPATH=f"{private}:{ROOT}")
    proc = subprocess.run([sys.executable, "-m", "exercises.grade", "0.2", "--solutions", "mysub", "--quiet",
                           "--gradescope", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    # in a clone nobody can reach at all (a mode-700 home folder), the interpreter is what it names first
    what = "cannot import the submission" if _nobody_can_run_this_python() else "cannot run the grader's Python"
    assert proc.stderr.count(f"GRADER_RUN_AS='nobody' {what}") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "unset GRADER_RUN_AS" in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["score"] == 0 and "could not run" in doc["output"]


def _nobody_can_run_this_python() -> bool:
    return nobody_who_can_run(sys.executable) is not None


@pytest.mark.skipif(not _nobody_can_run_this_python(),
                    reason="needs root, a user 'nobody', and this clone readable by nobody (not in a mode-700 folder)")
def test_reloading_or_reimporting_the_reference_finds_only_stubs_when_code_runs_as_another_user(tmp_path, no_orphans):
    env = dict(os.environ, GRADER_RUN_AS="nobody")
    proc, doc = run_grade(tmp_path, "reloads_reference", ("0.1", "0.2"), env=env, timeout=20)
    assert doc is not None, proc.stderr[-3000:]
    assert doc["score"] == 0, [(t["name"], t["output"][:300]) for t in doc["tests"] if t["score"]]
    # run as the grader itself (local mode, which the docs warn trusts the code) the reloaded module
    # is the full reference: the frozen given code notices the reload and refuses the result
    env.pop("GRADER_RUN_AS")
    proc, doc = run_grade(tmp_path, "reloads_reference", ("0.1",), env=env, timeout=20)
    assert doc is not None and doc["score"] == 0, proc.stderr[-3000:]
    assert any("changed the course's given code" in t["output"] for t in doc["tests"]), doc["tests"][0]["output"]
    assert "runs submitted code as you" in (ROOT / "docs" / "teachers.md").read_text()


@pytest.mark.skipif(not _nobody_can_run_this_python(), reason="needs root, a user 'nobody' and a clone it can read")
def test_the_runner_imports_a_stripped_course_without_hidden_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADER_RUN_AS", "nobody")
    try:
        d = Path(sandbox.runtime_dir())
        text = (d / "reference" / "collectives.py").read_text()
        assert not (d / "exercises" / "grading" / "hidden.py").exists()
        assert not (d / "exercises" / "grading" / "checks").exists()          # the grader's inputs and truths
        assert not (d / "exercises" / "grading" / "core.py").exists()
        assert not list(d.rglob("oracle_answers.pt"))
        assert "def ring_all_reduce" in text and "exercises.collectives" in text
        full = (ROOT / "reference" / "collectives.py").read_text()
        assert len(text) < len(full)                # the bodies are delegations now
        assert oct(d.stat().st_mode & 0o777) == "0o755"
    finally:
        sandbox.remove_scratch()


# ----------------------------------------------------------------------------------------------
# Evidence the submission cannot rewrite: the library's collectives are switched off where the
# exercise is to build one; points for *how* (bytes, neighbours) are feedback only


@pytest.mark.parametrize("allowed", [("p2p",), ("all_to_all",)])
def test_the_guard_shuts_every_door_to_a_library_collective_and_keeps_the_exercises_own(allowed, no_orphans):
    from reference.launch import run_world
    from tests.workers.guard_workers import doors
    for r, got in enumerate(run_world(doors, 3, allowed, timeout=60).values):
        assert got.pop("p2p" if "p2p" in allowed else "a2a") == "ok"
        if "p2p" in allowed:                       # and only round the ring: r → r+1, on the world group
            assert f"sends only to rank {(r + 1) % 3}" in got.pop("ring: backwards send")
            assert f"receives only from rank {(r - 1) % 3}" in got.pop("ring: recv from the next")
            sub = got.pop("ring: subgroup")
            assert sub == "ok" if r == 2 else "only on the world's ring" in sub, sub
        reloaded = got.pop("reloaded c10d")
        assert reloaded != "RAN", reloaded         # a reload only loses the world
        opened = {k: v for k, v in got.items() if "not allowed in exercise 9.9" not in v
                  and not v.startswith("AttributeError")}
        assert not opened, opened
        assert "not allowed in exercise 9.9" in got["dist.all_reduce"]


def test_library_collectives_behind_a_forged_trace_earn_nothing(tmp_path, no_orphans):
    proc, doc = run_grade(tmp_path, "collective_swap", ("0.1", "0.2", "5a.3"), timeout=20)
    assert doc is not None, proc.stderr[-3000:]
    assert doc["score"] == 0, [(t["name"], t["output"][:200]) for t in doc["tests"] if t["score"]]
    assert sum("is not allowed in exercise" in t["output"] for t in doc["tests"]) >= 10
    # the one check left that reads the trace (skipped blocks) carries no points; the messages are the referee's
    trace_checks = [t for t in doc["tests"] if "trace" in t["name"]]
    assert len(trace_checks) == 1 and trace_checks[0]["max_score"] == 0
    counted = [t for t in doc["tests"] if "counted by the grader" in t["name"]]
    assert len(counted) == 3 and not any(t["score"] for t in counted)


def test_without_the_guard_the_swap_earns_the_value_points_and_its_forged_trace_fools_no_count(monkeypatch,
                                                                                               no_orphans):
    """Why the guard, and why the runner counts: with the library's collectives available the values
    are right, but the forged send events count for nothing, since the runner counts what the
    ranks' kernels sent (here nothing)."""
    registry = core.load_checks()
    monkeypatch.setattr(registry["0.1"], "comm", None)
    (res,) = session.grade("tests.submissions.collective_swap", ["0.1"], include_hidden=False, timeout=20)
    lost = [c for c in res.checks if not c.passed]
    assert [c.name for c in lost] == [c.name for c in res.checks if "counted by the grader" in c.name]
    assert res.score == res.max_score > 0 and lost[0].max_score == 0
    assert "sent 0 elements in 0 message(s)" in lost[0].message


@pytest.mark.skipif(not _nobody_can_run_this_python(), reason="needs root, a user 'nobody' and a clone it can read")
def test_the_composite_attack_graded_as_nobody_on_fresh_inputs_earns_nothing_within_the_deadline(tmp_path, no_orphans):
    ids = ("0.1", "0.2", "5a.2", "5a.3", "5a.4", "5b.1", "5b.2", "5b.3", "5b.4")
    env = dict(os.environ, GRADER_RUN_AS="nobody")
    proc, doc = run_grade(tmp_path, "composite", ids, "--fresh-inputs", env=env, timeout=20)
    assert doc is not None, proc.stderr[-3000:]
    assert doc["score"] == 0, [(t["name"], t["output"][:200]) for t in doc["tests"] if t["score"]]
    assert {t["extra_data"]["exercise"] for t in doc["tests"]} == set(ids)
    assert not any("time for grading this submission ran out" in t["output"] for t in doc["tests"])   # in time
