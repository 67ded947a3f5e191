"""This machine in the α–β model: measured on live ranks, the four numbers of a :class:`~.thresholds.Link`.

    α, β    latency and bandwidth of one message between two ranks: a ping-pong (rank 0 sends n bytes, rank 1
            sends them back; half the round trip is one message, t(n) = α + n/β), the best of a few at each size
            of a sweep, then fitted (:func:`fit_alpha_beta`)
    F       the FLOP/s a rank achieves: an m × m float32 matmul, 2m³ FLOPs, best of a few
    B_mem   the memory bandwidth a rank achieves: a copy of a tensor larger than the caches (bytes read + written)

Every rank measures at once, one thread each (as every course world runs), so the figures are what a rank gets
while the others work too: on a laptop the "devices" share cores and one memory bus.  The messages go through
:mod:`reference.comm` (gloo on CPU), so α is what a message costs the course's own code.

:func:`all_reduce_sweep` times ``all_reduce`` at the same sizes, to set the ring model 2(p−1)·α + 2(p−1)/p · n/β
beside a real collective; :func:`measure_link` runs all of it in a world and builds the ``Link``.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .. import comm
from .thresholds import Link

__all__ = ["SIZES", "fit_alpha_beta", "pingpong_worker", "all_reduce_worker", "kernel_worker",
           "all_reduce_sweep", "measure_link"]

SIZES = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20)     # bytes: 8 B … 4 MiB


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(α, β) of  t(n) = α + n/β  through measured (n, t), least squares on the *relative* error.

    Each point weighs 1/t, so that the 8-byte message (tens of µs, where α shows) counts as much as the 4 MiB one
    (milliseconds, where β shows): minimise Σ ((α + n·g − t)/t)², g = 1/β, a 2 × 2 linear system.  A negative α
    (possible with noisy small messages) is set to 0 and g refitted.  On a shared machine one size can come out
    several times too slow in every repeat (a rank descheduled): points more than twice the first fit are left out
    of a second one, as long as four remain."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, seconds) pairs, got {len(sizes)} sizes, {len(seconds)} times")
    if any(t <= 0 for t in seconds) or any(n < 0 for n in sizes):
        raise ValueError("times must be positive and sizes non-negative")
    alpha, g = _weighted_fit(sizes, seconds)
    kept = [(n, t) for n, t in zip(sizes, seconds) if t <= 2 * (alpha + n * g)]
    if len(sizes) > len(kept) >= 4:
        refit = _weighted_fit([n for n, _ in kept], [t for _, t in kept])
        if refit[1] > 0:
            alpha, g = refit
    if g <= 0:
        raise ValueError("no bandwidth could be fitted: the times do not grow with the message size")
    return alpha, 1 / g


def _weighted_fit(sizes, seconds) -> tuple[float, float]:
    """(α, g) minimising Σ ((α + n·g − t)/t)² (α ≥ 0): the normal equations of rows (1/t, n/t), target 1."""
    rows = [(1 / t, n / t) for n, t in zip(sizes, seconds)]
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1, r2 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    alpha, g = ((s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:
        alpha, g = 0.0, (r2 / s22 if s22 > 0 else 0.0)
    return alpha, g


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        comm.barrier()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pingpong_worker(sizes: Sequence[int] = SIZES, repeats: int = 7) -> dict[int, float]:
    """(every rank of a world of ≥ 2) {bytes: best one-way seconds} on rank 0, {} elsewhere: rank 0 sends n bytes
    to rank 1, which sends them back; half the round trip, best of ``repeats`` (after one warm-up)."""
    me = comm.rank()
    out = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32)

        def round_trip():
            if me == 0:
                comm.send(buf, 1, what="ping")
                comm.recv(buf, 1, what="pong")
            elif me == 1:
                comm.recv(buf, 0, what="ping")
                comm.send(buf, 0, what="pong")
        round_trip()
        out[n] = _best(round_trip, repeats) / 2
    return out if me == 0 else {}


def all_reduce_worker(sizes: Sequence[int] = SIZES, repeats: int = 7) -> dict[int, float]:
    """(every rank) {bytes: best seconds of one all-reduce (SUM) of a float32 tensor of that many bytes}."""
    out = {}
    for n in sizes:
        buf = torch.ones(max(1, n // 4), dtype=torch.float32)
        comm.all_reduce(buf, what="sweep")
        out[n] = _best(lambda: comm.all_reduce(buf, what="sweep"), repeats)
    return out


def kernel_worker(m: int = 512, copy_bytes: int = 64 << 20, repeats: int = 7) -> dict[str, float]:
    """(every rank) {"flops": an m × m float32 matmul's FLOP/s, "mem_bw": a copy's bytes read + written per
    second}, each the best of ``repeats`` (after a warm-up)."""
    g = torch.Generator().manual_seed(comm.rank())
    a, b = torch.randn(m, m, generator=g), torch.randn(m, m, generator=g)
    x = torch.randn(copy_bytes // 4, generator=g)
    y = torch.empty_like(x)
    a @ b
    y.copy_(x)
    mm = min(_timed(lambda: a @ b) for _ in range(repeats))
    cp = min(_timed(lambda: y.copy_(x)) for _ in range(repeats))
    return {"flops": 2 * m ** 3 / mm, "mem_bw": 2 * x.numel() * 4 / cp}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def all_reduce_sweep(world, sizes: Sequence[int] = SIZES, repeats: int = 7) -> dict[int, float]:
    """{bytes: seconds} of an all-reduce in ``world`` (a live :class:`reference.launch.World`): the slowest rank's
    best time at each size (a collective ends when its last rank does)."""
    per_rank = world.run(all_reduce_worker, tuple(sizes), repeats).values
    return {n: max(r[n] for r in per_rank) for n in sizes}


def measure_link(world, sizes: Sequence[int] = SIZES, repeats: int = 7, name: str = "") -> dict:
    """This machine's :class:`Link`, measured in ``world`` (a live World of ≥ 2 ranks); every figure the best of
    ``repeats``.

    Returns {"link": Link(α, β, F, B_mem), "sizes", "pingpong": one-way seconds per size (rank 0 ↔ 1),
    "all_reduce": the all-reduce's seconds per size over the whole world, "p": the world's size,
    "flops_per_rank", "mem_bw_per_rank"}.  F and B_mem are the slowest rank's (the step waits for it)."""
    if world.world_size < 2:
        raise ValueError(f"measuring a link needs a world of at least 2 ranks, got {world.world_size}")
    sizes = tuple(sizes)
    for attempt in range(3):                       # a busy machine can hide the growth with size once; not thrice
        one_way = world.run(pingpong_worker, sizes, repeats).values[0]
        try:
            alpha, beta = fit_alpha_beta(sizes, [one_way[n] for n in sizes])
            break
        except ValueError:
            if attempt == 2:
                raise
    reduced = all_reduce_sweep(world, sizes, repeats)
    kernels = world.run(kernel_worker, repeats=max(repeats, 2)).values
    flops, mem_bw = min(k["flops"] for k in kernels), min(k["mem_bw"] for k in kernels)
    return {"link": Link(alpha=alpha, beta=beta, flops=flops, hbm_bw=mem_bw,
                         name=name or f"this machine (gloo, {world.world_size} ranks)"),
            "sizes": sizes, "pingpong": [one_way[n] for n in sizes], "all_reduce": [reduced[n] for n in sizes],
            "p": world.world_size, "flops_per_rank": [k["flops"] for k in kernels],
            "mem_bw_per_rank": [k["mem_bw"] for k in kernels]}
