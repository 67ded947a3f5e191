"""A pipeline step laid out in time — the pure part of lecture 4b's Gantt widget (:mod:`.pipeline` draws it).

:func:`pipeline_timeline` reads a run's trace once (compute events: ``meta`` ``what``/``microbatch``/``chunk``/
``stage``/``stashed``; send/recv: ``what`` "activation" or "gradient", ``microbatch``) into blocks, messages and
stash curves, either in **slots** — the order each rank ran, re-laid out with every F, B, W one slot, each as
early as its inputs allow (F of stage s after F of stage s−1, B of s after B of s+1 and its own F, W after its
B): the idealised picture of what actually ran — or in **wall** clock (measured start/end in ms from the first
block).  :func:`order_timeline` lays out a schedule's order without a run (its slots from
:func:`reference.pipeline.schedules.simulate`, any cost and placement).  :func:`gantt_state` cuts a timeline at
time ``t``.  Bubble = idle / (p × makespan).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Block", "Message", "Timeline", "GanttState", "pipeline_timeline", "order_timeline", "gantt_state"]

def _get(e: Any, name: str, default=None):
    """Events are :class:`reference.trace.Event` objects or plain dicts."""
    return e.get(name, default) if isinstance(e, dict) else getattr(e, name, default)


@dataclass(frozen=True)
class Block:
    rank: int
    kind: str             # "F", "B" or "W"
    microbatch: int
    chunk: int
    stage: int            # virtual stage = chunk·p + rank
    start: float          # slots, or ms since the first block
    end: float
    stashed: int | None = None   # micro-batches this rank holds after it (trace meta), if recorded


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    what: str             # "activation" (F → F, down) or "gradient" (B → B, up)
    microbatch: int
    depart: float         # the producing block's end (wall: the send's posting)
    arrive: float         # the consuming block's start (wall: when the receiver had it in hand)
    consumer: Block
    nbytes: int = 0


@dataclass
class Timeline:
    """A whole run laid out on one clock: what :func:`gantt_state` cuts at ``t``."""

    clock: str                                   # "slots" or "wall"
    ranks: int
    virtual_stages: int
    num_microbatches: int
    blocks: list[Block]
    messages: list[Message]
    stash: dict[int, list[tuple[float, int]]]    # rank -> [(time, held from then on)], starts at (0, 0)
    span: float                                  # last end − first start (the first start is 0)

    @property
    def unit(self) -> str:
        return "slots" if self.clock == "slots" else "ms"

    @property
    def busy(self) -> dict[int, float]:
        out = {r: 0.0 for r in range(self.ranks)}
        for b in self.blocks:
            out[b.rank] += b.end - b.start
        return out

    @property
    def bubble_per_rank(self) -> dict[int, float]:
        return {r: 1 - busy / self.span if self.span else 0.0 for r, busy in self.busy.items()}

    @property
    def bubble(self) -> float:
        """idle / total with total = p × makespan, idle = total − busy (the lecture's definition)."""
        total = self.ranks * self.span
        return 1 - sum(self.busy.values()) / total if total else 0.0

    @property
    def peak_stash(self) -> dict[int, int]:
        return {r: max(h for _, h in curve) for r, curve in self.stash.items()}

    def idle(self, rank: int, upto: float | None = None) -> list[tuple[float, float]]:
        """The rank's bubbles: gaps between 0, its blocks and the makespan (cut at ``upto``)."""
        end = self.span if upto is None else min(upto, self.span)
        gaps, at = [], 0.0
        for b in sorted((b for b in self.blocks if b.rank == rank), key=lambda b: b.start):
            if min(b.start, end) > at + 1e-9:
                gaps.append((at, min(b.start, end)))
            at = max(at, b.end)
        if end > at + 1e-9:
            gaps.append((at, end))
        return gaps


def _needs(kind: str, stage: int, i: int) -> list[tuple[str, int, int]]:
    """What a block waits for, as (kind, virtual stage, micro-batch)."""
    return {"F": [("F", stage - 1, i)], "B": [("F", stage, i), ("B", stage + 1, i)], "W": [("B", stage, i)]}[kind]


def _slots(order: list[list[tuple]]) -> dict[tuple, tuple[float, float]]:
    """Each rank's actions ``(kind, stage, mb)`` in its order, one slot each, as early as the
    dependencies present in the run allow.  Raises ValueError on an order that deadlocks."""
    keys = {a for acts in order for a in acts}
    done: dict[tuple, tuple[float, float]] = {}
    free, pos, progress = [0.0] * len(order), [0] * len(order), True
    while progress:
        progress = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts):
                deps = [d for d in _needs(*acts[pos[r]]) if d in keys]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d][1] for d in deps])
                done[acts[pos[r]]] = (start, start + 1.0)
                free[r], pos[r], progress = start + 1.0, pos[r] + 1, True
    stuck = [f"rank {r} at {acts[pos[r]][0]}{acts[pos[r]][2]}" for r, acts in enumerate(order) if pos[r] < len(acts)]
    if stuck:
        raise ValueError("the trace's order deadlocks in slots: " + ", ".join(stuck))
    return done


