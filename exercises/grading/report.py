"""The grader's three outputs: a terminal/notebook summary, Gradescope's results.json, JUnit XML.

Gradescope's format (its autograder specification): top-level ``score``, ``execution_time``,
``output`` and ``tests``; each test has ``name``, ``number``, ``score``, ``max_score``, ``status``
(``"passed"``/``"failed"``), ``output`` and ``visibility`` (``"visible"``, ``"hidden"``,
``"after_due_date"`` or ``"after_published"``).  Teachers' hidden checks are ``"hidden"``; the
top-level ``output`` and the summary a student sees mention visible checks only.  Files are written
by the grader's own process, last, through a temporary file and a rename.
"""
from __future__ import annotations

import html
import io
import json
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from .core import ExerciseResult


def _fmt(x: float) -> str:
    return f"{x:g}"


def summary_text(results: Sequence[ExerciseResult], *, show_hidden: bool = True) -> str:
    lines = []
    total = max_total = 0.0
    for ex in results:
        total += ex.score
        max_total += ex.max_score
        lines.append(f"Exercise {ex.exercise.id} — {ex.exercise.title}: {_fmt(ex.score)}/{_fmt(ex.max_score)}")
        for c in ex.checks:
            if c.hidden and not show_hidden:
                continue
            mark = "PASS" if c.passed else ("HELD" if c.held else "FAIL")
            tag = " (hidden)" if c.hidden else ""
            lines.append(f"  [{mark}] {c.name}{tag}  {_fmt(c.score)}/{_fmt(c.max_score)}  ({c.seconds:.1f} s)")
            if c.message:
                lines.extend("        " + ln for ln in c.message.splitlines())
    lines.append(f"Total: {_fmt(total)}/{_fmt(max_total)}")
    return "\n".join(lines)


def summary_html(results: Sequence[ExerciseResult]) -> str:
    parts = []
    for ex in results:
        ok = ex.score == ex.max_score and ex.max_score > 0
        colour = "#2e7d32" if ok else ("#c62828" if ex.score == 0 else "#ef6c00")
        parts.append(f"<div style='margin:4px 0'><b style='color:{colour}'>Exercise {html.escape(ex.exercise.id)} — "
                     f"{html.escape(ex.exercise.title)}: {_fmt(ex.score)}/{_fmt(ex.max_score)}</b>"
                     "<ul style='margin:2px 0'>")
        for c in ex.checks:
            # ✔/✘ are in the common text fonts (DejaVu); emoji fonts are often missing on Linux.
            mark = ("<b style='color:#2e7d32'>✔ PASS</b>" if c.passed else
                    "<b style='color:#ef6c00'>⏸ HELD</b>" if c.held else "<b style='color:#c62828'>✘ FAIL</b>")
            msg = (f"<pre style='white-space:pre-wrap;margin:2px 0 6px 0'>{html.escape(c.message)}</pre>"
                   if c.message else "")
            parts.append(f"<li>{mark} {html.escape(c.name)} <span style='color:#777'>"
                         f"({_fmt(c.score)}/{_fmt(c.max_score)}, {c.seconds:.1f} s)</span>{msg}</li>")
        parts.append("</ul></div>")
    return "".join(parts)


def _write_atomic(path: str | Path, text: str) -> None:
    """Write via a temporary file and a rename: whatever was at ``path`` (a file a submission
    wrote, a symlink it planted) is replaced, never followed or appended to."""
    import os
    import tempfile
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".results-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def gradescope_doc(results: Sequence[ExerciseResult], *, execution_time: float | None = None, output: str = "") -> dict:
    """Gradescope's results.json as a dict: one test per check, numbered ``<exercise>.<k>``."""
    tests = []
    for ex in results:
        for i, c in enumerate(ex.checks, 1):
            tests.append({
                "name": f"Exercise {ex.exercise.id}: {c.name}",
                "number": f"{ex.exercise.id}.{i}",
                "score": c.score,
                "max_score": c.max_score,
                "status": "passed" if c.passed else "failed",
                "output": c.message or "passed",
                "output_format": "text",
                "visibility": "hidden" if c.hidden else "visible",
                "tags": [f"exercise {ex.exercise.id}"],
                "extra_data": {"exercise": ex.exercise.id, "seconds": round(c.seconds, 3)},
            })
    visible = [(ex, [c for c in ex.checks if not c.hidden]) for ex in results]
    lines = [f"Exercise {ex.exercise.id} — {ex.exercise.title}: "
             f"{_fmt(sum(c.score for c in cs))}/{_fmt(sum(c.max_score for c in cs))} on the visible checks"
             for ex, cs in visible]
    doc = {"score": sum(ex.score for ex in results), "tests": tests,
           "output": "\n".join(([output] if output else []) + lines), "output_format": "text",
           "test_output_format": "text",
           "stdout_visibility": "hidden",
           "extra_data": {"max_score": sum(ex.max_score for ex in results)}}
    if execution_time is not None:
        doc["execution_time"] = round(execution_time, 2)
    return doc


def gradescope(results: Sequence[ExerciseResult], path: str | Path, *, execution_time: float | None = None,
               output: str = "") -> dict:
    """Write Gradescope's results.json (its autograder specification) to ``path``; return it.
    ``output`` is a line put first in the text every student sees (e.g. why grading stopped)."""
    doc = gradescope_doc(results, execution_time=execution_time, output=output)
    _write_atomic(path, json.dumps(doc, indent=2))
    return doc


def junit(results: Sequence[ExerciseResult], path: str | Path) -> None:
    checks = [c for ex in results for c in ex.checks]
    suites = ET.Element("testsuites", name="splitting-the-work", tests=str(len(checks)),
                        failures=str(sum(not c.passed for c in checks)),
                        time=f"{sum(c.seconds for c in checks):.3f}")
    for ex in results:
        s = ET.SubElement(suites, "testsuite", name=f"Exercise {ex.exercise.id}: {ex.exercise.title}",
                          tests=str(len(ex.checks)), failures=str(sum(not c.passed for c in ex.checks)),
                          time=f"{sum(c.seconds for c in ex.checks):.3f}")
        for c in ex.checks:
            tc = ET.SubElement(s, "testcase", classname=f"exercise_{ex.exercise.id.replace('.', '_')}",
                               name=c.name, time=f"{c.seconds:.3f}")
            props = ET.SubElement(tc, "properties")
            props.append(ET.Element("property", name="points", value=f"{_fmt(c.score)}/{_fmt(c.max_score)}"))
            props.append(ET.Element("property", name="visibility", value="hidden" if c.hidden else "visible"))
            if not c.passed:
                f = ET.SubElement(tc, "failure", message=(c.message.splitlines() or ["failed"])[0])
                f.text = c.message
    buf = io.BytesIO()
    ET.ElementTree(suites).write(buf, encoding="utf-8", xml_declaration=True)
    _write_atomic(path, buf.getvalue().decode("utf-8"))
