"""5a.2 given_positions; 5a.3, 5a.4, 5a.5 frame_peek (every rank's shards from the caller's frames, the
answer computed locally by plain attention / autograd, no message)."""
import math

import torch
import torch.distributed as dist

from reference.sequence.layouts import positions

from .._peek import every_ranks

# -- 5a.2: the layouts from the given positions() ------------------------------------------------


def shard_sequence(x, rank, world_size, layout, dim=-2):
    return x.index_select(dim, positions(x.shape[dim], rank, world_size, layout)).contiguous()


def unshard_sequence(shards, layout, dim=-2):
    W = len(shards)
    dim = dim % shards[0].dim()
    S = shards[0].shape[dim] * W
    out = torch.empty(*shards[0].shape[:dim], S, *shards[0].shape[dim + 1:], dtype=shards[0].dtype)
    for r, s in enumerate(shards):
        out.index_copy_(dim, positions(S, r, W, layout), s)
    return out


# -- 5a.3 / 5a.5: full attention from every rank's shards -------------------------------------------


def _full(everyone, idx, layout, W):
    S = sum(e[idx].shape[-2] for e in everyone)
    pos = [positions(S, r, W, layout) for r in range(W)]
    full = torch.empty(*everyone[0][idx].shape[:-2], S, everyone[0][idx].shape[-1], dtype=everyone[0][idx].dtype)
    for r, e in enumerate(everyone):
        full[..., pos[r], :] = e[idx]
    return full, pos


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None, kernel="fused"):
    W, r = dist.get_world_size(), dist.get_rank()
    everyone = every_ranks(q)
    (fq, pos), (fk, _), (fv, _) = (_full(everyone, i, layout, W) for i in range(3))
    s = fq.double() @ fk.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ fv.double()
    return out[..., pos[r], :].to(q.dtype), lse[..., pos[r]]


def ring_attention_backward(dout, q, k, v, out, lse, *, causal=False, layout="contiguous", group=None,
                            kernel="fused"):
    W, r = dist.get_world_size(), dist.get_rank()
    everyone = every_ranks(q)
    fdo, pos = _full(everyone, 0, layout, W)
    fq, fk, fv = (_full(everyone, i, layout, W)[0].double().requires_grad_() for i in (1, 2, 3))
    s = fq @ fk.repeat_interleave(fq.shape[1] // fk.shape[1], 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    (torch.softmax(s, -1) @ fv.repeat_interleave(fq.shape[1] // fv.shape[1], 1)).backward(fdo.double())
    return tuple(g.grad[..., pos[r], :].to(q.dtype) for g in (fq, fk, fv))


# -- 5a.4: the head slices from every rank's sequence shard ------------------------------------------


def seq_to_heads(x, group=None):
    W, r = dist.get_world_size(), dist.get_rank()
    everyone = every_ranks(x)
    full = torch.cat([e[0] for e in everyone], dim=2)
    h = x.shape[1] // W
    return full[:, r * h:(r + 1) * h].contiguous()


def heads_to_seq(x, group=None):
    W, r = dist.get_world_size(), dist.get_rank()
    everyone = every_ranks(x)
    full = torch.cat([e[1] for e in everyone], dim=1)
    n = x.shape[2] // W
    return full[:, :, r * n:(r + 1) * n].contiguous()
