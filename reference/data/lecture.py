"""The lecture 3 notebook's runs (recorded for the student release, see ``reference.notebook.recorded``).

    ddp_runs           one DataParallel backward per bucket setting, traced (the timeline widget),
                       and gradient accumulation with / without no_sync
    profiled_run       one of those backwards under torch.profiler too: the course's trace and the
                       profiler's, to write as Chrome trace files (write_chrome_traces) and draw side by side
    zero_memory        bytes held and bytes sent per step for DDP and ZeRO-1/2/3 at N = 1, 2, 4
    against_torch      DataParallel, ZeRO-1/2 and FSDP trained beside PyTorch's DistributedDataParallel,
                       ZeroRedundancyOptimizer and FSDP2 ``fully_shard``: the largest differences

Their rank functions (``timeline_run``, ``profiled_timeline_run``, ``no_sync_run``, ``zero_run``, ``train``) are
in :mod:`.workers`.
"""
from __future__ import annotations

from ..notebook.recorded import live_world, recordable
from .models import layer_model, make_model
from .workers import no_sync_run, profiled_timeline_run, timeline_run, train, zero_run

__all__ = ["ddp_runs", "ddp_story", "profiled_run", "write_chrome_traces", "chrome_lanes_of", "zero_memory",
           "against_torch", "PEERS", "SETTINGS"]

# what the timeline keeps of a traced backward: layers, gradients ready, its ends, CPU per thread, the buckets
TIMELINE_OPS = ("compute", "grad_ready", "backward_start", "backward_end", "thread_cpu")


def _timeline_events(trace):
    from ..trace import Trace
    return Trace(e for e in trace if e.op in TIMELINE_OPS or _gradient_all_reduce(e))


def SETTINGS(width: int) -> dict[str, dict]:
    layer_mb = (width * width + width) * 4 / 2 ** 20
    return {"one bucket (25 MB)": dict(bucket_cap_mb=25.0, overlap=True),
            "2 layers per bucket": dict(bucket_cap_mb=2.05 * layer_mb, overlap=True),
            "1 tensor per bucket": dict(bucket_cap_mb=1e-6, overlap=True),
            "2 layers per bucket, overlap=False": dict(bucket_cap_mb=2.05 * layer_mb, overlap=False)}


def ddp_story(runs: dict) -> list[str]:
    """How a ``ddp_runs`` result contradicts the notebook's text (empty if it does not): one bucket is
    posted after the last gradient, so it hides nothing; overlap off exposes at least what overlap on does."""
    from ..widgets.buckets import step_exposed, timeline_stats
    tl, broken = runs["timelines"], []
    one = timeline_stats(tl["one bucket (25 MB)"]["trace"])
    if max(s["hidden_fraction"] for s in one.values()) > 0.25:
        broken.append("one bucket hid part of its all-reduce behind backward")
    on = step_exposed(tl["2 layers per bucket"]["trace"])
    off = step_exposed(tl["2 layers per bucket, overlap=False"]["trace"])
    if off < on:
        broken.append(f"overlap off exposed less ({1e3 * off:.1f} ms) than overlap on ({1e3 * on:.1f} ms)")
    return broken


@recordable("03.ddp_runs", needs=("3.2",), timed=True, story=ddp_story)
def ddp_runs(world_size: int = 2, layers: int = 6, width: int = 512, rows: int = 256, repeats: int = 3,
             accum: int = 4, world=None) -> dict:
    """The DataParallel runs of the notebook, on one world of ``world_size`` ranks.

    "timelines": {setting: {"trace": the traced backward with the median exposed tail of ``repeats``
    (after one warm-up; times from 0), "buckets": rank 0's bucket layout}} for each of :func:`SETTINGS`;
    "no_sync": gradient accumulation over ``accum`` micro-batches with and without ``no_sync``:
    the gradient all-reduce bytes of rank 0, and the largest parameter difference between the two.
    """
    from ..widgets.buckets import step_exposed
    timelines, no_sync = {}, {}
    with live_world(world_size, {world_size: world} if world is not None else None) as world:
        for label, kw in SETTINGS(width).items():
            runs = []
            for i in range(1 + repeats):
                res = world.run(timeline_run, layers, width, rows, kw["bucket_cap_mb"], kw["overlap"])
                if i:   # the first is a warm-up
                    keep = _bucket_order(_timeline_events(res.trace).relative())
                    runs.append((step_exposed(keep), keep, res.values[0]))
            _, keep, buckets = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            timelines[label] = {"trace": keep, "buckets": buckets}
        params = {}
        for use in (True, False):
            res = world.run(no_sync_run, accum, use)
            no_sync[use] = sum(e.nbytes for e in res.trace.filter(rank=0) if _gradient_all_reduce(e))
            params[use] = res.values[0]
        diff = max(float((params[True][n] - params[False][n]).abs().max()) for n in params[True])
    return {"timelines": timelines, "no_sync": {"accum": accum, "bytes_with": no_sync[True],
                                                "bytes_without": no_sync[False], "max_param_diff": diff}}


