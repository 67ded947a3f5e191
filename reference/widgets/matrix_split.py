"""Replay a tensor-parallel MLP: the weights cut across ranks, activations flowing through the
column- then the row-parallel layer, and each collective lighting up with its bytes.

The run (``reference.tensor.lecture.mlp_run``) gives the shapes and rank 0's collectives in order.
:func:`phases` interleaves them with the compute steps every rank does::

    forward    X in (replicated, or S/W rows under sequence parallelism)
               [all-gather X]                                    sequence parallelism only
               fc1: Y_r = X·A_rᵀ + a_r   (column-parallel, no message)
               GELU on Y_r               (elementwise, local)
               fc2: Z_r = GELU(Y_r)·B_rᵀ (row-parallel: a PARTIAL sum of Z)
               all-reduce Z (g)  — or reduce-scatter under sequence parallelism
               + b once → output
    backward   ∂Z in  [all-gather ∂Z]  fc2ᵀ  [all-gather X again]  fc1ᵀ → a PARTIAL ∂X on each rank
               all-reduce ∂X (f) — or reduce-scatter under sequence parallelism
               (fc1 kept only its S/W rows of X under sequence parallelism: ``what="sp_regather"``)

Which position a collective takes comes from its trace meta (``direction``, ``layer``) and, when a
run lacks it, from its order.  The state is a plain dict (tested in the full course's
tests/widgets/test_matrix_split.py).
"""
from __future__ import annotations

from typing import Any

from matplotlib.patches import FancyArrowPatch, Rectangle

__all__ = ["phases", "matrix_split_state", "draw_matrix_split", "matrix_split_caption", "matrix_split_player"]

RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3")
FWD, BWD, IDLE, COMM = "#4C72B0", "#C44E52", "#DDDDDD", "#F2B701"
BLOCKS = ("X", "A", "Y", "B", "Z", "out")   # what each rank's row of the picture shows, left to right


def _comms(run: dict, direction: str) -> list[dict]:
    cols = [c for c in run["collectives"] if c.get("operator") != "sp-grad-sync"]
    tagged = [c for c in cols if c.get("direction")]
    if len(tagged) == len(cols):
        return [c for c in cols if c["direction"] == direction]
    half = len(cols) // 2                       # no meta: the first half ran forward
    return cols[:half] if direction == "forward" else cols[half:]


def phases(run: dict) -> list[dict]:
    """The frames of one run, in order: ``kind`` ("compute" or "comm"), ``direction``, ``block``
    (which of X, A, Y, B, Z, out is active), ``label`` and for collectives the collective's dict."""
    fwd, bwd = _comms(run, "forward"), _comms(run, "backward")
    comm = lambda c, block, what: {"kind": "comm", "block": block, "label": what, "comm": c}   # noqa: E731
    out = [{"kind": "compute", "direction": "forward", "block": "X", "label": "input X"}]
    enter = fwd[:-1] if len(fwd) > 1 else []
    out += [dict(comm(c, "X", "all-gather X along the sequence (enter the region)"), direction="forward")
            for c in enter]
    out += [{"kind": "compute", "direction": "forward", "block": "A",
             "label": "fc1 column-parallel: Y_r = X·A_rᵀ + a_r"},
            {"kind": "compute", "direction": "forward", "block": "Y", "label": "GELU on this rank's d_ff/W features"},
            {"kind": "compute", "direction": "forward", "block": "B",
             "label": "fc2 row-parallel: Z_r = GELU(Y_r)·B_rᵀ, a partial sum"}]
    out += [dict(comm(c, "Z", ("reduce-scatter" if c["op"] == "reduce_scatter" else "all-reduce")
                      + " of the partial Z (g)"),
                 direction="forward") for c in fwd[-1:]]
    out += [{"kind": "compute", "direction": "forward", "block": "out", "label": "+ bias b, once: the output"},
            {"kind": "compute", "direction": "backward", "block": "out", "label": "backward: ∂out arrives"}]
    regather = [c for c in bwd if c.get("what") == "sp_regather"]
    if not regather and not all(c.get("direction") for c in bwd):    # no meta: a second all-gather is fc1's
        regather = [c for c in bwd if c["op"] == "all_gather"][1:]
    bwd = [c for c in bwd if all(c is not g for g in regather)]
    out += [dict(comm(c, "out", "all-gather ∂out along the sequence"), direction="backward")
            for c in (bwd[:-1] if len(bwd) > 1 else [])]
    out += [{"kind": "compute", "direction": "backward", "block": "B", "label": "fc2ᵀ: ∂B_r and ∂GELU(Y_r), local"}]
    out += [dict(comm(c, "X", "all-gather X again: fc1 kept only its S/W rows"), direction="backward")
            for c in regather]
    out += [{"kind": "compute", "direction": "backward", "block": "A", "label": "fc1ᵀ: ∂A_r and a PARTIAL ∂X_r"}]
    out += [dict(comm(c, "X", ("reduce-scatter" if c["op"] == "reduce_scatter" else "all-reduce")
                      + " of the partial ∂X (f)"),
                 direction="backward") for c in bwd[-1:]]
    return out