def pipeline_timeline(trace: Iterable[Any], clock: str = "slots") -> Timeline:
    """Lay a run's trace out on ``clock`` ("slots" or "wall"): blocks, messages, stash curves."""
    if clock not in ("slots", "wall"):
        raise ValueError(f"clock must be 'slots' or 'wall', got {clock!r}")
    events = list(trace)
    compute = sorted((e for e in events if _get(e, "op") == "compute"
                      and {"what", "microbatch"} <= set(_get(e, "meta") or {})),
                     key=lambda e: (_get(e, "start"), _get(e, "end")))
    if not compute:
        return Timeline(clock, 0, 1, 0, [], [], {}, 0.0)
    p = 1 + max(int(_get(e, "rank")) for e in compute)
    v = 1 + max(int(_get(e, "meta").get("chunk", 0)) for e in compute)

    def key(e) -> tuple[str, int, int]:
        m, r = _get(e, "meta"), int(_get(e, "rank"))
        return m["what"], int(m.get("stage", m.get("chunk", 0) * p + r)), int(m["microbatch"])

    if clock == "slots":
        order: list[list[tuple]] = [[] for _ in range(p)]
        for e in compute:
            order[int(_get(e, "rank"))].append(key(e))
        times = _slots(order)
    else:
        t0 = _get(compute[0], "start")
        times = {key(e): ((_get(e, "start") - t0) * 1e3, (_get(e, "end") - t0) * 1e3) for e in compute}
    blocks = []
    for e in compute:
        kind, stage, i = key(e)
        m = _get(e, "meta")
        blocks.append(Block(int(_get(e, "rank")), kind, i, int(m.get("chunk", 0)), stage, *times[key(e)],
                            m.get("stashed")))
    return _assemble(clock, p, v, blocks, events, t0=_get(compute[0], "start"))


def order_timeline(order: list[list], *, placement: str = "loop", cost=None) -> Timeline:
    """A schedule's order (one list of :class:`~reference.pipeline.schedules.Action` per rank) laid out in
    slots by :func:`~reference.pipeline.schedules.simulate` with ``cost`` and ``placement`` — a picture of
    a schedule without a run (lecture 4b's last section: breadth-first, ZB-V, DualPipeV)."""
    from ..pipeline.schedules import simulate, virtual_stage
    p = len(order)
    v = 1 + max((a.chunk for acts in order for a in acts), default=0)
    blocks = [Block(r, a.kind, a.microbatch, a.chunk, virtual_stage(a.chunk, r, p, placement), start, end)
              for r, acts in enumerate(simulate(order, cost=cost, placement=placement)) for start, end, a in acts]
    return _assemble("slots", p, v, blocks, [], t0=0.0)


