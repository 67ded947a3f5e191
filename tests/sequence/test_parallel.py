"""Lecture 5a, multi-process: ring attention (forward and backward), Ulysses and USP on 1–5 ranks.

Every result is unsharded and compared with full attention computed here in float64 from the
same seed: out, lse, dq, dk, dv.  Work (pairs) and bytes are counted from the trace.
"""
from __future__ import annotations

import math

import pytest
import torch

from reference.launch import WorldError, run_world
from reference.sequence import (LAYOUTS, attention_block, attention_block_backward, chunk_ids, unshard_sequence,
                                usp_unshard, workers)
from tests.workers import sequence_workers

SHAPE = dict(batch=2, heads=4, heads_kv=2, head_dim=8)      # batch > 1 and GQA everywhere by default
TOL32 = 1e-5


def full_attention(q, k, v, causal=False):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def truth(seq_len, causal, **inputs):
    """float64 (out, lse, dq, dk, dv) of full attention on the inputs every rank builds."""
    q, k, v, dout = workers.make_inputs(seq_len, **{**inputs, "dtype": torch.float64})
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = full_attention(q, k, v, causal)
    out.backward(dout)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def single_device_error(seq_len, causal, **inputs):
    """Max error of the fused kernel on ONE device in the inputs' dtype, per quantity."""
    q, k, v, dout = workers.make_inputs(seq_len, **inputs)
    out, lse = attention_block(q, k, v, causal=causal)
    dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, causal=causal)
    ref = truth(seq_len, causal, **inputs)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    return {n: (got[n].double() - ref[n]).abs().max().item() for n in got}


def gathered(values, layout, name):
    return unshard_sequence([v[name] for v in values], layout, dim=-1 if name == "lse" else -2)


def errors(values, ref, unshard):
    return {n: (unshard([v[n] for v in values], n).double() - ref[n]).abs().max().item()
            for n in ref if n in values[0]}


def ring_unshard(layout):
    return lambda shards, name: unshard_sequence(shards, layout, dim=-1 if name == "lse" else -2)


# ----------------------------------------------------------------------------------------------
# Ring attention parity


