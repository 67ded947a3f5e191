"""Small plotting helpers the notebooks share: measured values as markers, formulas as lines.

Each takes the plain data a notebook demo returned (``reference.*.lecture`` / ``reference.primer``)
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


def alpha_beta(measured: dict):
    """Lecture 0: a ping-pong's one-way time and an all-reduce's time against the message size (log-log), measured
    (markers) beside the α–β model fitted to the ping-pong (lines): t = α + n/β, and the ring's 2(p−1)α +
    2(p−1)/p · n/β for the all-reduce.  ``measured``: :func:`reference.planner.measure.measure_link`'s result."""
    from ..planner.thresholds import ring_all_reduce
    link, sizes, p = measured["link"], measured["sizes"], measured["p"]
    a, b = link.alpha, link.beta
    fine = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 60) for i in range(61)]
    us = 1e6
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    line, = ax.plot(fine, [us * (a + n / b) for n in fine], "-", label="α + n/β (fitted)")
    ax.plot(sizes, [us * t for t in measured["pingpong"]], "o", color=line.get_color(),
            label="one message, measured (half a ping-pong)")
    line, = ax.plot(fine, [us * ring_all_reduce(n, p, a, b) for n in fine], "-",
                    label=f"2(p−1)α + 2(p−1)/p · n/β, p = {p}")
    ax.plot(sizes, [us * t for t in measured["all_reduce"]], "s", color=line.get_color(),
            label=f"all-reduce on {p} ranks, measured")
    ax.plot(fine, [us * a for _ in fine], ":", color="grey", lw=1)
    ax.plot(fine, [us * n / b for n in fine], ":", color="grey", lw=1)
    half = a * b
    if sizes[0] <= half <= sizes[-1]:
        ax.axvline(half, color="grey", lw=0.8, ls="--")
        ax.text(half, us * a / 3, f" n½ = αβ ≈ {half / 1e3:.0f} kB", fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=us * a / 6)
    ax.set_xlabel("message size n (bytes)")
    ax.set_ylabel("time (µs)")
    ax.set_title(f"{link.name}: α = {us * a:.0f} µs, β = {b / 1e9:.2f} GB/s (dotted: α alone, n/β alone)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def ring_vs_tree(link, sizes: dict, ranks=tuple(2 ** k for k in range(1, 13))):
    """Lecture 0: the α–β model's time of a ring and of a tree all-reduce against the number of ranks, one pair of
    lines per message size (``sizes``: {label: bytes}), on ``link`` (a ``thresholds.Link``)."""
    from ..planner.thresholds import ring_all_reduce, tree_all_reduce
    fig, ax = plt.subplots(figsize=(6.8, 3.6))
    for label, n in sizes.items():
        line, = ax.plot(ranks, [1e3 * ring_all_reduce(n, p, link.alpha, link.beta) for p in ranks], "-o", ms=3,
                        label=f"ring, {label}")
        ax.plot(ranks, [1e3 * tree_all_reduce(n, p, link.alpha, link.beta) for p in ranks], "--s", ms=3,
                color=line.get_color(), label=f"tree, {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("time (ms), α–β model")
    ax.set_title(f"all-reduce on {link.name}: α = {1e6 * link.alpha:.1f} µs, β = {link.beta / 1e9:.0f} GB/s",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def step_and_tail(timelines: dict):
    """Lecture 3: for each bucket setting, the step as a bar: the backward (first rank's start to last rank's end)
    and then the exposed tail, with its total — beside which the tail alone is a partial figure.  ``timelines``:
    ``reference.data.lecture.ddp_runs(...)["timelines"]``."""
    from ..widgets.buckets import step_time
    labels = list(timelines)
    steps = [step_time(timelines[k]["trace"]) for k in labels]
    fig, ax = plt.subplots(figsize=(8.2, 0.5 * len(labels) + 1.3))
    y = list(range(len(labels)))
    ax.barh(y, [1e3 * s["backward"] for s in steps], color="#9bb7d4", edgecolor="#33506e",
            label="backward (first rank's start → last rank's end)")
    ax.barh(y, [1e3 * s["exposed"] for s in steps], left=[1e3 * s["backward"] for s in steps], color="#c0392b",
            label="exposed tail")
    for i, s in enumerate(steps):
        ax.text(1e3 * s["step"], i, f" {1e3 * s['step']:.0f} ms (tail {1e3 * s['exposed']:.0f})", va="center",
                fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3e3 * max(s["step"] for s in steps))
    ax.set_xlabel("ms")
    ax.set_title("what the step pays: backward + exposed tail", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=2, frameon=False)
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


def topk_quality(result: dict, smooth: int = 10):
    """Lecture 5b: the tiny GPT dense, top-1 and top-2 (``reference.moe.lecture.topk_quality``): training
    loss (``smooth``-step moving average; line: mean over seeds, band: min–max) and held-out loss."""
    import torch
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.4))
    for name, run in result["runs"].items():
        losses = torch.tensor(run["losses"])                                     # seeds × steps
        smooth = min(smooth, losses.shape[1])
        avg = losses.unfold(1, smooth, 1).mean(-1)
        steps = range(smooth, losses.shape[1] + 1)
        line, = ax.plot(steps, avg.mean(0), label=name)
        ax.fill_between(steps, avg.min(0).values, avg.max(0).values, color=line.get_color(), alpha=0.2)
        held = torch.tensor([[v for _, v in curve] for curve in run["heldout"]])
        at = [s for s, _ in run["heldout"][0]]
        mean = held.mean(0)
        bx.errorbar(at, mean, yerr=[mean - held.min(0).values, held.max(0).values - mean], marker="o",
                    capsize=3, color=line.get_color(), label=name)
    n = len(result["config"]["seeds"])
    ax.set_title(f"training loss ({smooth}-step average; band: min–max over {n} seeds)", fontsize=9)
    bx.set_title(f"held-out loss (mean; bars: min–max over {n} seeds)", fontsize=9)
    for a in (ax, bx):
        a.set_xlabel("step")
        a.legend(fontsize=8)
    ax.set_ylabel("cross-entropy (nats per character)")
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


def ring_scaling(*, seq_len: int, heads: int, heads_kv: int, head_dim: int, bytes_per_value: int,
                 links: dict, world_sizes=(1, 2, 4, 8, 16, 32, 64, 128)):
    """Lecture 5a: modelled time of one attention forward vs W at fixed L, one panel per link
    ({name: reference.planner.thresholds.Link}); ring, Ulysses, all-gather and compute only, the
    ideal 1/W, and a dashed line where the ring's shard falls below the overlap threshold n*
    (``thresholds.cp_tokens``, non-causal, the latency included).  Returns (figure, {name: n*})."""
    from ..planner.thresholds import cp_tokens
    from ..sequence.scaling import step_times
    fig, axes = plt.subplots(1, len(links), figsize=(5.6 * len(links), 3.6), sharey=True, squeeze=False)
    thresholds = {}
    for ax, (name, link) in zip(axes[0], links.items()):
        st = step_times(seq_len, world_sizes, link, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                        bytes_per_value=bytes_per_value)
        t1 = st["compute only"][0]
        ax.plot(world_sizes, [1 / W for W in world_sizes], "k:", lw=1, label="ideal 1/W")
        for key, style in (("ring", "o-"), ("ulysses", "s-"), ("all-gather", "^-")):
            pts = [(W, t / t1) for W, t in zip(world_sizes, st[key]) if t is not None]
            ax.plot(*zip(*pts), style, ms=4, label=key)
        n_star = round(cp_tokens(link, heads, heads_kv, head_dim, bytes_per_value))
        thresholds[name] = n_star
        if seq_len / n_star <= world_sizes[-1]:
            ax.axvline(seq_len / n_star, color="grey", ls="--", lw=1)
            ax.text(seq_len / n_star * 1.05, 0.3, f"L/W = n* ≈ {n_star:,}:\nthe ring\nstops hiding", fontsize=7)
        else:
            ax.text(world_sizes[0], 2 / world_sizes[-1], f"n* ≈ {n_star:,}: the ring hides\nat every W shown",
                    fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W")
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel("modelled time per forward / time on 1 rank")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig, thresholds


# ----------------------------------------------------------------------------------------------
# The rank grid of lecture 5c (reference.mesh.RankGrid), as text and as a picture


def grid_text(grid, devices_per_node: int | None = None) -> str:
    """The grid as text: one block per pipeline stage, rows = dp, columns = cp, ``[..]`` = a tp group."""
    w = len(str(grid.world_size - 1))
    lines = [f"{grid!r}   order tp-cp-dp-pp (tensor fastest-varying)"]
    for p in range(grid.pp):
        lines.append(f"pp stage {p}:")
        head = " " * 7 + "".join(f"cp {c}".ljust(grid.tp * (w + 1) + 3) for c in range(grid.cp))
        if grid.cp > 1:
            lines.append(head.rstrip())
        for d in range(grid.dp):
            cells = []
            for c in range(grid.cp):
                members = " ".join(str(r).rjust(w) for r in grid._dense[p, d, c])
                cells.append(f"[{members}]")
            lines.append(f"  dp {d}".ljust(7) + "  ".join(cells))
    for axis in ("tp", "cp", "dp", "pp") + (("ep", "edp") if grid.ep > 1 else ()):
        if grid.sizes[axis] == 1:
            continue
        groups = grid.all_groups(axis)
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:8])
        more = f" … ({len(groups)} groups)" if len(groups) > 8 else ""
        node = ""
        if devices_per_node:
            node = "   crosses nodes" if grid.crosses_nodes(axis, devices_per_node) else "   inside a node"
        lines.append(f"{axis:>3} groups (size {grid.sizes[axis]}): {shown}{more}{node}")
    return "\n".join(lines)

