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
def test_stub_raises_the_first_tier_only_and_points_to_hint(ex_id, module, name):
    fn = getattr(module, name)
    args = [None] * len([p for p in inspect.signature(fn).parameters.values()
                         if p.default is inspect.Parameter.empty and p.kind != p.KEYWORD_ONLY])
    kwargs = {p.name: None for p in inspect.signature(fn).parameters.values()
              if p.kind == p.KEYWORD_ONLY and p.default is inspect.Parameter.empty}
    with pytest.raises(NotImplementedError) as err:
        fn(*args, **kwargs)
    msg = str(err.value)
    assert HINTS[ex_id][0] in msg and f'hint("{ex_id}")' in msg
    for later in HINTS[ex_id][1:]:
        assert later not in msg


def test_hint_walks_the_tiers_after_the_stubs_message_and_stops_at_the_last():
    n = len(HINTS["5a.3"])
    shown = [exercises.hint("5a.3") for _ in range(n + 1)]
    assert [h.tier for h in shown] == list(range(2, n + 1)) + [n, n]
    assert HINTS["5a.3"][1] in shown[0] and 'hint("5a.3") again for hint 3' in shown[0]
    assert "the last one" in shown[-1]
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