def _gradient_all_reduce(e) -> bool:
    """A bucket's all-reduce: ``what="grads"``, or no ``what`` at all (a learner's 3.2 need not say; in these
    runs every all-reduce is a gradient bucket's)."""
    return e.op == "all_reduce" and e.meta.get("what", "grads") == "grads"


def _bucket_order(trace):
    """``trace`` with each gradient all-reduce that lacks ``meta["bucket"]`` numbered by the order its rank
    posted it in (buckets are posted strictly in order, on every rank alike)."""
    from dataclasses import replace

    from ..trace import Trace
    posted: dict[int, int] = {}
    out = []
    for e in sorted(trace, key=lambda e: e.start):
        if _gradient_all_reduce(e):
            index = posted[e.rank] = posted.get(e.rank, -1) + 1
            if "bucket" not in e.meta:
                e = replace(e, meta={**e.meta, "bucket": index})
        out.append(e)
    return Trace(out)


# ----------------------------------------------------------------------------------------------
# The same backward in a real profiler


@recordable("03.profiled_run", needs=("3.2",))
def profiled_run(world_size: int = 2, layers: int = 6, width: int = 512, rows: int = 256,
                 setting: str = "2 layers per bucket", world=None) -> dict:
    """One backward of :func:`ddp_runs`' ``setting`` (after a warm-up one), traced by the course and profiled by
    ``torch.profiler`` on every rank at once.

    Returns {"setting", "trace": the course's events of the step (times on the machine's monotonic clock),
    "profiles": each rank's ``export_chrome_trace`` as a dict, "offsets": per rank, seconds from the course's
    clock to its profiler's}."""
    kw = SETTINGS(width)[setting]
    with live_world(world_size, {world_size: world} if world is not None else None) as w:
        res = w.run(profiled_timeline_run, layers, width, rows, kw["bucket_cap_mb"], kw["overlap"])
    step = _timeline_events(res.trace)
    last = [e for e in step if e.op == "backward_start"]
    if last:      # the warm-up backward is in the trace too: keep the profiled one, after each rank's last start
        begin = {e.rank: e.start for e in last}
        step = type(step)(e for e in step if e.start >= begin[e.rank])
    return {"setting": setting, "trace": step, "profiles": [v["profile"] for v in res.values],
            "offsets": [v["offset"] for v in res.values]}


