"""Lecture 5c exercises — the rank grid.  Reference: ``reference/mesh.py``.

    5c.1  rank_groups     every group of an axis, for any order of the axes

Check your work with ``check("5c.1")`` in the notebook or ``python -m exercises.grade 5c.1``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np  # noqa: F401  (arange/reshape/moveaxis help; plain loops work too)

__all__ = ["rank_groups"]


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
    raise NotImplementedError(
        'Exercise 5c.1 (rank_groups): Write each rank as digits in the mixed radix of the sizes, the first '
        'axis of order being the last digit (it changes from one rank to the next). Two ranks are in the same '
        'group when all their OTHER digits agree. More help: hint("5c.1").')
