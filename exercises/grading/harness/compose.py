"""Lecture 5c's harness: the learner's ``sync_gradients`` on this rank's raw gradients."""
from __future__ import annotations

from . import function as _fn


def grad_sync_per_rank(module: str, sizes: dict, raw: list, kinds: list, moe: bool, sequence_parallel: bool):
    """On each rank: the learner's ``sync_gradients`` on this rank's raw gradients (a ``GradView`` of
    the grid's groups); returns the gradients after it, by name."""
    import torch.distributed as dist

    from reference.compose.cases import GradView
    r = dist.get_rank()
    view = GradView(sizes, raw[r], kinds[r], moe=moe, sequence_parallel=sequence_parallel)
    _fn(module, "sync_gradients")(view)
    return view.grads()
