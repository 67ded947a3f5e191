"""Replay a collective: ranks on a circle, chunks moving step by step.

Works for any trace of a ring collective's point-to-point messages.  The reference's carry ``step``,
``meta["phase"]`` and ``meta["chunk"]``; a learner's need not: a message without them is placed by its
order among its rank's sends (the k-th send of a rank is ring step k; in an all-reduce the first N−1
are the reduce-scatter) and its chunk by the ring's rule (rank r sends chunk (r − s) mod N at
reduce-scatter step s, (r + 1 − s) mod N at all-gather step s) — see :func:`ring_steps`.

State (pure, tested)::

    frames = collective_frames(trace, world_size, start="all")
    frames[0]          before anything moved
    frames[k]          after step k: .messages (src, dst, chunk, nbytes), .holdings, .bytes_sent

``holdings[r][c]`` is the set of ranks whose data chunk ``c`` on rank ``r`` contains: after a
reduce-scatter step the receiver's chunk gains the sender's contributors; after an all-gather step
it becomes a copy of the sender's.  A chunk is complete when it contains every rank.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..trace import Trace

PHASES = ("reduce-scatter", "all-gather")


@dataclass
class Frame:
    index: int
    label: str
    messages: list[tuple[int, int, int | None, int]] = field(default_factory=list)
    holdings: list[dict[int, frozenset[int]]] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)   # cumulative, per rank
    world_size: int = 0

    def complete(self, rank: int) -> list[int]:
        """Chunks on ``rank`` that hold every rank's contribution."""
        full = frozenset(range(self.world_size))
        return sorted(c for c, who in self.holdings[rank].items() if who == full)


def collective_frames(trace: Sequence[Any], world_size: int, start: str = "all",
                      chunks: int | None = None) -> list[Frame]:
    """Frames of a ring collective recorded in ``trace``.

    start: what each rank holds before step 0 — "all" (every chunk, its own data: all-reduce,
    reduce-scatter) or "one" (only chunk (r+1) mod N, complete: the all-gather of lecture 0).
    """
    n = world_size
    nchunks = chunks or n
    sends = ring_steps([e for e in trace if getattr(e, "op", None) == "send"], n, start)
    order = {p: i for i, p in enumerate(PHASES)}
    keys = sorted({(order.get(e.meta.get("phase"), len(PHASES)), e.meta.get("phase", ""), e.step) for e in sends})
    if start == "all":
        hold = [{c: frozenset({r}) for c in range(nchunks)} for r in range(n)]
    else:
        hold = [{(r + 1) % n: frozenset(range(n))} for r in range(n)]
    sent = [0] * n
    frames = [Frame(0, "start", [], [dict(h) for h in hold], list(sent), n)]
    for i, (_, phase, step) in enumerate(keys, 1):
        msgs = []
        for e in sends:
            if e.meta.get("phase", "") == phase and e.step == step:
                msgs.append((e.rank, e.peer, e.meta.get("chunk"), e.nbytes))
        new = [dict(h) for h in hold]
        for src, dst, c, nb in msgs:
            sent[src] += nb
            if c is None or dst is None:
                continue
            carried = hold[src].get(c, frozenset())
            if phase == "reduce-scatter":
                new[dst][c] = new[dst].get(c, frozenset()) | carried
            else:
                new[dst][c] = carried
        hold = new
        label = f"{phase} step {step}" if phase else f"step {step}"
        frames.append(Frame(i, label, sorted(msgs), [dict(h) for h in hold], list(sent), n))
    return frames


def inferred(trace: Sequence[Any]) -> bool:
    """Whether some send lacks the step, phase or chunk that :func:`ring_steps` then infers."""
    return any(e.step is None or "phase" not in e.meta or "chunk" not in e.meta
               for e in trace if getattr(e, "op", None) == "send")


def ring_steps(sends: Sequence[Any], world_size: int, start: str = "all") -> list[Any]:
    """``sends`` with the step, phase and chunk of every message: its own where it has all three,
    else inferred from its place among its rank's sends, in the order they were posted.

    start "all" (an all-reduce or a reduce-scatter): sends 0 … N−2 of a rank are reduce-scatter steps
    0 … N−2, the rest all-gather steps 0, 1, …; start "one": all-gather steps.  Chunks follow the ring:
    reduce-scatter step s sends chunk (r − s) mod N, all-gather step s chunk (r + 1 − s) mod N.
    """
    if not inferred(sends):
        return list(sends)
    from dataclasses import replace
    n, out = world_size, []
    by_rank: dict[int, list[Any]] = {}
    for i, e in enumerate(sends):
        by_rank.setdefault(e.rank, []).append((e.start, i, e))
    for r, mine in by_rank.items():
        scatter = min(len(mine), n - 1) if start == "all" else 0
        for k, (_, _, e) in enumerate(sorted(mine, key=lambda t: t[:2])):
            phase, s = ("reduce-scatter", k) if k < scatter else ("all-gather", k - scatter)
            chunk = (r - s) % n if phase == "reduce-scatter" else (r + 1 - s) % n
            out.append(replace(e, step=s, meta={**e.meta, "phase": phase, "chunk": e.meta.get("chunk", chunk)}))
    return out