def write_chrome_traces(run: dict, folder=None) -> dict[str, str]:
    """Write :func:`profiled_run`'s two views of the step as Chrome trace files in ``folder`` (made if needed;
    default the course's ``build/03``):
    ``course_trace.json`` (``Trace.to_chrome``: a process per rank, compute and communication rows) and
    ``profiler_trace.json`` (every rank's ``torch.profiler`` trace in one file, a process per rank).  Both open
    in https://ui.perfetto.dev or chrome://tracing.  Returns {"course": path, "profiler": path}."""
    import json
    from pathlib import Path
    from ..notebook.recorded import ROOT
    folder = Path(folder) if folder is not None else ROOT / "build" / "03"
    folder.mkdir(parents=True, exist_ok=True)
    course = folder / "course_trace.json"
    run["trace"].to_chrome(str(course))
    merged = []
    for r, doc in enumerate(run["profiles"]):
        for e in doc["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "process_name" and isinstance(e.get("pid"), int):
                e = {**e, "args": {"name": f"rank {r} (pid {e['pid']})"}}
            merged.append(e)
    profiler = folder / "profiler_trace.json"
    with open(profiler, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return {"course": str(course), "profiler": str(profiler)}


def chrome_lanes_of(run: dict, pad_ms: float = 2.0) -> dict:
    """Both views of :func:`profiled_run` read back from their Chrome form as lanes (``widgets.chrome``), on one
    clock: ms from the first event of the course's trace (the backward; the profiler also shows the forward
    before it).  {"course", "profiler", "window": (start, end) ms}."""
    from ..widgets.chrome import chrome_lanes
    t0 = min(e.start for e in run["trace"])
    end_ms = (max(e.end for e in run["trace"]) - t0) * 1e3
    marks = [(e["ts"] / 1e6 - off - t0) * 1e3 for doc, off in zip(run["profiles"], run["offsets"])
             for e in doc["traceEvents"] if e.get("name") == "course: clock" and e.get("ph") == "X"]
    window = (min(marks + [0.0]) - pad_ms, end_ms + pad_ms)
    course = chrome_lanes(run["trace"].to_chrome(), window_ms=window)
    profiler = [lane for r, doc in enumerate(run["profiles"])
                for lane in chrome_lanes(doc, shift_us=(run["offsets"][r] + t0) * 1e6, window_ms=window)]
    return {"course": course, "profiler": profiler, "window": window}


# ----------------------------------------------------------------------------------------------
# Memory and bytes of DDP and ZeRO-1/2/3, N = 1, 2, 4 in one world of 4 (subgroups of size N)


@recordable("03.zero_memory", needs=("3.1", "3.2", "3.3", "3.4"))
def zero_memory(sizes: tuple = (1, 2, 4), layers: int = 4, width: int = 64, rows: int = 8, world=None) -> dict:
    """Bytes each rank holds after one step, and sends in it, for DDP and ZeRO-1/2/3 at each N.

    Returns {"psi": trainable elements, "rows": rank 0's rows (method, N, params, grads,
    optimizer_state, ring_bytes)}.
    """
    n = max(sizes)
    with live_world(n, {n: world} if world is not None else None) as world:
        res = world.run(zero_run, tuple(sizes), layers, width, rows)
    psi = sum(p.numel() for p in layer_model(layers, width).parameters())
    return {"psi": psi, "layers": layers, "rows": res.values[0]}


# ----------------------------------------------------------------------------------------------
# The course's wrappers beside PyTorch's own, on the same model, batches and optimizer

# (ours, its label, PyTorch's method in workers.wrap, its label).  PyTorch has no ZeRO-2 of its own on one node:
# ZeRO-2 is set beside DDP + ZeroRedundancyOptimizer, whose updates it must equal (only the gradient bytes held differ).
PEERS = (("ddp", "DataParallel", "torch_ddp", "DistributedDataParallel"),
         ("zero1", "ZeroOptimizer(stage=1)", "torch_zero1", "DDP + ZeroRedundancyOptimizer"),
         ("zero2", "ZeroOptimizer(stage=2)", "torch_zero1", "DDP + ZeroRedundancyOptimizer"),
         ("fsdp", "FullyShardedDataParallel", "torch_fsdp", "FSDP2 fully_shard"))


@recordable("03.vs_torch", needs=("3.2", "3.3", "3.4"))
def against_torch(world_size: int = 2, kind: str = "block", opt: str = "adamw", steps: int = 3,
                  world=None) -> dict:
    """Each pair of :data:`PEERS` trains the same seeded float64 model (``kind``: TinyBlock, with its
    tied and frozen parameters) for ``steps`` optimizer steps on ``world_size`` ranks, every rank on
    its own micro-batches (:func:`.workers.train`).

    Returns {"world_size", "kind", "opt", "steps", "numel" (trainable elements), "rows": one per pair
    {"ours", "peer", "max_param_diff" (max over ranks and parameters of |ours − PyTorch's| after the
    last step), "max_loss_diff" (max over ranks and steps of the loss difference), "losses" (rank 0's
    losses, ours)}}."""
    methods = sorted({m for ours, _, peer, _ in PEERS for m in (ours, peer)})
    with live_world(world_size, {world_size: world} if world is not None else None) as w:
        runs = {m: w.run(train, m, kind, opt, steps=steps, return_grads=False).values for m in methods}
    rows = []
    for ours, ours_label, peer, peer_label in PEERS:
        a, b = runs[ours], runs[peer]
        rows.append({"ours": ours_label, "peer": peer_label,
                     "max_param_diff": max(float((a[r]["params"][n] - t).abs().max())
                                           for r in range(world_size) for n, t in b[r]["params"].items()),
                     "max_loss_diff": max(abs(x - y) for r in range(world_size)
                                          for x, y in zip(a[r]["losses"], b[r]["losses"])),
                     "losses": a[0]["losses"]})
    model = make_model(kind)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"world_size": world_size, "kind": kind, "opt": opt, "steps": steps, "numel": numel, "rows": rows}
