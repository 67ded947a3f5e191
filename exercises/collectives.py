"""Lecture 0 exercises — collectives from point-to-point messages.  Reference: ``reference/collectives.py``.

Use ``reference.comm`` to talk to other ranks: ``comm.exchange([(tensor, dst)], [(buffer, src)])``
posts a send and a receive together and returns something you ``.wait()`` on; ``comm.ring_peers()``
gives ``(next, prev)``.  (Plain ``torch.distributed`` works too.)  Check your work with
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
    """
    raise NotImplementedError(
        "Exercise 0.1 (first half): ring reduce-scatter. Hints: cut tensor.flatten() into N chunks with "
        "torch.tensor_split (clone them: you will add into them); for s in 0..N-2 send chunk (r - s) % N to "
        "the next rank and add the chunk (r - s - 1) % N received from the previous one, posting both at once "
        "with comm.exchange([(chunk, nxt)], [(buffer, prv)]).wait(). Return chunk (r + 1) % N.")


def ring_all_reduce(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group`` with a ring: reduce-scatter, then all-gather.

    tensor: any shape and dtype, the same shape on every rank; it is not modified.
    Returns a new tensor of the same shape holding ``sum_r tensor_r`` on every rank.
    Bytes sent per rank: 2·(N-1)/N · tensor.nbytes (exactly, when N divides numel).
    """
    raise NotImplementedError(
        "Exercise 0.1: ring all-reduce. Hints: a ring reduce-scatter (above) leaves rank r with the complete "
        "sum of chunk (r + 1) % N; a ring all-gather (exercise 0.2) hands the complete chunks round until "
        "everyone has all of them. With one rank, return a copy. Keep the input unchanged and the shape.")


def ring_all_gather(chunk: torch.Tensor, numel: int, *, group=None) -> torch.Tensor:
    """Gather a flat tensor of ``numel`` elements cut into N chunks (as :func:`chunk_bounds`).

    chunk: on rank r, flat chunk ``(r + 1) mod N`` — where a ring reduce-scatter leaves it.
    Returns the whole flat tensor (``numel`` elements) on every rank.  Bytes sent: (N-1)/N · n.
    """
    raise NotImplementedError(
        "Exercise 0.2: ring all-gather. Hints: make N empty chunk buffers of the sizes chunk_bounds(numel, N) "
        "gives, put yours at index (r + 1) % N, then for N-1 steps send the chunk you got last to the "
        "next rank and receive the next one from the previous rank.")
