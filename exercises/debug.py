"""Lecture 6 exercises — when the split goes wrong.  Reference: ``reference/debug/``.

    6.1  diagnose_hang          from the course's hang report: the kind of hang and the ranks at fault
    6.2  first_divergence       where a parallel run first parts from one process (bisect, then walk)
    6.3  accumulate_gradients   fix the given run's silent bug (reference.debug.accumulate.accumulate_gradients_given)

Given (already written for you): the report format (:func:`reference.debug.hangs.hang_report`), the
recorded runs (:class:`reference.debug.records.Run`, :class:`~reference.debug.records.Record`) and the
answer's type :class:`~reference.debug.records.Divergence`, the padded data and the given step of
6.3 (``reference.debug.accumulate``), and the traced collectives in ``reference.comm``.  Check your
work with ``check("6.1")`` in the notebook or ``python -m exercises.grade 6.1`` in a terminal.
"""
from __future__ import annotations

import re  # noqa: F401  (reading the reports: you will want it)

import torch  # noqa: F401
import torch.nn.functional as F  # noqa: F401  (cross_entropy)

from reference import comm  # noqa: F401  (traced all_reduce)
from reference.debug.accumulate import IGNORE, accumulate_gradients_given  # noqa: F401  (given: 6.3's buggy step, to read)
from reference.debug.records import Divergence, Record, Run  # noqa: F401  (given)

__all__ = ["diagnose_hang", "first_divergence", "accumulate_gradients"]


# ----------------------------------------------------------------------------------------------
# 6.1 — read a hang report


def diagnose_hang(report: dict) -> dict:
    """The kind of hang in ``report`` (:func:`reference.debug.hangs.hang_report`) and the ranks at fault
    (exercise 6.1).

    report: ``{"kind": "timeout" | "exception" | "died", "message": str, "world_size": W,
    "ranks": {rank: {"state": str, "blocked_in": str, "error": str}}}``.
    Returns ``{"kind": one of "order", "skip", "p2p", "pipeline", "group", "shape",
    "ranks": sorted list of the ranks at fault}`` (see this module's table).  A report with no
    signature of any kind: ValueError.

    Graded on: the course's reports of six real hangs, each run on 2–3 real ranks with its bug planted on drawn
    ranks after 0–9 good steps (order and group together, skip, p2p, pipeline, shape under DETAIL; in a hidden
    check a 4-stage pipeline and the odd one out of 4): the kind, and the sorted ranks at fault as planted.
    """
    raise NotImplementedError(
        'Exercise 6.1 (diagnose_hang): Look at each rank\'s state first: who is blocked, who is "running" '
        'with no communication, who FINISHED, who raised. Each kind of hang leaves its own pattern (the table '
        'in reference/debug/diagnose.py\'s docstring is in the lecture). More help: hint("6.1").')


# ----------------------------------------------------------------------------------------------
# 6.2 — the first divergence


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
    raise NotImplementedError(
        "Exercise 6.2 (first_divergence): Compare one record first: for each (rank, offsets, block) of the "
        "parallel record, cut the same slice out of the one-process tensor (record.whole()) and test it with "
        'torch.isclose. Then search the steps by bisection. More help: hint("6.2").')


# ----------------------------------------------------------------------------------------------
# 6.3 — fix the given run


def accumulate_gradients(model, microbatches: list, *, group=None) -> float:
    """One step's gradient on this data-parallel rank, equal to one process's (exercise 6.3).

    microbatches: this rank's list of (x, y): x (b, S) token ids, y (b, S) targets, ``IGNORE`` (-100)
    at padding; ``model(x)`` returns logits (b, S, V).  The objective is one process's: the mean
    cross-entropy over every real (not IGNORE) token of the whole batch — all ranks of ``group``, all
    their micro-batches.  Afterwards every parameter's ``.grad`` (of every rank) holds ∂L/∂θ; returns
    L (a float, the same on every rank).  A micro-batch, a rank, even the whole batch may hold no
    real token: no NaN may come out of it (an empty batch's loss and gradients are 0).

    Graded on: every rank's returned loss and .grad against one process's on the whole padded batch (to 1e-9):
    2 ranks × 2 micro-batches, 1 rank × 4, 3 ranks × 1, and 2 ranks × 4 with micro-batches that hold no real
    token (4 ranks × 2 on fresh documents in a hidden check); each rank is given only its own micro-batches, and
    only all_reduce may communicate.
    """
    raise NotImplementedError(
        "Exercise 6.3 (accumulate_gradients): Start from a copy of the given step's body "
        "(accumulate_gradients_given in reference/debug/accumulate.py; calling it is switched off while 6.3 is "
        "graded): it runs, and it is silently wrong whenever micro-batches hold different numbers of real tokens. "
        'Find where with first_divergence, then fix it. More help: hint("6.3").')
