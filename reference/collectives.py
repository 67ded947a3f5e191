"""Lecture 0 — collectives built from point-to-point messages on a ring.

An all-reduce of a tensor of ``n`` bytes over ``N`` ranks, done as a ring, is two passes:

    reduce-scatter   N-1 steps; each rank ends with the full sum of one chunk   (N-1)/N · n bytes sent
    all-gather       N-1 steps; the summed chunks travel until all ranks hold all  (N-1)/N · n bytes sent
                     ------------------------------------------------------------------------------
    all-reduce                                                                  2·(N-1)/N · n bytes sent

The tensor is cut into N chunks (``torch.tensor_split``, so any size works).  At step ``s`` of the
reduce-scatter rank ``r`` sends chunk ``(r - s) mod N`` to rank ``r+1`` and adds the chunk
``(r - s - 1) mod N`` it receives from rank ``r-1`` into its own copy.  Four ranks, chunks a-d::

    step 0:  r0 sends a ▶ r1   r1 sends b ▶ r2   r2 sends c ▶ r3   r3 sends d ▶ r0
    step 1:  r0 sends d ▶ r1   r1 sends a ▶ r2   r2 sends b ▶ r3   r3 sends c ▶ r0
    step 2:  r0 sends c ▶ r1   r1 sends d ▶ r2   r2 sends a ▶ r3   r3 sends b ▶ r0
    now rank r holds the complete sum of chunk (r + 1) mod N: r0 has b, r1 has c, r2 has d, r3 has a.

Every step posts its send and receive together (``comm.exchange``), never a blocking send then a
blocking receive: if every rank sends first, every rank waits for a receiver that never comes.

Each message is traced with ``meta={"phase": "reduce-scatter" | "all-gather", "chunk": c}`` (on a
send event the chunk sent, on a receive event the chunk received).
"""
from __future__ import annotations

import torch

from . import comm

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "chunk_bounds"]


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the ``world_size`` chunks of a flat tensor (as ``tensor_split``)."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_reduce_scatter(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``; return this rank's chunk of the sum.

    tensor: any shape, same on every rank.  Returns the flat chunk ``(r + 1) mod N`` of
    ``sum_ranks(tensor).flatten()`` (chunks as :func:`chunk_bounds`).  Bytes sent: (N-1)/N · n.

    Graded on: the full sum of chunk (r+1) mod N on every rank of 3, your input left unchanged, and — counted by the
    grader, refused beyond — messages only to rank r+1, one chunk each, N−1 of them.
    """
    n, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    chunks = [c.clone() for c in torch.tensor_split(tensor.detach().flatten(), n)]
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n     # pass on chunk r-s, receive chunk r-s-1
        buf = torch.empty_like(chunks[recv_c])
        comm.exchange([(chunks[send_c], nxt)], [(buf, prv)], group=group, step=s,
                      phase="reduce-scatter", chunk=send_c, recv_meta={"chunk": recv_c}).wait()
        chunks[recv_c] += buf                              # now holds s + 2 ranks' contributions
    return chunks[(r + 1) % n]


def ring_all_gather(chunk: torch.Tensor, numel: int, *, group=None) -> torch.Tensor:
    """Gather a flat tensor of ``numel`` elements cut into N chunks (as :func:`chunk_bounds`).

    chunk: on rank r, flat chunk ``(r + 1) mod N`` — where a ring reduce-scatter leaves it.
    Returns the whole flat tensor (``numel`` elements) on every rank.  Bytes sent: (N-1)/N · n.

    Graded on: the whole tensor on every rank (2–4 ranks, uneven chunks, float32), your chunk left unchanged, and —
    counted by the grader, refused beyond — messages only to rank r+1, one chunk each, N−1 of them.
    """
    n, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    chunks = [torch.empty(b - a, dtype=chunk.dtype, device=chunk.device) for a, b in chunk_bounds(numel, n)]
    own = (r + 1) % n
    if chunks[own].shape != chunk.shape:
        raise ValueError(f"rank {r}: chunk has {chunk.numel()} elements, expected {chunks[own].numel()} "
                         f"(chunk {own} of {numel} split {n} ways)")
    chunks[own].copy_(chunk)
    for s in range(n - 1):
        send_c, recv_c = (own - s) % n, (own - s - 1) % n  # pass on the newest complete chunk
        comm.exchange([(chunks[send_c], nxt)], [(chunks[recv_c], prv)], group=group, step=s,
                      phase="all-gather", chunk=send_c, recv_meta={"chunk": recv_c}).wait()
    return torch.cat(chunks)


def ring_all_reduce(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group`` with a ring: reduce-scatter, then all-gather.

    tensor: any shape and dtype, the same shape on every rank; it is not modified.
    Returns a new tensor of the same shape holding ``sum_r tensor_r`` on every rank.
    Bytes sent per rank: 2·(N-1)/N · tensor.nbytes (exactly, when N divides numel).

    Graded on: the sum on every rank (1–4 ranks, sizes N does not divide, values of 1e6, int64), your input left
    unchanged, and — counted by the grader, refused beyond — messages only to rank r+1, one chunk each, 2·(N−1) of
    them.
    """
    if comm.world_size(group) == 1:
        return tensor.detach().clone()
    mine = ring_reduce_scatter(tensor, group=group)
    return ring_all_gather(mine, tensor.numel(), group=group).view(tensor.shape)
