"""Checks for exercise 3.1 all_reduce_gradients: every .grad the mean over ranks."""
from __future__ import annotations

import torch

from .common import ALLREDUCE, H


def _grads(ctx, W: int, seed: int, scale: float = 1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(ctx.seed(seed))
    shapes = [(3, 4), (5,), None, (2, 2, 2)]
    return [[None if s is None else (torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype)
             for s in shapes] for _ in range(W)]


def _allreduce_case(ctx, W: int, seed: int, scale: float = 1.0, dtype=torch.float64):
    per_rank = _grads(ctx, W, seed, scale, dtype)
    res = ctx.ranks(W, f"{H}:grads_per_rank", per_rank=per_rank)
    for r, got in enumerate(res.values):
        for i, g in enumerate(per_rank[0]):
            if g is None:
                ctx.expect(got[i] is None, f"rank {r}: parameter {i} had no gradient on any rank; its .grad must stay "
                           "None (skip it: every rank skips the same ones).")
                continue
            want = torch.stack([per_rank[q][i].double() for q in range(W)]).mean(0)
            ctx.compare(got[i], want.to(dtype), f"gradient {i}", rank=r, world_size=W, case=f"W={W}, scale {scale:g}",
                        atol=1e-12 * scale if dtype == torch.float64 else 1e-5 * scale,
                        rtol=1e-10 if dtype == torch.float64 else 1e-5,
                        extra={"input": per_rank[r][i]})


@ALLREDUCE.check("2 ranks: every .grad becomes the mean over ranks; a missing .grad stays None", points=2)
def _(ctx):
    _allreduce_case(ctx, 2, seed=301)


@ALLREDUCE.check("4 ranks, gradients of magnitude 1e6", points=2)
def _(ctx):
    _allreduce_case(ctx, 4, seed=302, scale=1e6)


