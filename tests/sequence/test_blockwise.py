"""Lecture 5a, single process: layouts, block kernels, the merge, blockwise attention, block plans.

Ground truth is full softmax attention computed here in float64 (independent of reference code).
"""
from __future__ import annotations

import math

import pytest
import torch

from reference.sequence import (LAYOUTS, attention_block, attention_block_backward, attention_block_backward_explicit,
                                attention_block_explicit, block_plan, blockwise_attention, causal_pairs, chunk_ids,
                                merge_attention, positions, shard_sequence, tile_kind, unshard_sequence)


def full_attention(q, k, v, causal=False, scale=None):
    """Float64 softmax attention over all keys; GQA by repeating K/V heads.  Returns (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def grads_of(q, k, v, dout, causal=False):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = full_attention(q, k, v, causal)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def randn(*shape, scale=1.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ----------------------------------------------------------------------------------------------
# Layouts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_shard_then_unshard_gives_back_the_sequence(layout, W):
    x = torch.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    shards = [shard_sequence(x, r, W, layout) for r in range(W)]
    assert all(s.shape == (2, 3, 24 // W, 2) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    y = x.transpose(1, 2)  # another dim
    assert torch.equal(unshard_sequence([shard_sequence(y, r, W, layout, dim=1) for r in range(W)], layout, dim=1), y)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_positions_are_the_tokens_the_shard_holds(layout, W):
    S = 24
    for r in range(W):
        pos = positions(S, r, W, layout)
        assert pos.dtype == torch.long
        assert torch.equal(shard_sequence(torch.arange(S).view(1, 1, S, 1), r, W, layout).flatten(), pos)
        assert torch.all(pos[1:] > pos[:-1]), "local order must be increasing global position"


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_layout_definitions(W):
    S = 8 * W
    for r in range(W):
        c = S // W
        assert torch.equal(positions(S, r, W, "contiguous"), torch.arange(r * c, (r + 1) * c))
        h = S // (2 * W)
        zig = torch.cat([torch.arange(r * h, (r + 1) * h), torch.arange((2 * W - 1 - r) * h, (2 * W - r) * h)])
        assert torch.equal(positions(S, r, W, "zigzag"), zig)
        assert torch.equal(positions(S, r, W, "striped"), torch.tensor([i for i in range(S) if i % W == r]))
        assert chunk_ids(r, W, "contiguous") == [r]
        assert chunk_ids(r, W, "zigzag") == [r, 2 * W - 1 - r]
        assert chunk_ids(r, W, "striped") == [r]


def test_bad_layout_sizes_raise_value_error():
    x = torch.zeros(1, 1, 6, 1)
    with pytest.raises(ValueError):
        shard_sequence(x, 0, 4, "contiguous")
    with pytest.raises(ValueError):
        shard_sequence(x, 0, 2, "zigzag")       # 6 is not a multiple of 4
    with pytest.raises(ValueError):
        shard_sequence(x, 0, 4, "striped")
    with pytest.raises(ValueError):
        shard_sequence(x, 3, 3, "contiguous")   # rank out of range
    with pytest.raises(ValueError):
        shard_sequence(x, 0, 2, "diagonal")
    with pytest.raises(ValueError):
        positions(10, 0, 3, "contiguous")


# ----------------------------------------------------------------------------------------------
# Block kernels


KERNELS = {"fused": (attention_block, attention_block_backward),
           "explicit": (attention_block_explicit, attention_block_backward_explicit)}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_kernel_matches_full_attention(kernel, causal, heads_kv, dtype):
    fwd, _ = KERNELS[kernel]
    q, k, v = randn(2, 4, 19, 8, dtype=dtype, seed=1), randn(2, heads_kv, 19, 8, dtype=dtype, seed=2), \
        randn(2, heads_kv, 19, 8, dtype=dtype, seed=3)
    out, lse = fwd(q, k, v, causal=causal)
    ref_out, ref_lse = full_attention(q, k, v, causal)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=0)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_block_kernel_causal_is_top_left_aligned_for_rectangles(kernel):
    fwd, _ = KERNELS[kernel]
    q, k, v = randn(1, 2, 7, 4, seed=1), randn(1, 2, 5, 4, seed=2), randn(1, 2, 5, 4, seed=3)
    out, lse = fwd(q, k, v, causal=True)
    s = q @ k.transpose(-1, -2) / 2
    s = s.masked_fill(~torch.ones(7, 5, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_empty_block_gives_zero_output_and_minus_inf_lse(kernel):
    fwd, bwd = KERNELS[kernel]
    q, k = randn(1, 2, 3, 4), randn(1, 2, 0, 4)
    out, lse = fwd(q, k, k)
    assert torch.equal(out, torch.zeros_like(q)) and torch.all(torch.isneginf(lse))
    out, lse = fwd(q[:, :, :0], randn(1, 2, 3, 4), randn(1, 2, 3, 4))
    assert out.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 1])
def test_block_backward_shares_add_up_to_full_gradients(kernel, causal, heads_kv):
    """dQ summed over key blocks, dK/dV of each key block, from the FINAL out and lse."""
    _, bwd = KERNELS[kernel]
    S = 12
    q, k, v, dout = randn(2, 4, S, 8, seed=1), randn(2, heads_kv, S, 8, seed=2), randn(2, heads_kv, S, 8, seed=3), \
        randn(2, 4, S, 8, seed=4)
    out, lse, dq_ref, dk_ref, dv_ref = grads_of(q, k, v, dout, causal)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, b in ((0, 5), (5, 12)):
        # causal: key block [a, b) against all queries; top-left alignment needs query rows from a on
        rows = slice(a, S) if causal else slice(0, S)
        dq_b, dk_b, dv_b = bwd(dout[..., rows, :], q[..., rows, :], k[..., a:b, :], v[..., a:b, :],
                               out[..., rows, :], lse[..., rows], causal=causal)
        dq[..., rows, :] += dq_b
        dks.append(dk_b)
        dvs.append(dv_b)
    torch.testing.assert_close(dq, dq_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat(dks, 2), dk_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat(dvs, 2), dv_ref, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------------------------
# Merge


@pytest.mark.parametrize("logit_scale", [1.0, 4.0, 1000.0])
def test_merge_of_two_key_blocks_equals_attention_over_both(logit_scale):
    q, k, v = randn(2, 3, 10, 8, scale=logit_scale, seed=1), randn(2, 3, 16, 8, seed=2), randn(2, 3, 16, 8, seed=3)
    oa, la = attention_block_explicit(q, k[..., :6, :], v[..., :6, :])
    ob, lb = attention_block_explicit(q, k[..., 6:, :], v[..., 6:, :])
    out, lse = merge_attention(oa, la, ob, lb)
    ref_out, ref_lse = full_attention(q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10 * logit_scale, rtol=0)


def test_merge_in_float32_with_huge_logits_stays_finite_and_exact():
    """lse near 1000: e^{lse} overflows float32 (and float64 near 710) without the running max."""
    q, k, v = randn(1, 2, 6, 8, scale=300.0, seed=5), randn(1, 2, 8, 8, seed=6), randn(1, 2, 8, 8, seed=7)
    ref_out, ref_lse = full_attention(q, k, v)
    assert ref_lse.abs().max() > 200
    q32, k32, v32 = q.float(), k.float(), v.float()
    oa, la = attention_block(q32, k32[..., :3, :], v32[..., :3, :])
    ob, lb = attention_block(q32, k32[..., 3:, :], v32[..., 3:, :])
    out, lse = merge_attention(oa, la, ob, lb)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=0, rtol=1e-6)


def test_merge_with_a_fully_masked_side_returns_the_other_side():
    out_a, lse_a = randn(1, 2, 4, 3, seed=1), randn(1, 2, 4, seed=2)
    empty_out, empty_lse = (torch.zeros(1, 2, 4, 3, dtype=torch.float64),
                            torch.full((1, 2, 4), -math.inf, dtype=torch.float64))
    for out, lse in (merge_attention(out_a, lse_a, empty_out, empty_lse),
                     merge_attention(empty_out, empty_lse, out_a, lse_a)):
        torch.testing.assert_close(out, out_a, atol=0, rtol=0)
        torch.testing.assert_close(lse, lse_a, atol=0, rtol=0)
    out, lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, empty_out) and torch.all(torch.isneginf(lse))


# ----------------------------------------------------------------------------------------------
# Blockwise attention (single process)


@pytest.mark.parametrize("kernel", ["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [1, 5, 8, 64])
def test_blockwise_attention_equals_full_attention(kernel, causal, block_size):
    q, k, v = randn(2, 4, 21, 8, scale=4.0, seed=1), randn(2, 2, 21, 8, seed=2), randn(2, 2, 21, 8, seed=3)
    out, lse = blockwise_attention(q, k, v, causal=causal, block_size=block_size, kernel=kernel)
    ref_out, ref_lse = full_attention(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)


def test_blockwise_attention_rejects_bad_block_size():
    with pytest.raises(ValueError):
        blockwise_attention(randn(1, 1, 4, 2), randn(1, 1, 4, 2), randn(1, 1, 4, 2), block_size=0)


# ----------------------------------------------------------------------------------------------
# Block plans: which pairs each ring step computes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_block_plan_computes_exactly_the_unmasked_pairs(layout, causal, W):
    """For every (query rank, key rank): the pieces cover every unmasked pair once and no masked pair."""
    S = 4 * W if layout != "zigzag" else 8 * W
    n = S // W
    for r in range(W):
        pq = positions(S, r, W, layout)
        for j in range(W):
            pk = positions(S, j, W, layout)
            want = (pk[None, :] <= pq[:, None]) if causal else torch.ones(n, n, dtype=torch.bool)
            got = torch.zeros(n, n, dtype=torch.int64)
            pieces = block_plan(r, j, W, layout, causal, n)
            assert len(pieces) <= 1
            for p in pieces:
                block = torch.zeros(n, n, dtype=torch.int64)
                nq, nk = p.q.stop - p.q.start, p.k.stop - p.k.start
                sub = torch.ones(nq, nk, dtype=torch.int64)
                block[p.q, p.k] = sub.tril() if p.causal else sub
                got += block
                assert p.pairs == int(block.sum())
                for qc, kc, kind in p.tiles:
                    assert kind == tile_kind(qc, kc, layout, causal) != "masked"
            assert torch.equal(got, want.long()), (r, j)
            if not want.any():
                assert pieces == [], "fully masked blocks must be skipped"


def test_causal_pairs_counts_a_top_left_triangle():
    for nq in range(6):
        for nk in range(6):
            assert causal_pairs(nq, nk) == int(torch.ones(nq, nk).tril().sum())
