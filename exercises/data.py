"""Lecture 3 exercises — the data axis.  Reference: ``reference/data/``.

    3.1  all_reduce_gradients                          the gradient all-reduce: a mean over ranks
    3.2  assign_buckets, grad_ready, finish_buckets    bucketed all-reduce, overlapped with backward
    3.3  zero_step                                     a ZeRO-1/2 optimizer step: reduce, update my shard, all-gather
    3.4  gather_full_params, reduce_scatter_grad       ZeRO-3's two collectives

Given (already written for you): :class:`Bucket`, :func:`shard_size`, and the classes that call
your functions — ``reference.data.DataParallel`` (hooks, ``no_sync``), ``ZeroOptimizer`` and
``FullyShardedDataParallel`` — plus the traced collectives in ``reference.comm``
(``comm.all_reduce``, ``comm.all_reduce_async``, ``comm.reduce_scatter_tensor``,
``comm.all_gather_into_tensor``; plain ``torch.distributed`` works too).  Check your work with
``check("3.1")`` in the notebook or ``python -m exercises.grade 3.1`` in a terminal.  Stuck? More
hints, one tier at a time: ``from exercises.grading.checks.data import HINTS; HINTS["3.2"][0]``.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from reference import comm  # noqa: F401  (traced collectives)
from reference.data.ddp import Bucket  # noqa: F401  (given)
from reference.data.zero import shard_size  # noqa: F401  (given)

__all__ = ["Bucket", "shard_size", "all_reduce_gradients", "assign_buckets", "grad_ready", "finish_buckets",
           "zero_step", "gather_full_params", "reduce_scatter_grad"]


# ----------------------------------------------------------------------------------------------
# 3.1 — the gradient all-reduce


def all_reduce_gradients(parameters: Iterable[torch.Tensor], *, group=None) -> None:
    """Average every parameter's ``.grad`` over the ranks of ``group``, in place (exercise 3.1).

    After it, ``p.grad`` = (1/N) Σ_r (rank r's p.grad) on every rank, N = the group's size.  One
    all-reduce (a SUM, traced through ``comm.all_reduce``) per parameter, then a division by N
    (gloo's AVG is recent; sum-then-divide works on every backend).  Parameters whose ``.grad`` is
    None are skipped (the same ones on every rank).

    Graded on: every .grad the mean over 2–4 ranks (magnitudes 1e6, float32), a missing .grad left None; each rank
    is given its own gradients only.
    """
    raise NotImplementedError(
        'Exercise 3.1 (all_reduce_gradients): Every rank must end with the gradient of the MEAN loss over '
        'ranks. Which collective gives every rank the same total, and what turns a total into a mean? More '
        'help: hint("3.1").')


# ----------------------------------------------------------------------------------------------
# 3.2 — buckets, overlapped with backward


def assign_buckets(params: list[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Split ``params`` (already in gradient order) into buckets; return each bucket's indices.

    Greedy, in order: a parameter joins the current bucket if the bucket is empty or stays within
    ``bucket_cap_bytes`` with it; otherwise it starts the next bucket.  So a parameter larger than
    the cap gets a bucket of its own, and no bucket but such one exceeds the cap.

        sizes [3, 3, 3, 9, 1], cap 6   →   [[0, 1], [2], [3], [4]]

    Graded on: the buckets of random sizes, dtypes and caps (in bytes; a parameter larger than the cap alone).
    """
    raise NotImplementedError(
        'Exercise 3.2 (assign_buckets): assign_buckets is one greedy pass in the given order, counting bytes;'
        ' grad_ready counts a gradient and posts every complete bucket next in line with '
        'comm.all_reduce_async, never waiting; finish_buckets posts the rest, waits, turns sums into means '
        'and puts the gradients back. More help: hint("3.2").')


def grad_ready(buckets: list[Bucket], index: int, *, group=None) -> None:
    """One more gradient of ``buckets[index]`` is ready (called from a parameter's hook, exercise 3.2).

    Count it; then post, IN BUCKET ORDER, the all-reduce of every complete bucket not yet posted
    (stop at the first incomplete one): pack its gradients into one flat ``buffer`` and post
    ``comm.all_reduce_async(buffer, group=group, what="grads", bucket=b.index)`` — a SUM — keeping
    the pending handle in ``work``.  Do not wait here: backward goes on computing while it flies.

    Graded on: DataParallel's gradients equal to one process's on the whole batch (2–4 ranks, tiny buckets, a
    parameter unused on some ranks); overlap in values — once a bucket is complete its .grad are replaced, so only
    an all-reduce posted from grad_ready carries the right ones — and every all-reduce you post, counted by the
    grader as grad_ready returns.
    """
    raise NotImplementedError(
        'Exercise 3.2 (grad_ready): assign_buckets is one greedy pass in the given order, counting bytes; '
        'grad_ready counts a gradient and posts every complete bucket next in line with '
        'comm.all_reduce_async, never waiting; finish_buckets posts the rest, waits, turns sums into means '
        'and puts the gradients back. More help: hint("3.2").')


def finish_buckets(buckets: list[Bucket], *, group=None) -> None:
    """End of backward: every bucket reduced, every ``.grad`` the mean over ranks (exercise 3.2).

    Post, in order, any bucket not posted yet (overlap off, or a parameter that got no gradient
    this step: its gradient counts as zeros, so every rank still posts the same collectives and
    nobody hangs).  Then wait for each, divide by N, and copy its slices back into the ``.grad``
    of its parameters (creating ``.grad`` where it was None).  Reset ``ready``/``buffer``/``work``.

    Graded on: DataParallel's gradients equal to one process's on the whole batch (2–4 ranks, tiny buckets, a
    parameter unused on some ranks); each bucket reduced exactly once, counted by the grader.
    """
    raise NotImplementedError(
        'Exercise 3.2 (finish_buckets): assign_buckets is one greedy pass in the given order, counting bytes;'
        ' grad_ready counts a gradient and posts every complete bucket next in line with '
        'comm.all_reduce_async, never waiting; finish_buckets posts the rest, waits, turns sums into means '
        'and puts the gradients back. More help: hint("3.2").')


# ----------------------------------------------------------------------------------------------
# 3.3 — a ZeRO-1/2 step


def zero_step(params: list[torch.Tensor], shard: torch.Tensor, optimizer: torch.optim.Optimizer, *, stage: int,
              group=None) -> None:
    """One ZeRO-1/2 optimizer step (exercise 3.3).

    params:    the trainable parameters, each a view into a flat buffer of N·S elements in this
               order (p.grad: this rank's local gradient, or None = zeros).
    shard:     this rank's S-element slice of that flat buffer (rank r: elements [r·S, (r+1)·S)),
               the one tensor ``optimizer`` was built on.
    stage 1:   all-reduce (SUM) the flat gradient, ÷ N; the params' ``.grad`` become views of it
               (every rank keeps the full mean gradient); ``shard.grad`` = my slice of it.
    stage 2:   reduce-scatter (SUM) the flat gradient into my S elements, ÷ N; ``shard.grad`` = that;
               the params' ``.grad`` are set to None (only my shard of the gradient is kept).
    Then ``optimizer.step()`` updates ``shard`` in place, and an all-gather of every rank's shard
    (``comm.all_gather_into_tensor``) brings every rank the full updated parameters.

    Graded on: the parameters after 1–3 steps equal to one process's (stages 1 and 2, 2–4 ranks, uneven shards, SGD
    and AdamW); before your step the parameters outside this rank's shard hold garbage, so only a step that all-
    gathers the owners' shards is right.
    """
    raise NotImplementedError(
        'Exercise 3.3 (zero_step): Reduce the flat gradient (stage 1 and stage 2 differ here), let the '
        "optimizer update only this rank's shard, then share the updated shards. Which elements does rank r "
        'own? More help: hint("3.3").')


# ----------------------------------------------------------------------------------------------
# 3.4 — ZeRO-3's collectives


def gather_full_params(shard: torch.Tensor, *, group=None, layer: str | None = None,
                       phase: str = "forward") -> torch.Tensor:
    """Every rank's S-element ``shard`` of a layer, concatenated in rank order: (N·S,) (exercise 3.4).

    One ``comm.all_gather_into_tensor`` (traced with ``what="params"``, ``layer=layer``,
    ``phase=phase``: "forward", "backward" or "state_dict").  The result is a new tensor; the
    caller takes views of it as the layer's weights and frees it after use.

    Graded on: every rank's shard in rank order (3–4 ranks, float32), and FullyShardedDataParallel with your
    collectives equal to one process.
    """
    raise NotImplementedError(
        "Exercise 3.4 (gather_full_params): gather_full_params: every rank's shard, in rank order (one all-"
        'gather). reduce_scatter_grad: only your own S elements of the gradient summed over ranks — and as a '
        'mean. More help: hint("3.4").')


def reduce_scatter_grad(flat_grad: torch.Tensor, *, group=None, layer: str | None = None) -> torch.Tensor:
    """This rank's S elements of the MEAN over ranks of ``flat_grad`` (N·S,) (exercise 3.4).

    One ``comm.reduce_scatter_tensor`` with a SUM (traced, ``what="grads"``, ``layer=layer``), then
    ÷ N: rank r gets (1/N) Σ_q flat_grad_q[r·S:(r+1)·S].

    Graded on: each rank's S elements of the MEAN gradient (3 ranks), and FullyShardedDataParallel with your
    collectives equal to one process.
    """
    raise NotImplementedError(
        "Exercise 3.4 (reduce_scatter_grad): gather_full_params: every rank's shard, in rank order (one all-"
        'gather). reduce_scatter_grad: only your own S elements of the gradient summed over ranks — and as a '
        'mean. More help: hint("3.4").')
