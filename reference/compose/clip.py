"""Lecture 5c — global-norm gradient clipping on the rank grid: one norm for a model cut in pieces.

One process clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``: the norm of ALL
the gradients, as one vector, and one coefficient for every gradient::

    ‖g‖ = sqrt( Σ_p ‖g_p‖² )          over the model's unique parameters p
    g_p ← g_p · min(1, c / (‖g‖ + 1e-6))                (torch's epsilon and clamp, exactly)

On a grid no rank holds all of g.  A tensor cut over tp, cp, pp or ep lives in pieces (each
piece's squares are a part of ‖g_p‖²: add them up); a replicated tensor lives in copies (count ONE
copy).  The copies, after :func:`.train.sync_gradients`, are equal::

    parameter (Shard, .parallel_gpt)          pieces over         copies over       counted by
    ────────────────────────────────────────  ──────────────────  ────────────────  ─────────────────────
    qkv, proj.weight, fc1, fc2.weight, vocab  tp, pp              dp·cp             dp = cp = 0
    LayerNorms, pos_emb, row biases, router   pp                  tp × dp·cp        tp = dp = cp = 0
    experts (column / row cuts)               ep × etp, pp        edp               edp = 0
    an expert's row bias                      ep, pp              etp × edp         etp = edp = 0

So each rank sums the squares of the gradients it *owns* (:func:`owns`: the copy with coordinate 0
on every axis that replicates it, read off the model's own shard table: ``Shard.kind`` "replicated"
= whole on every tp rank, ``Shard.expert`` = synchronised over edp instead of dp·cp), and ONE
all-reduce of one float64 over the whole world adds the ranks' sums::

    ‖g‖² = Σ_ranks r  Σ_{p held by r}  owns(r, p) · ‖g_p^(r)‖²

Why one world all-reduce with a mask rather than all-reduces along the axes (Σ over tp of the
sharded part, then over pp, then ep …, as Megatron does over its model-parallel group): every
parameter then obeys the same rule whatever mix of axes cuts it, the sum is 8 bytes on the wire
(traced ``what="grad_norm"``), and every rank gets the same ‖g‖, hence the same coefficient, so
the copies stay equal.  Locally a tensor seen twice (a tied weight) is counted once.  TinyGPT's
head is not tied to its embedding; a model that ties them across the first and last pipeline
stage (Megatron's shared embedding) must count it on one stage only — one more ``owns`` rule.

The classic composed-training bug is to get the counting wrong: Σ every rank's squares counts a
LayerNorm gradient tp·dp·cp times (or, taking only dp = cp = 0, still tp times), and summing only
the local shard gives each rank its own ‖g‖, hence its own coefficient: tp ranks then scale
their copies of one LayerNorm differently and the "replicas" drift apart.  Adam is nearly blind
to one scale on the whole gradient, so the loss curve hardly shows either error; compare ‖g‖
itself with one process's (the full course's tests/compose/test_clip.py: to 1e-10, and the wrong counts differ).

It runs after the gradient synchronisation and before the optimizer step (``train_step(…,
clip_grad_norm=c)``).  With ZeRO (.zero) the dense gradients, once reduced, live in dp·cp shards
of one flat vector (ZeRO-2: only my shard; ZeRO-1: my shard is all Adam reads): every rank counts
its shard (the shards partition the vector, no dp·cp copies left) with tp-replicated elements
masked out on tp ≠ 0 (:func:`clip_zero_`).
"""
from __future__ import annotations

import math

import torch

from .. import comm

__all__ = ["owns", "global_grad_norm", "clip_coef", "clip_grad_norm_", "clip_zero_", "EPS"]

EPS = 1e-6            # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (‖g‖ + 1e-6), clamped to 1


