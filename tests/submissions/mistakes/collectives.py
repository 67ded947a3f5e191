"""Two classic mistakes: an all-reduce without its all-gather half, and an all-gather that sends the
wrong chunk at each step (the chunks handed the other way round, to the right neighbour).  The
reduce-scatter is correct."""
import torch

from reference import comm


def ring_reduce_scatter(tensor, *, group=None):
    n, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    chunks = [c.clone() for c in torch.tensor_split(tensor.detach().flatten(), n)]
    for s in range(n - 1):
        sc, rc = (r - s) % n, (r - s - 1) % n
        buf = torch.empty_like(chunks[rc])
        comm.exchange([(chunks[sc], nxt)], [(buf, prv)], step=s).wait()
        chunks[rc] += buf
    return chunks[(r + 1) % n]

def ring_all_reduce(tensor, *, group=None):
    # mistake: the all-gather half is missing
    n, r = comm.world_size(group), comm.rank(group)
    out = tensor.detach().clone().flatten()
    mine = ring_reduce_scatter(tensor, group=group)
    list(torch.tensor_split(out, n))[(r + 1) % n].copy_(mine)
    return out.view(tensor.shape)

def ring_all_gather(chunk, numel, *, group=None):
    # mistake: each step sends the chunk after its own instead of the one it received last
    from reference.collectives import chunk_bounds
    n, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    chunks = [torch.empty(b - a, dtype=chunk.dtype) for a, b in chunk_bounds(numel, n)]
    own = (r + 1) % n
    chunks[own].copy_(chunk)
    for s in range(n - 1):
        sc, rc = (own + s) % n, (own - s - 1) % n
        comm.exchange([(chunks[sc], nxt)], [(chunks[rc], prv)], step=s).wait()
    return torch.cat(chunks)
