"""The student release points only at what it ships, and speaks of the course alone.

Every notebook cell, the README, and the ``.py`` files a learner reads (``reference/``, the stubs in
``exercises/``, ``scripts/``: docstrings, comments, messages; not the grader's own package) are scanned for

* a path to a course file the release lacks (``tests/…``, ``benchmarks/…``, ``docs/…``, or any
  ``reference/``, ``exercises/``, ``notebooks/``, ``scripts/`` file that is not there), unless it is named
  as the full course's (the README says the teacher keeps the tests and benchmarks);
* an invitation to read a graded function in ``reference/`` ("read ``ring_attention_backward`` in
  ``reference/sequence/ring.py``"), whose body in the release is a call to the learner's own stub;
* words of the course's making rather than of its subject ("the issue's 20 %", "issue 24", "the seed's
  question", "ticket").
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PATH = re.compile(r"\b((?:tests|benchmarks|docs|reference|exercises|notebooks|scripts)/[\w./-]*\w)")
INTERNAL = re.compile(r"\bissue'?s?\b(?! the same| one| a| an| its| their| the collectives| collectives| trackers?)"
                      r"|\bseed's\b"
                      r"|\bthe seed (?:lecture|course|question)\b|\btickets?\b|\bthe lead\b", re.I)
FULL_COURSE = re.compile(r"full\s+course", re.I)
READ_GRADED = re.compile(r"\b[Rr]ead\b[^.;]{0,80}?`(\w+)`[^.;]{0,60}?(reference/[\w/]+\.py)")


def release_texts(release: Path) -> dict[str, str]:
    """{where: text} for every cell of every notebook and every text file a student reads."""
    out = {}
    for nb in sorted((release / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            out[f"{nb.relative_to(release)}[{i}]"] = "".join(cell["source"])
    out["README.md"] = (release / "README.md").read_text()
    for folder in ("reference", "exercises", "scripts"):
        for p in sorted((release / folder).rglob("*.py")):
            if "grading" not in p.relative_to(release).parts:
                out[str(p.relative_to(release))] = p.read_text(errors="replace")
    return out


def graded_functions() -> set[tuple[str, str]]:
    """(file relative to the course, function name) of every graded function (a delegation in the release)."""
    import inspect

    from exercises.grading import core
    return {(Path(inspect.getsourcefile(fn)).resolve().relative_to(ROOT).as_posix(), fn.__name__)
            for _, _, fn in core.graded_functions(None)}


def dead_pointers(release: Path, texts: dict[str, str], graded: set[tuple[str, str]]) -> list[str]:
    found = []
    for where, text in texts.items():
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if "*" in path or "…" in path or FULL_COURSE.search(text[max(0, m.start() - 40):m.start()]):
                continue
            if not (release / path).exists() and not (release / path.split("::")[0]).exists():
                found.append(f"{where}: {path} is not in the release")
        for m in READ_GRADED.finditer(text):
            if (m.group(2), m.group(1)) in graded:
                found.append(f"{where}: asks to read {m.group(1)} in {m.group(2)}, a body the learner writes")
    return found


# an issue of another project, cited by its tracker's number ("torchtitan issue 775", "NCCL issues 1260 and 1324"),
# is the subject's, not the course's making
CITED_ISSUE = re.compile(r"(?:torchtitan|NCCL|nccl|Megatron-LM|Megatron-Core|TransformerEngine|PyTorch|DeepSpeed|"
                         r"picotron|axolotl|scaling-book)\s+$")


def internal_words(texts: dict[str, str]) -> list[str]:
    return [f"{where}: {text[max(0, m.start() - 40):m.end() + 40]!r}" for where, text in texts.items()
            for m in INTERNAL.finditer(text)
            if not (m.group().lower().startswith("issue") and CITED_ISSUE.search(text[max(0, m.start() - 40):m.start()])
                    and re.match(r"\s+\d", text[m.end():]))]


@pytest.mark.slow
def test_the_release_points_only_at_what_it_ships_and_speaks_of_the_course_alone(student_release):
    texts = release_texts(student_release)
    assert sum(k.startswith("notebooks/") for k in texts) > 100 and "README.md" in texts   # it read them all
    problems = dead_pointers(student_release, texts, graded_functions()) + internal_words(texts)
    assert not problems, f"{len(problems)} places:\n" + "\n".join(problems)
