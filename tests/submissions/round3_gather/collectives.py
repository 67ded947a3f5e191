import torch
import torch.distributed as dist

from reference import comm


def _everyone(t):
    W, r = dist.get_world_size(), dist.get_rank()
    t = t.contiguous()
    bufs = [torch.empty_like(t) for _ in range(W)]
    others = [q for q in range(W) if q != r]
    comm.exchange([(t, q) for q in others], [(bufs[q], q) for q in others]).wait()
    bufs[r] = t
    return bufs


def ring_all_reduce(tensor, *, group=None):
    return torch.stack(_everyone(tensor.detach())).sum(0)


def ring_reduce_scatter(tensor, *, group=None):
    W, r = dist.get_world_size(), dist.get_rank()
    return torch.tensor_split(ring_all_reduce(tensor).flatten(), W)[(r + 1) % W].clone()


def ring_all_gather(chunk, numel, *, group=None):
    W = dist.get_world_size()
    sizes = [len(c) for c in torch.tensor_split(torch.empty(numel), W)]
    mine = torch.zeros(max(sizes), dtype=chunk.dtype)
    mine[:chunk.numel()] = chunk
    parts = _everyone(mine)
    chunks = [None] * W
    for q in range(W):
        own = (q + 1) % W
        chunks[own] = parts[q][:sizes[own]]
    return torch.cat(chunks)
