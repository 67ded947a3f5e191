"""The Gradescope bundle (``make autograder``): ``run_autograder`` grades a submitted
``exercises/`` against the full reference, hidden checks included, and writes results.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from exercises.grading import core, release
from tests.conftest import nobody_who_can_run

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = core.load_checks()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("autograder")
    # the fresh-input check of the whole course is tests/grading/test_attacks.py's (and the refusal
    # test_make_autograder_refuses_a_bundle_whose_reference_loses_points_on_fresh_inputs's): here the build
    # verifies one exercise, enough to show it runs the check
    z = release.build_autograder(out, verify_ids=["0.1"])
    src = out / "source"
    with zipfile.ZipFile(z) as f:
        f.extractall(src)
    for name in ("run_autograder", "setup.sh"):
        (src / name).chmod(0o755)
    return src


def test_bundle_has_gradescope_scripts_at_its_root_full_reference_and_hidden_checks(bundle):
    assert (bundle / "setup.sh").exists() and (bundle / "run_autograder").exists()
    assert (bundle / "exercises" / "grading" / "hidden.py").exists()
    for ex, name, fn in core.graded_functions(REGISTRY):
        assert fn.__code__.co_code   # the reference here is the full one: same files as the repo
    assert (bundle / "reference" / "collectives.py").read_text() == (ROOT / "reference" / "collectives.py").read_text()
    assert subprocess.run(["bash", "-n", str(bundle / "setup.sh")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(bundle / "run_autograder")]).returncode == 0
    assert "torch==2.13.0" in (bundle / "scripts" / "bootstrap.py").read_text()
    for name in ("LICENSE", "LICENSE-CONTENT"):          # the bundle carries both licences
        assert (bundle / name).read_text() == (ROOT / name).read_text()


def test_run_autograder_grades_a_submission_end_to_end(bundle, tmp_path, no_orphans):
    other = next((ex.id for ex in REGISTRY.values() if ex.module != "collectives"), None)
    ids = ["0.1", "0.2"] + ([other] if other else [])
    sub = tmp_path / "submission"
    (sub / "exercises" / "grading").mkdir(parents=True)
    (sub / "exercises" / "collectives.py").write_text((ROOT / "tests" / "submissions" / "_ring.py").read_text())
    # a submitted grader is ignored: only the exercise modules are taken
    (sub / "exercises" / "grading" / "core.py").write_text("raise SystemExit('not me')\n")
    results = tmp_path / "results" / "results.json"
    env = dict(os.environ, AUTOGRADER_SOURCE=str(bundle), AUTOGRADER_SUBMISSION=str(sub),
               AUTOGRADER_RESULTS=str(results), AUTOGRADER_PYTHON=sys.executable, AUTOGRADER_IDS=" ".join(ids),
               GRADER_TIMEOUT="20")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(bundle / "run_autograder")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(results.read_text())
    by_ex: dict[str, list[dict]] = {}
    for t in doc["tests"]:
        by_ex.setdefault(t["extra_data"]["exercise"], []).append(t)
    for i in ("0.1", "0.2"):
        assert all(t["status"] == "passed" for t in by_ex[i])
        assert any(t["visibility"] == "hidden" for t in by_ex[i])      # the teachers' hidden checks ran
    if other:
        assert all(t["score"] == 0 and "not implemented" in t["output"] for t in by_ex[other])
    assert doc["score"] == sum(REGISTRY[i].points for i in ("0.1", "0.2"))
    assert "hidden" not in doc["output"]


def test_run_autograder_writes_a_zero_result_when_the_grader_itself_cannot_run(bundle, tmp_path):
    results = tmp_path / "results.json"
    env = dict(os.environ, AUTOGRADER_SOURCE=str(bundle), AUTOGRADER_SUBMISSION=str(tmp_path / "none"),
               AUTOGRADER_RESULTS=str(results), AUTOGRADER_PYTHON=sys.executable, AUTOGRADER_IDS="no-such-exercise")
    proc = subprocess.run(["bash", str(bundle / "run_autograder")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    doc = json.loads(results.read_text())
    assert doc["score"] == 0 and "autograder itself failed" in doc["output"]


@pytest.mark.skipif(nobody_who_can_run(sys.executable) is None,
                    reason="needs root, a user 'nobody', and this clone's interpreter runnable by nobody")
def test_a_locked_bundle_grades_as_nobody_who_can_read_no_solution_check_or_hidden_check(bundle, no_orphans):
    import tempfile
    user = nobody_who_can_run(sys.executable)
    with tempfile.TemporaryDirectory(prefix="locked-bundle-") as d:    # pytest's own tmp folders are mode 700
        os.chmod(d, 0o755)
        _grade_locked(bundle, Path(d), user)


def _grade_locked(bundle: Path, tmp_path: Path, user) -> None:
    import shutil
    src = tmp_path / "source"
    shutil.copytree(bundle, src)
    (src / ".venv").mkdir()                                 # stands for setup.sh's interpreter folder
    (src / ".venv" / "marker").write_text("readable")
    subprocess.run(["bash", str(src / "lock_source.sh"), str(src)], check=True)

    def can_read(path: Path) -> bool:
        return subprocess.run(["cat", str(path)], capture_output=True, user=user.pw_uid, group=user.pw_gid,
                              extra_groups=[]).returncode == 0
    assert can_read(src / ".venv" / "marker")
    for rel in ("reference/collectives.py", "exercises/grading/hidden.py", "exercises/grading/checks/collectives.py",
                "exercises/grading/core.py", "run_autograder"):
        assert not can_read(src / rel), rel
    # and grading still works: the honest ring earns full marks, reloading the reference earns nothing
    for fixture, full in (("_ring.py", True), ("reloads_reference/collectives.py", False)):
        sub = tmp_path / f"sub-{full}"
        (sub / "exercises").mkdir(parents=True)
        (sub / "exercises" / "collectives.py").write_text((ROOT / "tests" / "submissions" / fixture).read_text())
        sub.chmod(0o755)
        results = tmp_path / f"results-{full}" / "results.json"
        env = dict(os.environ, AUTOGRADER_SOURCE=str(src), AUTOGRADER_SUBMISSION=str(sub), GRADER_RUN_AS="nobody",
                   AUTOGRADER_RESULTS=str(results), AUTOGRADER_PYTHON=sys.executable, AUTOGRADER_IDS="0.1 0.2",
                   GRADER_TIMEOUT="20")
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(["bash", str(src / "run_autograder")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        doc = json.loads(results.read_text())
        lost = [(t["name"], t["output"][:200]) for t in doc["tests"] if t["status"] != "passed"]
        if full:
            assert doc["score"] == sum(REGISTRY[i].points for i in ("0.1", "0.2")), (lost, proc.stderr[-2000:])
        else:
            assert doc["score"] == 0, [(t["name"], t["output"][:200]) for t in doc["tests"] if t["score"]]
