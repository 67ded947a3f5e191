import torch

from reference import comm
from reference.sequence.blockwise import attention_block
from reference.sequence.ring import block_plan


def _merge(out, lse, o, lse_b):
    m = torch.maximum(lse, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse - m), torch.exp(lse_b - m)
    new = m + torch.log(wa + wb)
    return (wa.unsqueeze(-1) * out + wb.unsqueeze(-1) * o) / (wa + wb).unsqueeze(-1), new


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None, kernel="fused"):
    """The ring's messages exactly (K and V one hop per step), but every block is KEPT until all have
    arrived, then attention is computed block by block and merged: the messages cannot tell it from
    the ring; only the memory it holds can (every rank's K/V at once)."""
    W, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    blocks = {r: (k.contiguous(), v.contiguous())}
    cur = blocks[r]
    for s in range(1, W):
        nk, nv = torch.empty_like(cur[0]), torch.empty_like(cur[1])
        comm.exchange([(cur[0], nxt), (cur[1], nxt)], [(nk, prv), (nv, prv)]).wait()
        cur = blocks[(r - s) % W] = (nk, nv)
    n = q.shape[-2]
    out = lse = None
    for j, (kj, vj) in blocks.items():
        for p in block_plan(r, j, W, layout, causal, n):
            o, lb = attention_block(q[..., p.q, :], kj[..., p.k, :], vj[..., p.k, :], causal=p.causal)
            o = o.double()
            if out is None:
                out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
                lse = torch.full(q.shape[:-1], float("-inf"), dtype=lb.dtype)
            out[..., p.q, :], lse[..., p.q] = _merge(out[..., p.q, :], lse[..., p.q], o, lb)
    return out.to(q.dtype), lse
