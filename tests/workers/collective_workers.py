"""Rank functions for tests/test_trace_and_collectives.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import collectives, comm, trace
from reference.collectives import chunk_bounds


def _inputs(numel: int, scale: float, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(numel, dtype=torch.float64, generator=g) * scale for _ in range(n)]


def all_reduce_case(numel: int, scale: float):
    r, n = dist.get_rank(), dist.get_world_size()
    xs = _inputs(numel, scale, n)
    mine = xs[r].clone()
    got = collectives.ring_all_reduce(mine)
    assert torch.equal(mine, xs[r]), "input was modified"
    return got, torch.stack(xs).sum(0)


def all_gather_case(numel: int):
    r, n = dist.get_rank(), dist.get_world_size()
    full = _inputs(numel, 1.0, 1)[0]
    a, b = chunk_bounds(numel, n)[(r + 1) % n]
    return collectives.ring_all_gather(full[a:b].clone(), numel), full


def library_collectives(numel: int):
    x = torch.ones(numel, dtype=torch.float32)
    comm.all_reduce(x)
    comm.all_gather(torch.ones(numel // dist.get_world_size()))
    with trace.span("compute", step=0, pairs=7):
        pass
    return float(x[0])
