"""Lecture 5a, part 5 — does the ring scale?  A timeline model calibrated on this machine.

A 2-core laptop cannot show strong scaling past two ranks, so this module models it, and says
exactly which parts are measured and which are assumed:

    MEASURED   t_block(n): seconds for one (n × n) attention block with the fused kernel on this
               machine, at a few n; fitted as  t_block(n) = 4·n²·H·D / F  (F: this machine's
               attention FLOP/s; larger blocks and other H, D follow from F).
    ASSUMED    a link:  t_msg(bytes) = α + bytes / β  (latency α, bandwidth β per direction).
    MODELLED   one attention forward over L tokens on W ranks, n = L/W, non-causal:

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
hop hides, t_block(n) ≥ t_msg(hop), i.e. while n ≥ n*; below n* every step waits for the link and
T ≈ W·t_msg ∝ W·(L/W) = L stops falling.  (At a fixed shard size n instead — weak scaling — T
grows ∝ W: attention's FLOPs grow as L².)  A causal mask halves t_block (zigzag) and so doubles n*.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["BlockFit", "Link", "measure_block_times", "fit_block_times", "step_times", "overlap_threshold"]


@dataclass
class BlockFit:
    """t_block(n) = t0 + 4·n²·H·D / flops  (seconds), fitted to measurements."""
    t0: float
    flops: float

    def __call__(self, n: int, heads: int, head_dim: int) -> float:
        return self.t0 + 4 * n * n * heads * head_dim / self.flops


@dataclass
class Link:
    """t_msg(bytes) = latency + bytes / bandwidth (seconds; bandwidth in bytes/s per direction)."""
    latency: float
    bandwidth: float
    name: str = "link"

    def __call__(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


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


def overlap_threshold(block: BlockFit, link: Link, heads: int, heads_kv: int, head_dim: int,
                      bytes_per_value: int, causal: bool = False) -> int:
    """Smallest n (tokens per rank) whose block time covers one K/V hop: the n* of the lecture."""
    hop = lambda n: link(2 * n * heads_kv * head_dim * bytes_per_value)          # noqa: E731
    work = lambda n: block(n, heads, head_dim) / (2 if causal else 1)            # noqa: E731
    n = 1
    while work(n) < hop(n):
        n *= 2
    lo, hi = n // 2, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if work(mid) < hop(mid) else (lo, mid)
    return hi


def step_times(seq_len: int, world_sizes, block: BlockFit, link: Link, *, heads: int, heads_kv: int,
               head_dim: int, bytes_per_value: int) -> dict[str, list[float | None]]:
    """Modelled seconds of one attention forward per W for ring, Ulysses and all-gather attention
    (None where the method does not apply: Ulysses needs W to divide H and H_kv — beyond H_kv ranks
    the K/V heads would have to be repeated)."""
    D, b = head_dim, bytes_per_value
    out: dict[str, list[float | None]] = {"ring": [], "ulysses": [], "all-gather": [], "compute only": []}
    for W in world_sizes:
        n = seq_len // W
        t_b = block(n, heads, D)
        hop = link(2 * n * heads_kv * D * b) if W > 1 else 0.0

        def a2a(rows: int) -> float:
            return 0.0 if W == 1 else (W - 1) * link.latency + (W - 1) / W * rows * D * b / link.bandwidth
        out["compute only"].append(W * t_b)
        out["ring"].append(t_b + (W - 1) * max(t_b, hop))
        out["ulysses"].append(2 * a2a(n * heads) + 2 * a2a(n * heads_kv) + W * t_b
                              if heads % W == 0 and heads_kv % W == 0 else None)
        out["all-gather"].append((W - 1) * hop + W * t_b)
    return out
