"""The pipeline Gantt widget (lecture 4b): a recorded pipeline step replayed, stage by stage.

::

    measured bubble 27% · formula 27%                        ┌ legend ─────────┐
    stage 0 │F0│F1│F2│F3│░░░░░░░░│B0│F4│B1│ ... │B7│░░░│      │ F  light        │
    stage 1 │░░│F0│F1│F2│░░░░░│B0│F3│B1│ ...  │B7│░░░░░│      │ B  dark         │
    stage 2 │░░░░░│F0│F1│░░│B0│F2│B1│  ...  │B7│░░░░░░░░│      │ W  hatched      │
    stage 3 │░░░░░░░░│F0│B0│F1│B1│ ...   │B7│░░░░░░░░░░░│      │ ░  bubble (idle)│
             ╲ ╱  thin lines: activations going down, gradients coming up (block end → block start)
    ─────────────────────────────────────────────────── │ now
    stashed │   ┌──┐        rank 0 (peak 4)
    act.    │ ┌─┘  └──┐     rank 3 (peak 1)             one step curve per rank
            └──────────────── time (slots | ms)

Colour = micro-batch (one hue each): F light, B dark, W (zero-bubble weight gradient) hatched.
Interleaved runs: one row per rank (its virtual stages c·p + r named), chunk c's blocks underlined c times.

Pure part, unit-tested, in :mod:`.gantt`: :func:`~.gantt.pipeline_timeline` lays a trace out in slots or
wall clock, :func:`~.gantt.order_timeline` a schedule's order without a run, :func:`~.gantt.gantt_state`
cuts either at time ``t``.  Drawing: :func:`draw_gantt` (one frame), :func:`draw_order` (a whole order,
overlapped pairs outlined).  Widget: :func:`pipeline_player` over runs keyed ``(schedule, p, m)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gantt import Block, GanttState, Message, Timeline, gantt_state, order_timeline, pipeline_timeline

__all__ = ["Block", "Message", "Timeline", "GanttState", "PipelineRun", "pipeline_timeline", "order_timeline",
           "gantt_state", "draw_gantt", "draw_order", "caption", "pipeline_player"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
BUBBLE_GREY = "#dcdcdc"


# ----------------------------------------------------------------------------------------------
# Drawing


def _palette(m: int) -> list[tuple[float, float, float]]:
    """One hue per micro-batch; greys left out (grey is the bubble)."""
    import matplotlib
    tab10 = [matplotlib.colormaps["tab10"](i)[:3] for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
    tab20 = [matplotlib.colormaps["tab20"](i)[:3] for i in range(20) if i not in (14, 15)]
    cols = tab10 if m <= len(tab10) else tab20
    return [cols[i % len(cols)] for i in range(max(1, m))]


def _shade(rgb, kind: str):
    """F lighter, B and W darker."""
    return tuple(0.45 * c + 0.55 for c in rgb) if kind == "F" else tuple(0.85 * c for c in rgb)


def draw_gantt(fig, st: GanttState) -> None:
    """Gantt chart (rows = ranks, rank 0 on top) above, stashed activations per rank below."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    tl = st.timeline
    p, span = tl.ranks, tl.span or 1.0
    gs = fig.add_gridspec(2, 1, height_ratios=[3, 1.15], hspace=0.12, left=0.1, right=0.8, top=0.9, bottom=0.11)
    ax = fig.add_subplot(gs[0])
    ax2 = fig.add_subplot(gs[1], sharex=ax)
    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)
    if tl.clock == "slots":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    px_per_unit = fig.get_figwidth() * fig.dpi * 0.7 / span
    cols = _palette(tl.num_microbatches)
    H = 0.76                                            # bar height; rows at y = rank

    for r, gaps in st.idle.items():                     # the bubble: every idle stretch, grey
        for a, b in gaps:
            ax.add_patch(Rectangle((a, r - H / 2), b - a, H, fc=BUBBLE_GREY, ec="#bdbdbd", lw=0.5, hatch="..",
                                   zorder=1, gid="bubble"))
    for b in st.blocks:
        end = min(b.end, st.t)
        if end <= b.start:                              # a block of no time (a full backward's W, drawn in its B)
            continue
        fc = _shade(cols[b.microbatch % len(cols)], b.kind)
        ax.add_patch(Rectangle((b.start, b.rank - H / 2), end - b.start, H, fc=fc, ec="white", lw=0.8,
                               hatch="////" if b.kind == "W" else None, zorder=2, gid="block"))
        if b.chunk:                                     # interleaving: later chunks underlined, one bar per chunk
            for c in range(b.chunk):
                y = b.rank + H / 2 - 0.05 - 0.09 * c
                ax.plot([b.start + 0.08 * (end - b.start), end - 0.08 * (end - b.start)], [y, y], color="black",
                        lw=1.6, solid_capstyle="butt", zorder=3)
        text, width = f"{b.kind}{b.microbatch}", (end - b.start) * px_per_unit
        size = 8.5 if width >= 6.5 * len(text) + 4 else 7 if width >= 5.2 * len(text) + 1 else 0
        if size:
            dark = b.kind == "F" or sum(fc) > 2.1
            ax.text((b.start + end) / 2, b.rank - (0.06 if b.chunk else 0), text, ha="center", va="center",
                    fontsize=size, zorder=3, color="black" if dark else "white",
                    weight="bold" if b.kind != "F" else "normal")
    for msg in st.messages:                             # thin lines: block end on one row → block start on another
        down = msg.dst > msg.src
        y0, y1 = msg.src + (H / 2 if down else -H / 2), msg.dst - (H / 2 if down else -H / 2)
        x1, y_end = msg.arrive, y1
        if msg.arrive > st.t:                           # in flight: drawn as far as it has come
            f = (st.t - msg.depart) / (msg.arrive - msg.depart)
            x1, y_end = st.t, y0 + f * (y1 - y0)
        ax.annotate("", xy=(x1, y_end), xytext=(msg.depart, y0), zorder=4,
                    arrowprops=dict(arrowstyle="-|>,head_width=0.15,head_length=0.3", lw=0.7, shrinkA=0, shrinkB=0,
                                    color="#333333" if msg.what == "activation" else "#b2182b", alpha=0.75))
    if st.t < tl.span:
        for a in (ax, ax2):
            a.axvline(st.t, color="crimson", lw=1.2, zorder=5)

    bub = tl.bubble_per_rank
    if tl.virtual_stages > 1:                           # loop or V placement: the stages each rank ran
        names = [f"rank {r}\nstages " + ",".join(str(k) for k in sorted({b.stage for b in tl.blocks if b.rank == r}))
                 for r in range(p)]
    else:
        names = [f"stage {r}" for r in range(p)]
    ax.set_yticks(range(p), [f"{n}\nidle {bub[r]:.0%}" for r, n in enumerate(names)], fontsize=8.5)
    ax.tick_params(axis="x", labelbottom=False)
    pred = f" · formula {st.predicted:.1%}" if st.predicted is not None else ""
    head = f"{st.title}   " if st.title else ""
    ax.set_title(f"{head}measured bubble {tl.bubble:.1%}{pred}", fontsize=11, loc="left")
    ax.set_title(f"t = {min(st.t, tl.span):.4g} / {tl.span:.4g} {tl.unit}", fontsize=9, loc="right", color="#555")

    rank_cols = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]
    peaks = tl.peak_stash
    for r, curve in st.stash.items():                   # nudged apart a little so equal curves stay visible
        xs, ys = zip(*curve)
        nudge = 0.07 * (r - (p - 1) / 2) * max(1, max(peaks.values(), default=1) / 8)
        ax2.step(list(xs) + [min(st.t, tl.span)], [y + nudge for y in list(ys) + [ys[-1]]], where="post", lw=1.6,
                 color=rank_cols[r % len(rank_cols)], label=f"rank {r} (peak {peaks[r]})")
    ax2.set_ylim(-0.4, max(peaks.values(), default=1) + 0.8)
    ax2.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    ax2.set_ylabel("stashed\nactivations", fontsize=8.5)
    ax2.set_xlabel(f"time ({tl.unit})" + ("  — every F, B, W one slot" if tl.clock == "slots" else ""), fontsize=9)
    ax2.tick_params(labelsize=8)
    ax2.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.05), frameon=False,
               title="micro-batches held", title_fontsize=7.5)

    grey = (0.55, 0.55, 0.55)
    handles = [Patch(fc=_shade(grey, "F"), label="F forward"), Patch(fc=_shade(grey, "B"), label="B backward")]
    if any(b.kind == "W" for b in tl.blocks):
        handles.append(Patch(fc=_shade(grey, "W"), hatch="////", ec="white", label="W weight grad"))
    if tl.virtual_stages > 1:
        handles.append(Line2D([], [], color="black", lw=1.6, label="chunk 1 (2: two bars)"))
    handles += [Patch(fc=BUBBLE_GREY, ec="#bdbdbd", hatch="..", label="bubble (idle)"),
                Line2D([], [], color="#333333", lw=0.9, label="activation (F → F)"),
                Line2D([], [], color="#b2182b", lw=0.9, label="gradient (B → B)")]
    ax.legend(handles=handles, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              title="colour = micro-batch", title_fontsize=7.5)


