"""Lecture 5a exercises — sequence parallelism.  Reference: ``reference/sequence/``.

    5a.1  merge_attention                       fold two partial attention results into one
    5a.2  shard_sequence, unshard_sequence      contiguous, zigzag and striped layouts
    5a.3  ring_attention_forward                Q stays, K/V travel the ring
    5a.4  seq_to_heads, heads_to_seq            the Ulysses all-to-all
    5a.5  ring_attention_backward               K/V travel again; dK/dV accumulators travel home

Given (not exercises): ``attention_block(q, k, v, causal=..)`` returns ``(out, lse)`` for one block
of keys (the fused CPU kernel; ``attention_block_explicit`` is the same written out with matmuls);
``attention_block_backward(dout, q, k, v, out, lse, causal=..)`` returns one block's share of
``(dq, dk, dv)`` given the rows' FINAL out and lse (``attention_block_backward_explicit``: written out);
``block_plan(r, j, W, layout, causal, n)`` lists the rows of a block that are computed (empty: masked);
and ``reference.comm`` for messages: ``comm.exchange([(t, dst)], [(buf, src)]).wait()`` posts a send
and a receive together; ``comm.ring_peers(group)`` gives ``(next, prev)``; ``comm.all_to_all``.
While 5a.3 and 5a.5 are graded only point-to-point messages work, and in 5a.4 only the all-to-all.
Check your work with ``check("5a.1")`` in the notebook or ``python -m exercises.grade 5a.1``.
"""
from __future__ import annotations

import torch

from reference import comm  # noqa: F401  (traced send/recv/exchange/all_to_all)
from reference.sequence.blockwise import (attention_block, attention_block_backward,  # noqa: F401  (given)
                                          attention_block_backward_explicit, attention_block_explicit)
from reference.sequence.ring import block_plan  # noqa: F401  (given)

__all__ = ["merge_attention", "shard_sequence", "unshard_sequence", "ring_attention_forward",
           "seq_to_heads", "heads_to_seq", "ring_attention_backward"]


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key blocks into attention over their union.

    out_*: (B, H, S, D); lse_*: (B, H, S).  With m = max(lse_a, lse_b)::

        w_a = e^{lse_a − m},  w_b = e^{lse_b − m}          (one of them is 1, none overflows)
        lse = m + log(w_a + w_b)
        out = (w_a · out_a + w_b · out_b) / (w_a + w_b)

    A side with lse = −inf (the row saw no key there) gets weight 0; if both are −inf the result
    is out 0, lse −inf.  Returns new tensors (out in the promoted dtype of the inputs).

    Graded on: (out, lse) against float64 attention over both blocks, with logits ×4 and ×30 and sides that saw no
    key.
    """
    raise NotImplementedError(
        "Exercise 5a.1 (merge_attention): Each side's weight is its share of the softmax mass, e^{lse_a} / "
        '(e^{lse_a} + e^{lse_b}). Think about what e^{lse} does when the logits are large, and what a fully '
        'masked side (lse = -inf) must contribute. More help: hint("5a.1").')


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (a new contiguous tensor).

    x: e.g. (batch, heads, S, head_dim) with ``dim=-2``.  Returns the same shape with S/W along ``dim``.
    Raises ValueError if S is not a multiple of the layout's number of chunks.

    Graded on: every layout's shards on 1–4 ranks along dim −2 and 1, bitwise, your input left unchanged, and
    ValueError for lengths the layout cannot split.
    """
    raise NotImplementedError(
        'Exercise 5a.2 (shard_sequence): Draw the three layouts for L = 8, W = 2 (the pictures are in '
        "reference/sequence/layouts.py's docstring): which global token positions does each rank hold, in "
        'which order? unshard_sequence is the inverse. More help: hint("5a.2").')


