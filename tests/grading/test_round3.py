"""Every route of the third hostile-student round, graded as the autograder grades (fresh inputs).

Each fixture package under ``tests/submissions/round3_*`` carries one route per exercise (see its
``__init__``).  A route that skips the skill earns nothing on the checks it attacks; a partial route
(one that does part of the work honestly) earns less than full marks, and loses exactly the check
that tells it apart.  The classes these routes come from, and the rule that closes each, are in
docs/teachers.md ("What protects the score").
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exercises.grading import session
from tests.conftest import nobody_who_can_run

ROOT = Path(__file__).resolve().parents[2]

# package -> {exercise: (the most it may score, words one of its failed checks must say)}
ROUTES = {
    "round3_peek": {          # frame_peek; snapshot_no_overlap; zero_unsharded; the given_* helpers
        "0.1": (0, "no list of every rank's inputs"), "0.2": (0, "no list of every rank's inputs"),
        "3.1": (0, "no list of every rank's gradients"),
        "3.2": (7, "Overlap means the bucket's all-reduce leaves from grad_ready"),
        "3.3": (0, "moved from values the grader wrote there"),
        "5a.2": (0, "is switched off while exercise 5a.2 is graded"),
        "5a.3": (0, "no list of every rank's inputs"), "5a.4": (0, "no list of every rank's inputs"),
        "5a.5": (0, "no list of every rank's inputs"), "5b.2": (0, "no list of every rank's inputs"),
        "5b.1": (0, "is switched off while exercise 5b.1 is graded"),
        "5b.3": (0, "is switched off while exercise 5b.3 is graded"),
        "5c.1": (0, "is switched off while exercise 5c.1 is graded"),
        "5c.2": (0, "is switched off while exercise 5c.2 is graded"),
    },
    "round3_gather": {        # p2p_gather; space_table
        "0.1": (0, "refused in exercise 0.1"),
        "0.2": (1, "refused in exercise 0.2"),      # on 2 ranks the one exchange IS the ring: only that check
        "5a.3": (2, "refused in exercise 5a.3"), "5a.5": (2, "refused in exercise 5a.5"),   # W ≤ 2: one hop
        "5c.1": (0, "no recorded answer"),
    },
    "round3_relay": {         # relay round the ring; frozen_verify_off; dummy_post; published_lookup
        "0.1": (2, "messages per rank is the whole pattern"),
        "0.2": (0, "changed the course's given code"),
        "3.2": (7, "something was reduced twice"),
        "5a.3": (9, "A rank that keeps every rank's K/V"),
        "5a.5": (12, "A rank that keeps every rank's K/V"),
        "5c.1": (0, "not a published input"),
    },
    "round3_inplace": {"0.1": (1, "changed its input tensor")},     # its reduce-scatter is honest
}


@pytest.mark.parametrize("package", sorted(ROUTES))
def test_every_route_of_round_three_earns_nothing_on_what_it_attacks(package, fresh, no_orphans):
    fresh(os.urandom(32))
    routes = ROUTES[package]
    results = session.grade(f"tests.submissions.{package}", list(routes), include_hidden=False, timeout=30)
    for res in results:
        most, words = routes[res.exercise.id]
        said = "\n".join(c.message for c in res.checks if not c.passed)
        earned = [(c.name, c.score) for c in res.checks if c.score]
        assert res.score <= most and res.score < res.max_score, (res.exercise.id, earned)
        assert words in said, (res.exercise.id, said[:3000])


@pytest.mark.skipif(nobody_who_can_run(sys.executable) is None,
                    reason="needs root, a user 'nobody', and this clone's interpreter runnable by nobody")
def test_a_hostile_environment_stays_in_its_exercise_when_graded_as_another_user(tmp_path, no_orphans):
    """hostile_env: poisoned torch, a thread that never ends, 1.2 GB, a detached sleeper, a planted
    pickle and sitecustomize.py — none of it reaches the grader, the files, or the next grading."""
    for f in ("/tmp/round3_hostile_payload_ran", "/tmp/round3_hostile_site_ran"):
        Path(f).unlink(missing_ok=True)
    env = dict(os.environ, GRADER_RUN_AS="nobody")

    def grade(solutions: str, ids: str, *extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "exercises.grade", *ids.split(), "--solutions", solutions,
                               "--quiet", "--timeout", "30", *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    out = grade("tests.submissions.round3_hostile", "5a.1")
    assert "thread your code started is still running" in out, out[-3000:]
    assert not (ROOT / "exercises" / "grading" / "oracle_answers.pt").exists()
    assert not [p for p in sys.path if p and os.path.exists(os.path.join(p, "sitecustomize.py"))
                and "round3_hostile" in Path(p, "sitecustomize.py").read_text(errors="replace")]
    sleepers = subprocess.run(["pgrep", "-u", "nobody", "-f", "/bin/sleep 3600"], capture_output=True,
                              text=True).stdout
    assert not sleepers.strip(), sleepers
    nxt = grade("tests.submissions.round3_hostile", "5c.1", "--fresh-inputs")   # the next grading: untouched
    total = re.search(r"Total: (\d+)/(\d+)", nxt)
    assert total and total.group(1) == total.group(2), nxt[-2000:]
    assert not Path("/tmp/round3_hostile_payload_ran").exists() and not Path("/tmp/round3_hostile_site_ran").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)
