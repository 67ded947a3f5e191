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


def ring_forward_of(impl: str, seq_len: int, world_size: int, layout: str, causal: bool) -> dict | None:
    """``impl``'s ring forward on ranks 0..world_size-1 of a bigger world (the trace is what the widget replays)."""
    import importlib

    from reference.sequence.layouts import positions
    group, r = comm.first_ranks_group(world_size), comm.rank()
    if r >= world_size:
        return None
    q, k, v, _ = make_inputs(seq_len)
    out, _ = importlib.import_module(impl).ring_attention_forward(
        *(shard_sequence(t, r, world_size, layout) for t in (q, k, v)), causal=causal, layout=layout, group=group)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return {"max_error": float((out - full[..., positions(seq_len, r, world_size, layout), :]).abs().max())}
