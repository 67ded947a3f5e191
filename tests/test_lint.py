"""The lint: ``ruff check`` with the configuration in ``pyproject.toml`` finds nothing, and the layout
rules a reader relies on hold (no module over 500 lines; every package says what lives where)."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE = ["reference", "exercises", "tests", "scripts", "benchmarks", "docs"]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed (it is part of make test's extras: .venv/bin/pip install ruff)")


def test_ruff_finds_nothing():
    proc = subprocess.run([*_ruff(), "check", "--output-format", "concise", *CODE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_module_is_longer_than_500_lines():
    long = {str(p.relative_to(ROOT)): n for d in ("reference", "exercises") for p in (ROOT / d).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines (split them by role): {long}"


def test_every_package_says_what_lives_where():
    quiet = []
    for d in ("reference", "exercises"):
        for init in (ROOT / d).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            if not doc or len(doc.split()) < 12:
                quiet.append(str(init.relative_to(ROOT)))
    assert not quiet, f"packages whose __init__ docstring does not say what lives where: {quiet}"
