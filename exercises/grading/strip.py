"""Taking the solutions out: the copies of the course that learners and their code see.

:func:`copy_tree` copies parts of the course (never caches, recordings or recorded answers);
:func:`strip_solutions` turns every graded reference function in a copy into a call to the
learner's function.  The student release (:mod:`.release`) and the runner's own copy of the course
under ``GRADER_RUN_AS`` (:func:`.sandbox.runtime_dir`) are both made this way.
"""
from __future__ import annotations

import ast
import inspect
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "NEVER", "STUDENT_LEAVE_OUT", "RUNTIME_LEAVE_OUT", "copy_tree", "delegate_source",
           "strip_solutions"]


NEVER = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", "oracle_answers.pt", "_recorded", ".progress.json"}


STUDENT_LEAVE_OUT = {"exercises/grading/hidden.py", "exercises/grading/release.py"}


# where submitted code runs as another user (sandbox.runtime_dir): not the grader's judging code either
RUNTIME_LEAVE_OUT = STUDENT_LEAVE_OUT | {"exercises/grading/checks", "exercises/grading/core.py",
                                         "exercises/grading/session.py", "exercises/grading/report.py"}


def copy_tree(paths: list[str], dest: Path, leave_out: set[str] = frozenset()) -> None:
    for rel in paths:
        src = ROOT / rel
        if not src.exists():
            continue
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
            continue
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = [d for d in dirnames if d not in NEVER and not d.endswith(".egg-info")]
            for f in filenames:
                p = Path(dirpath) / f
                r = p.relative_to(ROOT).as_posix()
                if f in NEVER or f.endswith((".pyc", ".pyo")) or any(r == x or r.startswith(x + "/")
                                                                     for x in leave_out):
                    continue
                (dest / r).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dest / r)


def _call_args(args: ast.arguments) -> str:
    """Source of a call that passes a function's parameters on unchanged."""
    parts = [a.arg for a in args.posonlyargs] + [a.arg for a in args.args]
    if args.vararg:
        parts.append("*" + args.vararg.arg)
    parts += [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
    if args.kwarg:
        parts.append("**" + args.kwarg.arg)
    return ", ".join(parts)


def delegate_source(path: Path, replacements: dict[str, str]) -> str:
    """``path``'s source with each module-level function ``name`` in ``replacements`` reduced to
    its docstring plus ``return <learner module>.<name>(...)``."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    edits = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in replacements:
            body = node.body
            has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str)
            first = body[1] if has_doc and len(body) > 1 else (None if has_doc else body[0])
            indent = " " * (body[0].col_offset)
            learner = replacements[node.name]
            new = (f"{indent}# The solution is yours to write: {learner}.{node.name} (this release has no body here).\n"
                   f"{indent}from {learner} import {node.name} as _yours\n"
                   f"{indent}return _yours({_call_args(node.args)})\n")
            start = (first.lineno - 1) if first is not None else node.end_lineno   # 0-based line after the docstring
            if first is not None and getattr(first, "decorator_list", None):
                start = first.decorator_list[0].lineno - 1
            edits.append((start, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    out = "".join(lines)
    ast.parse(out)  # still Python
    return out


def strip_solutions(dest: Path, registry=None) -> list[tuple[str, str, str]]:
    """Replace every graded reference function under ``dest`` by a delegation; return
    ``(exercise id, file relative to dest, function name)`` for each."""
    from . import core
    by_file: dict[Path, dict[str, str]] = {}
    done = []
    for ex, name, fn in core.graded_functions(registry):
        src = Path(inspect.getsourcefile(fn)).resolve()
        rel = src.relative_to(ROOT)
        by_file.setdefault(dest / rel, {})[fn.__name__] = f"exercises.{ex.module}"
        done.append((ex.id, rel.as_posix(), fn.__name__))
    for path, repl in by_file.items():
        path.write_text(delegate_source(path, repl))
    return done
