"""Where each axis's groups sit on the cluster: inside one node (NVLink) or across nodes (the NIC), and for
the experts' all-to-all how many nodes a group spans and how many of its ranks share a node.

Two grids over the same ranks, as the course's ``reference.mesh.RankGrid`` and Megatron-Core's
``RankGenerator`` build them (fastest-varying first)::

    dense layers     tp · cp · dp · pp                   rank = tp_r + tp·(cp_r + cp·(dp_r + dp·pp_r))
    expert layers    etp · ep · edp · pp                 edp = tp·cp·dp / (etp·ep)

Both keep the pipeline outermost, so each stage owns one contiguous block of tp·cp·dp ranks, and the
expert grid is *folded* over that block (MoE parallel folding, Liu et al. arXiv:2504.14960): the experts'
own tensor size etp and expert-parallel size ep need not be the dense tp and dp.  16 ranks per stage on
two 8-GPU nodes, tp 4, dp 4; experts etp 1, ep 8, edp 2::

    stage ranks      0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15        (| : tp groups)
    node             0  0  0  0   0  0  0  0   1  1  1  1    1  1  1  1
    ep groups        {0 … 7}  {8 … 15}          — each inside one node: the all-to-all rides NVLink
    with etp = tp = 4, ep 4: ep groups {0, 4, 8, 12} …  — every group spans both nodes

The planner is its own layer: it computes the groups by the same arithmetic instead of importing the
grid, and ``tests/planner`` holds the two equal wherever ``RankGrid`` can state the composition.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["Span", "DENSE_ORDER", "EXPERT_ORDER", "axis_groups", "group_spans"]

DENSE_ORDER = ("tp", "cp", "dp", "pp")
EXPERT_ORDER = ("etp", "ep", "edp", "pp")


@dataclass(frozen=True)
class Span:
    """The worst group of an axis: the most nodes it spans, and the fewest of its ranks one of those nodes
    holds (the rank with the most peers to reach across nodes)."""
    nodes: int
    local: int

    @property
    def link(self) -> str:
        return "intra" if self.nodes == 1 else "inter"


def axis_groups(sizes: dict[str, int], order: tuple[str, ...], axes: tuple[str, ...]) -> np.ndarray:
    """Every group of ``axes`` on a grid of ``sizes`` laid out in ``order`` (fastest-varying first): an array
    (groups, members) of global ranks — the ranks whose coordinates differ only on ``axes``."""
    grid = np.arange(int(np.prod([sizes[a] for a in order]))).reshape([sizes[a] for a in reversed(order)])
    dims = [len(order) - 1 - order.index(a) for a in axes]
    moved = np.moveaxis(grid, dims, list(range(grid.ndim - len(dims), grid.ndim)))
    return moved.reshape(-1, int(np.prod([sizes[a] for a in axes])))


def _span(groups: np.ndarray, per_node: int) -> Span:
    """The worst of ``groups``: the most nodes one spans, the fewest members one of its nodes holds."""
    nodes = np.sort(groups // per_node, axis=1)
    starts = np.ones(nodes.shape, dtype=bool)
    starts[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
    run = np.cumsum(starts, axis=1) - 1                       # which node (run) of its group each member is in
    counts = np.zeros(nodes.shape, dtype=int)
    np.add.at(counts, (np.arange(nodes.shape[0])[:, None], run), 1)
    return Span(int(run[:, -1].max()) + 1, int(counts[counts > 0].min()))


@lru_cache(maxsize=4096)
def group_spans(world: int, dp: int, tp: int, pp: int, cp: int, ep: int, etp: int, per_node: int
                ) -> dict[str, Span]:
    """{axis: Span} for tp, cp, dp, pp, dp_cp (the dense gradients' group) and the expert grid's etp, ep, edp.
    Raises ValueError when the sizes do not multiply to ``world`` or etp·ep does not divide tp·cp·dp."""
    block = tp * cp * dp
    if block * pp != world:
        raise ValueError(f"tp·cp·dp·pp = {tp}·{cp}·{dp}·{pp} = {block * pp} but the cluster has {world} devices")
    if block % (etp * ep):
        raise ValueError(f"etp·ep = {etp}·{ep} = {etp * ep} must divide the stage's tp·cp·dp = {tp}·{cp}·{dp} = "
                         f"{block} ranks (the expert grid is folded over them)")
    dense = dict(tp=tp, cp=cp, dp=dp, pp=pp)
    expert = dict(etp=etp, ep=ep, edp=block // (etp * ep), pp=pp)
    out = {a: _span(axis_groups(dense, DENSE_ORDER, (a,)), per_node) for a in DENSE_ORDER}
    out["dp_cp"] = _span(axis_groups(dense, DENSE_ORDER, ("cp", "dp")), per_node)
    out.update({a: _span(axis_groups(expert, EXPERT_ORDER, (a,)), per_node) for a in ("etp", "ep", "edp")})
    return out