def draw_order(fig, timeline: Timeline, *, title: str = "", predicted: float | None = None, pairs=()) -> None:
    """A whole order at once (:func:`order_timeline`): :func:`draw_gantt`'s last frame, with each pair of
    blocks the schedule overlaps — DualPipeV's forward of one micro-batch beside the backward of another,
    ``pairs`` as (rank, F action, B action) — outlined in black."""
    from matplotlib.patches import Rectangle

    draw_gantt(fig, gantt_state(timeline, timeline.span, predicted=predicted, title=title))
    ax = fig.axes[0]
    pred = f" · formula {predicted:.1%}" if predicted is not None else ""
    ax.set_title(f"{title}   slot bubble {timeline.bubble:.1%}{pred}", fontsize=11, loc="left")
    ax.set_title("", loc="right")
    fig.axes[1].set_xlabel("time (slots) — F, B, W one slot each; a full backward (B and W in one pass) two",
                           fontsize=9)
    at = {(b.rank, b.kind, b.microbatch, b.chunk): b for b in timeline.blocks}
    for rank, f, b in pairs:
        first, back = at[(rank, "F", f.microbatch, f.chunk)], at[(rank, "B", b.microbatch, b.chunk)]
        weight = at.get((rank, "W", b.microbatch, b.chunk))
        end = weight.end if weight is not None and abs(weight.start - back.end) < 1e-9 else back.end
        start = min(first.start, back.start)
        ax.add_patch(Rectangle((start, rank - 0.47), end - start, 0.94, fill=False, ec="black", lw=1.5, zorder=6,
                               gid="overlap"))


