"""Attention one block at a time, and the merge that makes the blocks add up to full attention.

For one query row q and keys k_1..k_n, softmax attention is ::

    s_t = scale · q·k_t          lse = log Σ_t e^{s_t}          out = Σ_t e^{s_t − lse} v_t

Split the keys into two blocks A and B.  Each block alone gives (out_A, lse_A) and (out_B, lse_B),
and the full answer is their mix weighted by each block's share of the softmax mass::

    lse = log(e^{lse_A} + e^{lse_B})
    out = e^{lse_A − lse} · out_A  +  e^{lse_B − lse} · out_B                        (merge)

Computed literally, e^{lse_A} overflows for large logits; subtract the running maximum
m = max(lse_A, lse_B) first (the online-softmax trick of Milakov & Gimelshein, used by
FlashAttention and the Blockwise Parallel Transformer, arXiv:2305.19370).  A block in which a row
sees no key at all (fully masked) has lse = −inf and weight 0.

Two block kernels return (out, lse) and give the same numbers:

* :func:`attention_block` — the fused CPU kernel behind ``scaled_dot_product_attention``
  (``aten._scaled_dot_product_flash_attention_for_cpu``), fast, supports fewer K/V heads (GQA);
* :func:`attention_block_explicit` — matmul, mask, stable softmax, written out to be read.

Their backward twins take the *final* output and log-sum-exp of the whole row (after all merges)
and return this block's share of dQ, dK, dV — what a ring backward adds up.

Tensors are (batch, heads, seq, head_dim), as in SDPA; lse is (batch, heads, seq).  K and V may
have fewer heads than Q (a divisor: grouped-query attention); query head h uses K/V head
h // (heads_q / heads_kv).  ``causal=True`` is the top-left aligned mask: query i sees keys t ≤ i
(local indices of the block).
"""
from __future__ import annotations

import functools
import inspect
import math

import torch

from .. import trace

