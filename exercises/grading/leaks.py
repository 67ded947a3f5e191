"""What would give a solution away, and a scan of any text for it: the student release's files and the pages
of the course's website are scanned the same way.

A reference solution shows itself by its *distinctive lines*: each line of a graded function's body that is
long enough to mean something (30 characters or more, not a comment) and that learners are not shown anyway —
not in the exercise stubs, the notebooks or the tiered hints, and not shared plumbing that also stands in
the reference's non-graded code.  A text that contains one of them carries that solution.
"""
from __future__ import annotations

import ast
import html
import inspect
from html.parser import HTMLParser
from pathlib import Path

from . import core
from .strip import ROOT

__all__ = ["solution_lines", "find_leaks", "page_text"]


def _body(fn) -> list[str]:
    """The lines of a graded function's body, after its docstring."""
    path = Path(inspect.getsourcefile(fn))
    source = path.read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == fn.__name__)
    start = node.body[1].lineno if ast.get_docstring(node) and len(node.body) > 1 else node.body[0].lineno
    return source.splitlines()[start - 1:node.end_lineno]


def _public() -> str:
    """What learners are shown on purpose: the stubs, the notebooks and the tiered hints."""
    import exercises
    files = list((ROOT / "exercises").glob("*.py")) + list((ROOT / "notebooks").glob("*.ipynb"))
    shown = [p.read_text() for p in files]
    shown += [t for tiers in exercises.hints().values() for t in tiers]
    return "\n".join(shown)


def solution_lines(registry=None) -> dict[tuple[str, str], list[str]]:
    """{(exercise id, function name): the distinctive lines of its reference body} for every graded function."""
    graded = core.graded_functions(registry or core.load_checks())
    bodies = {(ex.id, name): _body(fn) for ex, name, fn in graded}
    outside = "\n".join(p.read_text() for p in (ROOT / "reference").rglob("*.py"))
    for lines in bodies.values():
        outside = outside.replace("\n".join(lines), "")
    public = _public()
    out = {}
    for key, lines in bodies.items():
        stripped = (ln.strip() for ln in lines)
        out[key] = [s for s in stripped if len(s) >= 30 and not s.startswith("#") and s not in outside
                    and s not in public]
    return out


def find_leaks(text: str, lines: dict[tuple[str, str], list[str]] | None = None) -> list[tuple[str, str, str]]:
    """``(exercise id, function, line)`` for every distinctive solution line found in ``text``."""
    lines = solution_lines() if lines is None else lines
    return [(ex_id, name, s) for (ex_id, name), body in lines.items() for s in body if s in text]


class _Text(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def page_text(page: str) -> str:
    """An HTML page as the texts a scan must see: the text a reader reads (highlighted code's spans joined up
    again) and the markup itself with its entities decoded (attributes, inline scripts)."""
    parser = _Text()
    parser.feed(page)
    return "".join(parser.parts) + "\n" + html.unescape(page)
