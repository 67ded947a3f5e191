"""Wants exercise 5a.3 (ring attention) without a ring: all-gathers K and V with the library
(every door, _doors.py), computes plain attention over the gathered keys, and fakes the ring's
send events and its per-block compute events."""
import math

import torch

from reference import comm, trace

from . import _doors


def _positions(S, r, W, layout):
    n = S // W
    if layout == "contiguous":
        return list(range(r * n, (r + 1) * n))
    if layout == "striped":
        return list(range(r, S, W))
    c = S // (2 * W)                                     # zigzag: chunk r and chunk 2W-1-r
    return list(range(r * c, (r + 1) * c)) + list(range((2 * W - 1 - r) * c, (2 * W - r) * c))


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None, kernel="fused"):
    W, r = comm.world_size(), comm.rank()
    n = q.shape[-2]
    S = n * W
    ks = _doors.all_gather(k.contiguous()) if W > 1 else [k]
    vs = _doors.all_gather(v.contiguous()) if W > 1 else [v]
    kpos = torch.tensor([p for j in range(W) for p in _positions(S, j, W, layout)])
    qpos = torch.tensor(_positions(S, r, W, layout))
    K, V = torch.cat(ks, -2), torch.cat(vs, -2)
    g = q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)
    s = (q @ K.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(kpos[None, :] > qpos[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ V
    _doors.fake_ring_events(2 * k.numel() * k.element_size(), W - 1)
    for step in range(r + 1 if causal and layout == "contiguous" else W):
        trace.emit("compute", step=step, what="attn_fwd")
    return out, lse
