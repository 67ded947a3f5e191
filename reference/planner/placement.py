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
grid, and the full course's ``tests/planner`` holds the two equal wherever ``RankGrid`` can state the composition.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["Span", "axis_layout", "axis_groups", "group_spans"]


@dataclass(frozen=True)
class Span:
    """The worst group of an axis: the most nodes it spans, and the fewest of its ranks one of those nodes
    holds (the rank with the most peers to reach across nodes)."""
    nodes: int
    local: int

    @property
    def link(self) -> str:
        return "intra" if self.nodes == 1 else "inter"


def axis_layout(dp: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> dict[str, tuple[int, int]]:
    """{axis: (stride, size)}: an axis's groups are r + stride·{0, …, size − 1}, stride the product of the sizes of
    the axes faster than it (tp-cp-dp-pp dense, etp-ep-edp-pp for the experts; dp_cp: cp and dp together)."""
    block = tp * cp * dp
    return dict(tp=(1, tp), cp=(tp, cp), dp=(tp * cp, dp), pp=(block, pp), dp_cp=(tp, cp * dp),
                etp=(1, etp), ep=(etp, ep), edp=(etp * ep, block // (etp * ep)))


def _bases(world: int, stride: int, size: int) -> np.ndarray:
    """The first rank of every group of an axis laid out as (``stride``, ``size``): its coordinate 0."""
    ranks = np.arange(world)
    return ranks[(ranks // stride) % size == 0]


def axis_groups(world: int, stride: int, size: int) -> np.ndarray:
    """Every group of an axis laid out as (``stride``, ``size``) on ``world`` ranks: an array (groups, members)."""
    return _bases(world, stride, size)[:, None] + stride * np.arange(size)[None, :]


@lru_cache(maxsize=65536)
def _span(world: int, stride: int, size: int, per_node: int) -> Span:
    """The worst group of an axis whose groups are b + stride·{0, …, size−1} (one axis, or adjacent ones, of a
    mixed-radix grid): the most nodes one spans, the fewest members one of its nodes holds.  The bases are
    q·stride·size + j (j < stride), and only a base modulo the node size decides how its group falls on nodes:
    one group per residue is enough."""
    groups = world // (stride * size)
    residues = {(q * stride * size + j) % per_node for q in range(min(groups, per_node))
                for j in range(min(stride, per_node))}
    worst_nodes, worst_local = 1, size
    for r in residues:
        if stride >= per_node:                          # consecutive members a node or more apart
            nodes, local = size, 1
        else:
            counts = Counter((r + stride * i) // per_node for i in range(size)).values()
            nodes, local = len(counts), min(counts)
        worst_nodes, worst_local = max(worst_nodes, nodes), min(worst_local, local)
    return Span(worst_nodes, worst_local)


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
    layout = axis_layout(dp, tp, pp, cp, ep, etp)
    return {a: _span(world, stride, size, per_node) for a, (stride, size) in layout.items()}
