"""Small plotting helpers the notebooks share: measured values as markers, formulas as lines.

Each takes the plain data a notebook demo returned (``reference.*.demos`` / ``reference.primer``)
and returns the matplotlib figure, so that a notebook cell stays a few lines long.
"""
from __future__ import annotations

import matplotlib.pyplot as plt


def bytes_per_collective(data: dict):
    """Lecture 0: bytes SENT per rank by the busiest rank vs N, measured (markers) and formula (lines)."""
    n_bytes, rows = data["bytes"], data["rows"]
    Ns = [r["N"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    series = [("ring all-reduce", "ring_sent", lambda N: 2 * (N - 1) / N * n_bytes, "2(N−1)/N · n"),
              ("gather-to-one all-reduce (rank 0)", "one_sent", lambda N: (N - 1) * n_bytes, "(N−1) · n"),
              ("ring all-gather", "gather_sent", lambda N: (N - 1) / N * n_bytes, "(N−1)/N · n")]
    for (label, key, formula, text), marker in zip(series, "osD"):
        measured = [max(r[key].values()) for r in rows]
        line, = ax.plot(Ns, [formula(N) for N in Ns], "--", alpha=0.6)
        ax.plot(Ns, measured, marker, color=line.get_color(), label=f"{label}: {text}")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bytes sent by the busiest rank")
    ax.set_xticks(Ns)
    ax.set_title(f"one collective of n = {n_bytes:,} bytes (markers: measured; dashed: formula)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
