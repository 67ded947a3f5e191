"""USP — Unified Sequence Parallelism (Fang & Zhao, arXiv:2405.07719): Ulysses inside, ring outside.

Ulysses is capped by the number of heads; the ring sends ≈ 2·S·H_kv·D bytes per rank whatever W.
USP arranges W = U × R ranks in a grid: all-to-all inside each Ulysses group of U ranks (usually
ranks on fast links), ring attention across the R Ulysses groups::

    global rank g = ring_rank · U + ulysses_rank          (U = 2, R = 2)

                   ulysses_rank 0   ulysses_rank 1
    ring_rank 0        g0 ────────────── g1            ── Ulysses group (all-to-all)
                       │                 │
    ring_rank 1        g2 ────────────── g3            │  ring group (K/V ring)

Which tokens a rank holds.  The sequence is first cut over the ring dimension in ``layout``
(ring rank i gets ``shard_sequence(x, i, R, layout)``, S/R tokens in that layout's local order),
and that ring shard is cut into U contiguous pieces, one per Ulysses rank (:func:`usp_shard`).
After ``seq_to_heads`` inside the Ulysses group every rank holds its ring shard whole — in layout
order — for H/U heads, so ring attention over the ring group applies unchanged; ``heads_to_seq``
then returns each rank its own piece.  With zigzag the causal work is balanced across the ring,
and the Ulysses split keeps it balanced inside each group.

Requirements: U divides H (and the K/V heads, after the repeat of :mod:`.ulysses`); S divisible by
R·U (by 2·R·U for zigzag).
"""
from __future__ import annotations

import torch

from .. import comm
from .layouts import check_layout, shard_sequence, unshard_sequence
from .ring import ring_attention
from .ulysses import _spread_kv, check_ulysses_inputs, heads_to_seq, seq_to_heads

__all__ = ["usp_attention", "usp_groups", "usp_shard", "usp_unshard"]


def usp_groups(ulysses_size: int, ring_size: int, timeout: float | None = None):
    """Create every Ulysses and ring group; return this rank's ``(ulysses_group, ring_group)``.

    Every rank of the world must call it (it creates all groups, in the same order everywhere).
    Ulysses group of ring rank i: global ranks [i·U, …, i·U + U − 1]; ring group of Ulysses rank
    u: [u, u + U, …, u + (R − 1)·U].
    """
    U, R = ulysses_size, ring_size
    W = comm.world_size()
    if U < 1 or R < 1 or U * R != W:
        raise ValueError(f"ulysses_size × ring_size must equal the world size {W}, got {U} × {R}")
    me = comm.rank()
    mine_u = mine_r = None
    for i in range(R):
        g = comm.new_group([i * U + u for u in range(U)], timeout=timeout)
        if me // U == i:
            mine_u = g
    for u in range(U):
        g = comm.new_group([i * U + u for i in range(R)], timeout=timeout)
        if me % U == u:
            mine_r = g
    return mine_u, mine_r


def usp_shard(x: torch.Tensor, ulysses_rank: int, ulysses_size: int, ring_rank: int, ring_size: int,
              layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The tokens a USP rank holds: ring shard ``ring_rank`` in ``layout``, then contiguous piece ``ulysses_rank``."""
    shard = shard_sequence(x, ring_rank, ring_size, layout, dim=dim)
    if shard.shape[dim] % ulysses_size:
        raise ValueError(f"a ring shard of {shard.shape[dim]} tokens cannot be split over {ulysses_size} Ulysses ranks")
    return shard.chunk(ulysses_size, dim=dim)[ulysses_rank].contiguous()


def usp_unshard(pieces: list[torch.Tensor], ulysses_size: int, ring_size: int, layout: str = "zigzag",
                dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`usp_shard`; ``pieces[g]`` is global rank g's (g = ring_rank·U + ulysses_rank)."""
    U, R = ulysses_size, ring_size
    ring_shards = [torch.cat(pieces[i * U:(i + 1) * U], dim=dim) for i in range(R)]
    return unshard_sequence(ring_shards, layout, dim=dim)


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  ulysses_group, ring_group, layout: str = "zigzag") -> torch.Tensor:
    """2-D sequence parallelism: all-to-all over ``ulysses_group``, ring attention over ``ring_group``.

    q: (B, H, S/(U·R), D), k, v: (B, H_kv, S/(U·R), D) — this rank's piece as :func:`usp_shard`.
    Returns this rank's rows of full attention, (B, H, S/(U·R), D).  Differentiable.
    """
    U = comm.world_size(ulysses_group)
    check_ulysses_inputs(q, k, v, U)
    check_layout(layout)
    if layout == "zigzag" and (q.shape[2] * U) % 2:
        raise ValueError(f"zigzag: a ring shard ({q.shape[2] * U} tokens) holds two equal chunks, so it must be even")
    k, v = _spread_kv(k, U), _spread_kv(v, U)
    qh, kh, vh = seq_to_heads(q, ulysses_group), seq_to_heads(k, ulysses_group), seq_to_heads(v, ulysses_group)
    oh = ring_attention(qh, kh, vh, causal=causal, layout=layout, group=ring_group)
    return heads_to_seq(oh, ulysses_group)
