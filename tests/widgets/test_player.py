"""The player every widget uses: a slider moved while a frame is being drawn never queues the frames it
passed through — the picture goes from the frame being drawn straight to the slider's last position."""
from __future__ import annotations

import threading

from reference.widgets.player import Player


def test_frames_asked_for_while_one_is_drawn_are_dropped_but_the_newest():
    drawn, hold = [], threading.Event()

    def draw(fig, step):
        drawn.append(step)
        if step == 1:
            hold.wait(30)                 # a slow frame: a busy machine, or a big figure
        fig.text(0.5, 0.5, str(step))

    p = Player(lambda i: i, 10, draw, caption=lambda i: f"frame {i}")
    p.widget()
    assert drawn == [0]                   # the first frame, drawn with the widget
    for step in range(1, 10):             # the slider dragged across while frame 1 draws
        p.slider.value = step
    hold.set()
    p.show(9)
    assert drawn == [0, 1, 9], "frames 2-8 were asked for and superseded while frame 1 was drawn"
    assert p.image.value == p.png(9) and "frame 9" in p.text.value


def test_a_frame_that_fails_to_draw_raises_from_show_and_the_next_one_draws():
    def draw(fig, step):
        if step == 3:
            raise ValueError("no frame 3")
        fig.text(0.5, 0.5, str(step))

    p = Player(lambda i: i, 5, draw)
    try:
        p.show(3)
    except ValueError as e:
        assert "no frame 3" in str(e)
    else:
        raise AssertionError("show(3) did not raise")
    p.show(4)
    assert p.image.value == p.png(4)