__all__ = ["attention_block", "attention_block_explicit", "attention_block_backward",
           "attention_block_backward_explicit", "merge_attention", "blockwise_attention", "block_kernels",
           "causal_pairs"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_block(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that see no key: out = 0, lse = −inf.  (The fused kernel crashes on empty inputs.)"""
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    lse = torch.full(q.shape[:-1], -math.inf, dtype=_lse_dtype(q.dtype), device=q.device)
    return out, lse


def _use_fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FUSED_DTYPES


def causal_pairs(n_q: int, n_k: int) -> int:
    """Unmasked pairs of a top-left causal block: query i sees min(i+1, n_k) keys."""
    m = min(n_q, n_k)
    return m * (m + 1) // 2 + max(0, n_q - n_k) * n_k


def _measured(what: str):
    """A given kernel called outside any traced block — a learner's ring calls it bare — records the
    block as a ``compute`` event (``what``, ``pairs``: unmasked (query, key) pairs of one batch
    element and head), so that the lecture measures pairs per rank, and draws the timeline, of a
    learner's run as of the reference's, which traces its own blocks (and is not counted twice)."""
    def deco(kernel):
        signature = inspect.signature(kernel)

        @functools.wraps(kernel)
        def measured(*args, **kwargs):
            if not trace.is_recording() or trace.in_span():
                return kernel(*args, **kwargs)
            given = signature.bind(*args, **kwargs).arguments
            n_q, n_k = given["q"].shape[-2], given["k"].shape[-2]
            pairs = causal_pairs(n_q, n_k) if given.get("causal") else n_q * n_k
            with trace.span("compute", what=what, pairs=pairs):
                return kernel(*args, **kwargs)
        return measured
    return deco


# ----------------------------------------------------------------------------------------------
# Forward


@_measured("attn_fwd")
def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q`` over one block of keys/values, with the log-sum-exp of each row.

    q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D), Hkv divides H.  Returns out (B, H, Sq, D) in q's dtype
    and lse (B, H, Sq) in float32 (float64 for float64 inputs).  Uses the fused CPU kernel; on
    other devices or dtypes it falls back to :func:`attention_block_explicit` (same results).
    No autograd: call it under ``torch.no_grad()`` or on detached tensors.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_block(q, v)
    if not _use_fused(q):
        return attention_block_explicit(q, k, v, causal=causal, scale=scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=_scale(q, scale))
    return out, lse


@_measured("attn_fwd")
def attention_block_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`attention_block`, written out::

        S   = scale · Q Kᵀ                      (B, H, Sq, Sk); masked entries −inf
        m   = rowmax(S)                         shift so that no exponent is positive
        P̃   = exp(S − m),   ℓ = rowsum(P̃)
        out = P̃ V / ℓ,      lse = m + log ℓ

    Half-precision inputs are computed in float32.  A fully masked row gives out 0, lse −inf.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _empty_block(q, v)
    work = torch.promote_types(q.dtype, torch.float32)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    # Grouped-query attention without copying K/V: the G query heads that share a K/V head are a
    # separate axis, and K/V broadcast over it.
    qg = q.to(work).unflatten(1, (Hkv, H // Hkv))                  # (B, Hkv, G, Sq, D)
    kg, vg = k.to(work).unsqueeze(2), v.to(work).unsqueeze(2)      # (B, Hkv, 1, Sk, D)
    s = (qg @ kg.transpose(-1, -2)) * _scale(q, scale)             # (B, Hkv, G, Sq, Sk)
    if causal:
        keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)     # fully masked row: any finite shift
    p = torch.exp(s - m)
    ell = p.sum(dim=-1, keepdim=True)
    out = (p @ vg) / torch.where(ell == 0, torch.ones_like(ell), ell)
    lse = (m + torch.log(ell)).squeeze(-1)                         # log 0 = −inf for masked rows
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).to(_lse_dtype(q.dtype))


# ----------------------------------------------------------------------------------------------
# Backward


@_measured("attn_bwd")
def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool = False,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dQ, dK, dV), given the rows' FINAL ``out`` and ``lse``.

    Fused CPU kernel (``..._flash_attention_for_cpu_backward``); other devices/dtypes fall back to
    :func:`attention_block_backward_explicit`.  dQ is (B, H, Sq, D); dK, dV are (B, Hkv, Sk, D),
    already summed over the query heads that share each K/V head.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if not _use_fused(q):
        return attention_block_backward_explicit(dout, q, k, v, out, lse, causal=causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=_scale(q, scale))


@_measured("attn_bwd")
def attention_block_backward_explicit(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      out: torch.Tensor, lse: torch.Tensor, *, causal: bool = False,
                                      scale: float | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FlashAttention-2 backward (arXiv:2307.08691, Alg. 2) for one block, step by step:

        1. S  = scale · Q Kᵀ                 (masked entries −inf)
        2. P  = exp(S − lse)                 recomputed from the saved FINAL lse: this block's
                                             exact share of each row's softmax, no re-normalising
        3. dV = Pᵀ dO
        4. dP = dO Vᵀ
        5. D  = rowsum(dO ∘ O)               O is the final output of the whole row
        6. dS = P ∘ (dP − D)                 softmax backward
        7. dQ = scale · dS K
        8. dK = scale · dSᵀ Q

    Summing steps 3, 7, 8 over all key blocks (dQ) or all query blocks (dK, dV) gives the full
    gradients, because P and D are already the global ones.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    work = torch.promote_types(q.dtype, torch.float32)
    sc = _scale(q, scale)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    grouped = lambda t: t.to(work).unflatten(1, (Hkv, G))          # noqa: E731  (B, Hkv, G, Sq, ·)
    qg, dog, og = grouped(q), grouped(dout), grouped(out)
    kg, vg = k.to(work).unsqueeze(2), v.to(work).unsqueeze(2)
    lse_g = lse.to(work).unflatten(1, (Hkv, G)).unsqueeze(-1)
    lse_g = torch.where(torch.isneginf(lse_g), torch.zeros_like(lse_g), lse_g)
    s = (qg @ kg.transpose(-1, -2)) * sc                                        # 1
    if causal:
        keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    p = torch.exp(s - lse_g)                                                    # 2
    dv = (p.transpose(-1, -2) @ dog).sum(dim=2)                                 # 3
    dp = dog @ vg.transpose(-1, -2)                                             # 4
    d = (dog * og).sum(dim=-1, keepdim=True)                                    # 5
    ds = p * (dp - d)                                                           # 6
    dq = (ds @ kg) * sc                                                         # 7
    dk = (ds.transpose(-1, -2) @ qg).sum(dim=2) * sc                            # 8
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_kernels(kernel: str):
    """``(forward, backward)`` block functions for ``kernel`` in "fused", "explicit"."""
    if kernel == "fused":
        return attention_block, attention_block_backward
    if kernel == "explicit":
        return attention_block_explicit, attention_block_backward_explicit
    raise ValueError(f"kernel must be 'fused' or 'explicit', got {kernel!r}")


# ----------------------------------------------------------------------------------------------
# Merge


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key blocks into attention over their union.

    out_*: (B, H, S, D); lse_*: (B, H, S).  With m = max(lse_a, lse_b)::

        w_a = e^{lse_a − m},  w_b = e^{lse_b − m}          (one of them is 1, none overflows)
        lse = m + log(w_a + w_b)
        out = (w_a · out_a + w_b · out_b) / (w_a + w_b)

    A side with lse = −inf (the row saw no key there) gets weight 0; if both are −inf the result
    is out 0, lse −inf.  Returns new tensors (out in the promoted dtype of the inputs).

    Graded on: (out, lse) against float64 attention over both blocks, with logits ×4 and ×30 and sides that saw no
    key.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)
    total = torch.where(total == 0, torch.ones_like(total), total)
    out = out_a * (w_a / total).unsqueeze(-1) + out_b * (w_b / total).unsqueeze(-1)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Single process, block by block


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        block_size: int = 128, scale: float | None = None,
                        kernel: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed one (query block, key block) tile at a time, never holding the S×S scores.

    Blockwise Parallel Transformer style (arXiv:2305.19370): for each query block, walk over the
    key blocks and fold each into a running (out, lse) with :func:`merge_attention`.  With
    ``causal=True`` (query i sees keys t ≤ i, positions counted from 0 in both q and k) tiles
    entirely above the diagonal are skipped and the diagonal tiles use the causal kernel::

                 key blocks →
               ┌───┬───┬───┬───┐
        q   0  │ ◣ │ · │ · │ · │     ◣ causal tile   █ full tile   · skipped
        blk 1  │ █ │ ◣ │ · │ · │
        ↓   2  │ █ │ █ │ ◣ │ · │
            3  │ █ │ █ │ █ │ ◣ │
               └───┴───┴───┴───┘

    Returns (out (B, H, Sq, D), lse (B, H, Sq)) — the same as one call on all keys.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    fwd, _ = block_kernels(kernel)
    Sq, Sk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for a in range(0, Sq, block_size):
        b = min(a + block_size, Sq)
        out, lse = _empty_block(q[..., a:b, :], v)
        for c in range(0, Sk, block_size):
            d = min(c + block_size, Sk)
            if causal and c > b - 1:          # every key of this tile is after every query
                break
            diagonal = causal and d - 1 > a   # some keys are after some queries: c == a here
            o_blk, l_blk = fwd(q[..., a:b, :], k[..., c:d, :], v[..., c:d, :], causal=diagonal, scale=scale)
            out, lse = merge_attention(out, lse, o_blk, l_blk)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)