# ----------------------------------------------------------------------------------------------
# Caption and player


def caption(st: GanttState) -> str:
    """One line: what each rank did in the step that just ended, and why the idle ones idle."""
    tl = st.timeline
    if st.t <= 0:
        return "t = 0: nothing has run yet — press Play."
    if st.finished:
        peaks = [tl.peak_stash[r] for r in range(tl.ranks)]
        return (f"done in {tl.span:.4g} {tl.unit}: {len(tl.blocks)} blocks on {tl.ranks} ranks, measured bubble "
                f"{tl.bubble:.1%}" + (f" (formula {st.predicted:.1%})" if st.predicted is not None else "")
                + f"; peak stashed micro-batches per rank {peaks}.")
    parts, idle = [], []
    for r in range(tl.ranks):
        b, who = st.now[r], f"stage {r}" if tl.virtual_stages == 1 else f"rank {r}"
        if b is not None:
            parts.append(f"{who} runs {b.kind}{b.microbatch}" + (f" (stage {b.stage})" if b.stage != r else ""))
            continue
        mine = [x for x in tl.blocks if x.rank == r]
        nxt = min((x for x in mine if x.start >= st.t - 1e-9), key=lambda x: x.start, default=None)
        if nxt is None:
            idle.append(f"{who} idle (bubble: drained, waits for the others)")
            continue
        wait = next((m for m in tl.messages if m.consumer == nxt), None)
        why = "fill" if not any(x.end <= st.t for x in mine) else ""
        if wait:
            why += (", " if why else "") + (f"waits for the {wait.what} of micro-batch {wait.microbatch} "
                                            f"from rank {wait.src}")
        idle.append(f"{who} idle (bubble: {why or 'waiting'})")
    fmt = f"{st.t:.0f}" if tl.clock == "slots" else f"{st.t:.1f} ms"
    return f"t={fmt}: " + ", ".join(parts) + ("; " if parts and idle else "") + "; ".join(idle)


