"""The grader's three outputs: a terminal/notebook summary, Gradescope's results.json, JUnit XML.

Gradescope's format (its autograder specification): top-level ``score`` and ``tests``; each test has
``name``, ``number``, ``score``, ``max_score``, ``status``, ``output`` and ``visibility``
(``"visible"``, ``"hidden"``, ``"after_due_date"`` or ``"after_published"``).
"""
from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Sequence

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
            mark = "PASS" if c.passed else "FAIL"
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
                     f"{html.escape(ex.exercise.title)}: {_fmt(ex.score)}/{_fmt(ex.max_score)}</b><ul style='margin:2px 0'>")
        for c in ex.checks:
            mark = "✅" if c.passed else "❌"
            msg = f"<pre style='white-space:pre-wrap;margin:2px 0 6px 0'>{html.escape(c.message)}</pre>" if c.message else ""
            parts.append(f"<li>{mark} {html.escape(c.name)} <span style='color:#777'>"
                         f"({_fmt(c.score)}/{_fmt(c.max_score)}, {c.seconds:.1f} s)</span>{msg}</li>")
        parts.append("</ul></div>")
    return "".join(parts)


def gradescope(results: Sequence[ExerciseResult], path: str | Path, *, execution_time: float | None = None) -> dict:
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
                "visibility": "hidden" if c.hidden else "visible",
            })
    doc = {"score": sum(ex.score for ex in results), "tests": tests,
           "output": summary_text(results, show_hidden=False).splitlines()[-1]}
    if execution_time is not None:
        doc["execution_time"] = round(execution_time, 2)
    Path(path).write_text(json.dumps(doc, indent=2))
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
            ET.SubElement(tc, "properties").append(ET.Element("property", name="points",
                                                              value=f"{_fmt(c.score)}/{_fmt(c.max_score)}"))
            if not c.passed:
                f = ET.SubElement(tc, "failure", message=(c.message.splitlines() or ["failed"])[0])
                f.text = c.message
    ET.ElementTree(suites).write(str(path), encoding="utf-8", xml_declaration=True)
