"""Expert loads over training, replayed: no balancing, Switch's auxiliary loss and loss-free balancing side by side.

From :func:`reference.moe.lecture.balance_over_training`'s result (the tiny GPT, every MoE layer's loads and
loss-free bias after every step), step by step::

    ┌ none ────────────┐ ┌ aux ─────────────┐ ┌ loss_free ───────┐   per setting: each expert's load ÷ the mean
    │ ▇ ▂ ▅ █ ▁ ▃ ▄ ▂  │ │ ▅ ▃ ▇ ▄ ▂ ▆ ▃ ▅  │ │ ▄ ▅ ▄ ▅ ▄ ▄ ▅ ▄  │   (one bar per layer), 1 = its fair share;
    └──────────────────┘ └──────────────────┘ └──────────────────┘   loss_free: its bias, dots on the right axis
    max/mean load over the steps so far  ·  cross-entropy over the steps so far (a 10-step moving mean)

The state is a plain dict (:func:`loads_state`); :func:`draw_loads` paints it and :func:`loads_player` plays it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["loads_state", "loads_caption", "draw_loads", "loads_player", "moving_mean", "COLOURS"]

COLOURS = {"none": "#8C8C8C", "aux": "#DD8452", "loss_free": "#4C72B0"}
LAYER_SHADES = ("#4C72B0", "#A1C4E8", "#55A868", "#B3DDB9")
REPLAY_FRAMES = 15       # the headless replay's frames (0.3-0.5 s of drawing each): every fourth of 60 steps


def moving_mean(values: list[float], window: int = 10) -> list[float]:
    """The mean of each value and the ``window − 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loads_state(result: dict, step: int, names: list[str] | None = None, window: int = 10) -> dict[str, Any]:
    """What the picture shows after training step ``step`` (0-based, clamped) of ``result``.

    Returns {"step", "n_steps", "names", "E", "settings": {name: {"relative": [layers][E] load ÷ the layer's
    mean, "bias": [layers][E], "max_over_mean": [steps so far], "task": [steps so far, moving mean of
    ``window``], "heldout": the final held-out cross-entropy}}}.
    """
    runs = result["runs"]
    names = [n for n in (names or list(runs)) if n in runs]
    if not names:
        raise ValueError(f"no setting to show: the result holds {sorted(runs)}")
    n = len(runs[names[0]]["max_over_mean"])
    step = max(0, min(int(step), n - 1))
    settings = {}
    for name in names:
        run = runs[name]
        loads = run["loads"][step]
        task = run.get("task", run["loss"])
        settings[name] = {"relative": [[x / (sum(layer) / len(layer)) for x in layer] for layer in loads],
                          "bias": run["bias"][step], "max_over_mean": run["max_over_mean"][: step + 1],
                          "task": moving_mean(task, window)[: step + 1], "heldout": run.get("heldout")}
    return {"step": step, "n_steps": n, "names": names, "E": len(runs[names[0]]["loads"][0][0]),
            "settings": settings}


def loads_caption(st: dict) -> str:
    parts = [f"{name}: max/mean {s['max_over_mean'][-1]:.2f}, loss {s['task'][-1]:.3f}"
             for name, s in st["settings"].items()]
    return f"step {st['step'] + 1}/{st['n_steps']} — " + "; ".join(parts)


def draw_loads(fig, st: dict) -> None:
    """Paint :func:`loads_state`: a bar panel per setting, then max/mean and the loss over the steps so far."""
    names, E, n = st["names"], st["E"], st["n_steps"]
    grid = fig.add_gridspec(2, len(names), height_ratios=(1.15, 1.0), hspace=0.45, wspace=0.3)
    top = max(2.0, max(x for s in st["settings"].values() for layer in s["relative"] for x in layer) * 1.08)
    for i, name in enumerate(names):
        s = st["settings"][name]
        ax = fig.add_subplot(grid[0, i])
        layers = len(s["relative"])
        width = 0.8 / layers
        for li, rel in enumerate(s["relative"]):
            ax.bar([e - 0.4 + width * (li + 0.5) for e in range(E)], rel, width,
                   color=LAYER_SHADES[li % len(LAYER_SHADES)], label=f"layer {li}")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_ylim(0, top)
        ax.set_xticks(range(E), [f"E{e}" for e in range(E)], fontsize=7)
        ax.set_title(f"{name}: max/mean {s['max_over_mean'][-1]:.2f}", fontsize=10,
                     color=COLOURS.get(name, "black"), fontweight="bold")
        if i == 0:
            ax.set_ylabel("load ÷ mean load", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
        if any(b for layer in s["bias"] for b in layer):
            twin = ax.twinx()
            for li, bias in enumerate(s["bias"]):
                twin.plot([e - 0.4 + width * (li + 0.5) for e in range(E)], bias, "o", ms=3,
                          color="#C44E52" if li == 0 else "#E8A0A2")
            lim = max(abs(b) for layer in s["bias"] for b in layer) * 1.3
            twin.set_ylim(-lim, lim)
            twin.axhline(0, color="#C44E52", lw=0.5)
            twin.tick_params(labelsize=7, colors="#C44E52")
            twin.set_ylabel("bias b_e (dots)", fontsize=8, color="#C44E52")
    ax_m = fig.add_subplot(grid[1, : max(1, len(names) // 2 + len(names) % 2)])
    ax_l = fig.add_subplot(grid[1, max(1, len(names) // 2 + len(names) % 2):]) if len(names) > 1 else None
    for name in names:
        s = st["settings"][name]
        steps = range(1, len(s["max_over_mean"]) + 1)
        ax_m.plot(steps, s["max_over_mean"], color=COLOURS.get(name), lw=1.2, label=name)
        if ax_l is not None:
            ax_l.plot(steps, s["task"], color=COLOURS.get(name), lw=1.2, label=name)
    ax_m.set_xlim(1, n)
    ax_m.set_ylim(1.0, max(2.0, max(max(s["max_over_mean"]) for s in st["settings"].values()) * 1.05))
    ax_m.axhline(1.0, color="black", lw=0.6, ls="--")
    ax_m.set_xlabel("training step", fontsize=9)
    ax_m.set_title("max/mean expert load (1 = balanced)", fontsize=10)
    ax_m.legend(fontsize=8)
    if ax_l is not None:
        ax_l.set_xlim(1, n)
        ax_l.set_xlabel("training step", fontsize=9)
        ax_l.set_title("cross-entropy (10-step moving mean)", fontsize=10)
        ax_l.legend(fontsize=8)


def loads_player(result: dict, names: list[str] | None = None, *, figsize=(12, 6.4)):
    """A :class:`~reference.widgets.player.Player` over the training steps of ``result`` (the last step drawn
    where no widget runs; its self-contained replay shows :data:`REPLAY_FRAMES` of the steps, each frame being
    six panels to draw)."""
    from .player import Player
    n = len(next(iter(result["runs"].values()))["max_over_mean"])
    return Player(lambda step: loads_state(result, step, names), n, draw_loads, caption=loads_caption,
                  figsize=figsize, interval_ms=150, static_step=n - 1, replay_frames=REPLAY_FRAMES,
                  title="Expert loads while the tiny GPT trains: no balancing, Switch's loss, loss-free bias")
