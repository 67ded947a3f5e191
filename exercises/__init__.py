"""Splitting the Work — your exercises.

Each module here mirrors one in ``reference/``: the same functions, signatures and docstrings,
with bodies for you to write.  Grade in a notebook with ``check("0.1")`` or in a terminal with
``python -m exercises.grade 0.1``.  Stuck?  ``hint("0.1")`` gives the next hint, a little more each time.
"""
from __future__ import annotations


def check(*ids: str, solutions: str = "exercises", timeout: float = 60.0):
    """Grade exercises in place (e.g. ``check("0.1")``) and show per-check feedback.

    Your code runs in separate processes with a time limit, so a hang or a crash fails the check
    with a message instead of freezing the notebook.
    """
    from .grading import report, session

    results = session.grade(solutions, list(ids) or None, timeout=timeout)
    if solutions == "exercises":
        note_progress(results)
    return _Summary(results, report)


def note_progress(results) -> None:
    """Note which of the learner's exercises passed, so the notebooks' demos replay the learner's own run
    once its exercise passes (and the recording again if it fails later)."""
    from reference.notebook import recorded
    recorded.note_passed([r.exercise.id for r in results if r.score == r.max_score],
                         [r.exercise.id for r in results if r.score < r.max_score])


_SEEN: dict[str, int] = {}     # exercise id -> hint tiers shown so far (1 if the stub's error shows tier 1)


def hints() -> dict[str, list[str]]:
    """Every exercise's hints, in tiers: the ``HINTS`` dicts of the check modules."""
    import importlib

    from .grading import core
    out: dict[str, list[str]] = {}
    for name in core.CHECK_MODULES:
        try:
            out.update(getattr(importlib.import_module(name), "HINTS", {}))
        except ModuleNotFoundError:
            continue
    return out


def stub_messages(exercise_id: str) -> list[str]:
    """The messages the exercise's stubs raise (read from their source, nothing is run)."""
    import ast
    import importlib
    import inspect

    from .grading import core
    ex = core.load_checks().get(exercise_id)
    if ex is None:
        return []
    module = importlib.import_module(f"exercises.{ex.module}")
    out = []
    for name in ex.functions:
        tree = ast.parse(inspect.getsource(getattr(module, name)).lstrip())
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args \
                    and isinstance(node.exc.args[0], ast.Constant) and isinstance(node.exc.args[0].value, str):
                out.append(node.exc.args[0].value)
    return out


def _shown_by_stub(exercise_id: str, tiers: list[str]) -> int:
    """1 if the stubs' error messages already show tier 1, else 0 (their nudge comes before tier 1)."""
    return int(any(tiers[0] in m for m in stub_messages(exercise_id)))


def hint(exercise_id: str, tier: int | None = None) -> _Hint:
    """The next hint for an exercise (``hint("5a.3")``), one tier further each call.  The message
    your stub raises is the first nudge; ``tier=`` shows one tier again."""
    tiers = hints().get(exercise_id)
    if not tiers:
        known = ", ".join(sorted(hints()))
        raise ValueError(f"no hints for exercise {exercise_id!r}; exercises with hints: {known}")
    if exercise_id not in _SEEN:
        _SEEN[exercise_id] = _shown_by_stub(exercise_id, tiers)
    if tier is None:
        tier = min(_SEEN[exercise_id] + 1, len(tiers))
    if not 1 <= tier <= len(tiers):
        raise ValueError(f"exercise {exercise_id} has hint tiers 1-{len(tiers)}, not {tier}")
    _SEEN[exercise_id] = max(_SEEN[exercise_id], tier)
    return _Hint(exercise_id, tier, len(tiers), tiers[tier - 1], _SEEN[exercise_id] + 1)


class _Hint(str):
    def __new__(cls, exercise_id: str, tier: int, n: int, text: str, following: int):
        more = (f" (hint(\"{exercise_id}\") again for hint {following})" if following <= n
                else " (the last: a sketch of the answer)")
        obj = super().__new__(cls, f"Exercise {exercise_id}, hint {tier} of {n}{more}:\n{text}")
        obj.exercise_id, obj.tier, obj.n = exercise_id, tier, n
        return obj

    def __repr__(self) -> str:
        return str(self)


def _next_hint_line(results) -> str:
    """For each exercise that did not pass, which hint comes next."""
    all_hints, lines = hints(), []
    for r in results:
        tiers = all_hints.get(r.exercise.id)
        if r.score < r.max_score and tiers:
            seen = _SEEN[r.exercise.id] if r.exercise.id in _SEEN else _shown_by_stub(r.exercise.id, tiers)
            nxt = min(seen + 1, len(tiers))
            lines.append(f"Stuck on {r.exercise.id}? hint(\"{r.exercise.id}\") shows hint {nxt} of {len(tiers)}.")
    return "\n".join(lines)


class _Summary:
    def __init__(self, results, report):
        self.results, self._report = results, report

    @property
    def score(self) -> float:
        return sum(r.score for r in self.results)

    @property
    def max_score(self) -> float:
        return sum(r.max_score for r in self.results)

    def __repr__(self) -> str:
        more = _next_hint_line(self.results)
        return self._report.summary_text(self.results) + ("\n" + more if more else "")

    def _repr_html_(self) -> str:
        import html
        more = _next_hint_line(self.results)
        return self._report.summary_html(self.results) + (f"<p>{html.escape(more)}</p>".replace("\n", "<br>")
                                                           if more else "")
