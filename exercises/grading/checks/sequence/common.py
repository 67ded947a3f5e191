"""Shared by the checks of lecture 5a: harness paths, time limit, and the ground truth written out
independently of the learner's and the reference's code."""
from __future__ import annotations

import math

import torch

from ...core import salted_seed

H = "exercises.grading.harness"
ME = "exercises.grading.harness.sequence"
RANKS_TIMEOUT = 12.0   # seconds: every multi-rank run here takes well under one; a deadlock is reported after this

# ----------------------------------------------------------------------------------------------
# Ground truth, written out independently


def layout_positions(seq_len: int, rank: int, world_size: int, layout: str) -> list[int]:
    """Global token positions rank ``rank`` holds, in local order (from the layouts' definitions)."""
    W, S = world_size, seq_len
    if layout == "contiguous":
        c = S // W
        return list(range(rank * c, (rank + 1) * c))
    if layout == "zigzag":
        h = S // (2 * W)
        return list(range(rank * h, (rank + 1) * h)) + list(range((2 * W - 1 - rank) * h, (2 * W - rank) * h))
    if layout == "striped":
        return list(range(rank, S, W))
    raise ValueError(layout)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None):
    """float64 attention with an explicit boolean mask ``keep`` (Sq, Sk); rows with no key: out 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return p @ v, lse


def _randn(shape, seed: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(salted_seed(seed))
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
