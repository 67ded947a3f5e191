"""The one animation player every course widget uses.

A widget is two parts:

* a **pure state function** ``state(trace, step) -> dict`` (or a dataclass): what the picture
  shows at ``step`` — which rank holds which chunk, which tiles are computed.  No drawing, no
  widgets; unit-tested like any other function.
* a **draw function** ``draw(fig, state)`` that paints that state with matplotlib.

:class:`Player` joins them: a Play button, a step slider, optional extra controls (layout, world
size, ...) and an image that is re-rendered for each frame.  It never sleeps in a loop — the Play
button's timer runs in the browser — so it also works in a kernel with no front end.  For
headless execution (nbval, nbconvert) its rich display carries a PNG of the first frame next to
the widget, so a notebook run without a browser still shows a picture — and, where no Jupyter server
started the kernel, the whole replay as a self-contained HTML animation (:mod:`.animation`) that
plays without a kernel (the course's website is built from such runs).
"""
from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

from matplotlib.figure import Figure

__all__ = ["Player", "render_png"]


def render_png(draw: Callable[[Figure, Any], None], state: Any, figsize=(9, 4.2), dpi: int = 80) -> bytes:
    """Draw ``state`` on a fresh figure and return PNG bytes."""
    fig = Figure(figsize=figsize, dpi=dpi)
    draw(fig, state)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


class Player:
    """Play/slider over ``n_steps`` frames of ``state_at(step) -> state`` drawn by ``draw``.

    ``controls``: extra ipywidgets whose change calls ``rebuild(**values)`` → ``(state_at, n_steps)``,
    e.g. a layout dropdown that replays another trace.  ``caption(state) -> str`` writes a line of
    text under the picture (what happens at this step).  ``static_step``: the frame of the static
    picture a headless run shows.
    """

    def __init__(self, state_at: Callable[[int], Any], n_steps: int, draw: Callable[[Figure, Any], None], *,
                 controls: dict[str, Any] | None = None, rebuild: Callable[..., tuple] | None = None,
                 caption: Callable[[Any], str] | None = None, figsize=(9, 4.2), interval_ms: int = 900,
                 title: str = "", static_step: int = 0):
        self.state_at, self.n_steps, self.draw = state_at, n_steps, draw
        self.controls, self.rebuild = controls or {}, rebuild
        self.caption, self.figsize, self.interval_ms, self.title = caption, figsize, interval_ms, title
        self.static_step = static_step   # the frame shown where widgets cannot run (nbconvert, nbval)
        self._widget = None
        self._drawn = threading.Condition()         # frames to draw: see _ask
        self._asked, self._busy, self._failed = (0, 0), False, None

    # -- the picture -------------------------------------------------------------------------------

    def png(self, step: int = 0) -> bytes:
        return render_png(self.draw, self.state_at(step), self.figsize)

    def figure(self, step: int = 0) -> Figure:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=self.figsize)
        self.draw(fig, self.state_at(step))
        return fig

    # -- the widget --------------------------------------------------------------------------------

    def widget(self):
        if self._widget is not None:
            return self._widget
        import ipywidgets as W

        last = max(0, self.n_steps - 1)
        self.play = W.Play(value=0, min=0, max=last, step=1, interval=self.interval_ms, description="Play")
        self.slider = W.IntSlider(value=0, min=0, max=last, description="step", continuous_update=True)
        W.jslink((self.play, "value"), (self.slider, "value"))
        self.image = W.Image(value=self.png(0), format="png")
        self.text = W.HTML(value=self._caption_html(0))
        self.slider.observe(lambda ch: self._ask(ch["new"]), names="value")
        for c in self.controls.values():
            c.observe(lambda ch: self._rebuild(), names="value")
        top = [W.HTML(f"<b>{self.title}</b>")] if self.title else []
        row = W.HBox([self.play, self.slider] + list(self.controls.values()),
                     layout=W.Layout(flex_flow="row wrap"))     # many controls wrap, not hide off-screen
        self._widget = W.VBox(top + [row, self.image, self.text])
        return self._widget

    def show(self, step: int) -> None:
        """Render frame ``step`` into the widget; return once it is shown."""
        self._ask(step)
        with self._drawn:
            self._drawn.wait_for(lambda: not self._busy)
        if self._failed is not None:
            raise self._failed

    def _ask(self, step: int) -> None:
        """Draw frame ``step`` off the kernel's message loop (what the slider calls).  One frame is drawn
        at a time; the frames asked for meanwhile are dropped but the newest, so a busy machine shows
        the slider's latest position next instead of every position it passed through."""
        if self._widget is None:
            self.widget()
        with self._drawn:
            self._asked = (self._asked[0] + 1, step)
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._draw_asked, name="player-frame", daemon=True).start()

    def _draw_asked(self) -> None:
        done = 0
        while True:
            with self._drawn:
                seq, step = self._asked
                if seq == done:
                    self._busy = False
                    self._drawn.notify_all()
                    return
            try:
                self.image.value, self.text.value = self.png(step), self._caption_html(step)
                failed = None
            except Exception as e:  # noqa: BLE001 - raised by show(); under a slider the last frame stays
                failed = e
            self._failed, done = failed, seq

    def _caption_html(self, step: int) -> str:
        if not self.caption:
            return ""
        return f"<span style='font-family:monospace'>{self.caption(self.state_at(step))}</span>"

    def _rebuild(self) -> None:
        if self.rebuild is None:
            return
        values = {k: c.value for k, c in self.controls.items()}
        self.state_at, self.n_steps = self.rebuild(**values)
        last = max(0, self.n_steps - 1)
        self.play.value = 0
        self.slider.value = 0
        self.play.max = self.slider.max = last
        self.show(0)

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.widget()._repr_mimebundle_(include=include, exclude=exclude) or {}
        import base64
        bundle = dict(bundle)
        bundle["image/png"] = base64.b64encode(self.png(min(self.static_step, max(0, self.n_steps - 1)))).decode()
        bundle.setdefault("text/plain", f"<{type(self).__name__}: {self.n_steps} steps>")
        from . import animation
        if animation.wanted():       # no front end will draw the widget: the replay as a self-contained page
            bundle["text/html"] = animation.to_html(self)
        return bundle