def unshard_sequence(shards: list[torch.Tensor], layout: str, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is rank r's shard; returns the full tensor.

    Graded on: every layout put back together on 1–4 ranks, bitwise.
    """
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

    The given ``block_plan(r, j, W, layout, causal, n)`` (``reference.sequence.ring``) plans the block of
    rank j's K/V: the kernel calls to make — which rows of the local Q and of the held K/V, with the causal
    mask or not — and an empty list when the whole block is masked (skip it).

    Graded on: (out, lse) against float64 full attention on 1–4 ranks (every layout, causal and not, logits ×30,
    float32); your inputs left unchanged; messages only to rank r+1, at most one K/V block each, 2·(W−1) of them
    (counted by the grader and refused beyond); and the memory a rank holds on 12 ranks (capped by the grader: a
    ring fits, a rank holding every rank's K/V does not).
    """
    raise NotImplementedError(
        'Exercise 5a.3 (ring_attention_forward): At step s rank r holds the K/V block of rank (r - s) mod W; '
        'K/V move one rank forward per step, queries never move. Post the next hop before computing the '
        'current block, and merge each block into a running (out, lse) with your 5a.1. With causal=True, the '
        'given block_plan says what part of each block to compute. More help: hint("5a.3").')


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H, S/W, D) sequence-sharded → (B, H/W, S, D) head-sharded, by one all-to-all.

    Rank r gets heads [r·H/W, (r+1)·H/W) of all S tokens (token chunks in rank order).
    Differentiable (its backward is :func:`heads_to_seq`).  H not divisible by W → ValueError.

    Graded on: exact slices on 2 and 4 ranks, the round trip bitwise, your input left unchanged, and ValueError on
    every rank (before any message) when the heads do not divide.
    """
    raise NotImplementedError(
        'Exercise 5a.4 (seq_to_heads): Before: every rank has all H heads of its n = L/W tokens. After: every'
        ' rank has H/W heads of all L tokens. One all-to-all does it: slice w of what a rank sends goes to '
        'rank w. heads_to_seq is the mirror image. More help: hint("5a.4").')


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H/W, S, D) head-sharded → (B, H, S/W, D) sequence-sharded: the inverse of :func:`seq_to_heads`.

    Graded on: exact slices on 2 and 4 ranks, the round trip bitwise, and your input left unchanged.
    """
    raise NotImplementedError(
        'Exercise 5a.4 (heads_to_seq): Before: every rank has all H heads of its n = L/W tokens. After: every'
        ' rank has H/W heads of all L tokens. One all-to-all does it: slice w of what a rank sends goes to '
        'rank w. heads_to_seq is the mirror image. More help: hint("5a.4").')


def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, *, causal: bool = False,
                            layout: str = "contiguous", group=None, kernel: str = "fused"
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention, backward: this rank's (dq, dk, dv), given the forward's FINAL out and lse.

    dout, q, out: (B, H, n, D) and lse: (B, H, n), this rank's n = S/W query rows in ``layout`` order
    (out and lse as :func:`ring_attention_forward` returned them); k, v: (B, H_kv, n, D), this rank's
    K/V.  Returns dq (B, H, n, D) and dk, dv (B, H_kv, n, D) in the inputs' dtypes: the rows of the
    full attention's gradients that belong to this rank's tokens.  Every rank of ``group`` must call
    it with the same shapes.

    Per (query block, key block) the FlashAttention-2 backward (arXiv:2307.08691), with the row's
    global lse and D, so that block shares simply add up (scale = 1/√D; ``attention_block_backward``
    computes one block's share)::

        P  = exp(scale·Q Kᵀ − lse)          this block's exact part of the softmax (lse over ALL keys)
        D  = rowsum(dO ∘ O)                 O: the final output over all keys
        dV_j += Pᵀ dO        dS = P ∘ (dO Vᵀ − D)        dQ += scale·dS K_j        dK_j += scale·dSᵀ Q

    Q, dO, O, lse and dQ stay on their rank.  K/V travel the ring as in the forward; the dK/dV
    accumulator of each block travels one step behind it, gathering every rank's share, and comes
    home to the block's owner.  Rank 1's block on W = 4 (each arrow one hop, r → r+1)::

        K1, V1     r1 ─▶ r2 ─▶ r3 ─▶ r0              K/V hops at steps 0, 1, 2            (what="kv")
        dK1, dV1         r2 ─▶ r3 ─▶ r0 ─▶ r1        accumulator hops at steps 1, 2, 3    (what="dkv")
                         +r2   +r3   +r0   +r1       each adds its share; r1's is its step-0 share,
                         (starts from zeros)         kept aside until the accumulator comes home

    Bytes sent per rank: (W−1)·2·n·H_kv·D·b for K/V (b bytes per value), and (W−1)·2·n·H_kv·D·b_acc
    for the dK/dV accumulators, which travel in the accumulation dtype (float32: b_acc = 4 for
    bfloat16 or float16 inputs, b_acc = b otherwise): twice the forward's bytes in float32, three times
    with bfloat16 K/V (b = 2, b_acc = 4).  Blocks are planned as in the forward
    (:func:`block_plan`: causal layouts skip masked blocks); compute events are traced with
    ``what="attn_bwd"``, messages with ``phase="bwd"``.

    Graded on: (dq, dk, dv) against float64 autograd of full attention on 1–4 ranks (every layout, causal and not,
    odd lengths, scores ±50, float32, fewer K/V heads); your inputs left unchanged; messages only to rank r+1, at
    most one K/V or dK/dV block each, 4·(W−1) of them (counted by the grader and refused beyond); and the memory a
    rank holds on 12 ranks (capped by the grader).
    """
    raise NotImplementedError(
        "Exercise 5a.5 (ring_attention_backward): Q, dO, O and lse stay on their rank; K/V go round the ring "
        "again, as in your forward. A rank's share of dK/dV for a block belongs to the block's OWNER, not to "
        "the rank that computed it: how does it get home? More help: hint(\"5a.5\").")
