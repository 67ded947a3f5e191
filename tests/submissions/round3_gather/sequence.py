import math

import torch
import torch.distributed as dist

from reference.sequence.layouts import positions

from .collectives import _everyone


def _full(t, layout):
    W = dist.get_world_size()
    parts = _everyone(t)
    S = t.shape[-2] * W
    full = torch.empty(*t.shape[:-2], S, t.shape[-1], dtype=t.dtype)
    pos = [positions(S, q, W, layout) for q in range(W)]
    for q, p in enumerate(parts):
        full[..., pos[q], :] = p
    return full, pos


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None, kernel="fused"):
    r = dist.get_rank()
    (fk, pos), (fv, _) = _full(k, layout), _full(v, layout)
    mine = pos[r]
    s = q.double() @ fk.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(mine[:, None] < torch.arange(s.shape[-1])[None, :], -math.inf)
    return (torch.softmax(s, -1) @ fv.double()).to(q.dtype), torch.logsumexp(s, -1)


def ring_attention_backward(dout, q, k, v, out, lse, *, causal=False, layout="contiguous", group=None,
                            kernel="fused"):
    r = dist.get_rank()
    (fdo, pos), (fq, _), (fk, _), (fv, _) = (_full(t, layout) for t in (dout, q, k, v))
    fq, fk, fv = (t.double().requires_grad_() for t in (fq, fk, fv))
    G = fq.shape[1] // fk.shape[1]
    s = fq @ fk.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    (torch.softmax(s, -1) @ fv.repeat_interleave(G, 1)).backward(fdo.double())
    return tuple(g.grad[..., pos[r], :].to(q.dtype) for g in (fq, fk, fv))
