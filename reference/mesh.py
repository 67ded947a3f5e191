"""Lecture 5c — the rank grid: which ranks talk to which on each axis of a composed run.

A run with ``tp × cp × dp × pp = N`` ranks gives every rank one coordinate per axis and one group
per axis (the ranks that differ from it on that axis only).  :class:`RankGrid` computes those
groups by arithmetic — no world needed — so tests, the planner and the widget use the same grid
that a training run builds with :meth:`RankGrid.group`.

The order (dense layers): tp-cp-dp-pp, tensor fastest-varying
-------------------------------------------------------------
    rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))

16 ranks, tp=2, cp=2, dp=2, pp=2, two nodes of 8 devices::

              node 0 (fast links)                     node 1
      ┌──────────────────────────────────┐   ┌──────────────────────────────────┐
      │  pp stage 0                      │   │  pp stage 1                      │
      │         cp 0        cp 1         │   │         cp 0        cp 1         │
      │  dp 0  [ 0  1]     [ 2  3]       │   │  dp 0  [ 8  9]     [10 11]       │
      │  dp 1  [ 4  5]     [ 6  7]       │   │  dp 1  [12 13]     [14 15]       │
      └──────────────────────────────────┘   └──────────────────────────────────┘
      [..] = a tensor-parallel group (neighbouring ranks)
      cp group of rank 0: {0, 2}      dp group of rank 0: {0, 4}      pp group of rank 0: {0, 8}

Why this order: bandwidth.  Neighbouring ranks share a node (NVLink, ~10× the bandwidth of the
links between nodes), so the axis that talks most belongs innermost.  Tensor parallelism
all-reduces activations four times per layer per micro-batch, in the critical path; context
parallelism passes K/V blocks every layer; data parallelism all-reduces gradients once per step
(and can overlap them with the backward); pipeline parallelism sends one activation per
micro-batch per stage boundary.  Chattiest innermost, quietest outermost: tp, cp, dp, pp.

Experts: the expert grid etp-ep-edp-pp, folded over the tensor × context × data ranks
----------------------------------------------------------------------------------------
MoE layers use another factorisation of the SAME ranks ("MoE parallel folding", Megatron-Core,
arXiv:2504.14960): inside each pipeline stage, the ``tp·cp·dp`` ranks are laid out again as

    rank = etp_rank + etp·(ep_rank + ep·(edp_rank + edp·pp_rank))      etp · ep · edp = tp · cp · dp

* ``etp`` — expert-tensor size: each expert's fc1/fc2 cut over etp neighbouring ranks (default:
  ``etp = tp``, the dense layers' cut, and today's grids);
* ``ep`` — the expert-parallel group: the dispatch/combine all-to-all, over ep ranks ``etp`` apart;
* ``edp = tp·cp·dp / (etp·ep)`` — the ranks holding the same expert shard (their gradient all-reduce).

Why fold.  With ``etp = tp`` the ep group is carved out of the dp × cp ranks, which sit ``tp``
apart: with tp = 8 on 8-device nodes every all-to-all crosses ep nodes.  With ``etp = 1`` the ep
group takes neighbouring ranks — ep up to ``tp·cp·dp`` (DeepSeek-V3: EP 64 over TP 2 × DP 32), and
with ep ≤ devices per node the all-to-all never leaves the node.  64 ranks, tp = 8, dp = 8::

    unfolded (etp = 8, ep = 8):  ep group of rank 0 = {0, 8, 16, …, 56}   8 nodes, every token crosses
    folded   (etp = 1, ep = 8):  ep group of rank 0 = {0, 1, 2, …, 7}     one node
                                 edp group of rank 0 = {0, 8, 16, …, 56}  (the expert-gradient all-reduce)

Both grids have the same pipeline groups (the same layers live on the same ranks; asserted, as
Megatron-Core's ``RankGenerator`` users assert it).  Dense gradients are averaged over ``dp_cp``
(every rank that holds the same dense shard: the context-parallel ranks too — they saw different
tokens of the same sequences); expert gradients are summed over ``edp`` (lecture 5b).

Who else does what
------------------
* Megatron-Core (``parallel_state.RankGenerator``, default order ``"tp-cp-ep-dp-pp"``) builds the
  dense grid with ep=1 and the expert grid with tp=expert_tensor_parallel_size, cp=1, and
  dp=expert data parallel size, and asserts their pipeline groups are equal; this module follows
  it: same order, same folding (the full course's ``tests/test_mesh.py`` holds its group lists against ours).
* picotron builds ``torch.arange(world).view(dp, pp, cp, tp)``: tensor innermost too, but data
  *outermost* and pipeline inside it.  Both keep tp on a node; they differ on which of the two
  inter-node axes gets the nearer ranks.
* torchtitan builds one ``DeviceMesh`` over the world with dims ``(pp, dp_replicate, dp_shard, cp,
  tp)`` — Megatron's rank order, data split into replicated × sharded (HSDP) — and takes each axis
  as a named (or flattened, e.g. ``dp_shard_cp``) sub-mesh; its experts also take their ranks
  from the data × context dims.

The course follows Megatron's order because the expert grid must share the pipeline groups and be
carved from the contiguous data × context block of each stage, which pp-outermost makes simple; and
it lists groups by plain arithmetic (not a DeviceMesh) so the planner and the widget can use them
without a running world.  :meth:`RankGrid.group` then creates them through
:func:`reference.comm.new_group`, so they get the launched world's timeout.

Words, as torchtitan uses them: an *axis* is a dimension of the rank grid (tp, cp, dp, pp, ep,
etp, edp; their group sizes are the grid's *degrees*, passed as ``RankGrid(world, dp=…, tp=…)`` or a
``sizes`` dict); a *dim* is a dimension of a tensor.  Drawing the grid is the notebook's job
(``reference.notebook.plots.grid_text`` and ``grid_plot``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RankGrid", "AxisGroups", "AXES", "DENSE_ORDER", "EXPERT_ORDER", "rank_groups"]

DENSE_ORDER = ("tp", "cp", "dp", "pp")      # fastest-varying first
EXPERT_ORDER = ("etp", "ep", "edp", "pp")
AXES = ("tp", "cp", "dp", "pp", "etp", "ep", "edp", "dp_cp", "tp_dp_cp")

_DESCRIPTIONS = {
    "tp": "tensor parallel: all-reduce of activations inside each layer",
    "cp": "context parallel: K/V ring (or all-to-all) inside attention",
    "dp": "data parallel: gradient all-reduce of dense parameters (without cp)",
    "pp": "pipeline parallel: activations to the next stage",
    "etp": "expert tensor parallel: all-reduce of activations inside each expert",
    "ep": "expert parallel: dispatch/combine all-to-all in MoE layers",
    "edp": "expert data parallel: gradient all-reduce of experts",
    "dp_cp": "dense gradient all-reduce: data × context ranks",
    "tp_dp_cp": "every rank of a pipeline stage: the tokens a folded MoE layer routes (etp ≠ tp)",
}


def rank_groups(sizes: dict[str, int], order: Sequence[str], axis: str | Sequence[str]) -> list[list[int]]:
    """Every group of ``axis`` on a grid of ``sizes`` laid out in ``order`` (exercise 5c.1).

    sizes: group size per axis, e.g. ``{"tp": 2, "cp": 1, "dp": 2, "pp": 2}``; order: the same axes,
    **fastest-varying first** (``("tp", "cp", "dp", "pp")`` is Megatron's; picotron's
    ``view(dp, pp, cp, tp)`` is ``("tp", "cp", "pp", "dp")``).  A rank's coordinates are the digits
    of its number in that mixed radix::

        rank = c[o0] + s[o0]·(c[o1] + s[o1]·(c[o2] + s[o2]·c[o3]))      o = order, s = sizes

    A group of ``axis`` (one axis, or several: ``("dp", "cp")``) is the set of ranks whose
    coordinates differ only on those axes.  Returns every group as a sorted list, the groups sorted
    by their smallest rank; together they hold every rank exactly once.
    Raises ``ValueError`` if ``order`` is not an arrangement of the axes of ``sizes``, a size is
    not a positive integer, or ``axis`` is not one of them.

    Graded on: every group of Megatron's, picotron's and random orders and of the expert grid, on grids of up to
    2048 ranks drawn at random, and ValueError for an order that is not an arrangement of the axes.
    """
    order = list(order)
    axes = [axis] if isinstance(axis, str) else list(axis)
    if sorted(order) != sorted(sizes) or len(set(order)) != len(order):
        raise ValueError(f"rank_groups: order {order} must list each axis of sizes {sorted(sizes)} exactly once")
    bad = {k: v for k, v in sizes.items() if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1}
    if bad:
        raise ValueError(f"rank_groups: sizes must be positive integers, got {bad}")
    unknown = [a for a in axes if a not in sizes]
    if unknown or not axes:
        raise ValueError(f"rank_groups: axis {axis!r} is not one of {order}")
    # C order: the LAST array dimension varies fastest, so the array's dims are the order reversed
    grid = np.arange(int(np.prod([sizes[a] for a in order]))).reshape([sizes[a] for a in reversed(order)])
    dims = [len(order) - 1 - order.index(a) for a in axes]
    moved = np.moveaxis(grid, dims, list(range(grid.ndim - len(dims), grid.ndim)))
    n = int(np.prod([sizes[a] for a in axes]))
    return sorted(sorted(int(r) for r in g) for g in moved.reshape(-1, n))


class RankGrid:
    """The rank grid of a composed run.

    RankGrid(world_size, *, dp=1, tp=1, pp=1, cp=1, ep=1, etp=None, rank=None)

    Requires ``tp·cp·dp·pp == world_size`` and ``etp·ep`` dividing ``tp·cp·dp`` (``etp`` defaults to
    ``tp``), else ``ValueError`` naming the sizes.  ``rank`` is the rank whose groups :meth:`ranks`
    and :meth:`coords` describe by default; inside a world it defaults to this process's rank.

    Axes: ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"`` (dense grid), ``"etp"``, ``"ep"``, ``"edp"`` (expert
    grid, with the same ``"pp"``), ``"dp_cp"`` (the dp × cp ranks over which dense gradients are
    averaged) and ``"tp_dp_cp"`` (all the ranks of one pipeline stage).
    """

    def __init__(self, world_size: int, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None, rank: int | None = None):
        sizes = dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=tp if etp is None else etp)
        bad = {k: v for k, v in sizes.items() if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1}
        if bad or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"RankGrid sizes must be positive integers, got world_size={world_size!r}, "
                             + ", ".join(f"{k}={v!r}" for k, v in sizes.items()))
        etp = sizes["etp"]
        if tp * cp * dp * pp != world_size:
            raise ValueError(f"RankGrid: tp·cp·dp·pp = {tp}·{cp}·{dp}·{pp} = {tp * cp * dp * pp} "
                             f"but world_size = {world_size}")
        if (tp * cp * dp) % (etp * ep):
            raise ValueError(f"RankGrid: etp·ep = {etp}·{ep} = {etp * ep} must divide tp·cp·dp = {tp}·{cp}·{dp} = "
                             f"{tp * cp * dp} (the expert grid etp × ep × edp folds the same ranks of each stage)")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"RankGrid: rank={rank} is outside 0..{world_size - 1}")
        self.world_size = int(world_size)
        self.tp, self.cp, self.dp, self.pp, self.ep = int(tp), int(cp), int(dp), int(pp), int(ep)
        self.etp = int(etp)
        self.edp = self.tp * self.cp * self.dp // (self.etp * self.ep)
        self.rank = rank
        self._groups: dict[str, tuple[list[int], list]] = {}   # axis -> (this rank's ranks, its group)
        # ranks laid out as arrays whose LAST axis varies fastest (C order): [pp, dp, cp, tp] etc.
        ids = np.arange(self.world_size)
        self._dense = ids.reshape(self.pp, self.dp, self.cp, self.tp)
        self._expert = ids.reshape(self.pp, self.edp, self.ep, self.etp)
        # Both grids must put the same layers on the same ranks (Megatron-Core asserts the same).
        dense_pp = self._dense.reshape(self.pp, -1).T.tolist()
        expert_pp = self._expert.reshape(self.pp, -1).T.tolist()
        assert dense_pp == expert_pp, "the dense and expert grids must share their pipeline groups"

    # ------------------------------------------------------------------ sizes and coordinates

    @property
    def sizes(self) -> dict[str, int]:
        """Group size of every axis."""
        return dict(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, etp=self.etp, ep=self.ep, edp=self.edp,
                    dp_cp=self.dp * self.cp, tp_dp_cp=self.tp * self.dp * self.cp)

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            rank = self.rank
        if rank is None:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise ValueError("RankGrid: no rank given and no running world; pass rank= "
                                 "(to the constructor or to this call)")
            rank = dist.get_rank()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"RankGrid: rank={rank} is outside 0..{self.world_size - 1}")
        return int(rank)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """This rank's coordinate on every axis, e.g.
        ``{"tp": 1, "cp": 0, "dp": 1, "pp": 0, "etp": 1, "ep": 1, "edp": 0}``."""
        r = self._rank(rank)
        pp, dp, cp, tp = (int(i) for i in np.unravel_index(r, self._dense.shape))
        _, edp, ep, etp = (int(i) for i in np.unravel_index(r, self._expert.shape))
        return dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, edp=edp, etp=etp)

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at dense coordinates (tp, cp, dp, pp)."""
        return int(self._dense[pp, dp, cp, tp])

    # ------------------------------------------------------------------ groups by arithmetic

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` (each a sorted list of global ranks), in one fixed order.

        The ranks in a group differ only in their coordinate on ``axis``; the groups partition
        the world.  The order (by smallest member) is the order :meth:`group` creates them in.
        """
        grid, dims = self._layout(axis)
        moved = np.moveaxis(grid, dims, tuple(range(grid.ndim - len(dims), grid.ndim)))
        n = int(np.prod([grid.shape[d] for d in dims]))
        groups = sorted(sorted(int(r) for r in g) for g in moved.reshape(-1, n))
        return groups

    def _layout(self, axis: str) -> tuple[np.ndarray, tuple[int, ...]]:
        dense = {"pp": 0, "dp": 1, "cp": 2, "tp": 3}
        expert = {"edp": 1, "ep": 2, "etp": 3}
        if axis in dense:
            return self._dense, (dense[axis],)
        if axis in expert:
            return self._expert, (expert[axis],)
        if axis == "dp_cp":
            return self._dense, (1, 2)
        if axis == "tp_dp_cp":
            return self._dense, (1, 2, 3)
        raise ValueError(f"RankGrid: unknown axis {axis!r}; choose one of {', '.join(AXES)}")

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of this rank's group on ``axis`` (sorted; includes the rank itself)."""
        r = self._rank(rank)
        grid, dims = self._layout(axis)
        idx = list(np.unravel_index(r, grid.shape))
        for d in dims:
            idx[d] = slice(None)
        return sorted(int(x) for x in np.asarray(grid[tuple(idx)]).ravel())

    def crosses_nodes(self, axis: str, devices_per_node: int) -> bool:
        """True if some group of ``axis`` spans more than one node (ranks ``n·D .. n·D+D-1`` share node n)."""
        grid, dims = self._layout(axis)
        node = np.moveaxis(grid // devices_per_node, dims, tuple(range(grid.ndim - len(dims), grid.ndim)))
        node = node.reshape(-1, int(np.prod([grid.shape[d] for d in dims])))
        return bool((node.max(axis=1) != node.min(axis=1)).any())

    # ------------------------------------------------------------------ process groups

    def group(self, axis: str):
        """The process group of this rank on ``axis``, inside a running world.

        The first call for an axis creates ALL groups of that axis, on every rank, in the order of
        :meth:`all_groups` (``torch.distributed`` requires every rank to create every group), via
        :func:`reference.comm.new_group` (the world's timeout).  So every rank must call
        ``group(axis)`` for the same axes in the same order.  Cached per grid.
        """
        import torch.distributed as dist

        from . import comm
        if not dist.is_initialized():
            raise RuntimeError("RankGrid.group needs a running world (reference.launch.run_world or torchrun)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"RankGrid: grid of {self.world_size} ranks in a world of {dist.get_world_size()}")
        me = dist.get_rank()
        if self.rank is not None and self.rank != me:
            raise ValueError(f"RankGrid was built for rank {self.rank} but this process is rank {me}")
        if axis not in self._groups:
            mine = None
            for ranks in self.all_groups(axis):
                g = comm.new_group(ranks)
                if me in ranks:
                    mine = (ranks, g)
            self._groups[axis] = mine
        return self._groups[axis][1]

    def __repr__(self) -> str:
        extra = (f", ep={self.ep}" if self.ep > 1 else "") + (f", etp={self.etp}" if self.etp != self.tp else "")
        r = f", rank={self.rank}" if self.rank is not None else ""
        return f"RankGrid({self.world_size}, tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}{extra}{r})"

    @staticmethod
    def describe(axis: str) -> str:
        """One line: what travels on ``axis``."""
        return _DESCRIPTIONS[axis]


class AxisGroups(dict):
    """This rank's process group on each axis, ``groups["dp_cp"]``; asking for an axis that is not
    there says which are (a bare ``KeyError: 'x'`` would leave the learner guessing)."""

    def __missing__(self, axis):
        raise KeyError(f"no group {axis!r} here; the groups are {', '.join(map(repr, self))}")

