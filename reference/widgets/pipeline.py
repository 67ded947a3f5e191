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

Pure part, unit-tested: :func:`pipeline_timeline` reads a trace once (compute events: ``meta``
``what``/``microbatch``/``chunk``/``stage``/``stashed``; send/recv: ``what`` "activation" or
"gradient", ``microbatch``) into blocks, messages and stash curves, either in **slots** — the
order each rank ran, re-laid out with every F, B, W one slot, each as early as its inputs allow
(F of stage s after F of stage s−1, B of s after B of s+1 and its own F, W after its B): the
idealised picture of what actually ran — or in **wall** clock (measured start/end in ms from the
first block).  :func:`gantt_state` cuts it at time ``t``.  Bubble = idle / (p × makespan).
Drawing: :func:`draw_gantt`.  Widget: :func:`pipeline_player` over runs keyed ``(schedule, p, m)``.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Block", "Message", "Timeline", "GanttState", "PipelineRun", "pipeline_timeline", "gantt_state",
           "draw_gantt", "caption", "pipeline_player"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
BUBBLE_GREY = "#dcdcdc"


def _get(e: Any, name: str, default=None):
    """Events are :class:`reference.trace.Event` objects or plain dicts."""
    return e.get(name, default) if isinstance(e, dict) else getattr(e, name, default)


@dataclass(frozen=True)
class Block:
    rank: int
    kind: str             # "F", "B" or "W"
    microbatch: int
    chunk: int
    stage: int            # virtual stage = chunk·p + rank
    start: float          # slots, or ms since the first block
    end: float
    stashed: int | None = None   # micro-batches this rank holds after it (trace meta), if recorded


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    what: str             # "activation" (F → F, down) or "gradient" (B → B, up)
    microbatch: int
    depart: float         # the producing block's end (wall: the send's posting)
    arrive: float         # the consuming block's start (wall: when the receiver had it in hand)
    consumer: Block
    nbytes: int = 0


@dataclass
class Timeline:
    """A whole run laid out on one clock: what :func:`gantt_state` cuts at ``t``."""

    clock: str                                   # "slots" or "wall"
    ranks: int
    virtual_stages: int
    num_microbatches: int
    blocks: list[Block]
    messages: list[Message]
    stash: dict[int, list[tuple[float, int]]]    # rank -> [(time, held from then on)], starts at (0, 0)
    span: float                                  # last end − first start (the first start is 0)

    @property
    def unit(self) -> str:
        return "slots" if self.clock == "slots" else "ms"

    @property
    def busy(self) -> dict[int, float]:
        out = {r: 0.0 for r in range(self.ranks)}
        for b in self.blocks:
            out[b.rank] += b.end - b.start
        return out

    @property
    def bubble_per_rank(self) -> dict[int, float]:
        return {r: 1 - busy / self.span if self.span else 0.0 for r, busy in self.busy.items()}

    @property
    def bubble(self) -> float:
        """idle / total with total = p × makespan, idle = total − busy (the lecture's definition)."""
        total = self.ranks * self.span
        return 1 - sum(self.busy.values()) / total if total else 0.0

    @property
    def peak_stash(self) -> dict[int, int]:
        return {r: max(h for _, h in curve) for r, curve in self.stash.items()}

    def idle(self, rank: int, upto: float | None = None) -> list[tuple[float, float]]:
        """The rank's bubbles: gaps between 0, its blocks and the makespan (cut at ``upto``)."""
        end = self.span if upto is None else min(upto, self.span)
        gaps, at = [], 0.0
        for b in sorted((b for b in self.blocks if b.rank == rank), key=lambda b: b.start):
            if min(b.start, end) > at + 1e-9:
                gaps.append((at, min(b.start, end)))
            at = max(at, b.end)
        if end > at + 1e-9:
            gaps.append((at, end))
        return gaps


