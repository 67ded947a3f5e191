"""A replay as a self-contained HTML animation (reference/widgets/animation.py): every step drawn, nothing fetched,
emitted where no Jupyter server started the kernel."""
from __future__ import annotations

import base64
import json
import re

import pytest

from reference.widgets import animation
from reference.widgets.player import Player


def _player(n_steps: int, **kw) -> Player:
    def draw(fig, state):
        ax = fig.add_subplot()
        ax.bar(range(3), [state, 3 - state % 3, 1], color=["#4c72b0", "#dd8452", "#55a868"])
        ax.set_title(f"step {state}")
    return Player(lambda i: i, n_steps, draw, caption=lambda s: f"caption of step {s}", figsize=(3, 2), **kw)


def _data(page: str) -> dict:
    return json.loads(re.search(r"data = (\{.*?\}), i = 0", page).group(1))


def test_every_step_becomes_a_frame_with_its_caption_and_nothing_is_fetched():
    page = animation.to_html(_player(4, title="a <title>", static_step=2))
    data = _data(page)
    assert data["steps"] == [0, 1, 2, 3] and data["last"] == 3
    assert data["captions"] == [f"caption of step {i}" for i in range(4)]
    frames = [base64.b64decode(f) for f in data["frames"]]
    assert all(f.startswith(b"\x89PNG") for f in frames) and len(set(frames)) == 4     # four different pictures
    assert len({(f[16:24]) for f in frames}) == 1                                      # one size: no jumping
    assert 'data-frame="2"' in page and "a &lt;title&gt;" in page                       # starts at static_step
    # self-contained: no address anywhere but the frames' data: URIs
    assert not re.search(r"(src|href)=\"(?!data:)", page) and "http" not in page
    assert "//" not in page.split("<script>")[0]


def test_a_long_replay_shows_evenly_spread_steps_from_first_to_last():
    assert animation.frame_steps(5, max_frames=8) == [0, 1, 2, 3, 4]
    steps = animation.frame_steps(200, max_frames=8)
    assert len(steps) == 8 and steps[0] == 0 and steps[-1] == 199 and steps == sorted(set(steps))
    page = animation.to_html(_player(12), max_frames=4)
    assert _data(page)["steps"] == [0, 4, 7, 11] and "4 of its 12 steps shown" in page


@pytest.mark.parametrize("setting, server, wanted", [
    ("", False, True), ("", True, False), ("html", True, True), ("off", False, False), ("OFF", False, False)])
def test_the_animation_is_wanted_where_no_jupyter_server_started_the_kernel(monkeypatch, setting, server, wanted):
    monkeypatch.setenv("COURSE_ANIMATIONS", setting)
    if server:
        monkeypatch.setenv("JPY_SESSION_NAME", "/notebooks/05a.ipynb")
    else:
        monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert animation.wanted() is wanted


def test_the_player_carries_the_animation_beside_its_widget_and_picture_only_when_wanted(monkeypatch):
    for setting, wanted in (("html", True), ("off", False)):
        monkeypatch.setenv("COURSE_ANIMATIONS", setting)
        bundle = _player(2)._repr_mimebundle_()
        assert ("text/html" in bundle) is wanted and "image/png" in bundle
        assert "application/vnd.jupyter.widget-view+json" in bundle
