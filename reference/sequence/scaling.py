"""Lecture 5a, section 9 — does the ring scale?  A timeline model in the α–β model of lecture 0.

A 2-core laptop cannot show strong scaling past two ranks, so this module models it.  It takes the
hardware as three numbers, a ``link`` with ``alpha`` (seconds per message), ``beta`` (bytes/s one
device sends per direction) and ``flops`` (the FLOP/s one attention block runs at) — the fields of
:class:`reference.planner.thresholds.Link`, so a published device (``thresholds.link_of`` of a planner
preset) and this machine (measured by ``reference.planner.measure``) are modelled the same way:

    t_block(n) = 4·n²·H·D / F               one (n × n) attention block, QKᵀ and PV
    t_msg(x)   = α + x / β                   one message of x bytes

One attention forward over L tokens on W ranks, n = L/W, non-causal:

    ring        W blocks of n×n per rank; the hop for step s+1 is in flight during step s:
                    T = t_block(n) + (W−1) · max(t_block(n), t_msg(2·n·H_kv·D·b))
    Ulysses     all-to-alls of Q, K, V before attention and of the output after, on the
                critical path; attention over all L tokens for H/W heads (= W blocks of n×n):
                    T = 2·t_a2a(n·H) + 2·t_a2a(n·H_kv) + W · t_block(n)
                    t_a2a(rows) = (W−1)·α + (W−1)/W · rows·D·b / β        (W must divide H, H_kv)
                every pair of ranks at β: true inside an NVLink node, optimistic across nodes
    all-gather  (Llama 3's context parallelism) gather every rank's K/V first (a ring all-gather,
                not overlapped), then attend:
                    T = (W−1) · t_msg(2·n·H_kv·D·b) + W · t_block(n)

The ring's compute W·t_block(L/W) ∝ L²/W: it scales linearly (T ∝ 1/W, strong scaling) while the
hop hides, t_block(n) ≥ t_msg(hop), i.e. while n ≥ n* (``thresholds.cp_tokens``, the latency
included); below n* every step waits for the link and T ≈ W·t_msg ∝ W·(L/W) = L stops falling.
(At a fixed shard size n instead — weak scaling — T grows ∝ W: attention's FLOPs grow as L².)
A causal mask halves t_block (zigzag) and so doubles n*.

:func:`measure_block_times` and :func:`fit_block_times` measure F for the fused CPU kernel (the
planner's model of this machine uses them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["BlockFit", "measure_block_times", "fit_block_times", "step_times"]


@dataclass
class BlockFit:
    """t_block(n) = t0 + 4·n²·H·D / flops  (seconds), fitted to measurements."""
    t0: float
    flops: float

    def __call__(self, n: int, heads: int, head_dim: int) -> float:
        return self.t0 + 4 * n * n * heads * head_dim / self.flops


def measure_block_times(sizes=(256, 512, 1024, 2048), heads: int = 2, head_dim: int = 64, repeats: int = 3,
                        dtype=torch.float32) -> dict[int, float]:
    """Best-of-``repeats`` seconds of one fused attention block (n queries × n keys) per n, here."""
    from .blockwise import attention_block
    out = {}
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        q, k, v = (torch.randn(1, heads, n, head_dim, generator=g, dtype=dtype) for _ in range(3))
        attention_block(q, k, v)                                        # warm-up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            attention_block(q, k, v)
            best = min(best, time.perf_counter() - t)
        out[n] = best
    return out


def fit_block_times(times: dict[int, float], heads: int, head_dim: int) -> BlockFit:
    """The machine's attention FLOP/s from measured block times: least squares of t = x / F over
    x = 4·n²·H·D (through the origin, so the largest blocks dominate; per-call overhead, which a
    GPU kernel launch keeps to microseconds, is left out: t0 = 0)."""
    x = torch.tensor([4.0 * n * n * heads * head_dim for n in times], dtype=torch.float64)
    t = torch.tensor(list(times.values()), dtype=torch.float64)
    return BlockFit(0.0, float((x * x).sum() / (x * t).sum()))


def step_times(seq_len: int, world_sizes, link, *, heads: int, heads_kv: int, head_dim: int,
               bytes_per_value: int) -> dict[str, list[float | None]]:
    """Modelled seconds of one attention forward per W for ring, Ulysses and all-gather attention
    (None where the method does not apply: Ulysses needs W to divide H and H_kv — beyond H_kv ranks
    the K/V heads would have to be repeated).  ``link``: ``alpha``, ``beta`` and ``flops`` (a
    :class:`reference.planner.thresholds.Link`)."""
    D, b = head_dim, bytes_per_value
    alpha, beta = link.alpha, link.beta
    out: dict[str, list[float | None]] = {"ring": [], "ulysses": [], "all-gather": [], "compute only": []}
    for W in world_sizes:
        n = seq_len // W
        t_b = 4 * n * n * heads * D / link.flops
        hop = alpha + 2 * n * heads_kv * D * b / beta if W > 1 else 0.0

        def a2a(rows: int) -> float:
            return 0.0 if W == 1 else (W - 1) * alpha + (W - 1) / W * rows * D * b / beta
        out["compute only"].append(W * t_b)
        out["ring"].append(t_b + (W - 1) * max(t_b, hop))
        out["ulysses"].append(2 * a2a(n * heads) + 2 * a2a(n * heads_kv) + W * t_b
                              if heads % W == 0 and heads_kv % W == 0 else None)
        out["all-gather"].append((W - 1) * hop + W * t_b)
    return out
