"""The backward / all-reduce timeline of lecture 3: buckets and overlap, replayed from a real run.

Pure part — :func:`timeline_state` ``(trace, step) -> dict``: the trace of one DataParallel
backward (``compute`` events per layer, ``grad_ready`` per parameter, one ``all_reduce`` per
bucket from post to wait) cut at time ``t = (step + 1)/n_steps`` of the run.  Per rank: the blocks
started by then (clipped at t), and the figures of the whole run: backward time, communication
time, how much of it hid behind backward, and the exposed tail (communication after backward).

Drawing — :func:`draw_timeline`: two lanes per rank (backward layers; bucket all-reduces), a
cursor at t.  :func:`timeline_player` puts them in the course's :class:`Player` with a dropdown of
the settings (one bucket, small buckets, no overlap, ...).
"""
from __future__ import annotations

from typing import Any

__all__ = ["timeline_state", "timeline_stats", "step_exposed", "step_time", "thread_cpu", "draw_timeline",
           "timeline_caption", "timeline_player"]

N_STEPS = 24


def _get(e, key):
    return e[key] if isinstance(e, dict) else getattr(e, key)


def _meta(e) -> dict:
    return _get(e, "meta") or {}


def timeline_stats(trace) -> dict[int, dict[str, float]]:
    """Per rank, over the whole run (seconds): backward start/end, all-reduce busy time, the part of
    it inside backward (hidden), and the exposed tail (last all-reduce end − backward end, ≥ 0)."""
    out = {}
    for r in sorted({_get(e, "rank") for e in trace}):
        mine = [e for e in trace if _get(e, "rank") == r]
        comp = [e for e in mine if _get(e, "op") == "compute"]
        ars = [e for e in mine if _get(e, "op") == "all_reduce"]
        marks = {_get(e, "op"): _get(e, "start") for e in mine if _get(e, "op") in ("backward_start", "backward_end")}
        b0 = marks.get("backward_start", min((_get(e, "start") for e in comp), default=0.0))
        b1 = max([_get(e, "end") for e in comp] + [_get(e, "start") for e in mine if _get(e, "op") == "grad_ready"],
                 default=b0)
        # the union of all-reduce intervals (several may be in flight at once)
        spans = sorted((_get(e, "start"), _get(e, "end")) for e in ars)
        merged: list[list[float]] = []
        for s, t in spans:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], t)
            else:
                merged.append([s, t])
        busy = sum(t - s for s, t in merged)
        hidden = sum(max(0.0, min(t, b1) - max(s, b0)) for s, t in merged)
        end = max((t for _, t in merged), default=b1)
        out[r] = {"backward_start": b0, "backward_end": b1, "comm_busy": busy, "hidden": hidden,
                  "hidden_fraction": hidden / busy if busy > 0 else 0.0, "exposed": max(0.0, end - b1),
                  "end": max(end, b1), "buckets": len(ars)}
    return out


def step_exposed(trace) -> float:
    """The step's exposed communication (seconds): from the moment the *last* rank finishes backward to the
    end of the last all-reduce on any rank.  A rank's own tail (``timeline_stats``' "exposed") also counts the
    time it waits for a peer that started backward later; this is what the step pays for communication."""
    return _step_tail(timeline_stats(trace))


def step_time(trace) -> dict[str, float]:
    """What the step pays (seconds), the backward and its exposed tail added up:

        backward   from the first rank's start of backward to the last rank's end of it
        exposed    :func:`step_exposed`: communication still running after that
        step       backward + exposed — the figure overlap must shorten to be worth it

    Overlap shortens the tail; it pays only if the backward does not grow by more (on a CPU the communication
    runs on the cores the backward computes on)."""
    stats = timeline_stats(trace)
    if not stats:
        return {"backward": 0.0, "exposed": 0.0, "step": 0.0}
    backward = max(s["backward_end"] for s in stats.values()) - min(s["backward_start"] for s in stats.values())
    exposed = _step_tail(stats)
    return {"backward": backward, "exposed": exposed, "step": backward + exposed}


def thread_cpu(trace) -> dict[str, float] | None:
    """CPU seconds the backward used per rank, by role, averaged over ranks: {"compute", "communication"} from
    the ``thread_cpu`` events a traced backward leaves (``reference.data.workers``), None without them."""
    rows = [_meta(e) for e in trace if _get(e, "op") == "thread_cpu"]
    if not rows:
        return None
    return {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in ("compute", "communication")}


def _step_tail(stats: dict) -> float:
    if not stats:
        return 0.0
    return max(0.0, max(s["end"] for s in stats.values()) - max(s["backward_end"] for s in stats.values()))


