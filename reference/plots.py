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


def collapse(runs: dict):
    """Lecture 5b: fraction of tokens per expert over training, one panel per balance coefficient α."""
    import torch
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.3), sharey=True, squeeze=False)
    for ax, (alpha, run) in zip(axes[0], runs.items()):
        load = torch.tensor(run["load"])
        ax.stackplot(range(len(load)), load.T.numpy(), labels=[f"expert {e}" for e in range(load.shape[1])])
        ax.set_title(f"balance coefficient α = {alpha}")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("fraction of tokens")
    axes[0][-1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def params_vs_flops(rows: list[dict]):
    """Lecture 5b: parameters and FLOPs per token relative to the smallest E, against E (log 2)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    Es = [r["experts"] for r in rows]
    ax.plot(Es, [r["params"] / rows[0]["params"] for r in rows], "o-", label="parameters")
    ax.plot(Es, [r["flops_per_token"] / rows[0]["flops_per_token"] for r in rows], "s-", label="FLOPs per token")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("experts E (top-2)")
    ax.set_ylabel(f"relative to E = {Es[0]}")
    ax.legend()
    fig.tight_layout()
    return fig


def activation_memory(lengths, curves: dict, device_bytes: float, device_name: str):
    """Lecture 5a: memory vs sequence length, log-log, one line per curve, a device-memory line."""
    fig, ax = plt.subplots(figsize=(6.6, 3.6))
    for label, values in curves.items():
        ax.loglog(lengths, [v / 2**30 for v in values], "o-", ms=3, label=label)
    ax.axhline(device_bytes / 2**30, color="k", ls="--", lw=1)
    ax.text(lengths[0], device_bytes / 2**30 * 1.15, device_name, fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length L (tokens)")
    ax.set_ylabel("activation memory (GiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bars_per_rank(values: dict, *, ylabel: str, title: str = "", formula: dict | None = None):
    """Grouped bars: one group per rank, one bar per key of ``values`` ({name: [per rank]});
    ``formula`` ({name: [per rank]}) is drawn as black ticks over the bars."""
    import numpy as np
    names = list(values)
    W = len(next(iter(values.values())))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for i, name in enumerate(names):
        x = np.arange(W) + (i - (len(names) - 1) / 2) * width
        ax.bar(x, values[name], width, label=name)
        if formula and name in formula:
            ax.plot(x, formula[name], "k_", ms=14, mew=2)
    ax.set_xticks(range(W), [f"rank {r}" for r in range(W)])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def per_rank_vs_world(series: dict, *, ylabel: str, title: str = "", loglog: bool = False):
    """Lines against the world size W: ``series`` {label: (Ws, values, style)}."""
    fig, ax = plt.subplots(figsize=(6.2, 3.3))
    for label, (Ws, vals, style) in series.items():
        ax.plot(Ws, vals, style, label=label)
    if loglog:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
    ax.set_xlabel("ranks W")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
