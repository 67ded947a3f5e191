"""Lecture 6, part 3 — the tool that finds silent bugs: where does a parallel run first part from one process?

Two recorded runs of the same training (:mod:`.runs`) — one on a grid of ranks, one on one process —
hold every module's input, output and gradients, every parameter's gradient and value, step by step,
each rank's pieces placed in the one-process tensor (:mod:`.records`).  A bug shows first in one record
and, from there on, in (nearly) everything computed from it.  On a real cluster every comparison costs a
dump of tensors, so the search is a bisection, as one bisects commits::

    steps        0         1         2         3         4         5
    differ?      no        no        ?                   yes       yes     ← once parted, the runs stay parted:
                                     └── bisect: log₂(steps) steps compared, not all of them
    the first differing step, walked in order:
      forward    tok_emb → blocks.0.ln1 → blocks.0.attn.qkv → blocks.0.attn.proj (input ✗)   ← the first
      backward   head → … (never reached)

Within a step the records are walked in the order one process made them: forward (each module's input,
then output), backward (∂L/∂output, ∂L/∂input, last module first), the gradients the optimizer used,
the parameters after its step.  A record differs where ``|parallel − single| > atol + rtol·|single|`` in
any element of any rank's piece; the answer names the ranks whose pieces differ and how much.
"""
from __future__ import annotations

import torch

from .records import Divergence, Run

__all__ = ["first_divergence"]


def first_divergence(parallel_run: Run, single_run: Run, *, atol: float = 1e-9, rtol: float = 1e-6
                     ) -> Divergence | None:
    """The first record at which ``parallel_run`` differs from ``single_run`` (exercise 6.2), or None.

    Both are :class:`reference.debug.records.Run`; ``single_run.records`` are in the order one
    process made them, and each parallel record (``parallel_run.get(record.key)``; a key the parallel
    run lacks is skipped) holds every rank's pieces ``(rank, offsets, block)``: ``block`` is the
    slice of the one-process tensor that starts at ``offsets``.  An element differs where
    ``|block − single| > atol + rtol·|single|`` (NaN equals only NaN).

    Bisect over the steps (a step differs if any of its records does; once two runs part they stay
    parted), then walk the first differing step's records in order.  Returns a
    :class:`reference.debug.records.Divergence`: the record's step, phase, module and tensor, the
    sorted ranks whose pieces differ, the largest absolute difference (inf for a NaN against a
    number), that over the largest |entry| of the one-process tensor, and the index in the whole
    tensor of the largest difference.

    Graded on: runs of 2 ranks recorded in float64 with each of the nine planted bugs at a drawn layer and rank,
    and two correct runs (None is the answer there); the first differing record (step, phase, module, tensor),
    its sorted ranks and max_abs (to 1e-6 relative) — in a hidden check also a bug of the grader's own at a drawn
    record, rank and size, and a NaN.
    """
    by_step: dict[int, list] = {}
    for rec in single_run.records:
        by_step.setdefault(rec.step, []).append(rec)
    steps = sorted(by_step)

    def compare(rec):
        """(ranks that differ, max |Δ|, max |single|, index of the max) for one record, or None."""
        other = parallel_run.get(rec.key)
        if other is None:
            return None
        whole = rec.whole()
        ranks, worst, where = set(), -1.0, ()
        for rank, offsets, block in other.pieces:
            want = whole[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))]
            if want.shape != block.shape:             # a piece that does not fit: as different as can be
                ranks.add(rank)
                worst, where = float("inf"), tuple(offsets)
                continue
            bad = ~torch.isclose(block, want, rtol=rtol, atol=atol, equal_nan=True)
            if bool(bad.any()):
                ranks.add(rank)
                diff = (block - want).abs().where(bad, torch.zeros_like(want)).nan_to_num(nan=float("inf"))
                i = int(diff.reshape(-1).argmax())
                if float(diff.reshape(-1)[i]) > worst:
                    local = torch.unravel_index(torch.tensor(i), diff.shape)
                    worst, where = float(diff.reshape(-1)[i]), tuple(o + int(x) for o, x in zip(offsets, local))
        if not ranks:
            return None
        scale = float(whole.nan_to_num(nan=0.0).abs().max()) if whole.numel() else 0.0
        return sorted(ranks), worst, scale, where

    def step_differs(step: int) -> bool:
        return any(compare(rec) is not None for rec in by_step[step])

    lo, hi = 0, len(steps)                        # the first differing step lies in steps[lo:hi] (or none does)
    while lo < hi:
        mid = (lo + hi) // 2
        if step_differs(steps[mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(steps):
        return None
    for rec in by_step[steps[lo]]:
        found = compare(rec)
        if found is not None:
            ranks, worst, scale, where = found
            return Divergence(rec.step, rec.phase, rec.module, rec.tensor, ranks, worst,
                              worst / scale if scale > 0 else float("inf"), where)
    return None
