"""Lecture 5c's harness: the learner's ``sync_gradients`` on this rank's raw gradients."""
from __future__ import annotations

from . import function as _fn


def grad_sync_per_rank(module: str, mine: tuple, sizes: dict, moe: bool, sequence_parallel: bool):
    """On each rank: the learner's ``sync_gradients`` on this rank's raw gradients (``mine = (raw,
    kinds)``: this rank's own, by name) in a ``GradView`` of the grid's groups; returns the gradients
    after it, by name."""
    from reference.compose.cases import GradView
    raw, kinds = mine
    view = GradView(sizes, raw, kinds, moe=moe, sequence_parallel=sequence_parallel)
    _fn(module, "sync_gradients")(view)
    return view.grads()
