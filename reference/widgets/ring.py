"""Replay a ring-attention run: K/V blocks travelling the ring, the score matrix filling tile by tile.

Works on the trace of any run that follows the sequence lecture's trace contract (the reference's
``ring_attention_forward`` does; a learner's does if it records the same events):

    send / recv   one K/V hop: ``step`` s, ``meta["what"] == "kv"``, ``meta["chunks"]`` global chunk ids
    compute       one block: ``step``, ``meta`` with ``what == "attn_fwd"``, ``layout``, ``q_chunks``,
                  ``k_chunks`` (global chunk ids) and ``pairs`` (unmasked (query, key) pairs of one
                  batch element and head).  A fully masked block is skipped: it has no event.

State (pure, tested) — :func:`ring_state` ``(trace, step, ...) -> RingState``::

    holds[r]    K/V chunk ids rank r holds at ``step`` (its own at step 0, then one hop per step:
                rank (r - s) mod W's chunks at step s, because data flows r → r+1)
    owner       L×L int array: -2 masked by causality, -1 not computed yet, else the rank that
                computed that (query, key) score
    pairs[r]    pairs computed by rank r up to and including ``step``

:func:`timeline` / :func:`overlap_stats` turn the same trace into per-rank compute and
communication intervals and the share of communication hidden behind compute.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RingRun", "RingState", "ring_state", "chunk_tokens", "chunk_owner", "expected_pairs", "timeline",
           "overlap_stats", "draw_ring", "draw_timeline", "ring_player", "COLOURS"]

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]
MASKED, EMPTY = -2, -1


def _get(e: Any, name: str, default=None):
    """Events are :class:`reference.trace.Event` objects or plain dicts (the grader's copies)."""
    if isinstance(e, dict):
        return e.get(name, default)
    return getattr(e, name, default)


# ----------------------------------------------------------------------------------------------
# Layout arithmetic (kept here, independent of the exercise functions, so the widget can replay
# any run — including one whose sharding is wrong)


def _n_chunks(world_size: int, layout: str) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


def chunk_tokens(chunk: int, seq_len: int, world_size: int, layout: str) -> np.ndarray:
    """Global token positions of chunk ``chunk`` (stripe ``chunk`` for the striped layout)."""
    if layout == "striped":
        return np.arange(chunk, seq_len, world_size)
    size = seq_len // _n_chunks(world_size, layout)
    return np.arange(chunk * size, (chunk + 1) * size)


def chunk_owner(chunk: int, world_size: int, layout: str) -> int:
    """The rank a global chunk belongs to (zigzag: chunks r and 2W-1-r are rank r's)."""
    if layout == "zigzag" and chunk >= world_size:
        return 2 * world_size - 1 - chunk
    return chunk


def own_chunks(rank: int, world_size: int, layout: str) -> list[int]:
    return [rank, 2 * world_size - 1 - rank] if layout == "zigzag" else [rank]


def expected_pairs(seq_len: int, world_size: int, layout: str, causal: bool) -> list[int]:
    """Unmasked (query, key) pairs each rank computes, from the formulas of the lecture.

    non-causal: L²/W each.  causal, c = L/W:
      contiguous  rank r: c²·r + c(c+1)/2          (rank 0: one triangle; rank W-1: W-1 squares more)
      zigzag      every rank: L(L+1)/(2W)           (one early and one late chunk: balanced)
      striped     rank r: c(r+1) + W·c(c-1)/2       (token r + jW sees r + jW + 1 keys)
    """
    L, W = seq_len, world_size
    c = L // W
    if not causal:
        return [L * L // W] * W
    if layout == "contiguous":
        return [c * c * r + c * (c + 1) // 2 for r in range(W)]
    if layout == "zigzag":
        return [L * (L + 1) // (2 * W)] * W
    return [c * (r + 1) + W * c * (c - 1) // 2 for r in range(W)]


# ----------------------------------------------------------------------------------------------
# The state at one step


@dataclass
class RingRun:
    """One recorded run: its trace and the settings that produced it."""

    trace: Sequence[Any]
    world_size: int
    layout: str
    causal: bool
    seq_len: int

    @property
    def n_steps(self) -> int:
        return self.world_size


@dataclass
class RingState:
    step: int
    world_size: int
    layout: str
    causal: bool
    seq_len: int
    q_chunks: list[list[int]]                    # per rank, never moves
    holds: list[list[int] | None]                # per rank: K/V chunk ids held at this step
    holds_from: list[int | None]                 # per rank: whose K/V that is
    sends: list[tuple[int, int, list[int], int]]  # hops posted at this step: (src, dst, chunks, bytes)
    computed: list[bool]                         # per rank: computed a block at this step
    owner: np.ndarray                            # (L, L) int: MASKED, EMPTY or rank
    new: np.ndarray                              # (L, L) bool: computed at this step
    pairs: list[int]                             # per rank, cumulative up to this step
    pairs_step: list[int]                        # per rank, at this step only
    expected: list[int]                          # per rank at the end, from the formula
    recv_from: list[set[int]] = field(default_factory=list)   # per rank: peers it received from so far
    inferred: bool = False       # the trace had no compute events: tiles follow the ring order, not the run

    @property
    def n_steps(self) -> int:
        return self.world_size

    @property
    def imbalance(self) -> float:
        """max / mean pairs per rank so far (1.0 = perfectly balanced)."""
        mean = sum(self.pairs) / max(1, len(self.pairs))
        return max(self.pairs) / mean if mean else 1.0


def ring_state(trace: Iterable[Any], step: int, *, world_size: int, layout: str, causal: bool,
               seq_len: int) -> RingState:
    """What the ring looks like at ``step`` (0 ≤ step < W) of a recorded forward pass."""
    W, L = world_size, seq_len
    if not 0 <= step < W:
        raise ValueError(f"step must be in [0, {W}), got {step}")
    events = list(trace)
    kv = _kv_hops(events, W, layout)
    blocks = [e for e in events if _get(e, "op") == "compute" and _get(e, "step") is not None
              and (_get(e, "meta") or {}).get("what", "attn_fwd") == "attn_fwd"
              and "q_chunks" in (_get(e, "meta") or {})]
    inferred = not blocks
    if inferred:   # a run that records no blocks (e.g. a learner's): show the blocks the ring order implies
        blocks = _implied_blocks(W, layout, causal, L)

    holds: list[list[int] | None] = []
    for r in range(W):
        if step == 0:
            holds.append(own_chunks(r, W, layout))
            continue
        # what rank r holds now is what its predecessor sent it at the previous step
        got = [e for e in kv if _get(e, "op") == "send" and _get(e, "peer") == r and _get(e, "step") == step - 1]
        if got:
            holds.append(list(dict.fromkeys(int(c) for e in got for c in (_get(e, "meta") or {}).get("chunks", []))))
        else:   # no hop recorded (a run that does not trace its messages): read it off the blocks
            ks = [int(c) for e in blocks if _get(e, "rank") == r and _get(e, "step") == step
                  for c in _get(e, "meta")["k_chunks"]]
            holds.append(sorted(set(ks)) or None)
    holds = [h if h else own_chunks((r - step) % W, W, layout) if inferred else h for r, h in enumerate(holds)]
    holds_from = [chunk_owner(h[0], W, layout) if h else None for h in holds]
    hops: dict[tuple[int, int], tuple[list[int], int]] = {}      # (src, dst) -> (chunks, bytes), K and V together
    for e in kv:
        if _get(e, "op") == "send" and _get(e, "step") == step:
            key = (int(_get(e, "rank")), int(_get(e, "peer")))
            chunks, nb = hops.get(key, ([], 0))
            new_chunks = [int(c) for c in (_get(e, "meta") or {}).get("chunks", []) if int(c) not in chunks]
            hops[key] = (chunks + new_chunks, nb + int(_get(e, "nbytes") or 0))
    sends = sorted((src, dst, ch, nb) for (src, dst), (ch, nb) in hops.items())
    recv_from = [{int(_get(e, "peer")) for e in kv if _get(e, "op") == "recv" and _get(e, "rank") == r
                  and _get(e, "step") is not None and _get(e, "step") < step} for r in range(W)]

    owner = np.full((L, L), EMPTY, dtype=np.int64)
    if causal:
        owner[np.triu_indices(L, 1)] = MASKED
    new = np.zeros((L, L), dtype=bool)
    pairs, pairs_step, computed = [0] * W, [0] * W, [False] * W
    for e in blocks:
        s, r, meta = _get(e, "step"), int(_get(e, "rank")), _get(e, "meta")
        if s > step or r >= W:
            continue
        qt = np.concatenate([chunk_tokens(c, L, W, layout) for c in meta["q_chunks"]])
        kt = np.concatenate([chunk_tokens(c, L, W, layout) for c in meta["k_chunks"]])
        qq, kk = np.meshgrid(qt, kt, indexing="ij")
        keep = (kk <= qq) if causal else np.ones_like(qq, dtype=bool)
        owner[qq[keep], kk[keep]] = r
        n = int(meta.get("pairs", int(keep.sum())))
        pairs[r] += n
        if s == step:
            new[qq[keep], kk[keep]] = True
            pairs_step[r] += n
            computed[r] = True
    return RingState(step, W, layout, causal, L, [own_chunks(r, W, layout) for r in range(W)], holds, holds_from,
                     sends, computed, owner, new, pairs, pairs_step, expected_pairs(L, W, layout, causal), recv_from,
                     inferred)


def _kv_hops(events: list, W: int, layout: str) -> list:
    """The K/V hops of a run: its messages marked ``what="kv"``, or — for a learner's ring, which need
    not mark them — every unmarked message, each rank's sends (receives) cut in posting order into
    W−1 steps, carrying the chunks the ring passes: at step s rank r sends rank (r − s) mod W's."""
    kv = [e for e in events if _get(e, "op") in ("send", "recv") and (_get(e, "meta") or {}).get("what") == "kv"]
    if kv:
        return kv
    mine: dict[tuple[int, str], list] = {}
    for e in events:
        if _get(e, "op") in ("send", "recv") and not (_get(e, "meta") or {}).get("what"):
            mine.setdefault((int(_get(e, "rank")), _get(e, "op")), []).append(e)
    out = []
    for (r, op), msgs in mine.items():
        per_step = max(1, len(msgs) // max(1, W - 1))
        for i, e in enumerate(sorted(msgs, key=lambda m: _get(m, "start") or 0.0)):
            s = i // per_step
            holder = (r - s) % W if op == "send" else (r - 1 - s) % W
            out.append({"rank": r, "op": op, "peer": _get(e, "peer"), "nbytes": _get(e, "nbytes"), "step": s,
                        "meta": {"what": "kv", "chunks": own_chunks(holder, W, layout)}})
    return out


def _implied_blocks(W: int, layout: str, causal: bool, L: int) -> list[dict]:
    """Compute events as the ring order implies them: step s, rank r, K/V of rank (r - s) mod W,
    none for a block with no unmasked pair."""
    out = []
    for s in range(W):
        for r in range(W):
            j = (r - s) % W
            qt = np.concatenate([chunk_tokens(c, L, W, layout) for c in own_chunks(r, W, layout)])
            kt = np.concatenate([chunk_tokens(c, L, W, layout) for c in own_chunks(j, W, layout)])
            pairs = int((kt[None, :] <= qt[:, None]).sum()) if causal else len(qt) * len(kt)
            if pairs:
                out.append({"rank": r, "op": "compute", "step": s,
                            "meta": {"q_chunks": own_chunks(r, W, layout), "k_chunks": own_chunks(j, W, layout),
                                     "pairs": pairs}})
    return out


# ----------------------------------------------------------------------------------------------
# Compute vs communication over time


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(trace: Iterable[Any]) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """Per rank: ``{"compute": [(start, end)], "comm": [(start, end)]}`` in seconds from the first of them.

    A message's interval runs from when it was posted to when the rank's wait on it returned: the
    time it was in flight, during which the rank may have been computing.
    """
    kinds = {"compute": "compute", **{op: "comm" for op in ("send", "recv", "all_to_all", "all_gather", "all_reduce",
                                                           "reduce_scatter")}}
    events = [e for e in trace if _get(e, "op") in kinds]
    if not events:
        return {}
    t0 = min(_get(e, "start") for e in events)          # the first block or message: barriers before it are not shown
    out: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for e in events:
        kind = kinds[_get(e, "op")]
        row = out.setdefault(int(_get(e, "rank")), {"compute": [], "comm": []})
        row[kind].append((_get(e, "start") - t0, _get(e, "end") - t0))
    return dict(sorted(out.items()))


def overlap_stats(trace: Iterable[Any]) -> dict[int, dict[str, float]]:
    """Per rank: seconds of ``compute``, of ``comm`` in flight, of ``overlap`` (both at once), of
    ``exposed`` communication (in flight while not computing: the rank waits), and
    ``hidden`` = overlap / comm (1.0 = every message travelled while the rank computed)."""
    stats = {}
    for r, row in timeline(trace).items():
        comp, comm = _union(row["compute"]), _union(row["comm"])
        c_len, m_len = _length(comp), _length(comm)
        ov = _intersection(comp, comm)
        stats[r] = {"compute": c_len, "comm": m_len, "overlap": ov, "exposed": m_len - ov,
                    "hidden": ov / m_len if m_len > 0 else 1.0}
    return stats


# ----------------------------------------------------------------------------------------------
# Drawing


def _pos(r: int, n: int, radius: float = 1.0) -> tuple[float, float]:
    a = math.pi / 2 - 2 * math.pi * r / n
    return radius * math.cos(a), radius * math.sin(a)


def _chunk_label(chunks: list[int] | None, layout: str) -> str:
    if not chunks:
        return "?"
    word = "s" if layout == "striped" else ""
    return ",".join(f"{word}{c}" for c in chunks)


def _rgba(hex_colour: str, alpha: float = 1.0) -> tuple[float, float, float, float]:
    h = hex_colour.lstrip("#")
    return tuple(int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)) + (alpha,)  # type: ignore[return-value]


def draw_ring(fig, st: RingState) -> None:
    """Three panels: the ring (Q stays, K/V move), the L×L score matrix, pairs computed per rank."""
    from matplotlib.patches import Circle, FancyBboxPatch, Rectangle

    W, L = st.world_size, st.seq_len
    colour = lambda r: COLOURS[r % len(COLOURS)]  # noqa: E731

    # -- the ring ------------------------------------------------------------------------------
    ax = fig.add_axes([0.0, 0.02, 0.34, 0.9])
    R = 1.3                                   # ring radius (boxes are about 1 wide)
    ax.set_xlim(-2.0, 2.0)
    ax.set_ylim(-1.9, 2.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"step {st.step} of {W - 1}: Q stays, K/V move one hop per step", fontsize=10)
    ax.add_patch(Circle((0, 0), R, fill=False, ls=":", ec="#bbb"))
    for r in range(W):
        x, y = _pos(r, W, R)
        ax.add_patch(FancyBboxPatch((x - 0.52, y - 0.24), 1.04, 0.48, boxstyle="round,pad=0.02",
                                    fc="white", ec=colour(r), lw=2))
        ax.text(x, y + 0.3, f"rank {r}", ha="center", va="bottom", fontsize=9, weight="bold", color=colour(r))
        ax.add_patch(Rectangle((x - 0.48, y - 0.17), 0.44, 0.34, fc=_rgba(colour(r), 0.35), ec=colour(r)))
        ax.text(x - 0.26, y, "Q " + _chunk_label(st.q_chunks[r], st.layout), ha="center", va="center", fontsize=7.5)
        src = st.holds_from[r]
        fc = _rgba(colour(src), 0.85) if src is not None else "white"
        ax.add_patch(Rectangle((x + 0.04, y - 0.17), 0.44, 0.34, fc=fc, ec="#333",
                               hatch=None if st.computed[r] else "//"))
        ax.text(x + 0.26, y, "KV " + _chunk_label(st.holds[r], st.layout), ha="center", va="center", fontsize=7.5,
                color="white" if src is not None else "black", weight="bold")
        if not st.computed[r]:
            ax.text(x, y - 0.36, "skipped: all masked", ha="center", va="top", fontsize=7, color="#a00")
    step_angle = 2 * math.pi / W
    for src, dst, chunks, _ in st.sends:      # arrows along the ring, between the boxes
        a0 = math.pi / 2 - step_angle * src - min(0.3 * step_angle, 0.55)
        a1 = math.pi / 2 - step_angle * dst + min(0.3 * step_angle, 0.55)
        p0, p1 = (R * math.cos(a0), R * math.sin(a0)), (R * math.cos(a1), R * math.sin(a1))
        ax.annotate("", xy=p1, xytext=p0,
                    arrowprops=dict(arrowstyle="-|>,head_width=0.35,head_length=0.6", lw=2.2,
                                    color=colour(chunk_owner(chunks[0], W, st.layout)) if chunks else "#555",
                                    connectionstyle="arc3,rad=-0.25" if W > 2 else "arc3,rad=-0.45"))
    if st.sends:
        ax.text(0, 0, "K/V for the\nnext step\nin flight", ha="center", va="center", fontsize=7.5, color="#555")

    # -- the score matrix ------------------------------------------------------------------------
    mx = fig.add_axes([0.37, 0.1, 0.3, 0.78])
    img = np.ones((L, L, 4))
    img[st.owner == MASKED] = _rgba("#d9d9d9")
    for r in range(W):
        img[(st.owner == r) & ~st.new] = _rgba(colour(r), 0.45)
        img[(st.owner == r) & st.new] = _rgba(colour(r), 1.0)
    mx.imshow(img, interpolation="nearest", extent=(0, L, L, 0))
    # which rank holds each query row / key column
    qown = np.zeros(L, dtype=int)
    for r in range(W):
        for c in own_chunks(r, W, st.layout):
            qown[chunk_tokens(c, L, W, st.layout)] = r
    for t in range(L):
        mx.add_patch(Rectangle((-0.045 * L, t), 0.035 * L, 1, fc=colour(qown[t]), ec="none", clip_on=False))
        mx.add_patch(Rectangle((t, -0.045 * L), 1, 0.035 * L, fc=colour(qown[t]), ec="none", clip_on=False))
    if st.layout != "striped":
        size = L // _n_chunks(W, st.layout)
        for b in range(size, L, size):
            mx.axhline(b, color="white", lw=0.8)
            mx.axvline(b, color="white", lw=0.8)
    mx.set_xlim(-0.05 * L, L)
    mx.set_ylim(L, -0.05 * L)
    mx.set_xticks([])
    mx.set_yticks([])
    for s in mx.spines.values():
        s.set_visible(False)
    mx.set_xlabel("key position →", fontsize=8)
    mx.set_ylabel("← query position", fontsize=8)
    done = int((st.owner >= 0).sum())
    total = int((st.owner != MASKED).sum())
    mx.set_title(f"scores: {done}/{total} computed ({st.layout}{', causal' if st.causal else ''})"
                 + ("\n(inferred from the ring order: the run recorded no compute events)" if st.inferred else ""),
                 fontsize=9)

    # -- pairs per rank --------------------------------------------------------------------------
    bx = fig.add_axes([0.75, 0.14, 0.24, 0.7])
    bx.bar(range(W), st.pairs, color=[colour(r) for r in range(W)])
    for r, e in enumerate(st.expected):
        bx.plot([r - 0.4, r + 0.4], [e, e], color="black", lw=1, ls="--")
    balanced = sum(st.expected) / W
    bx.axhline(balanced, color="#a00", lw=0.8, ls=":")
    bx.text(W - 0.5, balanced, "fair share", color="#a00", fontsize=7, ha="right", va="bottom")
    bx.set_xticks(range(W))
    bx.set_xlabel("rank", fontsize=8)
    bx.set_ylim(0, max(st.expected + st.pairs + [1]) * 1.15)
    bx.set_title("pairs computed so far\n(- - at the end, by formula)", fontsize=8.5)
    bx.tick_params(labelsize=7)


def draw_timeline(fig, trace: Iterable[Any], *, title: str = "") -> dict[int, dict[str, float]]:
    """Per-rank rows: compute blocks (solid) and messages in flight (hatched).  Returns overlap_stats."""
    from matplotlib.patches import Patch

    tl, stats = timeline(trace), overlap_stats(trace)
    ax = fig.add_subplot(111)
    for i, (r, row) in enumerate(tl.items()):
        for a, b in row["comm"]:
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (i - 0.42, 0.36), fc="#ddd", ec="#777", hatch="///")
        for a, b in row["compute"]:
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (i + 0.02, 0.38), fc=COLOURS[r % len(COLOURS)], ec="black",
                           lw=0.5)
    ax.set_yticks(range(len(tl)))
    ax.set_yticklabels([f"rank {r}\n{100 * stats[r]['hidden']:.0f}% hidden" for r in tl], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[Patch(fc="#888", label="compute (block attention)"),
                       Patch(fc="#ddd", ec="#777", hatch="///", label="K/V message in flight")],
              loc="upper right", fontsize=7.5, framealpha=0.9)
    if title:
        ax.set_title(title, fontsize=10)
    return stats


# ----------------------------------------------------------------------------------------------
# The player


def _caption(st: RingState) -> str:
    held = "; ".join(f"r{r} holds K/V of r{st.holds_from[r]}" for r in range(st.world_size))
    skipped = [r for r in range(st.world_size) if not st.computed[r]]
    tail = f" — ranks {skipped} skip this step (every pair masked)" if skipped else ""
    return (f"step {st.step}: {held}{tail}. Pairs so far {st.pairs} "
            f"(max/mean {st.imbalance:.2f}).")


def ring_player(runs: dict[tuple[str, int, bool], RingRun], *, layout: str = "contiguous",
                world_size: int | None = None, causal: bool = True, title: str = "Ring attention, replayed"):
    """A :class:`~reference.widgets.player.Player` over recorded runs keyed ``(layout, W, causal)``.

    Record every combination first (a kept-alive :class:`reference.launch.World` per world size
    makes that cheap); changing a control then only re-selects a run.
    """
    import ipywidgets as W_

    from .player import Player

    sizes = sorted({k[1] for k in runs})
    layouts = [x for x in ("contiguous", "zigzag", "striped") if any(k[0] == x for k in runs)]
    world_size = world_size or sizes[-1]

    def select(layout: str, world_size: int, causal: bool):
        run = runs[(layout, world_size, causal)]
        return (lambda s: ring_state(run.trace, s, world_size=run.world_size, layout=run.layout,
                                     causal=run.causal, seq_len=run.seq_len)), run.n_steps

    controls = {"layout": W_.Dropdown(options=layouts, value=layout, description="layout",
                                      layout=W_.Layout(width="210px")),
                "world_size": W_.Dropdown(options=sizes, value=world_size, description="ranks",
                                          layout=W_.Layout(width="150px")),
                "causal": W_.Checkbox(value=causal, description="causal")}
    state_at, n = select(layout, world_size, causal)
    player = Player(state_at, n, draw_ring, controls=controls, rebuild=select, caption=_caption,
                    figsize=(12, 4.2), title=title)
    return player
