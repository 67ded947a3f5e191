"""A correct ring all-reduce / all-gather (the fixtures' honest half), written independently."""
import torch

from reference import comm


def _bounds(numel, n):
    base, extra = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _pass(chunks, first, reduce, group=None):
    n = comm.world_size(group)
    nxt, prv = comm.ring_peers(group)
    for s in range(n - 1):
        send_c, recv_c = (first - s) % n, (first - s - 1) % n
        buf = torch.empty_like(chunks[recv_c])
        comm.exchange([(chunks[send_c], nxt)], [(buf, prv)], group=group, step=s).wait()
        if reduce:
            chunks[recv_c] += buf
        else:
            chunks[recv_c].copy_(buf)


def ring_all_gather(chunk, numel, *, group=None):
    n, r = comm.world_size(group), comm.rank(group)
    chunks = [torch.empty(b - a, dtype=chunk.dtype) for a, b in _bounds(numel, n)]
    chunks[(r + 1) % n].copy_(chunk)
    _pass(chunks, (r + 1) % n, False, group)
    return torch.cat(chunks)


def ring_all_reduce(tensor, *, group=None):
    n, r = comm.world_size(group), comm.rank(group)
    if n == 1:
        return tensor.detach().clone()
    chunks = [c.clone() for c in torch.tensor_split(tensor.detach().flatten(), n)]
    _pass(chunks, r, True, group)
    return ring_all_gather(chunks[(r + 1) % n], tensor.numel(), group=group).view(tensor.shape)


def ring_reduce_scatter(tensor, *, group=None):
    n, r = comm.world_size(group), comm.rank(group)
    chunks = [c.clone() for c in torch.tensor_split(tensor.detach().flatten(), n)]
    _pass(chunks, r, True, group)
    return chunks[(r + 1) % n]
