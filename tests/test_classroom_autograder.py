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

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = core.load_checks()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("autograder")
    z = release.build_autograder(out)
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
