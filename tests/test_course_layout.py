"""The course's promises about its own shape: exercise stubs mirror the reference, every package the
course imports is declared for pip and conda, and notebooks are committed without outputs."""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exercises.grading.core import load_checks

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = load_checks()
FUNCS = sorted({(ex.module, fn) for ex in REGISTRY.values() for fn in ex.functions})


@pytest.mark.parametrize("module, name", FUNCS, ids=[f"{m}.{n}" for m, n in FUNCS])
def test_exercise_stub_has_the_reference_signature_and_docstring(module, name):
    ref = getattr(importlib.import_module(f"reference.{module}"), name)
    stub = getattr(importlib.import_module(f"exercises.{module}"), name)
    assert inspect.signature(stub) == inspect.signature(ref)
    assert inspect.getdoc(stub) == inspect.getdoc(ref)


@pytest.mark.parametrize("module, name", FUNCS, ids=[f"{m}.{n}" for m, n in FUNCS])
def test_untouched_stub_raises_not_implemented_naming_its_exercise(module, name):
    src = inspect.getsource(getattr(importlib.import_module(f"exercises.{module}"), name))
    assert "raise NotImplementedError(" in src and re.search(r"Exercise \w+\.\d+", src)


def _third_party_imports() -> set[str]:
    names: set[str] = set()
    for path in list((ROOT / "reference").rglob("*.py")) + list((ROOT / "exercises").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    local = {"reference", "exercises", "tests", "__future__"}
    return {n for n in names - local if n not in sys.stdlib_module_names}


PIP_NAME = {"matplotlib": "matplotlib", "torch": "torch", "numpy": "numpy", "ipywidgets": "ipywidgets",
            "IPython": "ipykernel", "nbformat": "nbformat", "nbclient": "nbclient", "PIL": "pillow"}


def test_every_package_the_course_imports_is_declared_for_pip_and_conda():
    imported = _third_party_imports()
    pyproject = (ROOT / "pyproject.toml").read_text()
    env = (ROOT / "environment.yml").read_text()
    for mod in sorted(imported):
        dist = PIP_NAME.get(mod, mod)
        assert re.search(rf'"{re.escape(dist)}[=<>!~\[ "]', pyproject), \
            f"{dist} (imported as {mod}) missing from pyproject.toml"
        assert re.search(rf"-\s+{re.escape(dist)}\b", env), f"{dist} (imported as {mod}) missing from environment.yml"
    for needed in ("torch", "jupyterlab", "ipywidgets", "matplotlib", "nbval"):
        assert re.search(rf"-\s+{needed}\b", env), f"environment.yml must list {needed}"


def test_notebooks_are_committed_without_outputs():
    tracked = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:  # not a git checkout (e.g. an unpacked release): check the files present
        tracked = [str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb")]
    assert tracked
    for nb in tracked:
        data = json.loads((ROOT / nb).read_text())
        for cell in data["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, f"{nb} has outputs"
        assert "widgets" not in data.get("metadata", {}), f"{nb} carries widget state"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
