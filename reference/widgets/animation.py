"""A replay as a self-contained HTML animation: it plays in any browser, with no kernel and no network.

A :class:`~reference.widgets.player.Player` redraws its picture from Python each time its slider
moves, so it needs a running kernel.  Where there is none — the course's website, a notebook
rendered on a code host, an ``nbconvert`` export — :func:`to_html` shows the same replay: every
frame drawn once, here, as a PNG inside the page, with a Play button, a step slider and the
frame's caption, driven by a few lines of inline JavaScript::

    ┌ title ────────────────────────────────────────────┐
    │ [|◀] [◀] [▶ Play] [▶] [▶|] ──●─────  step 3 of 12 │
    │ ┌───────────────────────────────────────────────┐ │
    │ │          frame 3, a PNG (a data: URI)         │ │
    │ └───────────────────────────────────────────────┘ │
    │ caption of frame 3                                │
    │ Shown: layout = zigzag (the other settings: run …)│
    └───────────────────────────────────────────────────┘

Nothing is fetched: no script, stylesheet or font from elsewhere (matplotlib's ``to_jshtml``
links Font Awesome from a CDN, and ipywidgets' embedding loads its manager from one).  The frames
are palette PNGs (256 colours: a replay is flat colours and text), a few tens of kB each, all cut to one
box so the picture does not jump; a replay longer than ``MAX_FRAMES`` steps shows that many, spread evenly.

The player emits this beside the widget where no front end will draw the widget: see
:func:`wanted`.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["wanted", "frame_steps", "frames_png", "to_html"]

MAX_FRAMES = 60          # a longer replay shows every k-th step, its first and its last


def wanted() -> bool:
    """Should a replay carry its HTML animation?  ``COURSE_ANIMATIONS=html`` says yes, ``=off`` no; by
    default yes where the kernel was not started by a Jupyter server (nbval, nbclient, nbconvert, the
    website's build: nobody will move the widget there), no in JupyterLab or Notebook, whose kernels the
    server starts with ``JPY_SESSION_NAME`` set and whose widgets play live."""
    choice = os.environ.get("COURSE_ANIMATIONS", "").strip().lower()
    if choice in ("html", "1", "yes", "on"):
        return True
    if choice in ("off", "0", "no", "png"):
        return False
    return "JPY_SESSION_NAME" not in os.environ


def frame_steps(n_steps: int, max_frames: int = MAX_FRAMES) -> list[int]:
    """The steps an animation shows: all of them, or ``max_frames`` spread evenly from the first to the last."""
    if n_steps <= max_frames:
        return list(range(n_steps))
    return sorted({round(i * (n_steps - 1) / (max_frames - 1)) for i in range(max_frames)})


def _palette_png(fig, dpi: int, bbox) -> bytes:
    """``fig`` cut to ``bbox`` (inches) as a 256-colour PNG (a third of the bytes of a full-colour one for
    a flat drawing)."""
    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches=bbox, facecolor="white")
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    image.save(out, format="png", optimize=True)
    return out.getvalue()


def _drawn(player: Any, step: int):
    from matplotlib.figure import Figure
    fig = Figure(figsize=player.figsize)
    player.draw(fig, player.state_at(step))
    return fig


def frames_png(player: Any, steps: Sequence[int], dpi: int = 80) -> list[bytes]:
    """Frames ``steps`` of ``player`` (anything with ``state_at``, ``draw`` and ``figsize``) as PNG bytes, all
    cut to one box: what the first and the last frame draw, as matplotlib's ``bbox_inches="tight"`` finds it
    (one size for every frame, so the picture does not jump; and one drawing per frame, not two)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox
    boxes = []
    for step in dict.fromkeys([steps[0], steps[-1]]):
        fig = _drawn(player, step)
        boxes.append(fig.get_tightbbox(FigureCanvasAgg(fig).get_renderer()).padded(0.1))
    bbox = Bbox.union(boxes)
    return [_palette_png(_drawn(player, step), dpi, bbox) for step in steps]


def _size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")     # the IHDR chunk


_SCRIPT = """(function () {
  var root = document.getElementById(%(id)s), data = %(data)s, i = 0, timer = null;
  var img = root.querySelector('img'), slider = root.querySelector('input'), play = root.querySelector('.play');
  var label = root.querySelector('.step'), caption = root.querySelector('.caption');
  function show(k) {
    i = Math.max(0, Math.min(data.frames.length - 1, k));
    img.src = 'data:image/png;base64,' + data.frames[i];
    slider.value = i; root.setAttribute('data-frame', i);
    label.textContent = 'step ' + data.steps[i] + ' of ' + data.last;
    caption.textContent = data.captions[i];
  }
  function stop() { if (timer) { clearInterval(timer); timer = null; } play.textContent = '\\u25B6 Play'; }
  function start() {
    if (i >= data.frames.length - 1) show(0);
    play.textContent = 'Pause';
    timer = setInterval(function () { if (i >= data.frames.length - 1) stop(); else show(i + 1); }, data.interval);
  }
  play.onclick = function () { if (timer) stop(); else start(); };
  root.querySelector('.first').onclick = function () { stop(); show(0); };
  root.querySelector('.prev').onclick = function () { stop(); show(i - 1); };
  root.querySelector('.next').onclick = function () { stop(); show(i + 1); };
  root.querySelector('.last').onclick = function () { stop(); show(data.frames.length - 1); };
  slider.oninput = function () { stop(); show(parseInt(slider.value, 10)); };
  show(%(start)d);
})();"""

_BUTTON = "border:1px solid #999;border-radius:3px;background:#f6f6f6;padding:1px 7px;cursor:pointer"
_BUTTONS = (("first", "first step", "|&#x25C0;"), ("prev", "one step back", "&#x25C0;"),
            ("play", "play", "&#x25B6; Play"), ("next", "one step on", "&#x25B6;"), ("last", "last step", "&#x25B6;|"))


def _settings(player: Any) -> str:
    """Which of a widget's settings this replay shows (a dropdown's layout, a world size ...)."""
    controls = getattr(player, "controls", None) or {}
    shown = ", ".join(f"{name} = {c.value}" for name, c in controls.items() if hasattr(c, "value"))
    return f"Shown: {shown} (run the notebook for the other settings)." if shown else ""


def to_html(player: Any, *, max_frames: int = MAX_FRAMES, dpi: int = 80) -> str:
    """The replay of ``player`` (a :class:`~reference.widgets.player.Player`) as one ``<div>`` of HTML with its
    frames inline, starting at the player's ``static_step``."""
    steps = frame_steps(player.n_steps, max_frames)
    pngs = frames_png(player, steps, dpi)
    caption = getattr(player, "caption", None)
    static = min(getattr(player, "static_step", 0), max(0, player.n_steps - 1))
    start = min(range(len(steps)), key=lambda k: abs(steps[k] - static))
    data = {"frames": [base64.b64encode(p).decode() for p in pngs], "steps": steps, "last": player.n_steps - 1,
            "captions": [caption(player.state_at(s)) if caption else "" for s in steps],
            "interval": int(getattr(player, "interval_ms", 900))}
    div_id = "course-animation-" + uuid.uuid4().hex[:12]
    title = html.escape(getattr(player, "title", "") or "")
    note = " ".join(x for x in (_settings(player), "Every frame drawn in advance from a recorded run" + (
        "." if len(steps) == player.n_steps else f": {len(steps)} of its {player.n_steps} steps shown.")) if x)
    buttons = "".join(f'<button type="button" class="{cls}" title="{tip}" style="{_BUTTON}">{face}</button> '
                      for cls, tip, face in _BUTTONS)
    script = _SCRIPT % {"id": json.dumps(div_id), "data": json.dumps(data), "start": start}
    return (
        f'<div id="{div_id}" class="course-animation" data-frames="{len(steps)}" data-frame="{start}" '
        f'style="font-family:sans-serif;font-size:13px;max-width:{_size(pngs[0])[0]}px">'
        + (f"<div><b>{title}</b></div>" if title else "")
        + f'<div style="display:flex;align-items:center;gap:6px;flex-wrap:wrap;margin:4px 0">{buttons}'
        f'<input type="range" min="0" max="{len(steps) - 1}" value="{start}" aria-label="step" '
        f'style="flex:1;min-width:120px"><span class="step" style="font-family:monospace"></span></div>'
        f'<img alt="{title or "replay"}: one frame" src="data:image/png;base64,{data["frames"][start]}" '
        f'style="max-width:100%;display:block">'
        f'<div class="caption" style="font-family:monospace;white-space:pre-wrap"></div>'
        f'<div style="color:#777;font-size:11px">{html.escape(note)}</div>'
        f"<script>{script}</script></div>")
