"""Lecture 5b, "sparse, not just large": why the dispatch must be index-based.

GShard's paper (arXiv:2006.16668, Algorithm 1) and the Mesh-TensorFlow / fairscale layers built on it
write dispatch and combine as dense einsums over a one-hot mask::

    dispatch_mask  (T, E, C)   1 where token t sits in slot c of expert e
    combine_w      (T, E, C)   its gate weight there
    buffers  = einsum("tec,td->ecd", dispatch_mask, x)        # 2·T·E·C·d FLOPs
    y        = einsum("tec,ecd->td",  combine_w, expert_out)   # 2·T·E·C·d FLOPs

With C ≈ k·T/E slots per expert that is ≈ 2·k·T²·d FLOPs each way: quadratic in the tokens, though
only k·T rows move.  An index-based dispatch (what :mod:`reference.moe.parallel` does) copies those
k·T rows of d numbers and nothing else: ``index_copy`` into the buffers, ``index_add`` back.

:func:`dense_vs_index` runs both on the same random routing on one process, checks that they give the
same buffers and the same output, and times them — the notebook prints the ratio beside the FLOP
count.  (The full course's ``benchmarks/moe.py`` measures the whole fairscale layer against ours on 2 ranks.)
"""
from __future__ import annotations

import math
import time

import torch


def random_routing(tokens: int, num_experts: int, k: int, capacity: int, *, seed: int = 0) -> dict:
    """Top-k of random logits, first come first served into ``capacity`` slots per expert.

    Returns ``token`` (n,), ``expert`` (n,), ``slot`` (n,), ``weight`` (n,) for the n kept
    assignments (the dropped ones are left out), first choices before second choices as in GShard.
    """
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(tokens, num_experts, generator=g).softmax(-1)
    w, e = probs.topk(k, dim=-1)                                   # (T, k)
    token = torch.arange(tokens).repeat_interleave(k).view(tokens, k).t().reshape(-1)   # choice-major
    expert, weight = e.t().reshape(-1), w.t().reshape(-1)
    one_hot = torch.nn.functional.one_hot(expert, num_experts)
    slot = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)             # position in its expert's queue
    keep = slot < capacity
    return {"token": token[keep], "expert": expert[keep], "slot": slot[keep], "weight": weight[keep]}


def dense_dispatch_combine(x: torch.Tensor, r: dict, num_experts: int, capacity: int, expert_fn):
    """GShard's einsum form: one-hot (T, E, C) masks, then two dense contractions."""
    T = x.shape[0]
    mask = x.new_zeros(T, num_experts, capacity)
    mask[r["token"], r["expert"], r["slot"]] = 1.0
    combine_w = x.new_zeros(T, num_experts, capacity)
    combine_w[r["token"], r["expert"], r["slot"]] = r["weight"].to(x.dtype)
    buffers = torch.einsum("tec,td->ecd", mask, x)
    return buffers, torch.einsum("tec,ecd->td", combine_w, expert_fn(buffers))


def index_dispatch_combine(x: torch.Tensor, r: dict, num_experts: int, capacity: int, expert_fn):
    """Index form: copy the k·T kept rows into their slots, and add them back weighted."""
    d = x.shape[1]
    where = r["expert"] * capacity + r["slot"]
    buffers = x.new_zeros(num_experts * capacity, d).index_copy_(0, where, x[r["token"]])
    out = expert_fn(buffers.view(num_experts, capacity, d)).reshape(-1, d)
    y = x.new_zeros(x.shape).index_add_(0, r["token"], out[where] * r["weight"].to(x.dtype)[:, None])
    return buffers.view(num_experts, capacity, d), y


def dense_vs_index(tokens: int = 2048, num_experts: int = 8, d_model: int = 256, k: int = 2,
                   capacity_factor: float = 1.0, reps: int = 3) -> dict:
    """Same routing, both dispatches: equal results, FLOPs counted, seconds measured (best of reps)."""
    capacity = math.ceil(k * capacity_factor * tokens / num_experts)
    r = random_routing(tokens, num_experts, k, capacity)
    x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(1))
    expert_fn = torch.tanh                                          # any row-wise function will do
    results, seconds = {}, {}
    for name, fn in (("dense", dense_dispatch_combine), ("index", index_dispatch_combine)):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            results[name] = fn(x, r, num_experts, capacity, expert_fn)
            best = min(best, time.perf_counter() - t0)
        seconds[name] = best
    (bd, yd), (bi, yi) = results["dense"], results["index"]
    return {
        "tokens": tokens, "num_experts": num_experts, "d_model": d_model, "k": k, "capacity": capacity,
        "kept": int(r["token"].numel()),
        "max_diff": max(float((bd - bi).abs().max()), float((yd - yi).abs().max())),
        "dense_flops": 2 * 2 * tokens * num_experts * capacity * d_model,   # two einsums
        "index_elements": 2 * int(r["token"].numel()) * d_model,             # rows copied out and back
        "dense_s": seconds["dense"], "index_s": seconds["index"],
    }
