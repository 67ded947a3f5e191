"""Fast guards for the release's predict → animate loop (the slow, complete check is
tests/grading/test_release.py, which runs every release notebook with the stubs untouched)."""
from pathlib import Path

import nbformat
import pytest

from exercises.grading import core
from reference.notebook import recorded

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_recordable_needs_registered_exercises_and_has_matchable_defaults():
    registry = core.load_checks()
    recs = recorded.import_all()
    assert recs
    for key, rec in recs.items():
        assert set(rec.needs) <= set(registry), (key, rec.needs)
        for kwargs in [{}] + rec.variants:
            rec.call_key((), kwargs)                    # defaults can be matched to a recording


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_explaining_cells_go_through_recordable_demos_not_needs(path):
    """A `with needs(...)` block prints "needs your solution" in the release: only cells tagged
    `exercise` (which run the learner's code on purpose) may use it."""
    book = nbformat.read(path, as_version=4)
    bad = [i for i, c in enumerate(book.cells) if c.cell_type == "code" and "with needs(" in c.source
           and "exercise" not in c.metadata.get("tags", [])]
    assert not bad, f"{path.name}: cells {bad} use needs(...) instead of a recordable demo"


def test_every_exercise_a_notebook_grades_is_registered():
    """nbval leaves the grading cells (``check("N.M")``) to the grader tests (tests/conftest.py): the ids
    they name must be exercises the grader knows, as ``check`` would otherwise say when run."""
    import re

    registry = core.load_checks()
    graded = []
    for path in NOTEBOOKS:
        for c in nbformat.read(path, as_version=4).cells:
            if c.cell_type == "code" and "check(" in c.source:
                for call in re.findall(r"^\s*(?:\w+\s*=\s*)?check\(([^)]*)\)", c.source, re.M):
                    ids = re.findall(r"[\"']([\w.]+)[\"']", call)
                    assert ids and set(ids) <= set(registry), (path.name, call)
                    graded += ids
    assert graded
