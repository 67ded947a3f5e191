"""Lecture 6's animation: the search for the first divergence, step by step.

``rows`` is a divergence map (:func:`reference.debug.lecture.divergence_map`): every record of a run in the
order one process made them, with the ranks whose pieces differ (empty: the record agrees).  The search is
:func:`reference.debug.first_divergence`'s: a binary search over the steps (a step differs if any of its
records does), then a walk through the first differing step's records.  :func:`bisection_frames` lists
what is known after each comparison (a pure function, tested); :func:`bisection_player` draws it::

    steps   0   1   2   3   4   5   6   7        ■ agrees  ■ differs  □ not compared yet
            ■           ■           ■   □        lo = 4, hi = 6: the first differing step is 4, 5 or 6
    step 6's records:  ■ ■ ■ ■ ■ ■ ■ ■ ■ ■ ■ ▶■   the walk: the first record that differs
"""
from __future__ import annotations

from typing import Any

__all__ = ["bisection_frames", "draw_bisection", "bisection_player"]


def bisection_frames(rows: list[dict]) -> list[dict]:
    """After each comparison of the search, what is known: {"steps": the steps, "verdict": {step: True if it
    differs}, "lo", "hi" (the first differing step lies in steps[lo:hi]), "walk": records of the found step
    looked at so far (indices into ``rows``), "found": the first differing record's index or None,
    "compared": records compared so far}."""
    steps = sorted({r["step"] for r in rows})
    in_step = {s: [i for i, r in enumerate(rows) if r["step"] == s] for s in steps}
    differs = {s: any(rows[i]["ranks"] for i in in_step[s]) for s in steps}
    frames, verdict, compared = [], {}, 0
    lo, hi = 0, len(steps)

    def frame(walk=(), found=None) -> dict:
        return {"steps": steps, "verdict": dict(verdict), "lo": lo, "hi": hi, "walk": list(walk), "found": found,
                "compared": compared}
    frames.append(frame())
    while lo < hi:
        mid = (lo + hi) // 2
        s = steps[mid]
        # a differing step is known as soon as one record differs; an agreeing one needs all of them
        compared += next((k + 1 for k, i in enumerate(in_step[s]) if rows[i]["ranks"]), len(in_step[s]))
        verdict[s] = differs[s]
        if differs[s]:
            hi = mid
        else:
            lo = mid + 1
        frames.append(frame())
    if lo == len(steps):
        return frames
    walk = []
    for i in in_step[steps[lo]]:
        walk.append(i)
        compared += 1
        if rows[i]["ranks"]:
            frames.append(frame(walk, i))
            break
        if len(walk) % 8 == 0:                     # one frame per eight agreeing records: the walk is long
            frames.append(frame(walk))
    return frames


def draw_bisection(fig, state: dict, rows: list[dict]) -> None:
    """Top: one box per step (green agrees, red differs, grey not compared; the bracket [lo, hi)); bottom:
    the found step's records, those walked so far coloured, the first differing one named."""
    from matplotlib.patches import Rectangle
    steps = state["steps"]
    ax = fig.add_subplot(2, 1, 1)
    for k, s in enumerate(steps):
        v = state["verdict"].get(s)
        colour = "#bbbbbb" if v is None else ("#d62728" if v else "#2ca02c")
        inside = state["lo"] <= k < max(state["hi"], state["lo"] + 1)
        ax.add_patch(Rectangle((k + 0.08, 0.1), 0.84, 0.8, color=colour, ec="black" if inside else colour,
                               lw=2 if inside else 0))
        ax.text(k + 0.5, 0.5, f"step {s}", ha="center", va="center", fontsize=9, color="white")
    ax.set_xlim(0, len(steps))
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(f"bisect the steps: the first differing step lies in the bracket ({state['compared']} records "
                 "compared so far)", fontsize=9)
    ax2 = fig.add_subplot(2, 1, 2)
    if state["walk"]:
        step = rows[state["walk"][0]]["step"]
        idx = [i for i, r in enumerate(rows) if r["step"] == step]
        for k, i in enumerate(idx):
            seen = i in state["walk"]
            colour = "#d62728" if seen and rows[i]["ranks"] else ("#2ca02c" if seen else "#dddddd")
            ax2.bar(k, 1, width=0.9, color=colour)
        if state["found"] is not None:
            r = rows[state["found"]]
            ax2.set_title(f"walk step {step}: the first record that differs is {r['phase']} {r['module']} "
                          f"{r['tensor']} on ranks {r['ranks']}", fontsize=9)
        else:
            ax2.set_title(f"walk step {step}'s records in order…", fontsize=9)
        ax2.set_xlim(-1, len(idx))
    else:
        ax2.set_title("then walk the first differing step's records in order", fontsize=9)
    ax2.axis("off")


def bisection_player(rows: list[dict], **kwargs: Any):
    """A :class:`~reference.widgets.player.Player` over :func:`bisection_frames` of ``rows``."""
    from .player import Player
    frames = bisection_frames(rows)
    return Player(lambda k: frames[k], len(frames), lambda fig, st: draw_bisection(fig, st, rows),
                  caption=lambda st: (f"{st['compared']} records compared; first differing step in "
                                      f"steps[{st['lo']}:{st['hi']}]"),
                  static_step=len(frames) - 1, figsize=(9, 3.4), **kwargs)
