"""One trace format for every axis of the course.

Every communication (send, recv, all-reduce, all-gather, reduce-scatter, all-to-all, broadcast)
and every compute block a lecture wants to show becomes one :class:`Event`::

    Event(rank=1, op="send", peer=2, nbytes=4096, step=0, start=0.0123, end=0.0151,
          meta={"what": "kv", "chunk": 1})

Events are plain dataclasses: they pickle back from worker processes to the caller, where widgets
replay them and tests count bytes and work from them.

Recording is per process and off by default.  ``reference.launch`` switches it on in every rank
while a world runs, so code written once records under the launcher and costs one boolean test per
call under ``torchrun``.  Reference code records through :func:`span` (a ``with`` block, timed) or
:func:`emit` (an instant event); ``reference.comm`` wraps the collectives with these.

A second, tiny channel, :func:`set_status`, tells the launcher what a rank is blocked in right now
("recv from rank 3, step 2"), so that a deadlock can be reported by operation and ring step.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

COMM_OPS = ("send", "recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier")


@dataclass
class Event:
    """One thing a rank did.

    rank:   global rank that did it
    op:     "send", "recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
            "broadcast", "barrier" or "compute" (lectures may add their own names)
    peer:   the other rank of a point-to-point op (global rank), else None
    nbytes: payload bytes this rank sent (send, collectives: the bytes it hands in) or received
            (recv); 0 for compute
    step:   the algorithm's step (ring step, pipeline micro-batch, ...), or None
    start, end: seconds on the machine's monotonic clock (comparable across local processes)
    meta:   what a lecture needs: attention pairs, chunk ids, tokens per expert, ...
    """

    rank: int
    op: str
    peer: int | None = None
    nbytes: int = 0
    step: int | None = None
    start: float = 0.0
    end: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trace(list):
    """A list of :class:`Event` with the few queries lectures and tests keep asking."""

    def filter(self, op: str | Iterable[str] | None = None, rank: int | None = None,
               step: int | None = None, **meta: Any) -> Trace:
        ops = {op} if isinstance(op, str) else (set(op) if op is not None else None)
        out = Trace()
        for e in self:
            if ops is not None and e.op not in ops:
                continue
            if rank is not None and e.rank != rank:
                continue
            if step is not None and e.step != step:
                continue
            if any(e.meta.get(k) != v for k, v in meta.items()):
                continue
            out.append(e)
        return out

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self})

    def bytes_by_rank(self, op: str | Iterable[str] = "send") -> dict[int, int]:
        """Total ``nbytes`` per rank over events of ``op`` (default: bytes sent point-to-point)."""
        totals: dict[int, int] = defaultdict(int)
        for r in self.ranks:
            totals[r] = 0
        for e in self.filter(op=op):
            totals[e.rank] += e.nbytes
        return dict(totals)

    def meta_sum(self, key: str, op: str = "compute") -> dict[int, Any]:
        """Sum of ``meta[key]`` per rank over events of ``op`` (e.g. attention pairs per rank)."""
        totals: dict[int, Any] = {r: 0 for r in self.ranks}
        for e in self.filter(op=op):
            if key in e.meta:
                totals[e.rank] = totals.get(e.rank, 0) + e.meta[key]
        return totals

    def steps(self) -> list[int]:
        return sorted({e.step for e in self if e.step is not None})

    def relative(self) -> Trace:
        """A copy whose times start at 0 (the earliest event's start)."""
        if not self:
            return Trace()
        t0 = min(e.start for e in self)
        return Trace(Event(e.rank, e.op, e.peer, e.nbytes, e.step, e.start - t0, e.end - t0, dict(e.meta))
                     for e in self)

    def sorted(self) -> Trace:
        return Trace(sorted(self, key=lambda e: (e.start, e.rank)))

    def to_chrome(self, path: str | None = None) -> dict[str, Any]:
        """The trace in the Chrome trace event format, written to ``path`` if given (a ``.json`` to open in
        https://ui.perfetto.dev or ``chrome://tracing``), and returned as a dict.

        Each rank is a process (``pid`` = rank) with two rows: ``compute`` and ``communication``, so that
        overlap shows as bars stacked in time.  Every event is a complete event (``ph: "X"``; ``ts`` and
        ``dur`` in µs from the trace's first event) whose ``args`` hold rank, op, peer, nbytes, step and the
        event's ``meta``; a send and the matching recv (the k-th send from a to b, the k-th recv on b from a)
        are joined by a flow arrow.  The same format as ``torch.profiler``'s ``export_chrome_trace``, so both
        open side by side in the same viewer."""
        import json
        t0 = min((e.start for e in self), default=0.0)
        us = lambda t: (t - t0) * 1e6                                # noqa: E731
        out: list[dict[str, Any]] = []
        for r in self.ranks:
            out.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
            for tid, row in ((0, "compute"), (1, "communication")):
                out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": row}})
        sends: dict[tuple[int, int], list[Event]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[Event]] = defaultdict(list)
        for e in self.sorted():
            name = e.op + (f" {'to' if e.op == 'send' else 'from' if e.op == 'recv' else 'with'} {e.peer}"
                           if e.peer is not None else "")
            args = {"rank": e.rank, "op": e.op, "peer": e.peer, "nbytes": e.nbytes, "step": e.step,
                    "meta": json.loads(json.dumps(e.meta, default=repr))}
            out.append({"ph": "X", "name": name, "cat": "comm" if e.op in COMM_OPS else "compute",
                        "pid": e.rank, "tid": 1 if e.op in COMM_OPS else 0, "ts": us(e.start),
                        "dur": max(us(e.end) - us(e.start), 0.0), "args": args})
            if e.op == "send" and e.peer is not None:
                sends[(e.rank, e.peer)].append(e)
            elif e.op == "recv" and e.peer is not None:
                recvs[(e.peer, e.rank)].append(e)
        flow = 0
        for pair, sent in sends.items():
            for s_ev, r_ev in zip(sent, recvs.get(pair, [])):
                flow += 1
                out.append({"ph": "s", "id": flow, "name": "message", "cat": "message", "pid": s_ev.rank,
                            "tid": 1, "ts": us(s_ev.start)})
                out.append({"ph": "f", "bp": "e", "id": flow, "name": "message", "cat": "message",
                            "pid": r_ev.rank, "tid": 1, "ts": us(max(r_ev.end, s_ev.start))})
        doc = {"traceEvents": out, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc


# ----------------------------------------------------------------------------------------------
# Per-process recorder.  One boolean decides whether anything is kept.

_events: list[Event] | None = None
_rank: int = 0
_status_sink: Callable[[str], None] | None = None
_depth = 0   # > 0 inside a span: the raw torch.distributed calls it makes are not recorded twice


def start(rank: int | None = None) -> None:
    """Start recording in this process (events of this rank are kept until :func:`stop`)."""
    global _events, _rank
    _events = []
    if rank is None:
        try:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_initialized() else 0
        except Exception:  # pragma: no cover - torch without distributed
            rank = 0
    _rank = rank


def stop() -> Trace:
    """Stop recording and return what was recorded."""
    global _events
    out = Trace(_events or [])
    _events = None
    return out


def is_recording() -> bool:
    return _events is not None


@contextmanager
def recording(rank: int | None = None) -> Iterator[Trace]:
    """``with recording() as tr: ...`` — ``tr`` holds the events once the block ends."""
    start(rank)
    tr = Trace()
    try:
        yield tr
    finally:
        tr.extend(stop())


def emit(op: str, *, peer: int | None = None, nbytes: int = 0, step: int | None = None,
         start: float | None = None, end: float | None = None, **meta: Any) -> None:
    """Record one event now (no-op when not recording)."""
    if _events is None:
        return
    now = time.perf_counter()
    _events.append(Event(_rank, op, peer, int(nbytes), step,
                         now if start is None else start, now if end is None else end, meta))


@contextmanager
def span(op: str, *, peer: int | None = None, nbytes: int = 0, step: int | None = None,
         **meta: Any) -> Iterator[dict[str, Any]]:
    """Time a block as one event.  Yields ``meta`` so the block can add to it (e.g. pairs).

    The block is also announced to the launcher as what this rank is doing, so a rank stuck
    inside it is reported by name.
    """
    global _depth
    if _status_sink is not None:
        set_status(describe(op, peer, step, meta))
    _depth += 1
    if _events is None:
        try:
            yield meta
        finally:
            _depth -= 1
            if _status_sink is not None:
                set_status("")
        return
    t0 = time.perf_counter()
    try:
        yield meta
    finally:
        _depth -= 1
        _events.append(Event(_rank, op, peer, int(nbytes), step, t0, time.perf_counter(), meta))
        if _status_sink is not None:
            set_status("")


@contextmanager
def quiet() -> Iterator[None]:
    """Inside this block, raw torch.distributed calls are not recorded (the caller records them)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def in_span() -> bool:
    return _depth > 0


def describe(op: str, peer: int | None, step: int | None, meta: dict[str, Any] | None = None) -> str:
    """Human words for an operation: ``"recv from rank 3 (step 2)"``."""
    words = op
    if peer is not None:
        words += {"send": " to", "recv": " from"}.get(op, " with") + f" rank {peer}"
    if step is not None:
        words += f" (step {step})"
    return words


# ----------------------------------------------------------------------------------------------
# Status channel for deadlock reports (set by the launcher in each rank).

def set_status_sink(sink: Callable[[str], None] | None) -> None:
    global _status_sink
    _status_sink = sink


def set_status(text: str) -> None:
    if _status_sink is not None:
        _status_sink(text)
