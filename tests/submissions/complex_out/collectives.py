"""0.1 honest; 0.2 returns a COMPLEX tensor whose real part is right: a wrong dtype kind must fail."""
import torch

from .._ring import ring_all_gather as _honest
from .._ring import ring_all_reduce, ring_reduce_scatter  # noqa: F401


def ring_all_gather(chunk, numel, *, group=None):
    return torch.complex(_honest(chunk, numel, group=group), torch.full((numel,), 0.5, dtype=chunk.dtype))
