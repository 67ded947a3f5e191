"""Rank functions only the sequence-parallel tests use (tests/sequence/test_parallel.py)."""
from __future__ import annotations

import torch

from reference import comm
from reference.sequence import heads_to_seq, ring_attention_forward, seq_to_heads, shard_sequence, ulysses_attention
from reference.sequence.workers import make_inputs


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


def roundtrip_worker(seq_len: int, heads: int = 4, seed: int = 0) -> dict:
    """seq_to_heads then heads_to_seq on this rank's contiguous shard: returns input, middle, output."""
    r, W = comm.rank(), comm.world_size()
    x = shard_sequence(make_inputs(seq_len, heads=heads, seed=seed)[0], r, W, "contiguous")
    mid = seq_to_heads(x)
    return {"x": x, "heads": mid, "back": heads_to_seq(mid)}