def _assemble(clock: str, p: int, v: int, blocks: list[Block], events: list, t0: float) -> Timeline:
    """Blocks laid out on a clock → the :class:`Timeline`: messages (every dependency that crosses ranks;
    on the wall clock the traced send/recv times) and stash curves."""
    by_key = {(b.kind, b.stage, b.microbatch): b for b in blocks}

    # messages: every dependency that crosses ranks; wall clock takes the send/recv times when traced
    wires: dict[tuple, list] = defaultdict(list)       # (op, src, dst, what, mb) -> events in time order
    for e in sorted(events, key=lambda e: (_get(e, "start"), _get(e, "end"))):
        m = _get(e, "meta") or {}
        if _get(e, "op") in ("send", "recv") and m.get("what") in ("activation", "gradient") and "microbatch" in m:
            ends = (_get(e, "rank"), _get(e, "peer"))
            src, dst = ends if _get(e, "op") == "send" else ends[::-1]
            wires[(_get(e, "op"), src, dst, m["what"], m["microbatch"])].append(e)
    edges: dict[tuple, list[tuple[Block, Block]]] = defaultdict(list)
    for b in blocks:
        for d in _needs(b.kind, b.stage, b.microbatch):
            src = by_key.get(d)
            if src is not None and src.rank != b.rank and d[0] == b.kind:
                what = "activation" if b.kind == "F" else "gradient"
                edges[(src.rank, b.rank, what, b.microbatch)].append((src, b))
    messages = []
    for (s, d, what, i), pairs in edges.items():
        pairs.sort(key=lambda sb: sb[0].end)
        sends, recvs = wires.get(("send", s, d, what, i), []), wires.get(("recv", s, d, what, i), [])
        for n, (src, dst) in enumerate(pairs):       # the n-th such message is the n-th send and recv
            depart, arrive, nbytes = src.end, dst.start, 0
            if clock == "wall" and n < len(sends):
                depart, nbytes = (_get(sends[n], "start") - t0) * 1e3, int(_get(sends[n], "nbytes") or 0)
            if clock == "wall" and n < len(recvs):
                arrive = min(dst.start, (_get(recvs[n], "end") - t0) * 1e3)
            messages.append(Message(s, d, what, i, depart, max(depart, arrive), dst, nbytes))
    messages.sort(key=lambda msg: msg.depart)

    # stash: the held count after each block (trace meta), else F adds one and its B (or W) frees it
    frees = "W" if any(b.kind == "W" for b in blocks) else "B"
    stash = {}
    for r in range(p):
        held, curve = 0, [(0.0, 0)]
        for b in sorted((b for b in blocks if b.rank == r), key=lambda b: b.end):
            held = b.stashed if b.stashed is not None else held + {"F": 1, frees: -1}.get(b.kind, 0)
            curve.append((b.end, held))
        stash[r] = curve
    span = max(b.end for b in blocks)
    return Timeline(clock, p, v, 1 + max(b.microbatch for b in blocks), blocks, messages, stash, span)


@dataclass
class GanttState:
    """The picture at time ``t``: what has started (blocks cut at ``t``), messages sent, stash so far."""

    timeline: Timeline
    t: float
    blocks: list[Block]                          # started before t (drawn up to min(end, t))
    done: list[Block]                            # finished by t
    now: dict[int, Block | None]                 # rank -> the block running just before t (start < t ≤ end)
    messages: list[Message]                      # departed by t
    in_flight: list[Message]                     # departed, not yet arrived
    idle: dict[int, list[tuple[float, float]]]   # rank -> bubbles up to t
    stash: dict[int, list[tuple[float, int]]]    # rank -> curve up to t
    stash_now: dict[int, int]
    predicted: float | None = None
    title: str = ""

    @property
    def finished(self) -> bool:
        return self.t >= self.timeline.span


def gantt_state(trace: Iterable[Any] | Timeline, t: float, *, clock: str = "slots", predicted: float | None = None,
                title: str = "") -> GanttState:
    """What the chart shows at time ``t`` (slots, or ms since the first block); ``trace`` may be a
    :class:`Timeline` already laid out (then ``clock`` is its own)."""
    tl = trace if isinstance(trace, Timeline) else pipeline_timeline(trace, clock)
    eps = 1e-9
    blocks = [b for b in tl.blocks if b.start < t - eps]
    now = {r: next((b for b in blocks if b.rank == r and b.end >= t - eps), None) for r in range(tl.ranks)}
    msgs = [m for m in tl.messages if m.depart <= t - eps]
    stash = {r: [(x, h) for x, h in c if x <= t + eps] for r, c in tl.stash.items()}
    return GanttState(tl, t, blocks, [b for b in blocks if b.end <= t + eps], now, msgs,
                      [m for m in msgs if m.arrive > t + eps], {r: tl.idle(r, t) for r in range(tl.ranks)},
                      stash, {r: c[-1][1] for r, c in stash.items()}, predicted, title)
