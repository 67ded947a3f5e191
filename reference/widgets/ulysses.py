"""Replay DeepSpeed-Ulysses' all-to-alls: W ranks trade a sequence split for a head split, attend, trade back.

Drawn from the layout arithmetic alone, so it works before exercise 5a.4 is written (the rule is the
one ``reference.sequence.ulysses.seq_to_heads`` implements; the full course's tests/widgets/test_ulysses.py holds the
two to each other on real tensors).  With ``n = S/W`` tokens per rank and ``h = H/W`` heads per group,
call block (w, g) the tokens of chunk w (rank w's own ``[w·n, (w+1)·n)``) in head group g (heads
``[g·h, (g+1)·h)``)::

    step  phase           what each rank r holds                        messages
    0     before          q, k, v: blocks (r, 0 … W−1) — S/W tokens × H    —
    1     all-to-all      block (w, g) goes from rank w to rank g, where  3 all-to-alls (q, k, v)
                          it lands at token rows [w·n, (w+1)·n)
    2     after           blocks (0 … W−1, r) — all S tokens × H/W heads  —
    3     attention       out = softmax(q·kᵀ/√D)·v for its h heads: each  —
                          head sees every token, no merge
    4     inverse         out block (w, g) goes from rank g back to w     1 all-to-all (out)
    5     back            out: blocks (r, 0 … W−1), the sequence split    —

In the picture a block is labelled as in the lecture's sketch, head group letter + token chunk digit
(``b0`` = heads of group 1, tokens of chunk 0), and coloured by the rank it last came from.  Every
all-to-all hands in a rank's whole shard, ``B·n·H·D·b`` bytes, and keeps the block addressed to
itself: ``(W−1)/W`` of the shard leaves the rank, ``(W−1)/W · B·n·H·D·b`` bytes; four of them per
attention forward (H_kv = H: the notebook's ``(W−1)/W·n·(2H + 2H_kv)·D·b``).

The state is a plain dict (:func:`ulysses_state`); :func:`draw_ulysses` paints it and
:func:`ulysses_player` adds the Play button, the step slider and a choice of W.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

__all__ = ["PHASES", "ulysses_state", "ulysses_caption", "draw_ulysses", "ulysses_player", "RANK_COLOURS"]

RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974")
PHASES = ("before", "all-to-all", "after", "attention", "inverse all-to-all", "back")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _check(world_size: int, seq_len: int, heads: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if heads % world_size:
        raise ValueError(f"{heads} heads cannot be split over {world_size} ranks (Ulysses needs W to divide H)")
    if seq_len % world_size:
        raise ValueError(f"sequence length {seq_len} is not a multiple of {world_size} ranks")


def _block(w: int, g: int, n: int, h: int, S: int, *, head_sharded: bool, colour: int) -> dict:
    """Block (w, g): global tokens and heads, and where they sit in the holder's local tensor
    (``local_tokens`` rows and ``local_heads`` of its (B, heads, tokens, D) shard)."""
    tokens, heads = (w * n, (w + 1) * n), (g * h, (g + 1) * h)
    local_tokens = tokens if head_sharded else (0, n)
    local_heads = (0, h) if head_sharded else heads
    return {"chunk": w, "group": g, "tokens": tokens, "heads": heads, "local_tokens": local_tokens,
            "local_heads": local_heads, "label": f"{LETTERS[g % 26]}{w}", "colour": colour}


def _layout(W: int, n: int, h: int, S: int, *, head_sharded: bool, colour_by: str) -> list[list[dict]]:
    """Per rank, the blocks it holds: sequence-sharded (rank r: chunk r, every group) or head-sharded
    (rank r: group r, every chunk).  ``colour_by``: "holder", "chunk" or "group"."""
    out = []
    for r in range(W):
        pairs = [(w, r) for w in range(W)] if head_sharded else [(r, g) for g in range(W)]
        out.append([_block(w, g, n, h, S, head_sharded=head_sharded,
                           colour={"holder": r, "chunk": w, "group": g}[colour_by]) for w, g in pairs])
    return out


def ulysses_state(step: int, *, world_size: int = 4, seq_len: int = 256, heads: int = 4, head_dim: int = 16,
                  bytes_per_value: int = 4, batch: int = 1) -> dict[str, Any]:
    """What frame ``step`` (clamped to 0 … 5, see :data:`PHASES`) shows for W = ``world_size`` ranks.

    Returns ``phase``, ``step``, ``n_steps``, the sizes (``W``, ``S``, ``H``, ``D``, ``b``, ``B``, ``n``,
    ``h``), ``tensors`` (("q", "k", "v") or ("out",)), ``holds`` (per rank, its blocks after this step:
    dicts with ``chunk``, ``group``, global ``tokens`` and ``heads`` ranges, ``local_tokens`` and
    ``local_heads`` in the holder's shard, ``label``, ``colour`` = a rank), for an all-to-all step also
    ``before`` (the blocks each rank handed in) and ``moves`` (one per block: ``src``, ``dst``, ``chunk``,
    ``group``), ``attending`` (step 3) and ``bytes``: per all-to-all and rank, ``shard`` (bytes handed
    in), ``off_rank`` (counted from the blocks that change rank), ``formula`` ((W−1)/W · shard, exact),
    ``all_to_alls`` at this step, ``step_off_rank`` and ``so_far`` (off-rank bytes per rank up to here).
    """
    W, S, H, D, b, B = world_size, seq_len, heads, head_dim, bytes_per_value, batch
    _check(W, S, H)
    step = max(0, min(step, len(PHASES) - 1))
    phase = PHASES[step]
    n, h = S // W, H // W
    seq = lambda colour_by: _layout(W, n, h, S, head_sharded=False, colour_by=colour_by)   # noqa: E731
    hds = lambda colour_by: _layout(W, n, h, S, head_sharded=True, colour_by=colour_by)    # noqa: E731
    holds = {"before": seq("holder"), "all-to-all": hds("chunk"), "after": hds("chunk"), "attention": hds("holder"),
             "inverse all-to-all": seq("group"), "back": seq("group")}[phase]
    before = {"all-to-all": seq("holder"), "inverse all-to-all": hds("holder")}.get(phase)
    moves = []
    if before is not None:
        for r, blocks in enumerate(before):
            for blk in blocks:
                dst = blk["group"] if phase == "all-to-all" else blk["chunk"]
                moves.append({"src": r, "dst": dst, "chunk": blk["chunk"], "group": blk["group"]})
    shard = B * n * H * D * b
    block_bytes = B * n * h * D * b
    off = {r: sum(block_bytes for m in moves if m["src"] == r and m["dst"] != r) for r in range(W)}
    count = {"all-to-all": 3, "inverse all-to-all": 1}.get(phase, 0)
    done = 3 * (step >= 1) + (step >= 4)
    per = (W - 1) * block_bytes
    return {"step": step, "n_steps": len(PHASES), "phase": phase, "W": W, "S": S, "H": H, "D": D, "b": b, "B": B,
            "n": n, "h": h, "tensors": ("out",) if step >= 3 else ("q", "k", "v"), "holds": holds, "before": before,
            "moves": moves, "attending": phase == "attention",
            "bytes": {"shard": shard, "off_rank": off, "formula": Fraction(W - 1, W) * shard, "all_to_alls": count,
                      "step_off_rank": {r: count * off[r] for r in range(W)}, "so_far": done * per,
                      "per_forward": 4 * per}}


def ulysses_caption(st: dict) -> str:
    """What happens at this frame, and the bytes each rank sends beside the formula."""
    W, n, H, D, b, B = st["W"], st["n"], st["H"], st["D"], st["b"], st["B"]
    by = st["bytes"]
    what = {
        "before": f"sequence-sharded: rank r holds tokens [r·{n}, (r+1)·{n}) of all {H} heads of q, k and v",
        "all-to-all": "all-to-all of q, k and v: block (chunk w, head group g) goes from rank w to rank g",
        "after": f"head-sharded: rank g holds all {st['S']} tokens of {st['h']} head{'s' if st['h'] > 1 else ''} "
                 f"(heads [g·{st['h']}, (g+1)·{st['h']}))",
        "attention": "attention, local: each rank runs softmax(q·kᵀ/√D)·v on its own heads, every token seen — "
                     "no message, no merge",
        "inverse all-to-all": "inverse all-to-all of out: block (chunk w, head group g) goes from rank g back to "
                              "rank w",
        "back": f"sequence-sharded again: rank r holds out for its {n} tokens, all {H} heads",
    }[st["phase"]]
    words = f"step {st['step']}/{st['n_steps'] - 1} · {what}"
    batch = f"{B}·" if B != 1 else ""
    formula = (f"(W−1)/W·{'B·' if B != 1 else ''}n·H·D·b = {W - 1}/{W}·{batch}{n}·{H}·{D}·{b} = "
               f"{int(by['formula']):,} B")
    if by["all_to_alls"]:
        off = by["off_rank"][0]
        words += (f" · each rank hands in its {by['shard']:,} B shard and sends {off:,} B of it off-rank per "
                  f"all-to-all — {formula}")
        if by["all_to_alls"] > 1:
            words += f"; × {by['all_to_alls']} (q, k, v) = {by['step_off_rank'][0]:,} B"
    words += f" · off-rank so far {by['so_far']:,} B of {by['per_forward']:,} B per forward (4 all-to-alls)"
    return words


def _heads(lo: int, hi: int) -> str:
    return f"head {lo}" if hi - lo == 1 else f"heads {lo}–{hi - 1}"


def draw_ulysses(fig, st: dict) -> None:
    """One panel per rank (rows: token chunks, columns: head groups; a held block filled with the colour
    of the rank it came from).  An all-to-all frame draws what was handed in above what arrived, an
    arrow per block (dotted: the block that stays); the attention frame draws each rank's S × S scores."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    W, S, n, h = st["W"], st["S"], st["n"], st["h"]
    ax = fig.add_subplot(111)
    gap, row_gap = 1.0, 3.0
    colour = lambda r: RANK_COLOURS[r % len(RANK_COLOURS)]   # noqa: E731

    def corner(r: int, row: int, w: int, g: int) -> tuple[float, float]:
        return r * (W + gap) + g, -(row * (W + row_gap)) - w - 1        # lower-left corner of block (w, g)

    def draw_row(layout: list[list[dict]], row: int, name: str, label_below: bool = False) -> None:
        for r in range(W):
            held = {(blk["chunk"], blk["group"]): blk for blk in layout[r]}
            for w in range(W):
                for g in range(W):
                    x, y = corner(r, row, w, g)
                    blk = held.get((w, g))
                    ax.add_patch(Rectangle((x, y), 1, 1, fc=colour(blk["colour"]) if blk else "white",
                                           ec="white" if blk else "#aaa", lw=1.2 if blk else 0.6, zorder=2))
                    if blk:
                        ax.text(x + 0.5, y + 0.5, blk["label"], ha="center", va="center", fontsize=8,
                                color="white", weight="bold", zorder=3)
            x0, y0 = corner(r, row, 0, 0)
            if label_below:                          # under the panel: the arrows come in from above
                ax.text(x0 + W / 2, y0 - W + 0.85, f"rank {r}", ha="center", va="top", fontsize=9, color=colour(r),
                        weight="bold")
            else:
                ax.text(x0 + W / 2, y0 + 1.15, f"rank {r}", ha="center", va="bottom", fontsize=9, color=colour(r),
                        weight="bold")
        ax.text(-0.4, corner(0, row, 0, 0)[1] + 1 - W / 2, name, rotation=90, ha="right", va="center", fontsize=8)

    tensors = ", ".join(st["tensors"])
    if st["before"] is not None:
        draw_row(st["before"], 0, f"{tensors}: handed in")
        draw_row(st["holds"], 1, f"{tensors}: arrived", label_below=True)
        for m in st["moves"]:
            x0, y0 = corner(m["src"], 0, m["chunk"], m["group"])
            x1, y1 = corner(m["dst"], 1, m["chunk"], m["group"])
            stays = m["src"] == m["dst"]
            ax.add_patch(FancyArrowPatch((x0 + 0.5, y0 + 0.5), (x1 + 0.5, y1 + 0.9), arrowstyle="-|>",
                                         mutation_scale=9, lw=0.8 if stays else 1.3, ls=":" if stays else "-",
                                         color=colour(m["src"]), alpha=0.6 if stays else 0.85, zorder=1))
    else:
        draw_row(st["holds"], 0, tensors)
    if st["attending"]:                              # each rank's S × S scores, for each of its heads
        for r in range(W):
            x0, y0 = corner(r, 1, W - 1, 0)
            ax.add_patch(Rectangle((x0 + 0.3, y0), W - 0.6, W - 0.6, fc=colour(r), alpha=0.35, ec=colour(r)))
            ax.text(x0 + W / 2, y0 + (W - 0.6) / 2, f"{S} × {S}\nscores\n× {h} head{'s' if h > 1 else ''}",
                    ha="center", va="center", fontsize=7.5)
        ax.text(-0.4, corner(0, 1, 0, 0)[1] + 1 - W / 2, "q·kᵀ, local", rotation=90, ha="right", va="center",
                fontsize=8)
    ax.set_xlim(-0.5, W * (W + gap))
    ax.set_ylim(-(2 * W + row_gap) - 2.2, 1.8)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(f"Ulysses, W = {W}: {st['phase']}", fontsize=10)
    legend = ", ".join(f"{LETTERS[g]} = {_heads(g * h, (g + 1) * h)}" for g in range(W))
    ax.text(-0.5, -(2 * W + row_gap) - 1.5, f"rows: token chunks 0 … {W - 1} of {n} tokens; letter: head group "
            f"({legend}); colour: the rank the block came from", fontsize=7.5, va="top")


def ulysses_player(*, world_size: int = 4, seq_len: int = 256, heads: int = 4, head_dim: int = 16,
                   bytes_per_value: int = 4, sizes: tuple = (2, 3, 4), title: str = "DeepSpeed-Ulysses, step by step"):
    """A :class:`~reference.widgets.player.Player` over the six frames, with a choice of W among ``sizes``
    that divide both ``heads`` and ``seq_len``."""
    import ipywidgets as widgets

    from .player import Player

    options = [W for W in sizes if heads % W == 0 and seq_len % W == 0]
    if world_size not in options:
        raise ValueError(f"world_size {world_size} must divide heads={heads} and seq_len={seq_len} "
                         f"and be one of {sizes}")
    sizes_kw = dict(seq_len=seq_len, heads=heads, head_dim=head_dim, bytes_per_value=bytes_per_value)

    def build(world_size: int):
        return (lambda step: ulysses_state(step, world_size=world_size, **sizes_kw)), len(PHASES)

    controls = {"world_size": widgets.Dropdown(options=options, value=world_size, description="ranks W",
                                               layout=widgets.Layout(width="160px"))} if len(options) > 1 else {}
    state_at, n = build(world_size)
    return Player(state_at, n, draw_ulysses, controls=controls, rebuild=build, caption=ulysses_caption,
                  figsize=(10, 5.2), title=title, static_step=1)
