"""Lecture 5a exercises — sequence parallelism.  Reference: ``reference/sequence/``.

    5a.1  merge_attention                       fold two partial attention results into one
    5a.2  shard_sequence, unshard_sequence      contiguous, zigzag and striped layouts
    5a.3  ring_attention_forward                Q stays, K/V travel the ring
    5a.4  seq_to_heads, heads_to_seq            the Ulysses all-to-all

Given (not exercises): ``attention_block(q, k, v, causal=..)`` returns ``(out, lse)`` for one block
of keys (the fused CPU kernel; ``attention_block_explicit`` is the same written out with matmuls),
and ``reference.comm`` for messages: ``comm.exchange([(t, dst)], [(buf, src)]).wait()`` posts a send
and a receive together; ``comm.ring_peers(group)`` gives ``(next, prev)``; ``comm.all_to_all``.
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
        "Exercise 5a.1: merge two attention results. Hints: each side's weight is its share of the "
        "softmax mass, e^{lse_a} / (e^{lse_a} + e^{lse_b}); never compute e^{lse} itself (it overflows "
        "for large logits) — subtract m = torch.maximum(lse_a, lse_b) first. lse has no head_dim axis: "
        "unsqueeze(-1) the weights before multiplying out_a and out_b. Where lse_a = -inf, side a's "
        "weight must be exactly 0.")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (a new contiguous tensor).

    x: e.g. (batch, heads, S, head_dim) with ``dim=-2``.  Returns the same shape with S/W along ``dim``.
    Raises ValueError if S is not a multiple of the layout's number of chunks.
    """
    raise NotImplementedError(
        "Exercise 5a.2: shard a sequence. Hints: contiguous — cut S into W chunks (x.chunk(W, dim)), "
        "rank r takes chunk r; zigzag — cut into 2W chunks, rank r takes chunk r then chunk 2W-1-r "
        "(torch.cat along dim); striped — token i goes to rank i mod W: slice r::W along dim "
        "(x.movedim(dim, 0) makes that easy). Check S % (number of chunks) first and raise ValueError. "
        "Return .contiguous() tensors.")


def unshard_sequence(shards: list[torch.Tensor], layout: str, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is rank r's shard; returns the full tensor."""
    raise NotImplementedError(
        "Exercise 5a.2: put the shards back in sequence order. Hints: W = len(shards). contiguous — "
        "concatenate; zigzag — split each shard in two halves: rank r's first half is chunk r, its "
        "second half chunk 2W-1-r; striped — local token a of rank r is global token a·W + r: "
        "torch.stack(shards, dim+1) then flatten(dim, dim+1) interleaves them (use a non-negative dim).")


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
        "Exercise 5a.3: ring attention forward. Hints: r = comm.rank(group), W = comm.world_size(group), "
        "(nxt, prv) = comm.ring_peers(group). For s in 0..W-1 you hold the K/V of rank j = (r - s) % W. "
        "Before computing, post the next hop: comm.exchange([(k_cur, nxt), (v_cur, nxt)], "
        "[(k_buf, prv), (v_buf, prv)], group=group, step=s, what='kv') (not on the last step; never a "
        "blocking send then recv: that deadlocks). Compute your queries against the held block with "
        "attention_block(q, k_blk, v_blk, causal=...) and fold it into the running (out, lse) with your "
        "merge_attention; then .wait() and swap buffers. Causal: whether a block is full, causal (diagonal included), strictly causal or skipped depends on the global positions of your queries and of rank j's keys in the layout — sketch the score matrix (contiguous: j < r full, j == r causal, j > r skip; zigzag and striped: work it out, a block may be only half visible). A fully masked block makes no call. Accumulate out in float32 or wider; return (out in q's dtype, lse).")


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H, S/W, D) sequence-sharded → (B, H/W, S, D) head-sharded, by one all-to-all.

    Rank r gets heads [r·H/W, (r+1)·H/W) of all S tokens (token chunks in rank order).
    Differentiable (its backward is :func:`heads_to_seq`).  H not divisible by W → ValueError.
    """
    raise NotImplementedError(
        "Exercise 5a.4: sequence-sharded to head-sharded. Hints: W = comm.world_size(group); check "
        "x.shape[1] % W first and raise ValueError (on every rank, before any communication). Cut the heads "
        "into W groups and stack them as the first axis: x.reshape(B, W, H//W, n, D).transpose(0, 1)"
        ".contiguous(); comm.all_to_all_single(out, send, group=group) sends slice w to rank w and "
        "fills slice w of out from rank w; then put the W received sequence chunks in rank order along "
        "the sequence axis. (The graded version need not be differentiable.)")


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H/W, S, D) head-sharded → (B, H, S/W, D) sequence-sharded: the inverse of :func:`seq_to_heads`."""
    raise NotImplementedError(
        "Exercise 5a.4: head-sharded back to sequence-sharded. Hints: the mirror image of seq_to_heads — "
        "cut the sequence into W chunks as the first axis (x.reshape(B, h, W, S//W, D).permute(2, 0, 1, 3, 4)"
        ".contiguous()), one all_to_all_single, then the slice from rank w is head group w: put the groups "
        "side by side along the head axis.")
