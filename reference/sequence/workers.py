"""Rank functions of lecture 5a: the sequence-parallel attentions on every rank.

Each worker builds the same full-size inputs on every rank from a seed (:func:`make_inputs`),
keeps its own shard, runs one algorithm and returns plain tensors, so the caller can unshard the
results and compare them with full attention.  Call them through ``reference.launch``::

    from reference.launch import run_world
    from reference.sequence import workers
    res = run_world(workers.ring_worker, 4, seq_len=64, layout="zigzag", causal=True)
    res.values[r]["out"], res.trace.filter(op="compute")

The notebook's workers (ring replay and timing, memory, bytes) run on the first ``world_size``
ranks of a bigger kept-alive world (one World(4) serves W = 2, 3, 4); the other ranks return None.
"""
from __future__ import annotations

import torch

from .. import comm, trace
from .layouts import shard_sequence
from .ring import ring_attention, ring_attention_forward
from .ulysses import ulysses_attention
from .usp import usp_attention, usp_groups, usp_shard

__all__ = ["make_inputs", "ring_worker", "ulysses_call_worker", "ulysses_limit_worker", "usp_worker",
           "ring_replay_worker", "ring_timing_worker", "peak_memory_worker", "bytes_worker"]


def make_inputs(seq_len: int, *, batch: int = 1, heads: int = 2, heads_kv: int | None = None, head_dim: int = 8,
                seed: int = 0, dtype: torch.dtype = torch.float32, logit_scale: float = 1.0):
    """Full (q, k, v, dout): N(0, 1) entries drawn in float64 from ``seed`` then cast to ``dtype``.

    q is multiplied by ``logit_scale`` (the attention logits scale by the same factor).  Casting
    a float64 draw means a float64 ground truth can use exactly the values the ranks used.
    """
    g = torch.Generator().manual_seed(seed)
    hk = heads if heads_kv is None else heads_kv
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64) * logit_scale
    k = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def ring_worker(seq_len: int, layout: str = "contiguous", causal: bool = False, *, backward: bool = True,
                kernel: str = "fused", iterations: int = 1, **inputs) -> dict:
    """Ring attention on this rank's shard; returns out, lse (and dq, dk, dv) of the shard.

    ``iterations`` > 1 repeats forward+backward (a deadlock test); the last results are returned.
    """
    r, W = comm.rank(), comm.world_size()
    q, k, v, dout = (shard_sequence(t, r, W, layout) for t in make_inputs(seq_len, **inputs))
    if not backward:
        out, lse = ring_attention_forward(q, k, v, causal=causal, layout=layout, kernel=kernel)
        return {"out": out, "lse": lse}
    for _ in range(iterations):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_attention(qg, kg, vg, causal=causal, layout=layout, return_lse=True, kernel=kernel)
        out.backward(dout)
    return {"out": out.detach(), "lse": lse, "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


def ulysses_call_worker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> dict:
    return {"out": ulysses_attention(q, k, v, causal=causal)}


def ulysses_limit_worker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Ulysses on heads the world may not divide: {"raised": exception type, "message"} if this rank raised,
    else {}.  Caught here, so the world stays up for the next run (a rank's exception stops the world)."""
    try:
        ulysses_attention(q, k, v)
    except Exception as e:  # noqa: BLE001 - the demo reports what every rank raised, whatever it is
        return {"raised": type(e).__name__, "message": str(e)}
    return {}


def usp_worker(seq_len: int, ulysses_size: int, ring_size: int, layout: str = "zigzag", causal: bool = False,
               **inputs) -> dict:
    """USP on a U × R grid; returns this rank's piece of out, dq, dk, dv (as :func:`.usp.usp_shard`)."""
    ug, rg = usp_groups(ulysses_size, ring_size)
    u, i = comm.rank(ug), comm.rank(rg)
    q, k, v, dout = (usp_shard(t, u, ulysses_size, i, ring_size, layout) for t in make_inputs(seq_len, **inputs))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = usp_attention(qg, kg, vg, causal=causal, ulysses_group=ug, ring_group=rg, layout=layout)
    out.backward(dout)
    return {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


def ring_replay_worker(seq_len: int, world_size: int, layout: str, causal: bool, *, kernel: str = "fused",
                       **inputs) -> dict | None:
    """Ring attention forward on ranks 0..world_size-1 (a trace for the ring widget); returns the
    largest difference from full float64 attention on this rank's rows."""
    group = comm.first_ranks_group(world_size)
    r = comm.rank()
    if r >= world_size:
        return None
    from .blockwise import attention_block_explicit
    from .layouts import positions
    q, k, v, _ = make_inputs(seq_len, **inputs)
    shards = [shard_sequence(t, r, world_size, layout) for t in (q, k, v)]
    out, lse = ring_attention_forward(*shards, causal=causal, layout=layout, group=group, kernel=kernel)
    with trace.quiet():
        full, _ = attention_block_explicit(q.double(), k.double(), v.double(), causal=causal)
    err = float((out.double() - full[..., positions(seq_len, r, world_size, layout), :]).abs().max())
    return {"max_error": err}


def ring_timing_worker(seq_len: int, world_size: int, layout: str = "zigzag", causal: bool = True, *,
                       backward: bool = False, alone: bool = False, **inputs) -> dict | None:
    """One timed ring forward (and backward) on ranks 0..world_size-1; the caller reads the trace.

    Returns {"seconds": this rank's wall time}; with ``alone=True`` (forward only) also "alone": the
    seconds of the same block computations run again with no message at all (best of 3, every rank at
    once, as in the ring), and "comm_cpu": the CPU seconds gloo's threads used during the ring forward
    (None where /proc does not tell) — what the "hidden" messages took from the cores the blocks run on."""
    import time

    from ..cpu_time import thread_cpu_seconds              # gloo's threads' CPU time, from /proc (lecture 3)
    group = comm.first_ranks_group(world_size)
    r = comm.rank()
    if r >= world_size:
        return None
    full = make_inputs(seq_len, **inputs)
    q, k, v, dout = (shard_sequence(t, r, world_size, layout) for t in full)
    alone = alone and not backward
    comm.barrier(group=group)
    cpu0 = thread_cpu_seconds() if alone else None
    t0 = time.perf_counter()
    if backward:
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(qg, kg, vg, causal=causal, layout=layout, group=group)
        trace.emit("backward_start")               # what was sent before it is the forward's
        out.backward(dout)
    else:
        ring_attention_forward(q, k, v, causal=causal, layout=layout, group=group)
    out = {"seconds": time.perf_counter() - t0}
    if alone:
        cpu1 = thread_cpu_seconds()
        out["comm_cpu"] = cpu1["communication"] - cpu0["communication"] if cpu0 and cpu1 else None
        out["alone"] = _blocks_alone(full, r, world_size, layout, causal, group)
    return out


def _blocks_alone(full, r: int, world_size: int, layout: str, causal: bool, group, repeats: int = 3) -> float:
    """Seconds of the blocks rank r computes in a ring forward, computed here with no message, best of
    ``repeats``: every K/V shard is cut from the full inputs (every rank builds them), the same kernel calls
    in the same order, every rank of the group at once (as in the ring)."""
    import time

    from .blockwise import attention_block
    from .ring import block_plan
    q = shard_sequence(full[0], r, world_size, layout)
    kv = [[shard_sequence(t, j, world_size, layout) for t in full[1:3]] for j in range(world_size)]
    n, best = q.shape[-2], float("inf")
    with torch.no_grad(), trace.quiet():
        for _ in range(repeats):
            comm.barrier(group=group)
            t0 = time.perf_counter()
            for s in range(world_size):
                j = (r - s) % world_size
                for p in block_plan(r, j, world_size, layout, causal, n):
                    attention_block(q[..., p.q, :], kv[j][0][..., p.k, :], kv[j][1][..., p.k, :], causal=p.causal)
            best = min(best, time.perf_counter() - t0)
    return best


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_memory_worker(seq_len: int, world_size: int, kernel: str = "explicit", **inputs) -> dict | None:
    """Peak resident memory (bytes) a causal ring forward adds on ranks 0..world_size-1 (Linux only).

    world_size 1 is one device computing attention of the whole sequence at once.  The peak is
    read from /proc (VmHWM, reset through /proc/self/clear_refs), so it counts every byte the
    process touched: inputs, K/V buffers, the scores of the block being computed.  Only in a world
    started with ``keep_freed_memory=False``: ranks that keep freed blocks for reuse never raise the
    high-water mark, whatever a step allocates.
    """
    import gc
    import os
    if os.environ.get("COURSE_KEEP_FREED_MEMORY") != "0":
        raise ValueError("peak_memory_worker reads resident memory, which ranks that keep freed memory never "
                         "raise: run it in World(n, keep_freed_memory=False)")
    group = comm.first_ranks_group(world_size) if world_size > 1 else None
    r = comm.rank()
    if r >= world_size:
        return None
    from .blockwise import block_kernels
    q, k, v, _ = (shard_sequence(t, r, world_size, "contiguous") for t in make_inputs(seq_len, **inputs))
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return {"peak_bytes": None}
    base = _rss_kib("VmRSS")
    if world_size == 1:
        forward, _ = block_kernels(kernel)
        with torch.no_grad():
            out, lse = forward(q, k, v, causal=True)
    else:
        out, lse = ring_attention_forward(q, k, v, causal=True, group=group, kernel=kernel)
    peak = _rss_kib("VmHWM")
    del out, lse
    return {"peak_bytes": (peak - base) * 1024}


def bytes_worker(seq_len: int, world_size: int, **inputs) -> dict | None:
    """Ring attention forward, then Ulysses attention forward, on the same shards (for the trace)."""
    group = comm.first_ranks_group(world_size)
    r = comm.rank()
    if r >= world_size:
        return None
    q, k, v, _ = (shard_sequence(t, r, world_size, "contiguous") for t in make_inputs(seq_len, **inputs))
    with trace.span("phase", what="ring"):
        ring_attention_forward(q, k, v, causal=True, group=group)
    with trace.span("phase", what="ulysses"), torch.no_grad():
        ulysses_attention(q, k, v, causal=True, group=group)
    return {}