def _needs(kind: str, stage: int, i: int) -> list[tuple[str, int, int]]:
    """What a block waits for, as (kind, virtual stage, micro-batch)."""
    return {"F": [("F", stage - 1, i)], "B": [("F", stage, i), ("B", stage + 1, i)], "W": [("B", stage, i)]}[kind]


def _slots(order: list[list[tuple]]) -> dict[tuple, tuple[float, float]]:
    """Each rank's actions ``(kind, stage, mb)`` in its order, one slot each, as early as the
    dependencies present in the run allow.  Raises ValueError on an order that deadlocks."""
    keys = {a for acts in order for a in acts}
    done: dict[tuple, tuple[float, float]] = {}
    free, pos, progress = [0.0] * len(order), [0] * len(order), True
    while progress:
        progress = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts):
                deps = [d for d in _needs(*acts[pos[r]]) if d in keys]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d][1] for d in deps])
                done[acts[pos[r]]] = (start, start + 1.0)
                free[r], pos[r], progress = start + 1.0, pos[r] + 1, True
    stuck = [f"rank {r} at {acts[pos[r]][0]}{acts[pos[r]][2]}" for r, acts in enumerate(order) if pos[r] < len(acts)]
    if stuck:
        raise ValueError("the trace's order deadlocks in slots: " + ", ".join(stuck))
    return done


def pipeline_timeline(trace: Iterable[Any], clock: str = "slots") -> Timeline:
    """Lay a run's trace out on ``clock`` ("slots" or "wall"): blocks, messages, stash curves."""
    if clock not in ("slots", "wall"):
        raise ValueError(f"clock must be 'slots' or 'wall', got {clock!r}")
    events = list(trace)
    compute = sorted((e for e in events if _get(e, "op") == "compute"
                      and {"what", "microbatch"} <= set(_get(e, "meta") or {})),
                     key=lambda e: (_get(e, "start"), _get(e, "end")))
    if not compute:
        return Timeline(clock, 0, 1, 0, [], [], {}, 0.0)
    p = 1 + max(int(_get(e, "rank")) for e in compute)
    v = 1 + max(int(_get(e, "meta").get("chunk", 0)) for e in compute)

    def key(e) -> tuple[str, int, int]:
        m, r = _get(e, "meta"), int(_get(e, "rank"))
        return m["what"], int(m.get("stage", m.get("chunk", 0) * p + r)), int(m["microbatch"])

    if clock == "slots":
        order: list[list[tuple]] = [[] for _ in range(p)]
        for e in compute:
            order[int(_get(e, "rank"))].append(key(e))
        times = _slots(order)
    else:
        t0 = _get(compute[0], "start")
        times = {key(e): ((_get(e, "start") - t0) * 1e3, (_get(e, "end") - t0) * 1e3) for e in compute}
    blocks = []
    for e in compute:
        kind, stage, i = key(e)
        m = _get(e, "meta")
        blocks.append(Block(int(_get(e, "rank")), kind, i, int(m.get("chunk", 0)), stage, *times[key(e)],
                            m.get("stashed")))
    by_key = {(b.kind, b.stage, b.microbatch): b for b in blocks}

    # messages: every dependency that crosses ranks; wall clock takes the send/recv times when traced
    wires: dict[tuple, list] = defaultdict(list)       # (op, src, dst, what, mb) -> events in time order
    for e in sorted(events, key=lambda e: (_get(e, "start"), _get(e, "end"))):
        m = _get(e, "meta") or {}
        if _get(e, "op") in ("send", "recv") and m.get("what") in ("activation", "gradient") and "microbatch" in m:
            ends = (_get(e, "rank"), _get(e, "peer"))
            src, dst = ends if _get(e, "op") == "send" else ends[::-1]
            wires[(_get(e, "op"), src, dst, m["what"], m["microbatch"])].append(e)
    edges: dict[tuple, list[tuple[Block, Block]]] = defaultdict(list)
    for b in blocks:
        for d in _needs(b.kind, b.stage, b.microbatch):
            src = by_key.get(d)
            if src is not None and src.rank != b.rank and d[0] == b.kind:
                what = "activation" if b.kind == "F" else "gradient"
                edges[(src.rank, b.rank, what, b.microbatch)].append((src, b))
    messages = []
    for (s, d, what, i), pairs in edges.items():
        pairs.sort(key=lambda sb: sb[0].end)
        sends, recvs = wires.get(("send", s, d, what, i), []), wires.get(("recv", s, d, what, i), [])
        for n, (src, dst) in enumerate(pairs):       # the n-th such message is the n-th send and recv
            depart, arrive, nbytes = src.end, dst.start, 0
            if clock == "wall" and n < len(sends):
                depart, nbytes = (_get(sends[n], "start") - t0) * 1e3, int(_get(sends[n], "nbytes") or 0)
            if clock == "wall" and n < len(recvs):
                arrive = min(dst.start, (_get(recvs[n], "end") - t0) * 1e3)
            messages.append(Message(s, d, what, i, depart, max(depart, arrive), dst, nbytes))
    messages.sort(key=lambda msg: msg.depart)

    # stash: the held count after each block (trace meta), else F adds one and its B (or W) frees it
    frees = "W" if any(b.kind == "W" for b in blocks) else "B"
    stash = {}
    for r in range(p):
        held, curve = 0, [(0.0, 0)]
        for b in sorted((b for b in blocks if b.rank == r), key=lambda b: b.end):
            held = b.stashed if b.stashed is not None else held + {"F": 1, frees: -1}.get(b.kind, 0)
            curve.append((b.end, held))
        stash[r] = curve
    span = max(b.end for b in blocks)
    return Timeline(clock, p, v, 1 + max(b.microbatch for b in blocks), blocks, messages, stash, span)


