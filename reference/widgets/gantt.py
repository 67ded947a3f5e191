"""The pipeline Gantt widget (lecture 4b): a real run replayed, stage by stage, slot by slot.

::

    rank 0 | F0 F1 F2 F3 ░░ ░░ ░░ B0 F4 B1 ...      one row per rank (stage), time to the right
    rank 1 | ░░ F0 F1 F2 ░░ ░░ B0 F3 B1 F4 ...      colour = micro-batch (backward darker, W hatched)
    ...        ╲  ╲  (thin lines: an activation or a gradient passed between stages)
    ─────────────────────────────────────────       ░ = bubble (idle)
    stashed micro-batches per rank over time        (the activation memory the schedule needs)

Pure part: :func:`gantt_state` (what the picture shows at time ``t``) from a trace's compute
events, either in **slots** (the order each rank ran, laid out by :func:`reference.pipeline.simulate`
with every F, B, W one slot: the idealised picture of what actually ran) or in **wall-clock**
(the measured start and end of every block).  Drawing: :func:`draw_gantt`.  Widget:
:func:`gantt_player` over recorded runs keyed ``(schedule, p, m)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

__all__ = ["Block", "GanttState", "blocks_of", "gantt_state", "draw_gantt", "gantt_player"]


@dataclass
class Block:
    rank: int
    kind: str           # "F", "B" or "W"
    microbatch: int
    chunk: int
    stage: int          # virtual stage = chunk·p + rank
    start: float
    end: float


@dataclass
class GanttState:
    blocks: list[Block]                 # every block of the run
    t: float                            # now: blocks that started before t are drawn (cut at t)
    ranks: int
    microbatches: int
    span: float                         # end of the last block
    clock: str                          # "slots" or "wall"
    stash: dict[int, list[tuple[float, int]]] = field(default_factory=dict)   # rank -> [(time, held)]
    predicted: float | None = None      # the formula's bubble, if known
    title: str = ""

    @property
    def bubble(self) -> float:
        """Measured idle fraction of the whole run: 1 − busy / (ranks × span)."""
        busy = sum(b.end - b.start for b in self.blocks)
        return 1.0 - busy / (self.ranks * self.span) if self.span else 0.0

    def running(self) -> dict[int, Block | None]:
        return {r: next((b for b in self.blocks if b.rank == r and b.start <= self.t < b.end), None)
                for r in range(self.ranks)}


def _get(e: Any, name: str, default=None):
    return e.get(name, default) if isinstance(e, dict) else getattr(e, name, default)


def blocks_of(trace: Iterable[Any], clock: str = "slots") -> list[Block]:
    """The run's F/B/W blocks from its compute events (meta ``what``, ``microbatch``, ``chunk``, ``stage``)."""
    compute = [e for e in trace if _get(e, "op") == "compute" and "microbatch" in (_get(e, "meta") or {})]
    if not compute:
        return []
    ranks = 1 + max(_get(e, "rank") for e in compute)
    if clock == "wall":
        t0 = min(_get(e, "start") for e in compute)
        return [Block(_get(e, "rank"), e_m["what"], e_m["microbatch"], e_m.get("chunk", 0),
                      e_m.get("stage", _get(e, "rank")), (_get(e, "start") - t0) * 1e3, (_get(e, "end") - t0) * 1e3)
                for e in compute for e_m in [_get(e, "meta")]]
    from ..pipeline.schedules import Action, simulate
    order: list[list[Action]] = [[] for _ in range(ranks)]
    for e in sorted(compute, key=lambda e: (_get(e, "start"), _get(e, "end"))):
        m = _get(e, "meta")
        order[_get(e, "rank")].append(Action(m["what"], m["microbatch"], m.get("chunk", 0)))
    out = []
    for r, stage in enumerate(simulate(order)):
        for start, end, a in stage:
            out.append(Block(r, a.kind, a.microbatch, a.chunk, a.chunk * ranks + r, start, end))
    return out


def _stash(blocks: list[Block], ranks: int) -> dict[int, list[tuple[float, int]]]:
    """Micro-batches (× chunks) whose activations each rank holds: +1 when an F starts, −1 when the
    block that frees them ends (its W if the run has W's, else its B)."""
    frees = "W" if any(b.kind == "W" for b in blocks) else "B"
    out = {}
    for r in range(ranks):
        events = sorted([(b.start, 1) for b in blocks if b.rank == r and b.kind == "F"]
                        + [(b.end, -1) for b in blocks if b.rank == r and b.kind == frees])
        held, curve = 0, [(0.0, 0)]
        for t, d in events:
            held += d
            curve.append((t, held))
        out[r] = curve
    return out


def gantt_state(trace: Iterable[Any], t: float, *, clock: str = "slots", predicted: float | None = None,
                title: str = "") -> GanttState:
    """What the chart shows at time ``t`` (slots, or milliseconds since the first block)."""
    blocks = blocks_of(list(trace), clock)
    ranks = 1 + max((b.rank for b in blocks), default=0)
    m = 1 + max((b.microbatch for b in blocks), default=0)
    span = max((b.end for b in blocks), default=0.0)
    return GanttState(blocks, t, ranks, m, span, clock, _stash(blocks, ranks), predicted, title)


def _colour(i: int, m: int, kind: str):
    import matplotlib
    base = np.array(matplotlib.colormaps["viridis"](0.1 + 0.8 * i / max(1, m - 1))[:3])
    return tuple(base * 0.6) if kind != "F" else tuple(0.45 + 0.55 * base)


