"""Lecture 5c exercises — composing the axes.  Reference: ``reference/compose/``.

    5c.2  sync_gradients   which group averages which gradient, on any grid
    5c.3  step_bytes       a planner's estimate of the bytes one rank sends, checked against a real run

(5c.1, the rank groups of a grid, is in ``exercises/mesh.py``.)  Check your work with
``check("5c.2")`` in the notebook or ``python -m exercises.grade 5c.2``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from reference import comm  # noqa: F401  (comm.all_reduce(t, group=…) is traced; torch.distributed works too)

if TYPE_CHECKING:
    from reference.compose import ParallelGPT

__all__ = ["sync_gradients", "step_bytes"]


def sync_gradients(model: ParallelGPT) -> None:
    """Make every rank's ``.grad`` the gradient of the whole batch's loss, in place (exercise 5c.2).

    After ``backward`` each rank holds the gradient of ITS loss L_r: the mean over its B/dp
    sequences × S/cp positions, computed with its shards.  The step needs the gradient of
    L = (1/(dp·cp)) Σ_r L_r.  What ``model`` offers (a :class:`ParallelGPT`, or anything with these)::

        model.dense_params()               parameters that are not an expert's
        model.expert_params()              this rank's experts (lecture 5b; empty for a dense model)
        model.sequence_parallel_params()   replicated over tp but fed only S/tp rows each under
                                           sequence parallelism (empty without it); also in dense_params()
        model.groups[axis]                 this rank's process group on "tp", "cp", "dp", "dp_cp", "pp",
                                           and with experts "ep", "edp"
        model.grid                         the RankGrid (model.grid.dp, .cp, .tp, .ep, .edp, …)

    Parameters whose ``.grad`` is None are skipped (the same ones on every rank of a group).

    Graded on: every gradient after your sync equal to one process's, on dp × cp, dp × tp with sequence parallelism,
    and dp × cp × ep grids (and dp × pp, hidden).
    """
    raise NotImplementedError(
        'Exercise 5c.2 (sync_gradients): for each kind of parameter, ask which ranks hold the same tensor '
        'AND saw different tokens: those are the ranks its gradient must be averaged over. '
        'More help: hint("5c.2").')


def step_bytes(sizes: dict[str, int], coords: dict[str, int], *, tokens: int, d_model: int, layers: int,
               dense_params: int, num_microbatches: int = 1, bytes_per_element: int = 8) -> dict[str, int]:
    """Bytes one rank sends in one training step, per axis, by formula (exercise 5c.3).

    sizes: the grid, ``{"tp": …, "cp": …, "dp": …, "pp": …}`` (missing axes are 1); coords: this
    rank's coordinates on it (``{"tp": 0, "cp": 1, "dp": 0, "pp": 1}``); tokens: T, the tokens this
    rank holds in the step (its B/dp sequences × S/cp positions); d_model: the model width d;
    layers: the transformer blocks on this rank's pipeline stage; dense_params: the parameters
    this rank holds (its tensor shards; the model is dense); num_microbatches: the pipeline's m;
    bytes_per_element: b (8 for float64).

    Returns ``{"dp_cp": …, "cp": …, "pp": …}`` in bytes (ints), with an entry only for the axes
    that move data (dp·cp > 1, cp > 1, pp > 1): the gradient all-reduce over the dp·cp ranks
    (a ring all-reduce), ring attention's K/V traffic forward and backward, and the pipeline's
    activations and gradients.  What every rank SENDS is counted, as ``measured_bytes`` does.

    Graded on: the bytes per axis of ranks of real grids (dp × cp, dp × tp × pp, odd grids) and of random numbers.
    """
    raise NotImplementedError(
        'Exercise 5c.3 (step_bytes): one axis at a time — which collective or message does it use, how '
        'often per step, and how many bytes does THIS rank send in it? More help: hint("5c.3").')
