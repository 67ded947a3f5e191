"""reference.recorded: demos run live in the course, replay recordings in a release until the
learner's exercise passes, then run live again (on the learner's code)."""
from __future__ import annotations

import pytest

from reference.notebook import recorded

CALLS: list[tuple] = []


def _demo(n: int = 3, scale: float = 1.0, world=None):
    CALLS.append((n, scale))
    if getattr(_demo, "stub", False):
        raise NotImplementedError("Exercise 9.9: write me")
    return {"n": n, "value": n * scale}


@pytest.fixture
def demo(tmp_path, monkeypatch):
    monkeypatch.setattr(recorded, "RECORDINGS", tmp_path / "_recorded")
    monkeypatch.setattr(recorded, "progress_file", lambda: tmp_path / ".progress.json")
    recorded.REGISTRY.pop("test.demo", None)
    fn = recorded.recordable("test.demo", needs=("9.9",), variants=[{"n": 5}])(_demo)
    _demo.stub = False
    CALLS.clear()
    yield fn
    recorded.REGISTRY.pop("test.demo", None)


def test_in_the_course_a_recordable_always_runs_live(demo):
    assert not recorded.in_release()
    assert demo(4, scale=2.0) == {"n": 4, "value": 8.0}
    assert CALLS == [(4, 2.0)]


def test_in_a_release_the_recording_is_replayed_until_the_exercise_passes(demo, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recorded, "import_all", lambda package="reference": {"test.demo": demo.recordable})
    assert recorded.record_all(recorded.RECORDINGS, progress=None) == 2      # defaults + one variant
    assert CALLS == [(3, 1.0), (5, 1.0)]
    _demo.stub = True                                                          # the release: learner's stub
    CALLS.clear()
    assert demo() == {"n": 3, "value": 3.0} and demo(n=5, world=object()) == {"n": 5, "value": 5.0}
    assert CALLS == [] and "recorded from the reference" in capsys.readouterr().out
    with pytest.raises(NotImplementedError):                                   # not recorded: runs live
        demo(7)
    recorded.note_passed(["9.9"])
    _demo.stub = False                                                         # the learner's code now works
    assert demo(n=5, scale=1.0) == {"n": 5, "value": 5.0} and CALLS[-1] == (5, 1.0)
    assert "your own run" in capsys.readouterr().out
    recorded.note_passed([], failed=["9.9"])
    assert "9.9" not in recorded.passed_exercises()


def test_arguments_that_cannot_be_matched_are_refused(demo):
    with pytest.raises(TypeError, match="numbers, strings"):
        demo.recordable.call_key((), {"n": [object()]})