def draw_gantt(fig, st: GanttState) -> None:
    """Gantt chart above, stashed activations per rank below."""
    ax, ax2 = fig.subplots(2, 1, gridspec_kw={"height_ratios": [2.2, 1]}, sharex=True)
    unit = "slot" if st.clock == "slots" else "ms"
    for r in range(st.ranks):                                   # the bubble: everything not covered
        ax.barh(r, min(st.t, st.span), left=0, height=0.8, color="#e4e4e4", zorder=0)
    wide = st.span / max(1, len(st.blocks) / max(1, st.ranks))
    for b in st.blocks:
        if b.start >= st.t:
            continue
        end = min(b.end, st.t)
        ax.barh(b.rank, end - b.start, left=b.start, height=0.8, color=_colour(b.microbatch, st.microbatches, b.kind),
                edgecolor="white", linewidth=0.6, hatch="//" if b.kind == "W" else None, zorder=2)
        if end - b.start >= 0.6 * wide:
            ax.text((b.start + end) / 2, b.rank, f"{b.kind}{b.microbatch}", ha="center", va="center", fontsize=7,
                    color="white" if b.kind != "F" else "black", zorder=3)
    by_key = {(b.kind, b.stage, b.microbatch): b for b in st.blocks}
    for b in st.blocks:                                         # messages: what this block waited for
        src = by_key.get(("F", b.stage - 1, b.microbatch)) if b.kind == "F" else \
            by_key.get(("B", b.stage + 1, b.microbatch)) if b.kind == "B" else None
        if src is not None and src.rank != b.rank and b.start < st.t:
            ax.plot([src.end, b.start], [src.rank, b.rank], color="#555555", lw=0.5, alpha=0.6, zorder=1)
    ax.axvline(st.t, color="crimson", lw=1) if st.t < st.span else None
    ax.set_yticks(range(st.ranks), [f"rank {r}" for r in range(st.ranks)])
    ax.set_ylim(st.ranks - 0.5, -0.5)
    pred = f" · formula {st.predicted:.1%}" if st.predicted is not None else ""
    ax.set_title(f"{st.title}  measured bubble {st.bubble:.1%}{pred}  (grey = idle)", fontsize=10)
    for r, curve in st.stash.items():
        pts = [(t, h) for t, h in curve if t <= st.t] or [(0.0, 0)]
        xs, ys = zip(*pts)
        ax2.step(list(xs) + [min(st.t, st.span)], list(ys) + [ys[-1]], where="post", label=f"rank {r}")
    ax2.set_ylabel("stashed\nmicro-batches", fontsize=8)
    ax2.set_xlabel(f"time ({unit}s)" if unit == "slot" else "time (ms)")
    ax2.set_xlim(0, st.span * 1.01 if st.span else 1)
    ax2.legend(fontsize=7, ncol=min(4, st.ranks), loc="upper right")
    fig.tight_layout()


def _caption(st: GanttState) -> str:
    now = st.running()
    busy = ", ".join(f"rank {r}: {b.kind}{b.microbatch}" for r, b in now.items() if b is not None)
    idle = [str(r) for r, b in now.items() if b is None]
    when = f"t = {st.t:g} {'slots' if st.clock == 'slots' else 'ms'}"
    return f"{when}: {busy or 'nothing running'}" + (f"; idle (bubble): rank {', '.join(idle)}" if idle and
                                                      st.t < st.span else "")


def gantt_player(runs: dict[tuple[str, int, int], Any], *, schedule: str = "1f1b", num_stages: int = 4,
                 num_microbatches: int = 8, predicted: dict | None = None, frames: int = 24):
    """A Player over recorded runs ``{(schedule, p, m): trace}``: a schedule dropdown, p and m
    dropdowns (the combinations present), a clock toggle; Play advances time.
    ``predicted``: ``{(schedule, p, m): formula bubble}`` shown beside the measured one."""
    import ipywidgets as W

    from .player import Player

    names = [n for n in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") if any(k[0] == n for k in runs)]
    ps = sorted({k[1] for k in runs})
    ms = sorted({k[2] for k in runs})

    def select(schedule: str, p: int, m: int, clock: str):
        key = (schedule, p, m)
        if key not in runs:                       # e.g. 1F1B with m < p: fall back to GPipe
            key = ("gpipe", p, m)
        trace = runs[key]
        span = gantt_state(trace, 0.0, clock=clock).span
        n = frames + 1
        title = f"{key[0]}, p = {p}, m = {m}:" + ("" if key[0] == schedule else f" ({schedule} needs m ≥ p)")
        pred = (predicted or {}).get(key)
        return (lambda s: gantt_state(trace, span * s / frames if s < frames else span * 1.0001, clock=clock,
                                      predicted=pred, title=title)), n

    controls = {"schedule": W.Dropdown(options=names, value=schedule, description="schedule",
                                       layout=W.Layout(width="250px")),
                "p": W.Dropdown(options=ps, value=num_stages, description="stages p", layout=W.Layout(width="160px")),
                "m": W.Dropdown(options=ms, value=num_microbatches, description="micro-batches m",
                                layout=W.Layout(width="210px")),
                "clock": W.ToggleButtons(options=["slots", "wall"], value="slots", description="clock")}
    state_at, n = select(schedule, num_stages, num_microbatches, "slots")
    return Player(state_at, n, draw_gantt, controls=controls, rebuild=select, caption=_caption, figsize=(11, 5),
                  title="A pipeline step, replayed from its trace", static_step=n - 1, interval_ms=500)
