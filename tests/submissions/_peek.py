"""What a rank finds of the other ranks' inputs by looking round its own process (the review's
``frame_peek``): every caller's local variables, and every list or tuple the garbage collector
knows.  With the grader's rank isolation there is nothing of another rank's to find."""
import gc
import sys

import torch
import torch.distributed as dist


class NothingToPeek(RuntimeError):
    pass


def _holds(obj, like: torch.Tensor) -> bool:
    """``obj`` is (or directly contains) a tensor shaped like ``like``."""
    if isinstance(obj, torch.Tensor):
        return obj.shape == like.shape
    if isinstance(obj, (list, tuple)):
        return any(isinstance(x, torch.Tensor) and x.shape == like.shape for x in obj)
    return False


def every_ranks(like: torch.Tensor, world_size: int | None = None) -> list:
    """A sequence of one entry per rank whose entries hold tensors shaped like ``like`` and one of
    which is ``like`` itself: the whole per-rank list a harness was handed, if it was."""
    W = world_size or dist.get_world_size()
    seen = []
    f = sys._getframe(1)
    while f is not None:
        seen.extend(f.f_locals.values())
        f = f.f_back
    seen.extend(o for o in gc.get_objects() if isinstance(o, (list, tuple)))
    for obj in seen:
        if not isinstance(obj, (list, tuple)) or len(obj) != W or W < 2:
            continue
        if all(_holds(x, like) for x in obj) and any(
                x is like or (isinstance(x, (list, tuple)) and any(y is like for y in x)) for x in obj):
            return list(obj)
    raise NothingToPeek(f"frame_peek: no list of every rank's inputs anywhere in rank {dist.get_rank()}'s process")