def matrix_split_state(run: dict, step: int) -> dict[str, Any]:
    """What frame ``step`` shows: the shapes on each rank, the active block, the collective."""
    ph = phases(run)
    step = max(0, min(step, len(ph) - 1))
    p = ph[step]
    tp, S, d, dff, sp = run["tp"], run["S"], run["d_model"], run["d_ff"], run["sequence_parallel"]
    done = [q for q in ph[:step + 1] if q["kind"] == "comm"]
    return {"step": step, "n_steps": len(ph), "phase": p, "tp": tp, "sp": sp,
            "shapes": {"X": (S // tp if sp else S, d), "A": (d, dff // tp), "Y": (S, dff // tp),
                       "B": (dff // tp, d), "Z": (S, d), "out": (S // tp if sp else S, d)},
            "comm": p.get("comm"), "bytes_so_far": sum(q["comm"]["nbytes"] for q in done),
            "collectives_so_far": len(done), "max_error": run.get("max_error")}


def matrix_split_caption(st: dict) -> str:
    p = st["phase"]
    words = f"step {st['step'] + 1}/{st['n_steps']} · {p['direction']} · {p['label']}"
    if st["comm"]:
        c = st["comm"]
        words += f" · {c['op']} of {c['nbytes']} B per rank ({c['wire']:.0f} B on the wire)"
    return words + f" · collectives so far: {st['collectives_so_far']}"


def draw_matrix_split(fig, st: dict) -> None:
    """One row per rank: X | A_r | Y_r | B_r | Z_r | out, sized by shape; the active block coloured."""
    ax = fig.add_subplot(111)
    tp, shapes, p = st["tp"], st["shapes"], st["phase"]
    scale = 0.8 / max(max(s) for s in shapes.values())
    gap, row_h = 0.35, 1.1
    colour = FWD if p["direction"] == "forward" else BWD
    xs = {}
    for r in range(tp):
        x0, y0 = 0.0, -r * row_h
        for name in BLOCKS:
            h, w = shapes[name]
            h, w = h * scale, w * scale
            active = name == p["block"]
            ax.add_patch(Rectangle((x0, y0 - h), w, h, facecolor=colour if active else IDLE,
                                   edgecolor=RANK_COLOURS[r % 4], linewidth=2 if active else 1, alpha=0.9))
            label = {"X": "X", "A": f"A{r}ᵀ", "Y": f"Y{r}", "B": f"B{r}ᵀ", "Z": f"Z{r}", "out": "out"}[name]
            ax.text(x0 + w / 2, y0 + 0.06, label + ("" if p["direction"] == "forward" else "  ∂"),
                    ha="center", va="bottom", fontsize=8)
            xs[name] = (x0, w)
            x0 += w + gap
        ax.text(-0.1, y0 - 0.3, f"rank {r}", ha="right", va="center", fontsize=9, color=RANK_COLOURS[r % 4])
    if st["comm"]:
        c = st["comm"]
        bx, bw = xs[p["block"]]
        xm = bx + bw + gap / 2 if p["block"] in ("Z", "out") and c["op"] != "all_gather" else bx - gap / 2
        ax.add_patch(FancyArrowPatch((xm, 0.05), (xm, -(tp - 1) * row_h - 0.8), arrowstyle="<|-|>",
                                     mutation_scale=14, color=COMM, linewidth=3))
        ax.text(xm, -(tp - 1) * row_h - 0.95, f"{c['op'].replace('_', '-')}  {c['nbytes']} B/rank",
                ha="center", va="top", fontsize=9, fontweight="bold", color="#8a6d00")
    ax.set_xlim(-0.8, x0 + 0.2)
    ax.set_ylim(-(tp - 1) * row_h - 1.3, 0.45)
    ax.set_axis_off()
    mode = "tensor + sequence parallel" if st["sp"] else "tensor parallel"
    ax.set_title(f"{mode}, {tp} ranks — {p['direction']}: {p['label']}", fontsize=10)


def matrix_split_player(runs: dict[bool, dict], *, sequence_parallel: bool = False,
                        title: str = "A parallel MLP, replayed", figsize=(10, 4.2)):
    """A :class:`~reference.widgets.player.Player` over runs keyed by ``sequence_parallel``, with a
    toggle between them."""
    import ipywidgets as widgets

    from .player import Player

    controls = {"sp": widgets.ToggleButton(value=sequence_parallel, description="sequence parallel")} \
        if len(runs) > 1 else {}

    def build(sp):
        run = runs[sp]
        return (lambda step: matrix_split_state(run, step)), len(phases(run))

    state_at, n = build(sequence_parallel)
    first_g = next(i for i, p in enumerate(phases(runs[sequence_parallel]))
                   if p["kind"] == "comm" and p["block"] == "Z")
    return Player(state_at, n, draw_matrix_split, controls=controls, rebuild=build, caption=matrix_split_caption,
                  figsize=figsize, title=title, static_step=first_g)