def owns(shard, coords: dict) -> bool:
    """Does the rank at ``coords`` count this :class:`.parallel_gpt.Shard` in ‖g‖²?  The copy at 0
    on every axis that replicates it: edp (an expert) or dp and cp (dense), and tp (etp for an expert)
    if it is whole there."""
    if shard.expert:
        return coords["edp"] == 0 and (shard.kind != "replicated" or coords["etp"] == 0)
    return coords["dp"] == 0 and coords["cp"] == 0 and (shard.kind != "replicated" or coords["tp"] == 0)


def _world_norm(local_sq: torch.Tensor, device) -> float:
    """sqrt of Σ over the world of every rank's ``local_sq``: one all-reduce of one float64."""
    t = torch.tensor([float(local_sq)], dtype=torch.float64, device=device)
    comm.all_reduce(t, what="grad_norm")
    return math.sqrt(float(t))


def global_grad_norm(model, *, owns=owns) -> float:
    """‖g‖ of the whole model's (synchronised) gradients, the same on every rank (collective).

    ``owns(shard, coords)`` says which ranks count which parameter (default :func:`owns`; the tests
    pass wrong rules to show that the comparison with one process catches them)."""
    device = next(model.parameters()).device
    seen, sq = set(), torch.zeros((), dtype=torch.float64, device=device)
    for s in model.shards.values():
        g = s.param.grad
        if g is None or id(s.param) in seen or not owns(s, model.coords):
            continue
        seen.add(id(s.param))
        sq += g.detach().double().square().sum()
    return _world_norm(sq, device)


def clip_coef(total: float, max_norm: float) -> float:
    """min(1, max_norm / (total + 1e-6)): torch's coefficient."""
    return min(max_norm / (total + EPS), 1.0)


def _scale(grads, coef: float) -> None:
    for g in grads:
        if g is not None:
            g.mul_(coef)


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for a :class:`.parallel_gpt.ParallelGPT` on its grid.

    Call it on every rank after the gradient synchronisation and before the optimizer step.
    Returns ‖g‖ before clipping (a float, the same on every rank) and multiplies every ``.grad``
    of this rank by min(1, max_norm / (‖g‖ + 1e-6)) in place.  One all-reduce of 8 bytes.
    """
    total = global_grad_norm(model)
    _scale((p.grad for p in model.parameters()), clip_coef(total, max_norm))
    return total


@torch.no_grad()
def clip_zero_(model, zero, max_norm: float) -> float:
    """The same on a ZeRO run: ``zero`` is the :class:`reference.data.zero.ZeroOptimizer` of the dense
    parameters, between its gradient reduction and its optimizer step (:class:`.zero.ComposedZero`
    calls it there); the experts' gradients, already synchronised over edp, are plain tensors.

    Dense part: every rank's S-element shard of the flat mean gradient (``zero.shard.grad``), with
    the elements of tp-replicated parameters counted on tp rank 0 only.  Scales the shard (ZeRO-1:
    through the parameters' ``.grad``, views of the same flat vector) and the experts' gradients.
    """
    replicated = {id(s.param) for s in model.shards.values() if s.kind == "replicated"}
    counted = torch.zeros_like(zero.flat)            # 1 on the flat elements tp rank coords["tp"] counts
    offset = 0
    for p in zero.params:
        counted[offset:offset + p.numel()] = float(id(p) not in replicated or model.coords["tp"] == 0)
        offset += p.numel()
    S, r = zero.shard.numel(), comm.rank(zero.group)
    sq = (zero.shard.grad.double().square() * counted[r * S:(r + 1) * S]).sum()
    experts = {id(s.param): s for s in model.shards.values() if s.expert}     # each tensor once
    for s in experts.values():
        if s.param.grad is not None and owns(s, model.coords):
            sq += s.param.grad.double().square().sum()
    total = _world_norm(sq, zero.flat.device)
    coef = clip_coef(total, max_norm)
    _scale([p.grad for p in zero.params] if zero.stage == 1 else [zero.shard.grad], coef)
    _scale([s.param.grad for s in experts.values()], coef)
    return total
