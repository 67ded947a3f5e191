"""The student release (``make release``): no solution bodies, hidden checks left out, a grader
that scores the stubs 0 and a finished learner full marks from recorded reference answers, and
notebooks that run (cells that need an exercise say so instead of failing).

The release is built once per session (conftest.py), with the reference answers of one exercise per
learner module (to bound the time), taken from the session's one grading of the reference on the published
inputs (``course_grades``); the stripping and the scans cover every graded function.
"""
from __future__ import annotations

import ast
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exercises.grading import core, leaks, release
from tests.conftest import COURSE_ORACLE, browser_available, release_answers, release_ids
from tests.release_notebooks import WHERE, cell_text, explains, problems

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = core.load_checks()
GRADED = core.graded_functions(REGISTRY)
IDS = release_ids()


@pytest.fixture(scope="module")
def built(student_release) -> Path:
    return student_release


def grade_in(release_dir: Path, tmp: Path, ids) -> dict:
    res = tmp / "results.json"
    proc = subprocess.run([sys.executable, "-m", "exercises.grade", *ids, "--quiet", "--gradescope", str(res)],
                          cwd=release_dir, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(res.read_text())


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("ex,name,fn", GRADED, ids=[f"{e.id}-{n}" for e, n, _ in GRADED])
def test_graded_function_in_release_is_only_docstring_and_delegation_to_learner(built, ex, name, fn):
    rel = Path(inspect.getsourcefile(fn)).resolve().relative_to(ROOT)
    node = _function(ast.parse((built / rel).read_text()), fn.__name__)
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        assert ast.get_docstring(node) == inspect.getdoc(fn)     # the docstring is kept
        body = body[1:]
    assert len(body) == 2, ast.unparse(node)
    imp, ret = body
    assert isinstance(imp, ast.ImportFrom) and imp.module == f"exercises.{ex.module}" and imp.names[0].name == name
    assert isinstance(ret, ast.Return) and isinstance(ret.value, ast.Call)
    original = _function(ast.parse(Path(inspect.getsourcefile(fn)).read_text()), fn.__name__)
    assert ast.dump(node.args) == ast.dump(original.args)      # same signature


def test_no_distinctive_solution_line_survives_anywhere_in_the_release(built):
    release_text = "\n".join(p.read_text(errors="replace") for p in built.rglob("*") if p.suffix in (".py", ".ipynb"))
    lines = leaks.solution_lines(REGISTRY)      # what learners are shown anyway, or shared plumbing, left out
    assert sum(map(len, lines.values())) >= len(GRADED)   # the scan looks at real solution lines
    found = leaks.find_leaks(release_text, lines)
    assert not found, "solution lines found in the release:\n" + "\n".join(f"{i} {n}: {s!r}" for i, n, s in found)


def test_the_release_readme_is_the_students_and_everything_it_names_is_there(built):
    import re
    text = (built / "README.md").read_text()
    assert "make lab" in text and "check(" in text and "hint(" in text and "make grade" in text
    # no teacher's material: the tests, benchmarks and teachers' notes are not in a student's copy
    for absent in ("tests/", "benchmarks/", "docs/teachers.md", "make test", "make release", "make autograder"):
        assert absent not in text, absent
    # every path it names exists in the release
    named = set(re.findall(r"`((?:notebooks|exercises|reference|scripts)/[\w./-]*)`", text))
    named |= {f"notebooks/{n}.ipynb" for n in re.findall(r"\| `(\d\d\w*_\w+)` \|", text)}
    named |= {f"exercises/{f}" for f in re.findall(r"in `(\w+\.py)`", text)}
    missing = sorted(n for n in named if not (built / n).exists())
    assert named and not missing, missing
    # and every make target it names is in the release's Makefile, which has no test suite to run
    makefile = (built / "Makefile").read_text()
    for target in set(re.findall(r"make (\w+)", text)):
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert not re.search(r"^(test|release|autograder):", makefile, re.M)


def test_release_has_no_hidden_checks_no_oracle_of_its_own_and_a_zip(built):
    assert not (built / "exercises" / "grading" / "hidden.py").exists()
    assert not (built / "exercises" / "grading" / "release.py").exists()
    assert not (built / "tests").exists()
    assert (built / "exercises" / "grading" / "oracle_answers.pt").stat().st_size > 0
    assert (built.parent / f"{release.NAME}.zip").stat().st_size > 0
    for p in built.rglob("*.py"):
        assert "hidden_check(\"" not in p.read_text()


def test_release_carries_both_licences(built):
    for name in ("LICENSE", "LICENSE-CONTENT"):
        assert (built / name).read_text() == (ROOT / name).read_text()
    assert "Apache License" in (built / "LICENSE").read_text()
    assert "Attribution 4.0 International" in (built / "LICENSE-CONTENT").read_text()


def test_release_grader_scores_untouched_stubs_zero_saying_not_implemented(built, tmp_path):
    doc = grade_in(built, tmp_path, IDS)
    assert doc["score"] == 0 and doc["tests"]
    assert all(t["visibility"] == "visible" for t in doc["tests"])           # no hidden checks in a release
    assert all("not implemented" in t["output"] for t in doc["tests"]), \
        [t["output"][:200] for t in doc["tests"] if "not implemented" not in t["output"]]


def test_release_grader_gives_a_finished_learner_full_marks_from_recorded_answers(built, tmp_path):
    done = tmp_path / "finished"
    shutil.copytree(built, done)
    release.install_finished_learner(done, REGISTRY)
    doc = grade_in(done, tmp_path, IDS)
    assert doc["tests"] and all(t["status"] == "passed" for t in doc["tests"]), \
        [t["output"][:300] for t in doc["tests"] if t["status"] != "passed"]
    assert doc["score"] == sum(REGISTRY[i].points - sum(c.points for c in REGISTRY[i].checks if c.hidden) for i in IDS)


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_the_answers_the_session_shares_are_what_make_release_records(course_grades):
    """The session's release is built from the oracle answers its one grading of the reference recorded
    (conftest.py: release_answers); ``make release`` records them with record_oracle: the same, key for key."""
    shared = release_answers(course_grades)
    assert shared, "the reference lost points on the release's exercises, or no answers were recorded"
    for ex_id in ("4.4", "5c.1"):                   # a pipeline oracle (dicts, lists) and the grid's (lists)
        assert ex_id in IDS
        recorded, _ = release.record_oracle([ex_id])
        ours = {k: v for (i, _), answers in COURSE_ORACLE.items() if i == ex_id for k, v in answers.items()}
        assert recorded and recorded.keys() == ours.keys(), ex_id
        assert all(_same(recorded[k], ours[k]) for k in recorded), ex_id
        assert recorded.keys() <= shared.keys()


RELEASE_NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("name", RELEASE_NOTEBOOKS)
def test_release_notebook_explains_with_stubs_untouched_and_asks_for_exercises_instead_of_failing(
        built, name, monkeypatch):
    """Every release notebook runs with the stubs as shipped.  No explaining cell may say that a
    solution is needed: widgets and measurements show what the reference recorded when the release
    was built.  Grading cells say "not implemented"."""
    if browser_available():
        pytest.skip("run in JupyterLab, widgets moved, with the same checks, by tests/notebook/test_browser.py")
    nb = built / "notebooks" / name
    import nbformat
    from nbclient import NotebookClient
    book = nbformat.read(nb, as_version=4)
    # The kernel must import the release's own packages, not this repository's.
    monkeypatch.setenv("PYTHONPATH", str(built))
    book.cells.append(nbformat.v4.new_code_cell(WHERE))
    NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(nb.parent)}}).execute()
    imported = [ln for ln in cell_text(book.cells[-1]).splitlines() if ln.startswith("IMPORTED")][-1].split()[1:]
    bad = problems(book.cells[:-1], imported, str(built))
    assert not bad, f"{name} in the release:\n" + "\n".join(bad)


def test_explaining_cells_are_told_from_grading_cells():
    import nbformat
    assert explains(nbformat.v4.new_code_cell("run = demos.ring_runs()"))
    assert not explains(nbformat.v4.new_code_cell('from exercises import check\ncheck("5a.1")'))
    assert not explains(nbformat.v4.new_code_cell('summary = check("0.1")'))
    tagged = nbformat.v4.new_code_cell("worlds[4].run(primer.ring_all_reduce, 16, 'exercises.collectives')")
    tagged.metadata["tags"] = ["exercise"]
    assert not explains(tagged) and not explains(nbformat.v4.new_markdown_cell("check('0.1')"))
