"""Lecture 5c — rank functions the notebook and the tests run on a world (spawned ranks cannot
pickle functions defined in a notebook cell)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .mesh import RankGrid

__all__ = ["group_sums", "device_mesh_groups"]


def group_sums(grids: list[dict], axes: list[str]) -> list[dict]:
    """For each grid (a dict of sizes), all-reduce 2**rank over ``grid.group(axis)`` for every axis.

    The sum's set bits are exactly the ranks that took part: ``bits == Σ 2**q for q in
    grid.ranks(axis)`` proves the process group and the arithmetic agree.  Also returns the
    members torch reports for the group and whether a second ``group(axis)`` call hit the cache.
    """
    r = dist.get_rank()
    out = []
    for sizes in grids:
        grid = RankGrid(dist.get_world_size(), **sizes)
        res = {}
        for axis in axes:
            g = grid.group(axis)
            t = torch.tensor([2 ** r], dtype=torch.int64)
            comm.all_reduce(t, group=g, what=f"grid_{axis}")
            members = sorted(dist.get_global_rank(g, i) for i in range(dist.get_world_size(g)))
            res[axis] = dict(bits=int(t.item()), members=members, cached=grid.group(axis) is g)
        out.append(res)
    return out


def device_mesh_groups(sizes: dict) -> dict[str, list[int]]:
    """This rank's groups in PyTorch's ``DeviceMesh`` over dims (pp, dp, cp, tp) — torchtitan's layout.

    The production peer of :class:`RankGrid`'s dense grid: the same sizes must give the same groups.
    """
    from torch.distributed.device_mesh import init_device_mesh
    names = ("pp", "dp", "cp", "tp")
    mesh = init_device_mesh("cpu", tuple(sizes.get(n, 1) for n in names), mesh_dim_names=names)
    return {n: sorted(dist.get_process_group_ranks(mesh.get_group(n))) for n in names}
