"""Rank functions for tests/test_mesh.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference import comm
from reference.mesh import RankGrid


def group_sums(grids: list[dict], axes: list[str]) -> list[dict]:
    """For each grid, all-reduce 2**rank over ``group(axis)``: the sum's bits are the members.

    Also returns the members torch reports for the group, and the group object's identity on a
    second call (the cache).
    """
    r = dist.get_rank()
    out = []
    for sizes in grids:
        grid = RankGrid(dist.get_world_size(), **sizes)
        res = {}
        for axis in axes:
            g = grid.group(axis)
            t = torch.tensor([2 ** r], dtype=torch.int64)
            comm.all_reduce(t, group=g, what=f"mesh_{axis}")
            members = sorted(dist.get_global_rank(g, i) for i in range(dist.get_world_size(g)))
            res[axis] = dict(bits=int(t.item()), members=members, cached=grid.group(axis) is g)
        out.append(res)
    return out
