"""Chrome trace files drawn as one static timeline: the course's trace (``Trace.to_chrome``) and ``torch.profiler``'s
(``export_chrome_trace``) read the same way, for a notebook (which cannot embed Perfetto offline).

Pure part — :func:`chrome_lanes` ``(doc, shift_us) -> lanes``: one lane per (process, thread) that has complete
events (``"ph": "X"``), labelled from the file's metadata ("rank r" from a profiler's ``distributedInfo``, the
thread's name), holding its *top-level* events of non-zero length only (a profiler's ``aten::mm`` inside
``AddmmBackward0`` is left out, and so are instants), as (start ms, duration ms, name, is communication, level), times
in ms after ``shift_us``; events in flight together (a collective posted before the last one ended) take levels
0, 1, … of the lane.

Drawing — :func:`draw_lanes` paints lanes on an axis; :func:`side_by_side` puts two traces of the same run one
above the other on a shared time axis.
"""
from __future__ import annotations

from typing import Any

__all__ = ["COMM_WORDS", "is_communication", "chrome_lanes", "draw_lanes", "side_by_side"]

# An event is communication when its name says so: the course's ops, gloo's and NCCL's own names
COMM_WORDS = ("gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
              "all_to_all", "alltoall", "send", "recv", "barrier", "c10d::")


def is_communication(event: dict) -> bool:
    name = str(event.get("name", "")).lower()
    return event.get("cat") == "comm" or any(w in name for w in COMM_WORDS)


def _short(name: str) -> str:
    """'autograd::engine::evaluate_function: AddmmBackward0' -> 'AddmmBackward0'; 'all_reduce with 1' stays."""
    return name.rsplit(": ", 1)[-1]


def _name(e: dict) -> str:
    """An event's name, with the layer or bucket a course event carries in its meta."""
    name = str(e.get("name", ""))
    meta = (e.get("args") or {}).get("meta") or {}
    if isinstance(meta, dict):
        for key in ("layer", "bucket"):
            if meta.get(key) is not None:
                return f"{name} {key} {meta[key]}"
    return name


def chrome_lanes(doc: dict, shift_us: float = 0.0, window_ms: tuple[float, float] | None = None) -> list[dict]:
    """The lanes of one Chrome trace: [{"label", "pid", "tid", "levels", "events": [(start_ms, dur_ms, name,
    is_comm, level)]}], by process and thread (a profiler's main thread, tid = pid, first).  Only complete events
    of non-zero length in integer processes (a profiler's own "Spans" row is left out); only top-level events per
    thread (not inside another); events that overlap without nesting (collectives in flight together) get levels
    0, 1, … to be drawn apart; with ``window_ms`` only events overlapping it."""
    events = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    rank = (doc.get("distributedInfo") or {}).get("rank") if isinstance(doc, dict) else None
    procs: dict = {}
    threads: dict = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("name") == "thread_name":        # a profiler may name a thread twice: keep the specific name
            name = e["args"]["name"]
            if (e["pid"], e.get("tid")) not in threads or not name.endswith("(python)"):
                threads[(e["pid"], e.get("tid"))] = name
    by_lane: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and isinstance(e.get("pid"), int) and e.get("dur", 0) > 0:
            by_lane.setdefault((e["pid"], e.get("tid")), []).append(e)
    lanes = []
    main_first = rank is not None                      # a profiler's main thread has tid = pid
    order = lambda kv: (kv[0][0], main_first and kv[0][1] != kv[0][0], str(kv[0][1]))
    for (pid, tid), evs in sorted(by_lane.items(), key=order):
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        top: list[dict] = []
        for e in evs:                                  # top level: inside no event kept so far
            if not any(t["ts"] <= e["ts"] and e["ts"] + e["dur"] <= t["ts"] + t["dur"] for t in top[-8:]):
                top.append(e)
        rows = [((e["ts"] - shift_us) / 1e3, e["dur"] / 1e3, _name(e), is_communication(e)) for e in top]
        if window_ms is not None:
            rows = [r for r in rows if r[0] + r[1] >= window_ms[0] and r[0] <= window_ms[1]]
        if not rows:
            continue
        ends: list[float] = []                         # greedy levels: the first level free at the event's start
        placed = []
        for start, dur, name, comm in rows:
            level = next((i for i, end in enumerate(ends) if end <= start), len(ends))
            if level == len(ends):
                ends.append(0.0)
            ends[level] = start + dur
            placed.append((start, dur, name, comm, level))
        process = f"rank {rank}" if rank is not None else procs.get(pid, f"process {pid}")
        thread = threads.get((pid, tid), f"thread {tid}")
        if rank is not None:                          # a profiler's "thread 24815 (pt_gloo_runloop)"
            thread = "main thread" if tid == pid else thread.rsplit("(", 1)[-1].rstrip(")")
        lanes.append({"label": f"{process} · {thread}", "pid": pid, "tid": tid, "levels": len(ends),
                      "events": placed})
    return lanes


def draw_lanes(ax, lanes: list[dict], title: str = "", window_ms: tuple[float, float] | None = None,
               label_min_ms: float | None = None) -> None:
    """Each lane a row of bars (blue: compute, orange: communication), top lane first, its levels stacked inside
    the row; names on bars wide enough to hold them."""
    colors = {False: "#9bb7d4", True: "#f0a35e"}
    span = (window_ms[1] - window_ms[0]) if window_ms else max(
        (e[0] + e[1] for lane in lanes for e in lane["events"]), default=1.0)
    label_min_ms = span / 12 if label_min_ms is None else label_min_ms
    for i, lane in enumerate(lanes):
        y, h = len(lanes) - 1 - i, 0.8 / lane["levels"]
        for start, dur, name, comm, level in lane["events"]:
            yc = y + 0.4 - h * (level + 0.5)
            ax.barh(yc, max(dur, span / 2000), left=start, height=h * 0.9, color=colors[comm], edgecolor="#333333",
                    linewidth=0.3)
            if dur >= label_min_ms:
                ax.text(start + dur / 2, yc, _short(name)[:28], ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)), [lane["label"] for lane in reversed(lanes)], fontsize=7)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    if window_ms:
        ax.set_xlim(*window_ms)
    ax.set_title(title, fontsize=9)


def side_by_side(top: list[dict], bottom: list[dict], *, titles: tuple[str, str] = ("", ""),
                 window_ms: tuple[float, float] | None = None, figsize=(11, 5.6)) -> Any:
    """A matplotlib Figure: ``top`` lanes above ``bottom`` lanes, one time axis (ms)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    fig, axes = plt.subplots(2, 1, figsize=figsize, sharex=True,
                             gridspec_kw={"height_ratios": [max(len(top), 1), max(len(bottom), 1)]})
    draw_lanes(axes[0], top, titles[0], window_ms)
    draw_lanes(axes[1], bottom, titles[1], window_ms)
    axes[1].set_xlabel("ms")
    axes[0].legend(handles=[Patch(color="#9bb7d4", label="compute"), Patch(color="#f0a35e", label="communication")],
                   fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig
