"""Rank functions of lecture 3: one training run per call (tests, the grader, the benchmark), and
the rank side of the notebook's runs (:mod:`.lecture`: a traced backward, gradient accumulation,
the memory and bytes of DDP and ZeRO-1/2/3).

:func:`train` runs ``steps`` optimizer steps of a seeded model with one of the course's
implementations ("ddp", "zero1", "zero2", "fsdp"), PyTorch's ("torch_ddp", "torch_zero1" =
DistributedDataParallel + ZeroRedundancyOptimizer, "torch_fsdp" = FSDP2 ``fully_shard``), or in
one process on the whole batch ("single", the ground truth).  Rank r's micro-batch of step s,
micro-step m comes from :func:`batch`; the single process concatenates every rank's.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm, trace
from ..cpu_time import thread_cpu_seconds
from .models import layer_model, make_model

__all__ = ["batch", "wrap", "train", "OPTIMIZERS"]

OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
              "plain_sgd": (torch.optim.SGD, dict(lr=0.5))}     # update = −0.5·gradient: shows which shard moved


def batch(kind: str, seed: int, step: int, micro: int, rank: int, rows: int = 2, scale: float = 1.0,
          dtype=torch.float64, d: int | None = None, seq: int = 4):
    """Rank ``rank``'s (x, y) for one micro-step: x ~ N(0, scale²), y ~ N(0, 1)."""
    g = torch.Generator().manual_seed((1_000_003 * seed + 10_007 * step + 101 * micro + rank) % 2 ** 63)
    d = d or {"mlp": 6, "block": 8}[kind]
    shape = (rows, d) if kind == "mlp" else (rows, seq, d)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype), \
        torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _loss(model, x, y, accum: int):
    return F.mse_loss(model(x), y) / accum


def wrap(method: str, model: torch.nn.Module, opt_cls, opt_kw: dict, *, bucket_cap_mb: float = 25.0,
         overlap: bool = True, fsdp_units=()) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` made data parallel by ``method``, and its optimizer: the course's ("ddp", "zero1",
    "zero2", "fsdp"), PyTorch's ("torch_ddp", "torch_zero1" = DDP + ZeroRedundancyOptimizer,
    "torch_fsdp" = FSDP2 ``fully_shard`` on each of ``fsdp_units``, then the whole), or "single" (as is)."""
    wrapped, optimizer = model, None
    if method == "ddp":
        from .ddp import DataParallel
        wrapped = DataParallel(model, bucket_cap_mb=bucket_cap_mb, overlap=overlap)
    elif method in ("zero1", "zero2"):
        from .zero import ZeroOptimizer
        optimizer = ZeroOptimizer(model.parameters(), opt_cls, stage=int(method[-1]), **opt_kw)
    elif method == "fsdp":
        from .fsdp import FullyShardedDataParallel
        wrapped = FullyShardedDataParallel(model)
    elif method in ("torch_ddp", "torch_zero1"):
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        if method == "torch_zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=opt_cls, **opt_kw)
    elif method == "torch_fsdp":
        import warnings

        from torch.distributed.fsdp import fully_shard
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        for unit in fsdp_units:
            fully_shard(unit)
        fully_shard(model)
    elif method != "single":
        raise ValueError(f"unknown method {method!r}")
    if optimizer is None:
        optimizer = opt_cls([p for p in wrapped.parameters() if p.requires_grad], **opt_kw)
    return wrapped, optimizer


def train(method: str, kind: str = "mlp", opt: str = "adamw", *, steps: int = 3, accum: int = 1, scale: float = 1.0,
          seed: int = 0, world_size: int | None = None, rows: int = 2, bucket_cap_mb: float = 25.0,
          overlap: bool = True, skip_no_sync: bool = False, dtype=torch.float64, model_kw: dict | None = None,
          return_grads: bool = True, data_seed: int | Sequence[int] | None = None) -> dict:
    """Train and return {"params": {name: tensor}, "grads": first step's synced grads (by name, where
    the method keeps whole gradients), "memory": memory_report after the last step (course methods),
    "losses": this rank's loss of each step (its micro-batches' losses ÷ accum, summed)}.

    ``seed`` makes the model (the same on every rank); the micro-batches come from ``seed`` and the
    rank, or, with ``data_seed``, from a seed of each rank's own: this rank's (an int) in a parallel
    run, every rank's (a list) for ``"single"`` — then no rank can make another rank's batches."""
    W = world_size or comm.world_size()
    r = comm.rank()

    def rank_batch(q: int, step: int, m: int):
        if data_seed is None:
            return batch(kind, seed, step, m, q, rows, scale, dtype)
        own = data_seed[q] if method == "single" else data_seed
        return batch(kind, own, step, m, 0, rows, scale, dtype)
    model = make_model(kind, seed, dtype, **(model_kw or {}))
    names = [n for n, _ in model.named_parameters()]
    opt_cls, opt_kw = OPTIMIZERS[opt]
    units = [getattr(model, c) for c in (["hidden", "proj"] if kind == "mlp" else ["qkv", "attn_out", "mlp"])]
    wrapped, optimizer = wrap(method, model, opt_cls, opt_kw, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
                              fsdp_units=units)
    memory = None
    grads, losses = {}, []
    for step in range(steps):
        losses.append(0.0)
        for m in range(accum):
            if method == "single":
                parts = [rank_batch(q, step, m) for q in range(W)]
                x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            else:
                x, y = rank_batch(r, step, m)
            quiet = m < accum - 1 and not skip_no_sync and hasattr(wrapped, "no_sync")
            with wrapped.no_sync() if quiet else nullcontext():
                loss = _loss(wrapped, x, y, accum)
                loss.backward()
            losses[-1] += float(loss.detach())
        if step == 0 and return_grads and method in ("ddp", "torch_ddp", "torch_zero1", "single"):
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        if step == steps - 1 and hasattr(wrapped if method == "fsdp" else optimizer, "memory_report"):
            memory = (wrapped.memory_report(optimizer) if method == "fsdp" else optimizer.memory_report())
        elif step == steps - 1 and method == "ddp":
            memory = wrapped.memory_report(optimizer)
        optimizer.zero_grad()
    if method == "fsdp":
        full = wrapped.full_state_dict()
        params = {n: full[n] for n in names}
    elif method == "torch_fsdp":
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "grads": grads, "memory": memory, "losses": losses}


# ----------------------------------------------------------------------------------------------
# Small rank functions for the failure-mode and layout tests


class Branchy(torch.nn.Module):
    """x → a → (b if use_b) : b gets no gradient on a rank that skips it."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d)

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def unused_on_some_ranks(bucket_cap_mb: float = 25.0, seed: int = 0, data_seed: int | None = None) -> dict:
    """Only rank 0 uses ``b``: DataParallel must not hang; b's grads are the mean with zeros elsewhere.
    The batch: from ``seed`` and the rank, or from this rank's own ``data_seed``."""
    from .ddp import DataParallel
    torch.manual_seed(seed)
    model = Branchy().double()
    ddp = DataParallel(model, bucket_cap_mb=bucket_cap_mb)
    x, y = batch("mlp", seed, 0, 0, comm.rank(), d=4) if data_seed is None else batch("mlp", data_seed, 0, 0, 0, d=4)
    F.mse_loss(ddp(x, use_b=comm.rank() == 0), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def time_steps(methods: list[str], layers: int = 6, width: int = 512, rows: int = 64, steps: int = 10,
               warmup: int = 3, bucket_cap_mb: float = 25.0) -> list[list[float]]:
    """Worker of the full course's ``benchmarks/data_parallel.py``: seconds of each training step (forward, backward,
    AdamW step, zero_grad) of :func:`.models.layer_model` in float32, for each of ``methods`` (each its own
    model and optimizer, all in this world), after ``warmup`` steps each.  The methods take their steps in
    turn — step i of every method, then step i+1, the order reversed every other step — so the machine's
    load of any moment hits them alike; a barrier before every step."""
    import torch.distributed as dist

    runs = []
    for method in methods:
        model = layer_model(layers, width)
        runs.append(wrap(method, model, torch.optim.AdamW, dict(lr=1e-3), bucket_cap_mb=bucket_cap_mb,
                         fsdp_units=[m for m in model if isinstance(m, torch.nn.Linear)]))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(comm.rank()))
    times: list[list[float]] = [[] for _ in methods]
    for i in range(warmup + steps):
        for k in (range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))):
            wrapped, opt = runs[k]
            dist.barrier()
            t0 = time.perf_counter()
            F.mse_loss(wrapped(x), x).backward()
            opt.step()
            opt.zero_grad()
            times[k].append(time.perf_counter() - t0)
    return [t[warmup:] for t in times]


# ----------------------------------------------------------------------------------------------
# Rank functions of the notebook's runs (reference.data.lecture)


def _trace_backward_compute(model: nn.Module) -> None:
    """A ``compute`` event per Linear's backward (layer index in meta), for the timeline."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for i, m in enumerate(linears):
        def pre(mod, grad_out, i=i):
            mod._t0 = time.perf_counter()

        def post(mod, grad_in, grad_out, i=i):
            trace.emit("compute", start=mod._t0, end=time.perf_counter(), layer=i, phase="backward")
        m.register_full_backward_pre_hook(pre)
        m.register_full_backward_hook(post)


def _timeline_model(layers: int, width: int, rows: int, bucket_cap_mb: float, overlap: bool):
    """The notebook's DataParallel model (backward traced layer by layer) and this rank's input."""
    from .ddp import DataParallel
    model = layer_model(layers, width)
    ddp = DataParallel(model, bucket_cap_mb=bucket_cap_mb, overlap=overlap)
    _trace_backward_compute(model)
    g = torch.Generator().manual_seed(comm.rank())
    return ddp, torch.randn(rows, width, generator=g)


def _timeline_backward(ddp, x) -> None:
    """One forward and a traced backward; a "thread_cpu" event holds the CPU seconds each role used in the backward
    (``meta``: compute, communication), where /proc tells."""
    loss = ddp(x).pow(2).mean()
    before = thread_cpu_seconds()
    trace.emit("backward_start")
    loss.backward()
    trace.emit("backward_end")
    after = thread_cpu_seconds()
    if before is not None and after is not None:
        trace.emit("thread_cpu", **{k: after[k] - before[k] for k in after})


def timeline_run(layers: int, width: int, rows: int, bucket_cap_mb: float, overlap: bool) -> list[list[str]]:
    """Rank worker: one forward + backward of :func:`layer_model` under DataParallel; returns the buckets."""
    ddp, x = _timeline_model(layers, width, rows, bucket_cap_mb, overlap)
    _timeline_backward(ddp, x)
    return [b.names for b in ddp.buckets]


def profiled_timeline_run(layers: int, width: int, rows: int, bucket_cap_mb: float, overlap: bool) -> dict:
    """Rank worker: :func:`timeline_run`'s backward once more under ``torch.profiler`` (after a warm-up one).

    Returns {"profile": the profiler's own Chrome trace (``export_chrome_trace``, loaded as a dict), "offset":
    seconds to add to a course event's time to get the profiler's clock (both clocks read inside a
    ``record_function("course: clock")`` span: the shortest of five), "buckets": the bucket names}."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function
    ddp, x = _timeline_model(layers, width, rows, bucket_cap_mb, overlap)
    _timeline_backward(ddp, x)                                     # warm-up: buffers, gloo's connections
    reads = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        comm.barrier()                                             # every rank's profiler is running: start together
        for _ in range(5):                                         # marks: both clocks read at once, five times
            with record_function("course: clock"):
                reads.append(time.perf_counter())
        _timeline_backward(ddp, x)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            doc = json.load(f)
    finally:
        os.unlink(path)
    marks = sorted((e for e in doc["traceEvents"] if e.get("name") == "course: clock" and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    # the profiler's clock at a mark's middle, less the course's inside it: off by at most half the mark's length,
    # so the shortest of the five (a rank descheduled inside one makes that one long)
    offset = min(((m["ts"] + m["dur"] / 2) / 1e6 - t, m["dur"]) for m, t in zip(marks, reads))[0] \
        if len(marks) == len(reads) else marks[0]["ts"] / 1e6 - reads[0]
    return {"profile": doc, "offset": offset, "buckets": [b.names for b in ddp.buckets]}


def no_sync_run(accum: int, use_no_sync: bool) -> dict:
    """Rank worker: one step of gradient accumulation over ``accum`` micro-batches (TinyMLP, float64)."""
    out = train("ddp", "mlp", "sgd", steps=1, accum=accum, skip_no_sync=not use_no_sync, return_grads=False)
    return out["params"]


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
                       if e.op in ("all_reduce", "reduce_scatter", "all_gather")
                       and e.meta.get("what", "grads") in ("grads", "params"))   # (a learner's need not say)
            rows_out.append({"method": method, "N": N, **{k: v for k, v in mem.items() if k != "total"},
                             "ring_bytes": sent})
    return rows_out
