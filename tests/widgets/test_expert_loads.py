"""Lecture 5b's expert-load replay (reference.widgets.expert_loads): each frame's loads are the run's at that step
relative to the layer's mean, the series stop at the step, and every frame draws."""
from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from reference.widgets.expert_loads import draw_loads, loads_caption, loads_state, moving_mean  # noqa: E402


def _result(steps: int = 5, E: int = 4) -> dict:
    """A balance_over_training-shaped result: two layers; "aux" without a bias, "loss_free" with one."""
    runs = {}
    for name, skew in (("aux", 3.0), ("loss_free", 1.0)):
        loads = [[[skew * (s + 1) if e == 0 else 2.0 for e in range(E)], [4.0] * E] for s in range(steps)]
        ratio = [sum(max(layer) / (sum(layer) / E) for layer in step) / 2 for step in loads]
        bias = [[[0.01 * s * (name == "loss_free")] * E, [0.0] * E] for s in range(steps)]
        runs[name] = {"loss": [3.0 - 0.1 * s for s in range(steps)], "task": [2.0 - 0.1 * s for s in range(steps)],
                      "max_over_mean": ratio, "loads": loads, "bias": bias, "heldout": 1.5}
    return {"runs": runs}


def test_state_is_the_step_loads_over_their_mean_and_the_series_so_far():
    res = _result()
    st = loads_state(res, 2, window=2)
    assert st["step"] == 2 and st["n_steps"] == 5 and st["E"] == 4 and st["names"] == ["aux", "loss_free"]
    aux = st["settings"]["aux"]
    layer = res["runs"]["aux"]["loads"][2][0]
    assert aux["relative"][0] == pytest.approx([x / (sum(layer) / 4) for x in layer])
    assert aux["relative"][1] == [1.0] * 4
    assert aux["max_over_mean"] == res["runs"]["aux"]["max_over_mean"][:3]
    assert aux["task"] == pytest.approx([2.0, 1.95, 1.85])                     # moving mean of 2 of the task loss
    assert st["settings"]["loss_free"]["bias"] == res["runs"]["loss_free"]["bias"][2]
    assert loads_state(res, 99)["step"] == 4 and loads_state(res, -3)["step"] == 0       # clamped
    assert loads_state(res, 1, names=["loss_free"])["names"] == ["loss_free"]
    with pytest.raises(ValueError, match="no setting"):
        loads_state(res, 0, names=["nope"])


def test_moving_mean_averages_the_window_before_each_value():
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_mean([2.0], 10) == [2.0]


def test_first_and_last_frames_draw_bars_bias_and_both_series():
    res = _result()
    for step in (0, 4):
        st = loads_state(res, step)
        fig = Figure(figsize=(12, 6.4))
        draw_loads(fig, st)
        biased = step > 0                                   # loss_free's bias is 0 at step 0: no bias axis then
        assert len(fig.axes) == 2 + biased + 2              # a panel per setting, the bias axis, the two series
        assert loads_caption(st).startswith(f"step {step + 1}/5")