@dataclass
class GanttState:
    """The picture at time ``t``: what has started (blocks cut at ``t``), messages sent, stash so far."""

    timeline: Timeline
    t: float
    blocks: list[Block]                          # started before t (drawn up to min(end, t))
    done: list[Block]                            # finished by t
    now: dict[int, Block | None]                 # rank -> the block running just before t (start < t ≤ end)
    messages: list[Message]                      # departed by t
    in_flight: list[Message]                     # departed, not yet arrived
    idle: dict[int, list[tuple[float, float]]]   # rank -> bubbles up to t
    stash: dict[int, list[tuple[float, int]]]    # rank -> curve up to t
    stash_now: dict[int, int]
    predicted: float | None = None
    title: str = ""

    @property
    def finished(self) -> bool:
        return self.t >= self.timeline.span


def gantt_state(trace: Iterable[Any] | Timeline, t: float, *, clock: str = "slots", predicted: float | None = None,
                title: str = "") -> GanttState:
    """What the chart shows at time ``t`` (slots, or ms since the first block); ``trace`` may be a
    :class:`Timeline` already laid out (then ``clock`` is its own)."""
    tl = trace if isinstance(trace, Timeline) else pipeline_timeline(trace, clock)
    eps = 1e-9
    blocks = [b for b in tl.blocks if b.start < t - eps]
    now = {r: next((b for b in blocks if b.rank == r and b.end >= t - eps), None) for r in range(tl.ranks)}
    msgs = [m for m in tl.messages if m.depart <= t - eps]
    stash = {r: [(x, h) for x, h in c if x <= t + eps] for r, c in tl.stash.items()}
    return GanttState(tl, t, blocks, [b for b in blocks if b.end <= t + eps], now, msgs,
                      [m for m in msgs if m.arrive > t + eps], {r: tl.idle(r, t) for r in range(tl.ranks)},
                      stash, {r: c[-1][1] for r, c in stash.items()}, predicted, title)


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
    if tl.virtual_stages > 1:
        names = [f"rank {r}\nstages " + ",".join(str(c * p + r) for c in range(tl.virtual_stages)) for r in range(p)]
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
