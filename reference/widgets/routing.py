"""Replay an expert-parallel MoE forward: tokens routed to experts, capacity buffers, two all-to-alls.

The trace of one ``ExpertParallelMoE`` forward (``reference.moe.parallel``) holds, per rank, one
``route`` event (each token's choices, weights, kept/slot), the ``dispatch`` and ``combine``
all-to-alls (bytes per destination, real tokens per destination) and the experts' ``compute``.
:func:`routing_state` turns that into what the picture shows at each phase::

    phase        what happens                                            picture
    tokens       T tokens wait on each home rank                         coloured squares, top row
    route        the router picks k experts per token (softmax, top-k)   "→E3" under each token
    queue 1st    first choices take slots in their expert's buffer       E rows × C slots per rank
    queue 2nd    (top-2) second choices take what is left; overflow      red crosses right of a row
                 is DROPPED
    dispatch     all-to-all: rows for expert e go to rank e // (E/W)     received buffers, bytes
    experts      each expert runs on its W·C rows (padding included)     highlighted rows
    combine      all-to-all back: outputs return to the home ranks       bytes
    sum          y_t = Σ_j w_tj · out_tj over kept choices; a token      bar of Σ kept weights;
                 dropped by every expert outputs 0                       "0" under dropped tokens

The state is a plain dict (tested in the full course's ``tests/moe/test_lecture.py``); :func:`draw_routing` paints
it; :func:`routing_player` puts a Play button, a slider and the controls (k, capacity factor,
experts, ranks) around traces recorded up front, so that moving a control only swaps traces.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["phases", "routing_state", "bytes_per_phase", "draw_routing", "routing_caption", "routing_player",
           "RANK_COLOURS"]

RANK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974")
DROP_COLOUR = "#C44E52"


def _get(e: Any, name: str, default=None):
    if isinstance(e, dict):
        return e.get(name, default)
    return getattr(e, name, default)


def phases(k: int) -> list[str]:
    """Phase names for top-k routing (top-1 has no "queue 2nd" phase)."""
    return ["tokens", "route", "queue 1st"] + (["queue 2nd"] if k >= 2 else []) + \
        ["dispatch", "experts", "combine", "sum"]


def _route_events(trace: Iterable[Any]) -> dict[int, Any]:
    out = {}
    for e in trace:
        if _get(e, "op") == "route" and _get(e, "meta", {}).get("where", "expert_parallel") == "expert_parallel":
            out.setdefault(_get(e, "rank"), e)          # the first forward of each rank
    return out


def all_to_alls(trace: Iterable[Any]) -> list[tuple[Any, str | None]]:
    """Each all-to-all event of ``trace`` with what it carried: its ``meta["what"]``, or — for a
    learner's dispatch and combine, which need not say — its place among its rank's unlabelled
    all-to-alls: the first is the dispatch, the second the combine (a forward sends one of each)."""
    out, unlabelled = [], {}
    for e in trace:
        if _get(e, "op") != "all_to_all":
            continue
        what = _get(e, "meta", {}).get("what")
        if what is None:
            seen = unlabelled[_get(e, "rank")] = unlabelled.get(_get(e, "rank"), 0) + 1
            what = {1: "dispatch", 2: "combine"}.get(seen)
        out.append((e, what))
    return out


def bytes_per_phase(trace: Iterable[Any]) -> dict[str, dict[int, dict[str, int]]]:
    """For "dispatch" and "combine": per rank, bytes handed in (``total``), bytes that leave the
    rank (``off_rank``, excluding its block for itself) and real tokens sent off-rank."""
    out: dict[str, dict[int, dict[str, int]]] = {"dispatch": {}, "combine": {}}
    for e, what in all_to_alls(trace):
        meta = _get(e, "meta", {})
        if what not in out:
            continue
        r = _get(e, "rank")
        if r in out[what]:
            continue                                    # first forward only
        send_bytes = meta.get("send_bytes") or []
        tokens = meta.get("tokens_per_dest")            # None: not recorded (a learner's dispatch)
        if what == "combine" and meta.get("tokens_per_src") is not None:
            tokens = None                               # padded combine: tokens_per_dest counts every row
        out[what][r] = {
            "total": int(_get(e, "nbytes", 0)),
            "off_rank": int(sum(b for d, b in enumerate(send_bytes) if d != r)),
            "tokens_off_rank": None if tokens is None else int(sum(t for d, t in enumerate(tokens) if d != r)),
        }
    return out


def routing_state(trace: Iterable[Any], step: int) -> dict[str, Any]:
    """What the routing picture shows after phase ``step`` (0-based, clamped) of the trace's first forward.

    Returns a dict:
      phase, step, n_steps, phases        the phase name, its index, how many there are
      W, E, E_local, k, C, T              ranks, experts, experts per rank, top-k, capacity, tokens per rank
      tokens[r][t]                        {"choices": [(e, w, kept, slot)], "dest": [rank of e]}
      show_choices                        the router has decided (phase >= route)
      send[r][e]                          rank r's buffer for expert e: list of C entries, None or (t, j)
      dropped[r]                          (t, j, e) assignments of rank r dropped so far
      recv[r][i]                          local expert i of rank r: list of W·C entries, None or (src, t, j)
      computing                           experts are running (highlight the received buffers)
      returned                            outputs are back on the home ranks (combine done)
      output[r][t]                        Σ of kept weights (phase "sum"), else None; 0 = dropped token
      bytes                               :func:`bytes_per_phase`, plus "formula" bytes per all-to-all
      moved                               the all-to-all of this phase ("dispatch"/"combine") or None
    """
    tr = list(trace)
    routes = _route_events(tr)
    if not routes:
        raise ValueError("the trace has no 'route' events: record an ExpertParallelMoE forward")
    ranks = sorted(routes)
    W = len(ranks)
    meta0 = _get(routes[ranks[0]], "meta")
    E, k, C = int(meta0["num_experts"]), int(meta0["k"]), meta0.get("capacity")
    E_local = E // W
    names = phases(k)
    n = len(names)
    step = max(0, min(int(step), n - 1))
    phase = names[step]
    at = {name: i for i, name in enumerate(names)}

    tokens, T = [], []
    for r in ranks:
        m = _get(routes[r], "meta")
        rows = []
        for idx, w, kp, sl in zip(m["expert_index"], m["weight"], m["kept"], m["slot"]):
            rows.append({"choices": [(int(a), float(b), bool(c), int(d)) for a, b, c, d in zip(idx, w, kp, sl)],
                         "dest": [int(a) // E_local for a in idx]})
        tokens.append(rows)
        T.append(len(rows))
    if C is None:   # dropless: buffers as long as the longest queue, nothing dropped
        C = max([1] + [max((c[3] for row in rows for c in row["choices"]), default=0) + 1 for rows in tokens])

    # Which choices have queued by this phase: j = 0 from "queue 1st", j = 1.. from "queue 2nd".
    queued_upto = -1
    if step >= at["queue 1st"]:
        queued_upto = 0
    if "queue 2nd" in at and step >= at["queue 2nd"]:
        queued_upto = k - 1
    send = [[[None] * C for _ in range(E)] for _ in ranks]
    dropped: list[list[tuple[int, int, int]]] = [[] for _ in ranks]
    for ri, rows in enumerate(tokens):
        for j in range(queued_upto + 1):
            for t, row in enumerate(rows):
                e, _, kept, slot = row["choices"][j]
                if kept and 0 <= slot < C:
                    send[ri][e][slot] = (t, j)
                else:
                    dropped[ri].append((t, j, e))

    dispatched = step >= at["dispatch"]
    recv = [[[None] * (W * C) for _ in range(E_local)] for _ in ranks]
    if dispatched:
        for si in range(W):
            for e in range(E):
                dst, i = e // E_local, e % E_local
                for s, entry in enumerate(send[si][e]):
                    if entry is not None:
                        recv[dst][i][si * C + s] = (ranks[si], entry[0], entry[1])

    output = None
    if phase == "sum":
        output = [[sum(w for _, w, kept, _ in row["choices"] if kept) for row in rows] for rows in tokens]

    b = bytes_per_phase(tr)
    row_bytes = _row_bytes(tr, E, C)
    b["formula"] = {"per_all_to_all": None if row_bytes is None else E * C * row_bytes,
                    "off_rank": None if row_bytes is None else (W - 1) * E_local * C * row_bytes,
                    "row_bytes": row_bytes}
    return {
        "phase": phase, "step": step, "n_steps": n, "phases": names,
        "W": W, "E": E, "E_local": E_local, "k": k, "C": C, "T": T, "ranks": ranks,
        "dropless": meta0.get("capacity") is None,
        "tokens": tokens, "show_choices": step >= at["route"],
        "send": send, "dropped": dropped, "recv": recv,
        "computing": phase == "experts", "returned": step >= at["combine"],
        "output": output, "bytes": b,
        "moved": phase if phase in ("dispatch", "combine") else None,
    }


def _row_bytes(trace: list, E: int, C: int) -> int | None:
    """Bytes of one token row, read off the first dispatch all-to-all (its buffer has E·C rows)."""
    for e, what in all_to_alls(trace):
        meta = _get(e, "meta", {})
        if what == "dispatch":
            splits = meta.get("send_splits") or []
            rows = sum(splits) if splits else E * C
            return int(_get(e, "nbytes", 0)) // max(1, rows)
    return None


# ----------------------------------------------------------------------------------------------
# Drawing


def routing_caption(st: dict) -> str:
    W, E, k, C = st["W"], st["E"], st["k"], st["C"]
    ph = st["phase"]
    n_drop = sum(len(d) for d in st["dropped"])
    demand = sum(T * k for T in st["T"])
    if ph == "tokens":
        return f"{W} ranks × {st['T'][0]} tokens. Each rank holds {st['E_local']} of the {E} experts."
    if ph == "route":
        return (f"Router: softmax over all {E} experts, top-{k}. Capacity C = ceil(k·cf·T/E) = {C} slots "
                "per expert per rank.")
    if ph in ("queue 1st", "queue 2nd"):
        which = "first choices" if ph == "queue 1st" else "second choices (after every first choice)"
        return f"Queue {which}: {n_drop} of {demand} assignments dropped so far (buffer full)."
    if ph in ("dispatch", "combine"):
        bb = st["bytes"][ph]
        off = [bb.get(r, {}).get("off_rank", 0) for r in st["ranks"]]
        return (f"{ph.capitalize()} all-to-all: every rank sends its whole E·C-row buffer "
                f"(padding too); {', '.join(f'rank {r}: {o} B' for r, o in zip(st['ranks'], off))} leave the rank.")
    if ph == "experts":
        return f"Each expert runs on its W·C = {W * C} rows, padding included (the cost of a fixed capacity)."
    zero = sum(1 for rows in st["output"] for s in rows if s == 0)
    return f"y_t = Σ kept w_tj · expert_out. {zero} token(s) lost every choice: output 0, the residual carries them."


def draw_routing(fig, st: dict) -> None:
    """Paint :func:`routing_state` on a matplotlib figure: one column per rank.

    Top to bottom in each column: the rank's tokens (with their choices, or at the end the sum of
    their kept weights), its send buffer (E rows × C slots, overflow crossed out in red), the
    buffers its experts receive (W·C rows each, coloured by source rank), the bytes it moved.
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle

    W, E, E_local, k, C = st["W"], st["E"], st["E_local"], st["k"], st["C"]
    T = max(st["T"])
    col_w, gap, label_w = 10.0, 0.8, 1.6
    max_drop = max([1] + [sum(1 for (_, _, e2) in d if e2 == e) for d in st["dropped"] for e in range(E)])
    show_drops = min(max_drop, 6)
    s = min((col_w - label_w - 0.2) / (C + show_drops + 0.6), (col_w - 0.4) / T, 0.9)
    pitch = 1.15 * s
    # Vertical layout, in data units, going down from y = 0.
    tok_y = -0.4                                  # top of the token row
    tok_h = s * 3.0 + 0.6                         # token row + two lines of choices / the output bar
    send_top = tok_y - tok_h - 0.8
    send_h = E * pitch
    recv_top = send_top - send_h - 2.6
    block_gap = 0.35 * s
    recv_h = E_local * W * pitch + (E_local - 1) * block_gap
    bytes_y = recv_top - recv_h - 0.5
    bottom = bytes_y - 2.2
    width = W * (col_w + gap) - gap
    fw = fig.get_size_inches()[0]
    fig.set_size_inches(fw, fw * (2.2 - bottom) / (width + 0.4))   # as tall as the layout: the width sets the scale
    ax = fig.add_axes([0.005, 0.005, 0.99, 0.99])
    ax.set_axis_off()
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(bottom - 0.6, 1.6)
    ax.set_aspect("equal", anchor="N")
    inch = 0.99 * fw / (width + 0.4)
    pt = lambda units, lo=6.5, hi=10.0: max(lo, min(hi, units * inch * 72))   # noqa: E731

    def cell(x, yy, face, label="", hatch=None, edge="#333333", lw=0.6, alpha=1.0, fc="white"):
        ax.add_patch(Rectangle((x, yy - s), s * 0.92, s * 0.92, facecolor=face, edgecolor=edge, lw=lw, hatch=hatch,
                               alpha=alpha))
        if label != "":
            ax.text(x + s * 0.46, yy - s * 0.54, str(label), ha="center", va="center", color=fc,
                    fontsize=pt(0.5 * s), fontweight="bold")

    small = pt(0.42 * s, hi=9.0)
    for ri, r in enumerate(st["ranks"]):
        x0 = ri * (col_w + gap)
        colour = RANK_COLOURS[r % len(RANK_COLOURS)]
        ax.add_patch(Rectangle((x0 - 0.1, bottom + 0.9), col_w + 0.2, 0.95 - bottom - 0.9, facecolor=colour,
                               alpha=0.06, edgecolor=colour, lw=1.0))
        first, last = r * E_local, (r + 1) * E_local - 1
        ax.text(x0 + 0.1, 0.35, f"rank {r}  (experts E{first}–E{last})" if E_local > 1 else
                f"rank {r}  (expert E{first})", fontsize=pt(0.55, hi=10), fontweight="bold", color=colour,
                va="center")
        # tokens, their choices, and at the end the sum of their kept weights
        for t, row in enumerate(st["tokens"][ri]):
            tx = x0 + 0.2 + t * s
            out = st["output"][ri][t] if st["output"] is not None else None
            lost = out is not None and out == 0
            cell(tx, tok_y, "white" if lost else colour, t, edge=DROP_COLOUR if lost else "#333333",
                 fc=DROP_COLOUR if lost else "white")
            if st["show_choices"] and out is None:
                for j, (e, w, kept, slot) in enumerate(row["choices"]):
                    ax.text(tx + s * 0.46, tok_y - s * (1.45 + 0.7 * j), f"E{e}", ha="center", va="center",
                            fontsize=small, color="#222222" if j == 0 else "#808080")
            if out is not None:
                base = tok_y - s * 1.15 - 1.5 * s
                ax.add_patch(Rectangle((tx + 0.2 * s, base), s * 0.5, 1.5 * s * out, facecolor="#333333"))
                ax.add_patch(Rectangle((tx + 0.2 * s, base), s * 0.5, 1.5 * s, fill=False, edgecolor="#999999",
                                       lw=0.5))
                ax.text(tx + s * 0.46, base - 0.1, "0" if lost else (f"{out:.2f}"[1:] if out < 0.995 else "1"),
                        ha="center", va="top", fontsize=small, color=DROP_COLOUR if lost else "#333333")
        # send buffer
        note = "outputs returned" if st["returned"] else f"{E} experts × C={C} slots"
        ax.text(x0 + 0.1, send_top + 0.4, f"buffers on rank {r}: {note}", fontsize=pt(0.4, hi=9), color="#333333",
                va="center")
        for e in range(E):
            yy = send_top - e * pitch
            dest = e // E_local
            ax.text(x0 + label_w - 0.15, yy - s * 0.5, f"E{e}→r{dest}", ha="right", va="center", fontsize=small,
                    color=RANK_COLOURS[dest % len(RANK_COLOURS)])
            for c in range(C):
                entry = st["send"][ri][e][c]
                cx = x0 + label_w + c * s
                if entry is None:
                    cell(cx, yy, "#F2F2F2", edge="#BBBBBB", lw=0.4)
                else:
                    t, j = entry
                    cell(cx, yy, colour, t, hatch="////" if j > 0 else None,
                         edge="black" if st["returned"] else "#333333", lw=1.3 if st["returned"] else 0.6)
            drops = [(t, j) for (t, j, e2) in st["dropped"][ri] if e2 == e]
            for n_, (t, j) in enumerate(drops):
                cx = x0 + label_w + (C + 0.5 + n_) * s
                if n_ == show_drops - 1 and len(drops) > show_drops:
                    ax.text(cx + 0.1 * s, yy - s * 0.5, f"+{len(drops) - n_}", va="center", fontsize=small,
                            color=DROP_COLOUR, fontweight="bold")
                    break
                cell(cx, yy, "white", t, edge=DROP_COLOUR, lw=0.8, fc=DROP_COLOUR)
                ax.plot([cx, cx + s * 0.92], [yy - s, yy - s * 0.08], color=DROP_COLOUR, lw=0.8)
        # what this rank's experts receive
        if st["step"] >= st["phases"].index("dispatch"):
            ax.text(x0 + 0.1, recv_top + 0.4, f"expert inputs: C={C} rows × {W} ranks",
                    fontsize=pt(0.4, hi=9), color="#333333", va="center")
            hot = st["computing"]
            for i in range(E_local):
                e = r * E_local + i
                for src in range(W):
                    yy = recv_top - (i * W + src) * pitch - i * block_gap
                    ax.text(x0 + label_w - 0.15, yy - s * 0.5, f"E{e}←r{st['ranks'][src]}", ha="right", va="center",
                            fontsize=small, fontweight="bold" if hot else "normal",
                            color=RANK_COLOURS[st["ranks"][src] % len(RANK_COLOURS)])
                    for c in range(C):
                        entry = st["recv"][ri][i][src * C + c]
                        cx = x0 + label_w + c * s
                        if entry is None:
                            cell(cx, yy, "#FFF4C2" if hot else "#F2F2F2", edge="#BBBBBB", lw=0.4)
                        else:
                            _, t, j = entry
                            cell(cx, yy, RANK_COLOURS[st["ranks"][src] % len(RANK_COLOURS)], t,
                                 hatch="////" if j > 0 else None, edge="#E0A800" if hot else "#333333",
                                 lw=1.5 if hot else 0.6, alpha=0.4 if st["returned"] else 1.0)
        # bytes moved by this rank in each all-to-all so far
        lines = []
        for what in ("dispatch", "combine"):
            if st["step"] < st["phases"].index(what):
                continue
            bb = st["bytes"][what].get(r)
            if bb:
                lines.append(f"{what:<9}{bb['total']:>7} B{bb['off_rank']:>8} B")
        if lines:
            lines.insert(0, f"{'all-to-all':<9} buffer  leaves")
            ax.text(x0 + 0.1, bytes_y, "\n".join(lines), fontsize=pt(0.36, hi=9), va="top", family="monospace",
                    fontweight="bold" if st["moved"] else "normal")
    # all-to-all arrows: from rank s's block of rows for rank d to rank d (or back, in combine)
    if st["moved"]:
        for si in range(W):
            for di in range(W):
                n_real = sum(1 for e in range(di * E_local, (di + 1) * E_local) for x in st["send"][si][e]
                             if x is not None)
                if si == di or not n_real:
                    continue
                xs = si * (col_w + gap) + col_w * 0.5
                xd = di * (col_w + gap) + col_w * 0.5
                top, low = send_top - send_h - 0.1, recv_top + 1.0
                a, b_ = ((xs, top), (xd, low)) if st["moved"] == "dispatch" else ((xd, low), (xs, top))
                ax.add_patch(FancyArrowPatch(a, b_, arrowstyle="-|>", mutation_scale=8, lw=0.4 + 0.3 * n_real,
                                             alpha=0.6, color=RANK_COLOURS[si % len(RANK_COLOURS)],
                                             connectionstyle="arc3,rad=0.06"))
    head = f"top-{k}, capacity C = {C}" + (" (dropless)" if st["dropless"] else "") + \
        f"      phase {st['step'] + 1}/{st['n_steps']}: {st['phase']}"
    ax.text(width, 1.15, head, ha="right", va="center", fontsize=pt(0.6, hi=11), fontweight="bold")
    legend = ("solid = 1st choice   hatched = 2nd choice   red ✗ = dropped (buffer full)   "
              "grey = empty slot (padding: sent anyway)   colour = home rank")
    ax.text(0, bottom + 0.3, legend, fontsize=pt(0.4, hi=9), color="#444444", va="center")


