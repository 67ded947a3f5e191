"""Tiered hints: every exercise has them in its check module's HINTS; the stub raises tier 1 only;
hint("N.M") walks the tiers; a failed check offers the next one."""
import importlib
import inspect

import pytest

import exercises
from exercises.grading import core

REGISTRY = core.load_checks()
HINTS = exercises.hints()
STUBS = [(ex.id, importlib.import_module(f"exercises.{ex.module}"), name)
         for ex in REGISTRY.values() for name in ex.functions]


@pytest.fixture(autouse=True)
def fresh():
    exercises._SEEN.clear()
    yield
    exercises._SEEN.clear()


def test_every_exercise_has_at_least_three_tiers_of_hints():
    assert set(REGISTRY) <= set(HINTS), sorted(set(REGISTRY) - set(HINTS))
    for ex_id, tiers in HINTS.items():
        assert len(tiers) >= 3 and all(len(t) > 40 for t in tiers), ex_id
        assert len(set(tiers)) == len(tiers), ex_id


@pytest.mark.parametrize("ex_id,module,name", STUBS, ids=[f"{i}-{n}" for i, _, n in STUBS])
def test_stub_raises_a_nudge_not_the_later_tiers_and_points_to_hint(ex_id, module, name):
    fn = getattr(module, name)
    args = [None] * len([p for p in inspect.signature(fn).parameters.values()
                         if p.default is inspect.Parameter.empty and p.kind != p.KEYWORD_ONLY])
    kwargs = {p.name: None for p in inspect.signature(fn).parameters.values()
              if p.kind == p.KEYWORD_ONLY and p.default is inspect.Parameter.empty}
    with pytest.raises(NotImplementedError) as err:
        fn(*args, **kwargs)
    msg = str(err.value)
    assert f'hint("{ex_id}")' in msg and msg in exercises.stub_messages(ex_id)
    for later in HINTS[ex_id][1:]:
        assert later not in msg


@pytest.mark.parametrize("ex_id", ["0.1", "0.2", "5a.1", "5a.2", "5a.3", "5a.4", "5a.5", "5b.1", "5b.2", "5b.3",
                                   "5b.4"])
def test_in_lectures_0_5a_5b_the_stubs_error_is_tier_one(ex_id):
    assert all(HINTS[ex_id][0] in m for m in exercises.stub_messages(ex_id))
    assert exercises.hint(ex_id).tier == 2                     # the first hint() is the next tier


def test_a_stub_whose_nudge_comes_before_tier_one_gets_tier_one_first(monkeypatch):
    monkeypatch.setattr(exercises, "stub_messages", lambda ex_id: ["Exercise 5b.2: think. hint(\"5b.2\")"])
    assert exercises.hint("5b.2").tier == 1


def test_hint_walks_the_tiers_after_the_stubs_message_and_stops_at_the_last():
    n = len(HINTS["5a.3"])
    shown = [exercises.hint("5a.3") for _ in range(n + 1)]
    assert [h.tier for h in shown] == list(range(2, n + 1)) + [n, n]
    assert HINTS["5a.3"][1] in shown[0] and 'hint("5a.3") again for hint 3' in shown[0]
    assert "the last: a sketch of the answer" in shown[-1]
    assert exercises.hint("5a.3", tier=1).tier == 1
    with pytest.raises(ValueError, match="no hints"):
        exercises.hint("9.9")
    with pytest.raises(ValueError, match="tiers 1-"):
        exercises.hint("5a.3", tier=n + 1)


def test_a_failed_check_offers_the_next_tier():
    class R:   # the fields of a grading result the summary reads
        def __init__(self, ex_id, score):
            self.exercise, self.score, self.max_score = REGISTRY[ex_id], score, 4
    assert 'hint("5b.2") shows hint 2 of 3' in exercises._next_hint_line([R("5b.2", 1), R("5b.1", 4)])
    exercises.hint("5b.2")
    assert "hint 3 of 3" in exercises._next_hint_line([R("5b.2", 0)])
    assert exercises._next_hint_line([R("5b.1", 4)]) == ""


def _solution_lines() -> dict[str, set[str]]:
    """The distinctive code lines of every graded reference body (whitespace removed), by line: what
    a hint or a feedback message must not quote.  A line that also stands in the reference outside
    the graded bodies is shared plumbing (``N = comm.world_size(group)``), not a solution line."""
    import ast
    import re
    import textwrap
    from pathlib import Path

    def squeeze(t: str) -> str:
        return re.sub(r"\s+", "", t)
    bodies, lines = [], {}
    for ex, name, fn in core.graded_functions(REGISTRY):
        src = textwrap.dedent(inspect.getsource(fn))
        f = ast.parse(src).body[0]
        body = f.body[1:] if ast.get_docstring(f) else f.body
        segment = "\n".join(inspect.getsource(fn).splitlines()[body[0].lineno - 1:body[-1].end_lineno])
        bodies.append(segment)
        for ln in segment.splitlines():
            code = squeeze(ln.split("  #")[0])
            if len(code) >= 16 and ("(" in code or "[" in code):
                lines.setdefault(code, set()).add(f"{ex.id} {name}")
    outside = "\n".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "reference").rglob("*.py"))
    for b in bodies:
        outside = outside.replace(b, "")
    shared = squeeze(outside)
    return {code: owners for code, owners in lines.items() if code not in shared}


def test_no_feedback_or_hint_quotes_a_line_of_a_graded_reference_body():
    """Feedback names the mistake and hints sketch the way; neither hands over the solution's lines."""
    import ast
    import re
    from pathlib import Path
    lines = _solution_lines()
    assert len(lines) > 50                                   # the scan has real solution lines to look for
    texts = [(f"hint {ex_id} tier {i + 1}", t) for ex_id, tiers in HINTS.items() for i, t in enumerate(tiers)]
    grading = Path(core.__file__).parent
    for path in grading.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append((path.relative_to(grading).as_posix(), node.value))
    quoted = [(where, code, sorted(owners)) for where, text in texts for code, owners in lines.items()
              if code in re.sub(r"\s+", "", text)]
    assert not quoted, quoted