def timeline_state(trace, step: int, n_steps: int = N_STEPS) -> dict[str, Any]:
    """What the timeline shows at ``step`` (0 … n_steps−1): everything up to t = (step+1)/n_steps of the run."""
    events = [e for e in trace if _get(e, "op") in ("compute", "all_reduce", "grad_ready")]
    if not events:
        return {"ranks": [], "t": 0.0, "t_end": 0.0, "compute": [], "comm": [], "ready": [], "stats": {},
                "message": "this trace has no compute or all_reduce events: record a DataParallel backward"}
    stats = timeline_stats(trace)
    t0 = min(_get(e, "start") for e in events)
    t_end = max(max(_get(e, "end") for e in events), max(s["end"] for s in stats.values())) - t0
    step = max(0, min(step, n_steps - 1))
    t = t_end * (step + 1) / n_steps
    compute, comm, ready = [], [], []
    for e in events:
        s, f = _get(e, "start") - t0, _get(e, "end") - t0
        if s > t:
            continue
        row = {"rank": _get(e, "rank"), "start": s, "end": min(f, t), "done": f <= t}
        if _get(e, "op") == "compute":
            compute.append({**row, "layer": _meta(e).get("layer")})
        elif _get(e, "op") == "all_reduce":
            comm.append({**row, "bucket": _meta(e).get("bucket"), "nbytes": _get(e, "nbytes")})
        else:
            ready.append({**row, "bucket": _meta(e).get("bucket")})
    return {"ranks": sorted(stats), "t": t, "t_end": t_end, "compute": compute, "comm": comm, "ready": ready,
            "stats": {r: {k: (v - t0 if k in ("backward_start", "backward_end", "end") else v) for k, v in s.items()}
                      for r, s in stats.items()},
            "in_flight": sum(1 for c in comm if not c["done"]), "message": "",
            "step_exposed": _step_tail(stats)}


def timeline_caption(state: dict) -> str:
    if state["message"]:
        return state["message"]
    s = state["stats"][state["ranks"][0]]
    return (f"t = {state['t'] * 1e3:.1f} ms: {state['in_flight']} all-reduce(s) in flight on rank {state['ranks'][0]}. "
            f"Whole run: backward {1e3 * (s['backward_end'] - s['backward_start']):.1f} ms, {s['buckets']} bucket(s), "
            f"{100 * s['hidden_fraction']:.0f}% of all-reduce time hidden behind backward; the step's exposed tail "
            f"(after the last rank's backward) {1e3 * state['step_exposed']:.1f} ms.")


def draw_timeline(fig, state: dict) -> None:
    ax = fig.add_subplot(111)
    if state["message"]:
        ax.text(0.5, 0.5, state["message"], ha="center", va="center")
        ax.set_axis_off()
        return
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    ranks = state["ranks"]
    lanes = {}
    for i, r in enumerate(ranks):
        lanes[(r, "compute")] = 2 * (len(ranks) - 1 - i) + 1
        lanes[(r, "comm")] = 2 * (len(ranks) - 1 - i)
    ms = 1e3
    for c in state["compute"]:
        y = lanes[(c["rank"], "compute")]
        ax.barh(y, (c["end"] - c["start"]) * ms, left=c["start"] * ms, height=0.7, color="#9bb7d4",
                edgecolor="#33506e", alpha=1.0 if c["done"] else 0.6)
        if c["done"] and c["layer"] is not None:
            ax.text((c["start"] + c["end"]) / 2 * ms, y, str(c["layer"]), ha="center", va="center", fontsize=7)
    for c in state["comm"]:
        y = lanes[(c["rank"], "comm")]
        color = cmap((c["bucket"] or 0) % 10)
        ax.barh(y, max((c["end"] - c["start"]) * ms, 1e-3), left=c["start"] * ms, height=0.7, color=color,
                alpha=0.9 if c["done"] else 0.45, hatch=None if c["done"] else "//", edgecolor="k", linewidth=0.4)
        ax.text(c["start"] * ms, y + 0.38, f"b{c['bucket']}", fontsize=6, va="bottom")
    for g in state["ready"]:
        ax.plot([g["start"] * ms], [lanes[(g["rank"], "compute")] - 0.45], marker="|", color="k", markersize=5)
    for r in ranks:
        s = state["stats"][r]
        ax.axvline(s["backward_end"] * ms, color="#c0392b", lw=0.8, ls=":")
    ax.axvline(state["t"] * ms, color="k", lw=1.2)
    ax.set_yticks([lanes[k] for k in lanes], [f"rank {r} {'backward' if kind == 'compute' else 'all-reduce'}"
                                             for r, kind in lanes])
    ax.set_xlim(0, state["t_end"] * ms * 1.02)
    ax.set_xlabel("time (ms); dotted red: end of backward; | : a gradient ready")
    ax.set_title("backward layers (numbers: layer) and each bucket's all-reduce, from post to wait")


def timeline_player(runs: dict, setting: str | None = None, n_steps: int = N_STEPS):
    """A :class:`Player` over ``runs`` = {setting: {"trace": ...}} (from ``demos.bucket_timelines``)."""
    import ipywidgets as W

    from .player import Player
    labels = list(runs)
    setting = setting or labels[0]
    dropdown = W.Dropdown(options=labels, value=setting, description="buckets",
                          layout=W.Layout(width="30em"))   # the longest setting shows whole

    def build(setting):
        tr = runs[setting]["trace"]
        return (lambda step: timeline_state(tr, step, n_steps)), n_steps

    state_at, n = build(setting)
    return Player(state_at, n, draw_timeline, controls={"setting": dropdown}, rebuild=build, caption=timeline_caption,
                  figsize=(10, 3.8), title="DataParallel backward: buckets and overlap", static_step=n - 1)
