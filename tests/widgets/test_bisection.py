"""The bisection animation's state function: the frames follow first_divergence's search on a map."""
from reference.widgets.bisection import bisection_frames


def _rows(steps: int, per_step: int, first: tuple[int, int] | None):
    """A map: ``per_step`` records per step, differing from (step, record) ``first`` on (None: never)."""
    return [{"step": s, "phase": "forward", "module": f"m{i}", "tensor": "output",
             "ranks": [1] if first is not None and (s, i) >= first else []}
            for s in range(steps) for i in range(per_step)]


def test_the_frames_bracket_the_first_differing_step_then_walk_it_to_its_first_record():
    rows = _rows(8, 5, (6, 2))
    frames = bisection_frames(rows)
    assert frames[0]["verdict"] == {} and (frames[0]["lo"], frames[0]["hi"]) == (0, 8)
    assert [(f["lo"], f["hi"]) for f in frames[1:4]] == [(5, 8), (5, 6), (6, 6)]
    last = frames[-1]
    assert rows[last["found"]]["step"] == 6 and rows[last["found"]]["module"] == "m2"
    assert last["compared"] == 5 + 3 + 5 + 3                   # steps 4 (all), 6 (up to m2), 5 (all); the walk


def test_runs_that_agree_end_without_a_walk():
    frames = bisection_frames(_rows(4, 3, None))
    assert frames[-1]["lo"] == 4 and frames[-1]["found"] is None and not frames[-1]["walk"]
