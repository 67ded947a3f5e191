"""Lecture 5a exercises — sequence parallelism.  Reference: ``reference/sequence/``.

    5a.1  merge_attention                       fold two partial attention results into one
    5a.2  shard_sequence, unshard_sequence      contiguous, zigzag and striped layouts
    5a.3  ring_attention_forward                Q stays, K/V travel the ring
    5a.4  seq_to_heads, heads_to_seq            the Ulysses all-to-all

Given (not exercises): ``attention_block(q, k, v, causal=..)`` returns ``(out, lse)`` for one block
of keys (the fused CPU kernel; ``attention_block_explicit`` is the same written out with matmuls),
and ``reference.comm`` for messages: ``comm.exchange([(t, dst)], [(buf, src)]).wait()`` posts a send
and a receive together; ``comm.ring_peers(group)`` gives ``(next, prev)``; ``comm.all_to_all``.
While 5a.3 is graded only point-to-point messages work, and in 5a.4 only the all-to-all.
Check your work with ``check("5a.1")`` in the notebook or ``python -m exercises.grade 5a.1``.
"""
from __future__ import annotations

import torch

from reference import comm  # noqa: F401  (traced send/recv/exchange/all_to_all)
from reference.sequence.blockwise import attention_block, attention_block_explicit  # noqa: F401  (given)

__all__ = ["merge_attention", "shard_sequence", "unshard_sequence", "ring_attention_forward",
           "seq_to_heads", "heads_to_seq"]


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key blocks into attention over their union.

    out_*: (B, H, S, D); lse_*: (B, H, S).  With m = max(lse_a, lse_b)::

        w_a = e^{lse_a − m},  w_b = e^{lse_b − m}          (one of them is 1, none overflows)
        lse = m + log(w_a + w_b)
        out = (w_a · out_a + w_b · out_b) / (w_a + w_b)

    A side with lse = −inf (the row saw no key there) gets weight 0; if both are −inf the result
    is out 0, lse −inf.  Returns new tensors (out in the promoted dtype of the inputs).
    """
    raise NotImplementedError(
        "Exercise 5a.1 (merge_attention): Each side's weight is its share of the softmax mass, e^{lse_a} / "
        '(e^{lse_a} + e^{lse_b}). Think about what e^{lse} does when the logits are large, and what a fully '
        'masked side (lse = -inf) must contribute. More help: hint("5a.1").')


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (a new contiguous tensor).

    x: e.g. (batch, heads, S, head_dim) with ``dim=-2``.  Returns the same shape with S/W along ``dim``.
    Raises ValueError if S is not a multiple of the layout's number of chunks.
    """
    raise NotImplementedError(
        'Exercise 5a.2 (shard_sequence): Draw the three layouts for L = 8, W = 2 (the pictures are in '
        "reference/sequence/layouts.py's docstring): which global token positions does each rank hold, in "
        'which order? unshard_sequence is the inverse. More help: hint("5a.2").')


def unshard_sequence(shards: list[torch.Tensor], layout: str, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is rank r's shard; returns the full tensor."""
    raise NotImplementedError(
        'Exercise 5a.2 (unshard_sequence): Draw the three layouts for L = 8, W = 2 (the pictures are in '
        "reference/sequence/layouts.py's docstring): which global token positions does each rank hold, in "
        'which order? unshard_sequence is the inverse. More help: hint("5a.2").')


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                           layout: str = "contiguous", group=None, kernel: str = "fused"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention, forward only (no autograd).

    q: (B, H, n, D), this rank's n = S/W query tokens in ``layout`` order; k, v: (B, H_kv, n, D)
    likewise.  Returns (out (B, H, n, D), lse (B, H, n)) for this rank's queries over all S keys —
    equal to rows ``positions(S, r, W, layout)`` of full attention.  ``kernel``: "fused" or
    "explicit" block kernel.  Every rank of ``group`` must call it with the same shapes.
    """
    raise NotImplementedError(
        'Exercise 5a.3 (ring_attention_forward): At step s rank r holds the K/V block of rank (r - s) mod W; '
        'K/V move one rank forward per step, queries never move. Post the next hop before computing the '
        'current block, and merge each block into a running (out, lse) with your 5a.1. More help: '
        'hint("5a.3").')


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H, S/W, D) sequence-sharded → (B, H/W, S, D) head-sharded, by one all-to-all.

    Rank r gets heads [r·H/W, (r+1)·H/W) of all S tokens (token chunks in rank order).
    Differentiable (its backward is :func:`heads_to_seq`).  H not divisible by W → ValueError.
    """
    raise NotImplementedError(
        'Exercise 5a.4 (seq_to_heads): Before: every rank has all H heads of its n = L/W tokens. After: every'
        ' rank has H/W heads of all L tokens. One all-to-all does it: slice w of what a rank sends goes to '
        'rank w. heads_to_seq is the mirror image. More help: hint("5a.4").')


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H/W, S, D) head-sharded → (B, H, S/W, D) sequence-sharded: the inverse of :func:`seq_to_heads`."""
    raise NotImplementedError(
        'Exercise 5a.4 (heads_to_seq): Before: every rank has all H heads of its n = L/W tokens. After: every'
        ' rank has H/W heads of all L tokens. One all-to-all does it: slice w of what a rank sends goes to '
        'rank w. heads_to_seq is the mirror image. More help: hint("5a.4").')
