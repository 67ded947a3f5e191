"""Lecture 5b, part 3 (helpers) — which rank holds which experts, and the kept assignments in sending order.

Shared by the padded and dropless paths of :mod:`.parallel` and the overlapped halves of :mod:`.overlap`.
"""
from __future__ import annotations

import torch

from .. import comm

__all__ = ["_experts_per_rank", "_kept_assignments", "_by_expert"]


def _experts_per_rank(num_experts: int, group) -> tuple[int, int]:
    """(W, E_local); ValueError (the same on every rank, before any message) if E % W != 0."""
    W = comm.world_size(group)
    if num_experts % W:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {W} ranks")
    return W, num_experts // W


def _kept_assignments(routing):
    """(t, j) of the kept assignments and their expert e."""
    t, j = torch.nonzero(routing["kept"], as_tuple=True)
    return t, j, routing["expert_index"][t, j]


def _by_expert(routing: dict, num_experts: int, padded: bool = False):
    """The kept assignments sorted by (expert, slot), the order they are sent in; counts per expert.

    padded: also check that each expert's slots are 0, 1, …, count - 1 (as :func:`top_k_gating` fills
    them), so that its rows are the first ``count`` of its C in a padded buffer (:func:`_pad`)."""
    T, k = routing["expert_index"].shape
    t, j, e = _kept_assignments(routing)
    order = (e * (k * T) + routing["slot"][t, j]).argsort()
    t, j, e = t[order], j[order], e[order]
    counts = torch.bincount(e, minlength=num_experts)
    if padded:
        first = torch.cumsum(counts, 0) - counts                                    # each expert's first row
        if not torch.equal(routing["slot"][t, j], torch.arange(len(t), device=t.device) - first[e]):
            raise ValueError("each expert's kept slots must be 0, 1, ..., count - 1 (as top_k_gating fills them)")
    return t, j, counts
