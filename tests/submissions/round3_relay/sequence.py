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


def relay_all(k, v, group=None) -> dict:
    """Every rank's K/V, relayed W−1 hops round the ring (the ring's own messages) and all kept."""
    W, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    blocks = {r: (k.contiguous(), v.contiguous())}
    cur = blocks[r]
    for s in range(1, W):
        nk, nv = torch.empty_like(cur[0]), torch.empty_like(cur[1])
        comm.exchange([(cur[0], nxt), (cur[1], nxt)], [(nk, prv), (nv, prv)]).wait()
        cur = blocks[(r - s) % W] = (nk, nv)
    return blocks


def ring_attention_forward(q, k, v, *, causal=False, layout="contiguous", group=None, kernel="fused"):
    """The ring's messages exactly (K and V one hop per step), but every block is KEPT until all have
    arrived, then attention is computed block by block and merged: the messages cannot tell it from
    the ring; only the memory it holds can (every rank's K/V at once)."""
    W, r = comm.world_size(group), comm.rank(group)
    blocks = relay_all(k, v, group)
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


def ring_attention_backward(dout, q, k, v, out, lse, *, causal=False, layout="contiguous", group=None,
                            kernel="fused"):
    """The ring's messages again — K/V relayed W−1 hops, then the dK/dV shares sent home the same way —
    but every K/V block is kept first and every block's share computed at once: 2W blocks held where
    the ring holds a few."""
    from reference.sequence.blockwise import attention_block_backward
    W, r = comm.world_size(group), comm.rank(group)
    nxt, prv = comm.ring_peers(group)
    blocks = relay_all(k, v, group)
    n = q.shape[-2]
    dq = torch.zeros_like(q, dtype=torch.float64)
    shares = {}
    for j, (kj, vj) in blocks.items():
        dk, dv = torch.zeros_like(kj, dtype=torch.float64), torch.zeros_like(vj, dtype=torch.float64)
        for p in block_plan(r, j, W, layout, causal, n):
            a, b, c = attention_block_backward(dout[..., p.q, :], q[..., p.q, :], kj[..., p.k, :], vj[..., p.k, :],
                                               out[..., p.q, :], lse[..., p.q], causal=p.causal)
            dq[..., p.q, :] += a.double()
            dk[..., p.k, :] += b.double()
            dv[..., p.k, :] += c.double()
        shares[j] = (dk, dv)
    # send every share home: at hop s, pass on the accumulator of block (r − s) mod W, as the ring does
    acc = None
    for s in range(1, W):
        j = (r - s) % W
        mine = shares[j]
        acc = mine if acc is None else (acc[0] + mine[0], acc[1] + mine[1])
        got = (torch.empty_like(acc[0]), torch.empty_like(acc[1]))
        comm.exchange([(acc[0], nxt), (acc[1], nxt)], [(got[0], prv), (got[1], prv)]).wait()
        acc = got
    dk, dv = shares[r] if acc is None else (shares[r][0] + acc[0], shares[r][1] + acc[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
