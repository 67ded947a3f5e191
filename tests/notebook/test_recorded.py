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


def test_grading_in_a_terminal_notes_progress_as_check_does(tmp_path, monkeypatch, capsys):
    """`make grade` is the notebooks' check() in a terminal: an exercise that fails there (the stub) is no
    longer noted as passed; an autograder run (fresh inputs, a results file) notes nothing."""
    from exercises import grade
    monkeypatch.setattr(recorded, "progress_file", lambda: tmp_path / ".progress.json")
    recorded.note_passed(["0.1", "9.9"])
    assert grade.main(["0.1", "--quiet", "--no-hidden", "--junit", str(tmp_path / "r.xml")]) == 0
    assert recorded.passed_exercises() == {"0.1", "9.9"}                        # a results file: untouched
    assert grade.main(["0.1", "--quiet", "--no-hidden"]) == 0
    assert recorded.passed_exercises() == {"9.9"}                               # the stub failed 0.1
    assert "0.1" in capsys.readouterr().out


def test_a_replayed_cell_names_every_check_still_to_pass():
    label = recorded._replay_label(("5b.1", "5b.3"), {"5b.1"})
    assert 'once check("5b.3") passes' in label and "5b.1" not in label
    assert 'check("5b.1") and check("5b.3") pass,' in recorded._replay_label(("5b.1", "5b.3"), set())
    assert "still to be written" in recorded._replay_label(("5b.1",), {"5b.1"})


def test_a_recording_that_breaks_its_story_is_recorded_again_then_refused(demo, monkeypatch):
    monkeypatch.setattr(recorded, "import_all", lambda package="reference": {"test.demo": demo.recordable})
    verdicts = iter([["overlap off exposed less"], []])           # the second attempt tells the story
    monkeypatch.setattr(demo.recordable, "story", lambda out: next(verdicts, []))
    assert recorded.record_all(recorded.RECORDINGS, keys=["test.demo"], progress=None) == 2
    assert len(CALLS) == 3
    monkeypatch.setattr(demo.recordable, "story", lambda out: ["overlap off exposed less"])
    with pytest.raises(recorded.StoryBroken, match="test.demo.*3 recordings.*overlap off exposed less"):
        recorded.record_all(recorded.RECORDINGS, keys=["test.demo"], progress=None)


def test_a_replayed_cell_says_how_long_the_recorded_run_took_not_zero_seconds(demo, monkeypatch):
    import time
    monkeypatch.setattr(recorded, "import_all", lambda package="reference": {"test.demo": demo.recordable})
    recorded.record_all(recorded.RECORDINGS, progress=None)
    seconds = demo.recordable.recordings()[recorded.SECONDS + demo.recordable.call_key((), {})]
    t0 = time.perf_counter()
    assert recorded.took(t0).startswith("in ") and "recorded" not in recorded.took(t0)   # nothing replayed
    _demo.stub = True                                                                     # the release's stub
    t0 = time.perf_counter()
    demo()
    assert recorded.took(t0) == f"in {seconds:.1f} s when recorded (replayed here)"
