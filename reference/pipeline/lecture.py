"""Lecture 4b's demos: what notebook 04b runs, recorded from the reference for the student release.

Each function below starts (or reuses) worlds, runs the reference pipeline on real ranks and
returns plain data — traces, errors against one process, measured bubbles, bytes (the activations a
stage holds at its peak, the messages across each stage boundary) — so the notebook cells
stay short and the release can replay them before exercises 4.4–4.6 are done
(:mod:`reference.notebook.recorded`).  The grader's ground truth for 4.6 is here too (:func:`slot_bubble`).
"""
from __future__ import annotations

import time

from ..notebook.recorded import live_world, recordable
from . import workers
from .beyond import breadth_first, clock, gradients_final
from .executor import actions_from_trace, peak_stashed_from_trace, wall_clock_bubble
from .oracles import single_process_truth
from .schedules import measured_bubble, peak_stash, render, schedule, simulate

NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def slot_bubble(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a schedule measured in slots: its order run by :func:`.simulate` (every
    F, B, W one slot).  The value exercise 4.6's formula must give."""
    return measured_bubble(simulate(schedule(name, num_stages, num_microbatches, virtual_stages=virtual_stages)))


def possible(name: str, p: int, m: int, v: int = 2) -> bool:
    """Whether ``schedule(name, p, m)`` exists (1F1B-like orders need m ≥ p; interleaved m % p == 0)."""
    if name in ("1f1b", "zb_h1"):
        return m >= p
    if name == "interleaved_1f1b":
        return m % p == 0 and p > 1
    return True


def _grad_error(values: list[dict], truth: dict) -> float:
    got = {n: g for v in values for n, g in v["grads"].items()}
    return max(float((got[n] - truth["grads"][n]).abs().max()) for n in truth["grads"])


@recordable("04b.runs", needs=("4.4", "4.5"), ignore=("worlds",))
def schedule_runs(sizes: tuple = (2, 4), num_microbatches: tuple = (1, 4, 8), worlds: dict | None = None) -> dict:
    """Every schedule that exists for p in ``sizes`` and m in ``num_microbatches`` (interleaved: v = 2),
    one float64 step each: {(name, p, m): {"trace", "grad_error" (max |grad − one process|),
    "loss_error", "peak" (stashed micro-batches per rank, from the trace), "slot_bubble" (rebuilt
    from the order the trace shows), "wall_bubble", "messages" (sends per rank)}}."""
    runs = {}
    for p in sizes:
        with live_world(p, worlds) as w:
            for name in NAMES:
                v = 2 if name == "interleaved_1f1b" else 1
                for m in num_microbatches:
                    if not possible(name, p, m):
                        continue
                    res = w.run(workers.pipeline_worker, name, m, virtual_stages=v)
                    truth = single_process_truth(m, num_stages=p, virtual_stages=v)
                    loss = next(x["loss"] for x in res.values if x["loss"] is not None)
                    runs[(name, p, m)] = {
                        "trace": res.trace, "virtual_stages": v,
                        "grad_error": _grad_error(res.values, truth), "loss_error": abs(loss - truth["loss"]),
                        "peak": [peak_stashed_from_trace(res.trace).get(r, 0) for r in range(p)],
                        "slot_bubble": measured_bubble(simulate(actions_from_trace(res.trace, p))),
                        "wall_bubble": wall_clock_bubble(res.trace),
                        "messages": [len(res.trace.filter(op="send", rank=r)) for r in range(p)]}
    return runs


@recordable("04b.orders", needs=("4.4",))
def orders(cases: tuple = (("gpipe", 4, 1), ("gpipe", 4, 8), ("1f1b", 4, 8), ("zb_h1", 4, 8))) -> dict:
    """Each (name, p, m) order drawn in slots by :func:`.schedules.render` ("." = idle)."""
    return {c: render(schedule(*c), width=3) for c in cases}


@recordable("04b.formulas", needs=("4.6",))
def formulas(sizes: tuple = (2, 3, 4, 8, 16), max_microbatches: int = 128) -> dict:
    """``bubble_fraction`` for every schedule that exists with p in ``sizes``, 1 ≤ m ≤ ``max_microbatches``
    (interleaved: v = 2 and 4): {(name, p, m, v): idle fraction}."""
    from .schedules import bubble_fraction
    out = {}
    for p in sizes:
        for m in range(1, max_microbatches + 1):
            for name in NAMES:
                for v in ((2, 4) if name == "interleaved_1f1b" else (1,)):
                    if possible(name, p, m):
                        out[(name, p, m, v)] = bubble_fraction(name, p, m, virtual_stages=v)
    return out


@recordable("04b.timed", needs=("4.4", "4.5"), ignore=("worlds",))
def timed_runs(p: int = 2, m: int = 8, width: int = 192, layers: int = 8, repeats: int = 3,
               worlds: dict | None = None) -> dict:
    """GPipe and 1F1B with enough work per block to see time, ``repeats`` steps each, taken in turns
    (GPipe, 1F1B, GPipe, …) so that both meet the same load: {name: {"trace" (the fastest step's),
    "seconds" (the fastest), "all_seconds", "wall_bubbles" (every step's idle fraction in wall clock)}}."""
    out = {name: {"all_seconds": [], "wall_bubbles": []} for name in ("gpipe", "1f1b")}
    best: dict = {}
    with live_world(p, worlds) as w:
        for _ in range(repeats):
            for name in out:
                t0 = time.perf_counter()
                res = w.run(workers.pipeline_worker, name, m, layers=layers, width=width, batch=16 * m,
                            dtype="float32")
                took = time.perf_counter() - t0
                out[name]["all_seconds"].append(took)
                out[name]["wall_bubbles"].append(wall_clock_bubble(res.trace))
                if name not in best or took < best[name][0]:
                    best[name] = (took, res.trace)
    for name, (took, trace) in best.items():
        out[name].update(trace=trace, seconds=took)
    return out


def torch_flexible_interleaved(p: int = 2, m: int = 3, worlds: dict | None = None) -> dict:
    """torch's ``ScheduleInterleaved1F1B`` (v = 2) with m not a multiple of p — which Megatron's original
    schedule, and this course's, refuse — one float64 step on ``p`` ranks beside one process: {"order" (its
    plan as our actions), "grad_error", "rounds" (max(1, m // p), torch's micro-batch groups)}."""
    truth = single_process_truth(m, num_stages=p, virtual_stages=2)
    with live_world(p, worlds) as w:
        res = w.run(workers.torch_pipeline_worker, "interleaved_1f1b", m, virtual_stages=2)
    return {"order": res.values[0]["order"], "grad_error": _grad_error(res.values, truth), "rounds": max(1, m // p)}


@recordable("04b.vs_torch", needs=("4.4", "4.5"), ignore=("worlds",))
def against_torch(p: int = 2, m: int = 4, worlds: dict | None = None) -> dict:
    """Ours and ``torch.distributed.pipelining`` on the same model, split and micro-batches:
    {name: {"loss_diff", "grad_diff", "same_order"}} for GPipe, 1F1B and interleaved 1F1B."""
    out = {}
    with live_world(p, worlds) as w:
        for name in ("gpipe", "1f1b", "interleaved_1f1b"):
            v = 2 if name == "interleaved_1f1b" else 1
            ours = w.run(workers.pipeline_worker, name, m, virtual_stages=v)
            peer = w.run(workers.torch_pipeline_worker, name, m, virtual_stages=v)
            lo = next(x["loss"] for x in ours.values if x["loss"] is not None)
            lt = next(x["loss"] for x in peer.values if x["loss"] is not None)
            g_ours = {n: g for x in ours.values for n, g in x["grads"].items()}
            g_peer = {n: g for x in peer.values for n, g in x["grads"].items()}
            out[name] = {"loss_diff": abs(lo - lt),
                         "grad_diff": max(float((g_ours[n] - g_peer[n]).abs().max()) for n in g_ours),
                         "same_order": [x["executed"] for x in peer.values] == actions_from_trace(ours.trace, p)}
    return out


# ----------------------------------------------------------------------------------------------
# Bytes: activation memory per stage and messages per stage boundary


def in_flight(name: str, p: int, m: int, stage: int, v: int = 1) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak (with interleaving: chunk-micro-batches,
    each of L/(p·v) layers): GPipe m; 1F1B min(m, p − s), its warm-up plus the steady state's first
    forward; interleaved 1F1B min(v·m, (v − 1)·p + 2·(p − s − 1) + 1), Megatron-LM's warm-up plus one —
    on stage 0, v·p + p − 1 chunks of L/(p·v) layers: L·(1 + (p − 1)/(p·v)) layers' worth
    (Korthikanti et al. 2022, §4.2.3)."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - stage)
    if name == "interleaved_1f1b":
        return min(v * m, (v - 1) * p + 2 * (p - stage - 1) + 1)
    raise ValueError(f"no in-flight formula for {name!r}")


def stage_bytes_formula(name: str, p: int, m: int, v: int, layers: int, width: int, rows: int,
                        bytes_per_value: int = 8) -> list[int]:
    """Peak saved activation bytes of each stage for :func:`.workers.memory_worker`'s model: the
    micro-batches in flight × the chunk's L/(p·v) blocks × 2 tensors of rows × width values each."""
    per_block = 2 * rows * width * bytes_per_value
    return [in_flight(name, p, m, s, v) * layers // (p * v) * per_block for s in range(p)]


def boundary_bytes(trace) -> dict[tuple[int, int], dict[str, int]]:
    """Bytes the trace's sends carried across each stage boundary (k, k + 1), by kind: "activation"
    (k → k + 1) and "gradient" (k + 1 → k); the one-off shape hand-shake ("shape") apart."""
    out: dict[tuple[int, int], dict[str, int]] = {}
    for e in trace.filter(op="send"):
        what, a, b = e.meta.get("what"), e.meta.get("stage"), e.meta.get("peer_stage")
        if a is None or b is None:
            continue
        cell = out.setdefault((min(a, b), max(a, b)), {"activation": 0, "gradient": 0, "shape": 0})
        cell[what] = cell.get(what, 0) + e.nbytes
    return dict(sorted(out.items()))


@recordable("04b.bytes", needs=("4.4", "4.5"), ignore=("worlds",))
def stage_bytes(p: int = 4, m: int = 8, layers: int = 8, width: int = 16, rows: int = 2,
                worlds: dict | None = None) -> dict:
    """GPipe, 1F1B and interleaved 1F1B (v = 2) on ``p`` ranks, one float64 step each of
    :func:`.workers.memory_worker` (``layers`` blocks of ``width``, ``rows`` rows per micro-batch, ``m``
    micro-batches): {"p", "m", "layers", "width", "rows", "runs": {name: {"virtual_stages", "peak"
    (measured peak saved activation bytes per rank), "formula" (:func:`stage_bytes_formula`),
    "in_flight" (per rank), "boundaries" (:func:`boundary_bytes`)}}}."""
    runs = {}
    with live_world(p, worlds) as w:
        for name in ("gpipe", "1f1b", "interleaved_1f1b"):
            v = 2 if name == "interleaved_1f1b" else 1
            res = w.run(workers.memory_worker, name, m, virtual_stages=v, layers=layers, width=width, rows=rows)
            runs[name] = {"virtual_stages": v, "peak": [x["peak"] for x in res.values],
                          "formula": stage_bytes_formula(name, p, m, v, layers, width, rows),
                          "in_flight": [in_flight(name, p, m, s, v) for s in range(p)],
                          "boundaries": boundary_bytes(res.trace)}
    return {"p": p, "m": m, "layers": layers, "width": width, "rows": rows, "runs": runs}


# ----------------------------------------------------------------------------------------------
# Beyond ZB-H1: production's newer schedules, run by torch.distributed.pipelining, laid out by the simulator

BEYOND = ("breadth_first", "zb_v", "dualpipe_v")


@recordable("04b.beyond", needs=("4.4",), ignore=("worlds",))
def beyond(p: int = 4, m: int = 8, worlds: dict | None = None) -> dict:
    """§8 in one call: {"runs": :func:`beyond_runs` (torch's newer schedules on ``p`` ranks), "clock":
    :func:`on_one_clock` (those and the lecture's own schedules on one clock — 1F1B's and ZB-H1's orders are
    exercise 4.4's, hence the recording in the student release)}."""
    runs = beyond_runs(p, m, worlds)
    return {"runs": runs, "clock": on_one_clock(runs, p, m)}


def beyond_runs(p: int = 4, m: int = 8, worlds: dict | None = None) -> dict:
    """torch's breadth-first, ZB-V and DualPipeV schedules (two chunks per rank) on ``p`` real ranks, one
    float64 step each beside one process: {name: {"order" (torch's plan as our actions, a full backward as
    B then W), "full_backwards", "overlapped" ((rank, F, B) pairs), "placement", "grad_error", "loss_error",
    "ran_as_planned" (every rank ran its plan's F, B, W in order)}}; breadth-first's also "ours" (whether
    :func:`.beyond.breadth_first` states the same order).  Nothing here runs an exercise's code."""
    out = {}
    truth = single_process_truth(m, num_stages=p, virtual_stages=2)
    with live_world(p, worlds) as w:
        for name in BEYOND:
            res = w.run(workers.torch_pipeline_worker, name, m, virtual_stages=2)
            plan = res.values[0]
            loss = next(x["loss"] for x in res.values if x["loss"] is not None)
            out[name] = {"order": plan["order_split"], "full_backwards": plan["full_backwards"],
                         "overlapped": plan["overlapped"], "placement": plan["placement"],
                         "grad_error": _grad_error(res.values, truth), "loss_error": abs(loss - truth["loss"]),
                         "ran_as_planned": [x["executed"] for x in res.values] == plan["order"]}
            if name == "breadth_first":
                out[name]["ours"] = [breadth_first(p, m, 2, r) for r in range(p)] == plan["order"]
    return out


def on_one_clock(beyond: dict, p: int = 4, m: int = 8) -> dict:
    """Every schedule of the lecture at ``p``, ``m`` (interleaved and breadth-first: v = 2) on one clock — F = B =
    W = 1 slot, a full backward 2 (:func:`.beyond.clock`): {name: {"order", "placement", "full_backwards" (what
    :func:`.beyond.clock` needs besides the order), "bubble" (slot idle fraction), "peak" (activations held at once
    per rank, in micro-batches through one rank's share of the layers), "final" (:func:`.beyond.gradients_final`)}}.
    ``beyond``: :func:`beyond_runs`' result."""
    cases = {"1f1b": (schedule("1f1b", p, m), "loop", (), 1),
             "interleaved_1f1b": (schedule("interleaved_1f1b", p, m, virtual_stages=2), "loop", (), 2),
             "zb_h1": (schedule("zb_h1", p, m), "loop", (), 1)}
    cases.update({n: (r["order"], r["placement"], r["full_backwards"], 2) for n, r in beyond.items()})
    out = {}
    for name, (order, placement, full, v) in cases.items():
        cost = clock(order, full)
        out[name] = {"order": order, "placement": placement, "full_backwards": list(full),
                     "bubble": measured_bubble(simulate(order, cost=cost, placement=placement)),
                     "peak": [n / v for n in peak_stash(order)],
                     "final": gradients_final(order, cost=cost, placement=placement)}
    return out
