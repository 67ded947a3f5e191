"""Worker functions for notebooks and tests: run the sequence-parallel attentions on every rank.

Each worker builds the same full-size inputs on every rank from a seed (:func:`make_inputs`),
keeps its own shard, runs one algorithm and returns plain tensors, so the caller can unshard the
results and compare them with full attention.  Call them through ``reference.launch``::

    from reference.launch import run_world
    from reference.sequence import demos
    res = run_world(demos.ring_worker, 4, seq_len=64, layout="zigzag", causal=True)
    res.values[r]["out"], res.trace.filter(op="compute")

(Lecture helpers may append more workers below; keep them module-level functions.)
"""
from __future__ import annotations

import torch

from .. import comm
from .layouts import shard_sequence
from .ring import ring_attention, ring_attention_forward
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from .usp import usp_attention, usp_groups, usp_shard


def make_inputs(seq_len: int, *, batch: int = 1, heads: int = 2, heads_kv: int | None = None, head_dim: int = 8,
                seed: int = 0, dtype: torch.dtype = torch.float32, logit_scale: float = 1.0):
    """Full (q, k, v, dout): N(0, 1) entries drawn in float64 from ``seed`` then cast to ``dtype``.

    q is multiplied by ``logit_scale`` (the attention logits scale by the same factor).  Casting
    a float64 draw means a float64 ground truth can use exactly the values the ranks used.
    """
    g = torch.Generator().manual_seed(seed)
    hk = heads if heads_kv is None else heads_kv
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64) * logit_scale
    k = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def ring_worker(seq_len: int, layout: str = "contiguous", causal: bool = False, *, backward: bool = True,
                kernel: str = "fused", iterations: int = 1, **inputs) -> dict:
    """Ring attention on this rank's shard; returns out, lse (and dq, dk, dv) of the shard.

    ``iterations`` > 1 repeats forward+backward (a deadlock test); the last results are returned.
    """
    r, W = comm.rank(), comm.world_size()
    q, k, v, dout = (shard_sequence(t, r, W, layout) for t in make_inputs(seq_len, **inputs))
    if not backward:
        out, lse = ring_attention_forward(q, k, v, causal=causal, layout=layout, kernel=kernel)
        return {"out": out, "lse": lse}
    for _ in range(iterations):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_attention(qg, kg, vg, causal=causal, layout=layout, return_lse=True, kernel=kernel)
        out.backward(dout)
    return {"out": out.detach(), "lse": lse, "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


def ring_call_worker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     layout: str = "contiguous") -> dict:
    """Ring attention forward on tensors given as they are (each rank passes the same ones: for error tests)."""
    out, lse = ring_attention_forward(q, k, v, causal=causal, layout=layout)
    return {"out": out, "lse": lse}


def ulysses_worker(seq_len: int, causal: bool = False, *, backward: bool = True, **inputs) -> dict:
    r, W = comm.rank(), comm.world_size()
    q, k, v, dout = (shard_sequence(t, r, W, "contiguous") for t in make_inputs(seq_len, **inputs))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qg, kg, vg, causal=causal)
    if not backward:
        return {"out": out.detach()}
    out.backward(dout)
    return {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}


def ulysses_call_worker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> dict:
    return {"out": ulysses_attention(q, k, v, causal=causal)}


def roundtrip_worker(seq_len: int, heads: int = 4, seed: int = 0) -> dict:
    """seq_to_heads then heads_to_seq on this rank's contiguous shard: returns input, middle, output."""
    r, W = comm.rank(), comm.world_size()
    x = shard_sequence(make_inputs(seq_len, heads=heads, seed=seed)[0], r, W, "contiguous")
    mid = seq_to_heads(x)
    return {"x": x, "heads": mid, "back": heads_to_seq(mid)}


def usp_worker(seq_len: int, ulysses_size: int, ring_size: int, layout: str = "zigzag", causal: bool = False,
               **inputs) -> dict:
    """USP on a U × R grid; returns this rank's piece of out, dq, dk, dv (as :func:`.usp.usp_shard`)."""
    ug, rg = usp_groups(ulysses_size, ring_size)
    u, i = comm.rank(ug), comm.rank(rg)
    q, k, v, dout = (usp_shard(t, u, ulysses_size, i, ring_size, layout) for t in make_inputs(seq_len, **inputs))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = usp_attention(qg, kg, vg, causal=causal, ulysses_group=ug, ring_group=rg, layout=layout)
    out.backward(dout)
    return {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}