def grid_plot(grid, axis: str = "tp", *, ax=None, devices_per_node: int | None = None):
    """Draw the ranks as a grid of cells coloured by their group on ``axis``; returns the Axes.

    Columns: rank mod (tp·cp); rows: rank div (tp·cp) — so each row is one (dp, pp) slice and
    pipeline stages are separated by thick lines.  Node boundaries (if given) are dashed.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap

    if ax is None:
        _, ax = plt.subplots(figsize=(min(1 + 0.6 * grid.tp * grid.cp, 12), min(1 + 0.5 * grid.dp * grid.pp, 10)))
    cols = grid.tp * grid.cp
    rows = grid.world_size // cols
    colour = np.zeros(grid.world_size, dtype=int)
    for i, g in enumerate(grid.all_groups(axis)):
        colour[g] = i
    base = plt.get_cmap("tab20").colors
    cmap = ListedColormap([base[i % len(base)] for i in range(colour.max() + 1)])
    ax.imshow(colour.reshape(rows, cols), cmap=cmap, aspect="auto", interpolation="nearest",
              vmin=-0.5, vmax=colour.max() + 0.5)
    if grid.world_size <= 256:
        for r in range(grid.world_size):
            ax.text(r % cols, r // cols, str(r), ha="center", va="center", fontsize=8)
    for p in range(1, grid.pp):
        ax.axhline(p * grid.dp - 0.5, color="black", lw=2.5)
    if devices_per_node:
        for b in range(devices_per_node, grid.world_size, devices_per_node):
            if b % cols == 0:
                ax.axhline(b // cols - 0.5, color="white", lw=1.5, ls="--")
            else:
                ax.axvline(b % cols - 0.5, color="white", lw=1.5, ls="--")
    ax.set_xticks(range(cols), [f"c{c}t{t}" for c in range(grid.cp) for t in range(grid.tp)], fontsize=7)
    ax.set_yticks(range(rows), [f"p{p}d{d}" for p in range(grid.pp) for d in range(grid.dp)], fontsize=7)
    ax.set_title(f"{grid!r}: {axis} groups — {grid.describe(axis)}", fontsize=9)
    return ax