@pytest.mark.parametrize("kernel", ["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_ring_attention_matches_full_attention_out_lse_and_grads(world, W, layout, causal, kernel):
    S = 4 * W if layout != "zigzag" else 6 * W
    inputs = dict(SHAPE, seed=W * 10 + len(layout), dtype=torch.float32)
    res = world(W).run(workers.ring_worker, S, layout, causal, kernel=kernel, **inputs)
    err = errors(res.values, truth(S, causal, **inputs), ring_unshard(layout))
    assert set(err) == {"out", "lse", "dq", "dk", "dv"}
    assert all(e < TOL32 for e in err.values()), err


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", [2, 3, 4])
def test_ring_attention_large_logits_finite_and_as_accurate_as_one_device(world, W, layout, causal):
    """Logits ×4: the ring's fp32 error stays within a few times the single-device fp32 error."""
    S = 8 * W
    inputs = dict(SHAPE, seed=7 + W, dtype=torch.float32, logit_scale=4.0)
    res = world(W).run(workers.ring_worker, S, layout, causal, **inputs)
    for v in res.values:
        assert all(torch.isfinite(t).all() for t in v.values())
    err = errors(res.values, truth(S, causal, **inputs), ring_unshard(layout))
    single = single_device_error(S, causal, **inputs)
    for name in err:
        assert err[name] <= 4 * single[name] + 2e-6, (name, err[name], single[name])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_attention_float64_is_exact_to_rounding(world, layout):
    inputs = dict(batch=1, heads=3, heads_kv=1, head_dim=4, seed=3, dtype=torch.float64)   # MQA
    res = world(3).run(workers.ring_worker, 12, layout, True, **inputs)
    err = errors(res.values, truth(12, True, **inputs), ring_unshard(layout))
    assert all(e < 1e-12 for e in err.values()), err


# ----------------------------------------------------------------------------------------------
# Work and bytes, from the trace


@pytest.mark.parametrize("W", [2, 3, 4])
def test_zigzag_causal_work_is_exactly_balanced(world, W):
    S = 4 * W
    res = world(W).run(workers.ring_worker, S, "zigzag", True, **SHAPE)
    pairs = res.trace.filter(op="compute", what="attn_fwd").meta_sum("pairs")
    assert pairs == {r: S * (S + 1) // (2 * W) for r in range(W)}
    bwd = res.trace.filter(op="compute", what="attn_bwd").meta_sum("pairs")
    assert bwd == pairs


@pytest.mark.parametrize("W", [2, 3, 4])
def test_contiguous_causal_work_grows_with_rank_and_masked_steps_are_skipped(world, W):
    S = 4 * W
    c = S // W
    res = world(W).run(workers.ring_worker, S, "contiguous", True, **SHAPE)
    fwd = res.trace.filter(op="compute", what="attn_fwd")
    assert fwd.meta_sum("pairs") == {r: c * c * r + c * (c + 1) // 2 for r in range(W)}
    for r in range(W):
        # at step s rank r holds K/V of rank r - s: masked (skipped) once r - s < 0
        assert sorted(e.step for e in fwd.filter(rank=r)) == list(range(r + 1))
        assert sorted(e.step for e in res.trace.filter(op="compute", what="attn_bwd", rank=r)) == list(range(r + 1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", [1, 3])
def test_every_unmasked_pair_is_computed_once(world, layout, W):
    S = 6 * W
    for causal in (False, True):
        res = world(W).run(workers.ring_worker, S, layout, causal, backward=False, **SHAPE)
        total = sum(res.trace.filter(op="compute", what="attn_fwd").meta_sum("pairs").values())
        assert total == (S * (S + 1) // 2 if causal else S * S)


@pytest.mark.parametrize("W, dtype", [(W, dt) for dt in (torch.float32, torch.float64) for W in (2, 3, 4)]
                         + [(3, torch.bfloat16)])
def test_ring_bytes_forward_and_backward(world, W, dtype):
    """Forward: (W−1)·2·(S/W)·H_kv·D·b per rank.  Backward: the same for K/V, and the dK/dV accumulators at
    float32 or wider (b_acc = max(b, 4)): 2× the forward in float32 and float64, 3× with bfloat16 K/V."""
    S, Hkv, D = 4 * W, SHAPE["heads_kv"], SHAPE["head_dim"]
    b = torch.tensor([], dtype=dtype).element_size()
    res = world(W).run(workers.ring_worker, S, "zigzag", True, **dict(SHAPE, dtype=dtype))
    B = SHAPE["batch"]
    fwd = (W - 1) * 2 * (S // W) * Hkv * D * b * B
    sends = res.trace.filter(op="send")
    assert sends.filter(phase="fwd").bytes_by_rank() == {r: fwd for r in range(W)}
    assert sends.filter(phase="bwd", what="kv").bytes_by_rank() == {r: fwd for r in range(W)}
    assert sends.filter(phase="bwd", what="dkv").bytes_by_rank() == {r: fwd * max(b, 4) // b for r in range(W)}
    assert sends.filter(phase="bwd").bytes_by_rank()[0] == (3 if dtype == torch.bfloat16 else 2) * fwd
    assert res.trace.bytes_by_rank(op="recv") == res.trace.bytes_by_rank(op="send")


@pytest.mark.parametrize("W", [3, 4])
def test_kv_travels_forward_round_the_ring_with_its_chunk_ids(world, W):
    res = world(W).run(workers.ring_worker, 4 * W, "zigzag", True, **SHAPE)
    for phase in ("fwd", "bwd"):
        for e in res.trace.filter(op="send", what="kv", phase=phase):
            assert e.peer == (e.rank + 1) % W
            assert e.meta["chunks"] == chunk_ids((e.rank - e.step) % W, W, "zigzag")
        for e in res.trace.filter(op="recv", what="kv", phase=phase):
            assert e.peer == (e.rank - 1) % W
        for e in res.trace.filter(op="compute", what="attn_fwd"):
            assert e.meta["k_chunks"][0] in chunk_ids((e.rank - e.step) % W, W, "zigzag")
    steps = sorted({e.step for e in res.trace.filter(op="send", what="dkv")})
    assert steps == list(range(1, W))


@pytest.mark.parametrize("W", [2, 4])
def test_next_hop_is_posted_before_the_block_is_computed(world, W):
    res = world(W).run(workers.ring_worker, 8 * W, "contiguous", False, **SHAPE)
    for what in ("attn_fwd", "attn_bwd"):
        phase = what[-3:]
        for c in res.trace.filter(op="compute", what=what):
            if c.step == W - 1:
                continue
            hop = res.trace.filter(op="send", what="kv", phase=phase, rank=c.rank, step=c.step)
            assert len(hop) == 2                               # K and V
            assert all(h.start <= c.start and h.end >= c.end for h in hop)


# ----------------------------------------------------------------------------------------------
# Errors and endurance


def _expect_value_error_on_every_rank(fn, W, *args, **kwargs):
    with pytest.raises(WorldError) as info:
        run_world(fn, W, *args, timeout=30, **kwargs)
    err = info.value
    assert err.kind == "exception"            # raised on the ranks, not a hang reported by the timeout
    assert sorted(err.failures) == list(range(W))
    assert all(f.exc_type == "ValueError" for f in err.failures.values()), err


def test_ring_bad_inputs_raise_value_error_on_every_rank():
    z = lambda *s: torch.zeros(*s)                                           # noqa: E731
    _expect_value_error_on_every_rank(sequence_workers.ring_call_worker, 3, z(1, 3, 4, 8), z(1, 2, 4, 8),
                                      z(1, 2, 4, 8))                                                 # heads
    _expect_value_error_on_every_rank(sequence_workers.ring_call_worker, 2, z(1, 2, 3, 8), z(1, 2, 3, 8), z(1, 2, 3, 8),
                                      causal=True, layout="zigzag")                                  # odd zigzag shard
    _expect_value_error_on_every_rank(sequence_workers.ring_call_worker, 2, z(1, 2, 4, 8), z(1, 2, 4, 8).double(),
                                      z(1, 2, 4, 8))                                                 # dtypes
    _expect_value_error_on_every_rank(sequence_workers.ring_call_worker, 2, z(1, 2, 4, 8), z(1, 2, 5, 8),
                                      z(1, 2, 5, 8))                                                 # lengths


def test_ulysses_heads_not_divisible_raise_value_error_on_every_rank():
    z = torch.zeros(1, 4, 2, 8)
    _expect_value_error_on_every_rank(workers.ulysses_call_worker, 3, z, z, z)


@pytest.mark.parametrize("W", [2, 3, 4, 5])
def test_twenty_forward_backward_iterations_finish(world, W):
    for layout, causal in (("zigzag", True), ("striped", False)):
        res = world(W).run(workers.ring_worker, 4 * W, layout, causal, iterations=20, timeout=60, **SHAPE)
        assert len(res.trace.filter(op="compute", what="attn_bwd")) >= 20 * W


# ----------------------------------------------------------------------------------------------
# Ulysses and USP


@pytest.mark.parametrize("W", [2, 3, 4])
def test_seq_to_heads_to_seq_round_trip_is_bitwise_exact(world, W):
    res = world(W).run(sequence_workers.roundtrip_worker, 4 * W, heads=2 * W)
    full = workers.make_inputs(4 * W, heads=2 * W)[0]
    for r, v in enumerate(res.values):
        assert torch.equal(v["back"], v["x"])
        # rank r holds heads [2r, 2r+2) of the whole sequence
        assert torch.equal(v["heads"], full[:, 2 * r:2 * r + 2])
    a2a = res.trace.filter(op="all_to_all")
    assert {e.meta["what"] for e in a2a} == {"seq_to_heads", "heads_to_seq"}


@pytest.mark.parametrize("heads_kv", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_ulysses_attention_matches_full_attention(world, W, causal, heads_kv):
    inputs = dict(batch=2, heads=4, heads_kv=heads_kv, head_dim=8, seed=5, dtype=torch.float32)
    res = world(W).run(sequence_workers.ulysses_worker, 4 * W, causal, **inputs)
    err = errors(res.values, truth(4 * W, causal, **inputs), ring_unshard("contiguous"))
    assert set(err) == {"out", "dq", "dk", "dv"} and all(e < TOL32 for e in err.values()), err


@pytest.mark.parametrize("grid", [(2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_usp_attention_matches_full_attention(world, grid, layout, causal):
    U, R = grid
    S = 16
    inputs = dict(batch=2, heads=4, heads_kv=2 if U < 4 else 4, head_dim=8, seed=6, dtype=torch.float32)
    res = world(4).run(workers.usp_worker, S, U, R, layout, causal, **inputs)
    err = errors(res.values, truth(S, causal, **inputs), lambda shards, n: usp_unshard(shards, U, R, layout))
    assert set(err) == {"out", "dq", "dk", "dv"} and all(e < TOL32 for e in err.values()), err
