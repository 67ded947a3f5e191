"""Lecture 0 exercises — collectives from point-to-point messages.  Reference: ``reference/collectives.py``.

Use ``reference.comm`` to talk to other ranks: ``comm.exchange([(tensor, dst)], [(buffer, src)])``
posts a send and a receive together and returns something you ``.wait()`` on; ``comm.ring_peers()``
gives ``(next, prev)``.  (Plain ``torch.distributed`` send/recv work too; its collectives are
switched off while these exercises are graded — building them is the exercise.)  Check your work with
``check("0.1")`` in the notebook or ``python -m exercises.grade 0.1``.
"""
from __future__ import annotations

import torch

from reference import comm  # noqa: F401  (the traced send/recv/exchange you will need)
from reference.collectives import chunk_bounds  # noqa: F401  (given: where each chunk starts and stops)

__all__ = ["ring_reduce_scatter", "ring_all_reduce", "ring_all_gather"]


def ring_reduce_scatter(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``; return this rank's chunk of the sum.

    tensor: any shape, same on every rank.  Returns the flat chunk ``(r + 1) mod N`` of
    ``sum_ranks(tensor).flatten()`` (chunks as :func:`chunk_bounds`).  Bytes sent: (N-1)/N · n.

    Graded on: the full sum of chunk (r+1) mod N on every rank of 3, your input left unchanged, and — counted by the
    grader, refused beyond — messages only to rank r+1, one chunk each, N−1 of them.
    """
    raise NotImplementedError(
        'Exercise 0.1 (ring_reduce_scatter): A ring all-reduce is a reduce-scatter (N-1 steps: send a chunk '
        'right, add the one from the left) followed by an all-gather (N-1 steps: pass finished chunks round).'
        ' Post each step\'s send and receive together. More help: hint("0.1").')


def ring_all_reduce(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group`` with a ring: reduce-scatter, then all-gather.

    tensor: any shape and dtype, the same shape on every rank; it is not modified.
    Returns a new tensor of the same shape holding ``sum_r tensor_r`` on every rank.
    Bytes sent per rank: 2·(N-1)/N · tensor.nbytes (exactly, when N divides numel).

    Graded on: the sum on every rank (1–4 ranks, sizes N does not divide, values of 1e6, int64), your input left
    unchanged, and — counted by the grader, refused beyond — messages only to rank r+1, one chunk each, 2·(N−1) of
    them.
    """
    raise NotImplementedError(
        'Exercise 0.1 (ring_all_reduce): A ring all-reduce is a reduce-scatter (N-1 steps: send a chunk '
        'right, add the one from the left) followed by an all-gather (N-1 steps: pass finished chunks round).'
        ' Post each step\'s send and receive together. More help: hint("0.1").')


def ring_all_gather(chunk: torch.Tensor, numel: int, *, group=None) -> torch.Tensor:
    """Gather a flat tensor of ``numel`` elements cut into N chunks (as :func:`chunk_bounds`).

    chunk: on rank r, flat chunk ``(r + 1) mod N`` — where a ring reduce-scatter leaves it.
    Returns the whole flat tensor (``numel`` elements) on every rank.  Bytes sent: (N-1)/N · n.

    Graded on: the whole tensor on every rank (2–4 ranks, uneven chunks, float32), your chunk left unchanged, and —
    counted by the grader, refused beyond — messages only to rank r+1, one chunk each, N−1 of them.
    """
    raise NotImplementedError(
        'Exercise 0.2 (ring_all_gather): An all-gather on a ring: each rank starts with one finished chunk '
        'and, for N-1 steps, passes the chunk it got last to the next rank while receiving a new one from the'
        ' previous rank. More help: hint("0.2").')
