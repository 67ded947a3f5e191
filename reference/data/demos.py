"""The lecture 3 notebook's runs (recorded for the student release, see ``reference.recorded``).

    ddp_runs           one DataParallel backward per bucket setting, traced (the timeline widget),
                       and gradient accumulation with / without no_sync
    zero_memory        bytes held and bytes sent per step for DDP and ZeRO-1/2/3 at N = 1, 2, 4

Rank workers (``timeline_run``, ``no_sync_run``, ``zero_run``) are plain functions here so spawned ranks can import them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm, trace
from ..recorded import live_world, recordable

__all__ = ["ddp_runs", "zero_memory", "timeline_run", "no_sync_run", "zero_run", "SETTINGS", "layer_model"]


def layer_model(layers: int, width: int, dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    """``layers`` × (Linear(width, width), tanh): every layer one FSDP unit, one bucket-sized piece."""
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods).to(dtype)


def _trace_backward_compute(model: nn.Module) -> None:
    """A ``compute`` event per Linear's backward (layer index in meta), for the timeline."""
    import time
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for i, m in enumerate(linears):
        def pre(mod, grad_out, i=i):
            mod._t0 = time.perf_counter()

        def post(mod, grad_in, grad_out, i=i):
            trace.emit("compute", start=mod._t0, end=time.perf_counter(), layer=i, phase="backward")
        m.register_full_backward_pre_hook(pre)
        m.register_full_backward_hook(post)


def timeline_run(layers: int, width: int, rows: int, bucket_cap_mb: float, overlap: bool) -> list[list[str]]:
    """Rank worker: one forward + backward of :func:`layer_model` under DataParallel; returns the buckets."""
    from .ddp import DataParallel
    model = layer_model(layers, width)
    ddp = DataParallel(model, bucket_cap_mb=bucket_cap_mb, overlap=overlap)
    _trace_backward_compute(model)
    g = torch.Generator().manual_seed(comm.rank())
    x = torch.randn(rows, width, generator=g)
    loss = ddp(x).pow(2).mean()
    trace.emit("backward_start")
    loss.backward()
    trace.emit("backward_end")
    return [b.names for b in ddp.buckets]


def SETTINGS(width: int) -> dict[str, dict]:
    layer_mb = (width * width + width) * 4 / 2 ** 20
    return {"one bucket (25 MB)": dict(bucket_cap_mb=25.0, overlap=True),
            "2 layers per bucket": dict(bucket_cap_mb=2.05 * layer_mb, overlap=True),
            "1 tensor per bucket": dict(bucket_cap_mb=1e-6, overlap=True),
            "2 layers per bucket, overlap=False": dict(bucket_cap_mb=2.05 * layer_mb, overlap=False)}


def no_sync_run(accum: int, use_no_sync: bool) -> dict:
    """Rank worker: one step of gradient accumulation over ``accum`` micro-batches (TinyMLP, float64)."""
    from .workers import train
    out = train("ddp", "mlp", "sgd", steps=1, accum=accum, skip_no_sync=not use_no_sync, return_grads=False)
    return out["params"]


@recordable("03.ddp_runs", needs=("3.2",))
def ddp_runs(world_size: int = 2, layers: int = 6, width: int = 256, rows: int = 256, repeats: int = 2,
             accum: int = 4, world=None) -> dict:
    """The DataParallel runs of the notebook, on one world of ``world_size`` ranks.

    "timelines": {setting: {"trace": one traced backward (times from 0, after ``repeats`` − 1
    warm-ups), "buckets": rank 0's bucket layout}} for each of :func:`SETTINGS`;
    "no_sync": gradient accumulation over ``accum`` micro-batches with and without ``no_sync``:
    the gradient all-reduce bytes of rank 0, and the largest parameter difference between the two.
    """
    from ..trace import Trace
    timelines, no_sync = {}, {}
    with live_world(world_size, {world_size: world} if world is not None else None) as world:
        for label, kw in SETTINGS(width).items():
            for _ in range(repeats):
                res = world.run(timeline_run, layers, width, rows, kw["bucket_cap_mb"], kw["overlap"])
            keep = Trace(e for e in res.trace if e.op in ("compute", "grad_ready", "backward_start", "backward_end")
                         or (e.op == "all_reduce" and e.meta.get("what") == "grads"))
            timelines[label] = {"trace": keep.relative(), "buckets": res.values[0]}
        params = {}
        for use in (True, False):
            res = world.run(no_sync_run, accum, use)
            no_sync[use] = sum(e.nbytes for e in res.trace.filter("all_reduce", rank=0, what="grads"))
            params[use] = res.values[0]
        diff = max(float((params[True][n] - params[False][n]).abs().max()) for n in params[True])
    return {"timelines": timelines, "no_sync": {"accum": accum, "bytes_with": no_sync[True],
                                                "bytes_without": no_sync[False], "max_param_diff": diff}}


# ----------------------------------------------------------------------------------------------
# Memory and bytes of DDP and ZeRO-1/2/3, N = 1, 2, 4 in one world of 4 (subgroups of size N)


def zero_run(sizes: tuple[int, ...], layers: int, width: int, rows: int) -> list[dict]:
    """Rank worker: for each N in ``sizes`` (the world split into groups of N ranks) and each method,
    one AdamW step on :func:`layer_model` in float32; returns the memory report after the step and
    this rank's ring bytes of the step, per (method, N)."""
    from .ddp import DataParallel
    from .fsdp import FullyShardedDataParallel
    from .zero import ZeroOptimizer
    W, r = comm.world_size(), comm.rank()
    groups = {}
    for N in sizes:
        for start in range(0, W, N):
            g = comm.new_group(list(range(start, start + N)))
            if start <= r < start + N:
                groups[N] = g
    rows_out = []
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(r))
    for N in sizes:
        for method in ("ddp", "zero1", "zero2", "zero3"):
            model = layer_model(layers, width)
            if method == "ddp":
                wrapped = DataParallel(model, group=groups[N])
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            elif method == "zero3":
                wrapped = FullyShardedDataParallel(model, group=groups[N])
                opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            else:
                wrapped = model
                opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=int(method[-1]), group=groups[N],
                                    lr=1e-3)
            start = len(trace._events or [])
            F.mse_loss(wrapped(x), x).backward()
            opt.step()
            mem = (opt.memory_report() if method in ("zero1", "zero2") else wrapped.memory_report(opt))
            step_events = (trace._events or [])[start:]
            sent = sum(e.meta.get("ring_bytes", 0) for e in step_events
                       if e.op in ("all_reduce", "reduce_scatter", "all_gather") and e.meta.get("what") in ("grads", "params"))
            rows_out.append({"method": method, "N": N, **{k: v for k, v in mem.items() if k != "total"},
                             "ring_bytes": sent})
    return rows_out


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