# ----------------------------------------------------------------------------------------------
# Drawing

_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def _pos(r: int, n: int, radius: float = 1.0) -> tuple[float, float]:
    a = math.pi / 2 - 2 * math.pi * r / n
    return radius * math.cos(a), radius * math.sin(a)


def draw_frame(fig, frame: Frame, *, total_bytes: int | None = None, formula: str = "") -> None:
    """Ranks on a circle with their chunks; arrows for this step's messages; bytes sent so far."""
    n = frame.world_size
    ax = fig.add_axes([0.0, 0.0, 0.62, 1.0])
    ax.set_xlim(-1.7, 1.7)
    ax.set_ylim(-1.55, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(frame.label, fontsize=11)
    nchunks = max((max(h) + 1 for h in frame.holdings if h), default=n)
    letters = "abcdefghijklmnop"
    for r in range(n):
        x, y = _pos(r, n)
        ax.add_patch(_box(x - 0.48, y - 0.22, 0.96, 0.44, "#f5f5f5", "#555"))
        ax.text(x, y + 0.24, f"rank {r}", ha="center", va="bottom", fontsize=9, weight="bold")
        w = 0.86 / nchunks
        for c in range(nchunks):
            who = frame.holdings[r].get(c)
            cx = x - 0.43 + c * w
            if who is None:
                ax.add_patch(_box(cx, y - 0.15, w * 0.9, 0.3, "white", "#ccc", ls=":"))
                continue
            frac = len(who) / n
            colour = _COLOURS[c % len(_COLOURS)]
            ax.add_patch(_box(cx, y - 0.15, w * 0.9, 0.3, colour, "#333", alpha=0.25 + 0.75 * frac))
            ax.text(cx + w * 0.45, y, f"{letters[c % 16]}{len(who)}" if frac < 1 else letters[c % 16].upper(),
                    ha="center", va="center", fontsize=8, color="black")
    for src, dst, c, nb in frame.messages:
        if dst is None:
            continue
        (x0, y0), (x1, y1) = _pos(src, n, 0.6), _pos(dst, n, 0.6)
        colour = _COLOURS[(c or 0) % len(_COLOURS)]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", color=colour, lw=2, connectionstyle="arc3,rad=0.25"))
        mx, my = (x0 + x1) / 2 * 0.45, (y0 + y1) / 2 * 0.45
        ax.text(mx, my, letters[(c or 0) % 16], color=colour, fontsize=10, weight="bold", ha="center", va="center")
    ax.text(0, -1.5, "chunk letter + how many ranks' data it holds; CAPITAL = complete sum",
            ha="center", fontsize=7.5, color="#555")

    bx = fig.add_axes([0.70, 0.15, 0.28, 0.7])
    bx.bar(range(n), frame.bytes_sent, color=[_COLOURS[r % len(_COLOURS)] for r in range(n)])
    if total_bytes:
        bx.axhline(total_bytes, color="black", ls="--", lw=1)
        bx.text(n - 0.5, total_bytes, formula or f"{total_bytes} B", ha="right", va="bottom", fontsize=8)
    bx.set_xticks(range(n))
    bx.set_xlabel("rank")
    bx.set_title("bytes sent so far", fontsize=9)
    top = max([total_bytes or 0] + frame.bytes_sent + [1]) * 1.2
    bx.set_ylim(0, top)


def _box(x, y, w, h, face, edge, alpha=1.0, ls="-"):
    from matplotlib.patches import FancyBboxPatch
    return FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.03", facecolor=face,
                          edgecolor=edge, alpha=alpha, linestyle=ls)


def collective_player(trace: Trace, world_size: int, *, start: str = "all", total_bytes: int | None = None,
                      formula: str = "", title: str = "", static_step: int = 0):
    """A :class:`~reference.widgets.player.Player` over the frames of ``trace``
    (``static_step``: the frame a headless run shows as a picture)."""
    from .player import Player
    frames = collective_frames(trace, world_size, start=start)
    if inferred(trace):
        title = (title + " — " if title else "") + "steps and chunks read from the order of each rank's messages"

    def caption(fr: Frame) -> str:
        if not fr.messages:
            return "Before step 0: every rank holds its own data."
        moves = ", ".join(f"{s}→{d}:{'abcdefghijklmnop'[(c or 0) % 16]}" for s, d, c, _ in fr.messages)
        return f"{fr.label}: {moves}"

    return Player(lambda i: frames[i], len(frames),
                  lambda fig, fr: draw_frame(fig, fr, total_bytes=total_bytes, formula=formula),
                  caption=caption, title=title, figsize=(9, 4.2), static_step=static_step)