@dataclass
class PipelineRun:
    """A recorded run and, optionally, the bubble its formula predicts."""

    trace: Any
    predicted: float | None = None


def _unpack(run: Any) -> tuple[Any, float | None]:
    if isinstance(run, PipelineRun):
        return run.trace, run.predicted
    if isinstance(run, dict) and "trace" in run:
        return run["trace"], run.get("predicted")
    return run, None


def pipeline_player(runs: dict[tuple[str, int, int], Any], *, schedule: str = "1f1b", num_stages: int = 4,
                    num_microbatches: int = 8, predicted: dict | None = None, wall_frames: int = 40,
                    title: str = "A pipeline step, replayed from its trace"):
    """A :class:`~reference.widgets.player.Player` over recorded runs ``{(schedule, p, m): run}``, a
    run being a trace, a :class:`PipelineRun` or a dict with ``"trace"`` (and ``"predicted"``).
    Controls: schedule, p and m (the values present in ``runs``), the clock (slots: one frame per
    slot; wall: ``wall_frames`` frames).  ``predicted``: ``{(schedule, p, m): formula bubble}`` or a
    function ``(schedule, p, m) -> bubble``.
    A combination that was not recorded (1F1B with m < p, ...) falls back to the nearest m, then
    to GPipe, and the title says so."""
    import ipywidgets as W

    from .player import Player

    names = [n for n in SCHEDULE_NAMES if any(k[0] == n for k in runs)] + \
        sorted({k[0] for k in runs} - set(SCHEDULE_NAMES))
    ps, ms = sorted({k[1] for k in runs}), sorted({k[2] for k in runs})
    cache: dict[tuple, Timeline] = {}

    def pick(name: str, p: int, m: int) -> tuple:
        if (name, p, m) in runs:
            return name, p, m
        same = [k for k in runs if k[0] == name and k[1] == p] or [k for k in runs if k[1] == p] or list(runs)
        return min(same, key=lambda k: (abs(k[2] - m), k[0] != name, k[0] != "gpipe", abs(k[1] - p)))

    def select(schedule: str, p: int, m: int, clock: str):
        key = pick(schedule, p, m)
        trace, pred = _unpack(runs[key])
        pred = predicted(*key) if callable(predicted) else (predicted or {}).get(key, pred)
        if (key, clock) not in cache:
            cache[(key, clock)] = pipeline_timeline(trace, clock)
        tl = cache[(key, clock)]
        note = "" if key == (schedule, p, m) else f" (no {schedule} run with p={p}, m={m})"
        head = f"{key[0]}, p={key[1]}, m={key[2]}{note}:"
        if clock == "slots":
            n = int(round(tl.span)) + 1
            return (lambda s: gantt_state(tl, float(s), predicted=pred, title=head)), n
        n = wall_frames + 1
        return (lambda s: gantt_state(tl, tl.span * s / wall_frames, predicted=pred, title=head)), n

    controls = {"schedule": W.Dropdown(options=names, value=schedule if schedule in names else names[0],
                                       description="schedule", layout=W.Layout(width="240px")),
                "p": W.Dropdown(options=ps, value=num_stages if num_stages in ps else ps[-1], description="stages p",
                                layout=W.Layout(width="160px")),
                "m": W.Dropdown(options=ms, value=num_microbatches if num_microbatches in ms else ms[-1],
                                description="micro-batches m", style={"description_width": "initial"},
                                layout=W.Layout(width="190px")),
                "clock": W.ToggleButtons(options=["slots", "wall"], value="slots", description="clock",
                                         style={"button_width": "70px"})}
    state_at, n = select(*(controls[k].value for k in ("schedule", "p", "m", "clock")))
    return Player(state_at, n, draw_gantt, controls=controls, rebuild=select, caption=caption, figsize=(11.5, 5.2),
                  title=title, static_step=n - 1, interval_ms=600)