# ----------------------------------------------------------------------------------------------
# The player


def routing_player(traces: dict[tuple, Sequence[Any]], *, k: int = 2, capacity_factor: float = 1.0,
                   num_experts: int = 8, world_size: int = 4, title: str = "Token routing, replayed",
                   figsize=(13, 7.3)):
    """A :class:`~reference.widgets.player.Player` over traces keyed by (k, capacity_factor, E, W).

    Record every combination up front (``reference.moe.lecture.routing_traces``) so a control change
    only picks another trace.
    """
    import ipywidgets as widgets

    from .player import Player

    keys = list(traces)
    opts = {name: sorted({key[i] for key in keys}) for i, name in enumerate(("k", "cf", "E", "W"))}
    controls = {
        "k": widgets.Dropdown(options=opts["k"], value=k, description="k",
                              layout=widgets.Layout(width="150px")),
        "cf": widgets.Dropdown(options=opts["cf"], value=capacity_factor, description="cap. factor",
                               layout=widgets.Layout(width="170px")),
        "E": widgets.Dropdown(options=opts["E"], value=num_experts, description="experts",
                              layout=widgets.Layout(width="150px")),
        "W": widgets.Dropdown(options=opts["W"], value=world_size, description="ranks",
                              layout=widgets.Layout(width="140px")),
    }

    def build(k, cf, E, W) -> tuple[Callable[[int], dict], int]:
        tr = traces[(k, cf, E, W)]
        n = len(phases(k))
        cache: dict[int, dict] = {}

        def state_at(step: int) -> dict:
            if step not in cache:
                cache[step] = routing_state(tr, step)
            return cache[step]
        return state_at, n

    state_at, n = build(k, capacity_factor, num_experts, world_size)
    return Player(state_at, n, draw_routing, controls=controls, rebuild=build, caption=routing_caption,
                  figsize=figsize, title=title)
