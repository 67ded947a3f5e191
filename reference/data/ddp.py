"""Lecture 3, part 1 — data parallelism from scratch: the gradient all-reduce, buckets, overlap.

Every rank holds the whole model and a different micro-batch.  The objective is the mean over the
N ranks of each rank's loss (each the mean over its own, equal-sized micro-batch)::

    L = (1/N) Σ_r L_r        ⇒        ∇L = (1/N) Σ_r ∇L_r        (an all-reduce, then ÷ N)

so after backward every rank holds the same gradient — the one a single process computes on the
whole batch — and the same optimizer step keeps the replicas identical.

Buckets (PyTorch DDP, Li et al. 2020, arXiv:2006.15704).  One all-reduce per parameter pays the
latency of a collective hundreds of times; one all-reduce of everything waits for the whole
backward.  So gradients are packed into buckets of about ``bucket_cap_mb``, in the order backward
produces them (reverse registration order), and a bucket's all-reduce is posted the moment its
last gradient is ready — while backward keeps computing the earlier layers::

    backward   ███ layer 3 ███ layer 2 ███ layer 1 ███ layer 0 │
    bucket 0          └── all-reduce ──┐                       │ wait all, ÷ N,
    bucket 1                     └──── all-reduce ──────┐      │ grads ← buckets
    bucket 2                                     └──── all-reduce ─┘

Buckets are posted strictly in order (bucket i only after i−1), so every rank issues the same
collectives in the same order even if its gradients arrive in a different order.

Exercises: 3.1 :func:`all_reduce_gradients`; 3.2 :func:`assign_buckets`, :func:`grad_ready`,
:func:`finish_buckets`.  :class:`DataParallel` is the plumbing around them (hooks, ``no_sync``).
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import comm, trace
from .replicas import check_same_shapes, optimizer_state_bytes, storage_bytes, unique_parameters

__all__ = ["all_reduce_gradients", "Bucket", "assign_buckets", "grad_ready", "finish_buckets", "DataParallel"]


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
    N = comm.world_size(group)
    for i, p in enumerate(parameters):
        if p.grad is None:
            continue
        comm.all_reduce(p.grad, group=group, what="grads", param=i)
        p.grad.div_(N)


# ----------------------------------------------------------------------------------------------
# 3.2 — buckets


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce.

    params: in the order their gradients are expected (reverse registration order);
    ready:  how many of them have their gradient for this backward;
    buffer: the flat gradient being reduced (numel = Σ p.numel()), None between backwards;
    work:   the all-reduce in flight (``comm.PendingCollective``), None until posted;
    storage: optional flat tensor (numel = Σ p.numel(), the params' dtype) kept across backwards for
            ``buffer`` to be packed into, so a step allocates nothing (DataParallel's); None: allocate.
    """

    index: int
    params: list[torch.Tensor]
    ready: int = 0
    buffer: torch.Tensor | None = None
    work: object | None = None
    names: list[str] = field(default_factory=list)
    storage: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def assign_buckets(params: list[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Split ``params`` (already in gradient order) into buckets; return each bucket's indices.

    Greedy, in order: a parameter joins the current bucket if the bucket is empty or stays within
    ``bucket_cap_bytes`` with it; otherwise it starts the next bucket.  So a parameter larger than
    the cap gets a bucket of its own, and no bucket but such one exceeds the cap.

        sizes [3, 3, 3, 9, 1], cap 6   →   [[0, 1], [2], [3], [4]]

    Graded on: the buckets of random sizes, dtypes and caps (in bytes; a parameter larger than the cap alone).
    """
    buckets: list[list[int]] = []
    filled = 0
    for i, p in enumerate(params):
        size = p.numel() * p.element_size()
        if buckets and buckets[-1] and filled + size <= bucket_cap_bytes:
            buckets[-1].append(i)
            filled += size
        else:
            buckets.append([i])
            filled = size
    return buckets


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
    buckets[index].ready += 1
    for b in buckets:
        if b.work is not None:
            continue
        if b.ready < len(b.params):
            break
        b.buffer = torch.cat([p.grad.reshape(-1) for p in b.params], out=b.storage)
        b.work = comm.all_reduce_async(b.buffer, group=group, what="grads", bucket=b.index)


def finish_buckets(buckets: list[Bucket], *, group=None) -> None:
    """End of backward: every bucket reduced, every ``.grad`` the mean over ranks (exercise 3.2).

    Post, in order, any bucket not posted yet (overlap off, or a parameter that got no gradient
    this step: its gradient counts as zeros, so every rank still posts the same collectives and
    nobody hangs).  Then wait for each, divide by N, and copy its slices back into the ``.grad``
    of its parameters (creating ``.grad`` where it was None).  Reset ``ready``/``buffer``/``work``.

    Graded on: DataParallel's gradients equal to one process's on the whole batch (2–4 ranks, tiny buckets, a
    parameter unused on some ranks); each bucket reduced exactly once, counted by the grader.
    """
    N = comm.world_size(group)
    for b in buckets:
        if b.work is None:
            b.buffer = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in b.params], out=b.storage)
            b.work = comm.all_reduce_async(b.buffer, group=group, what="grads", bucket=b.index)
    for b in buckets:
        flat = b.work.wait()
        offset = 0
        for p in b.params:                        # ÷ N on the way back: one pass, the same bits as div_ then copy
            g = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = g / N
            elif p.grad.dtype == g.dtype and p.grad.is_contiguous():
                torch.div(g, N, out=p.grad)
            else:
                p.grad.copy_(g / N)
        b.ready, b.buffer, b.work = 0, None, None


# ----------------------------------------------------------------------------------------------
# The module wrapper


class DataParallel(nn.Module):
    """Data parallelism from scratch: ``loss.backward()`` leaves every ``.grad`` averaged over ranks.

    module:        the model, identical shapes on every rank (checked: ValueError naming ranks);
                   its parameters and buffers are broadcast from the group's rank 0 when wrapped.
    group:         the data-parallel process group (None: the world).
    bucket_cap_mb: bucket size in MiB (2**20 bytes) of gradient; a larger parameter gets its own.
    overlap:       post each bucket's all-reduce as soon as it is full (True), or all of them
                   after backward (False: no overlap, the baseline the notebook compares with).

    Frozen parameters (``requires_grad=False``) are broadcast but never reduced; a tied parameter
    is one tensor with one gradient hook, reduced once.  A parameter that gets no gradient in a
    step is reduced as zeros at the end of backward (every rank must post the same collectives);
    its ``.grad`` then holds the mean of the other ranks' gradients (or zeros).
    Gradient accumulation: inside ``with model.no_sync():`` backward only accumulates locally; the
    next backward outside it all-reduces the accumulated total.
    """

    def __init__(self, module: nn.Module, *, group=None, bucket_cap_mb: float = 25.0, overlap: bool = True):
        super().__init__()
        self.module, self.group, self.overlap = module, group, overlap
        self.bucket_cap_mb = bucket_cap_mb
        params = unique_parameters(module.parameters())
        check_same_shapes(params, group, "model wrapped in DataParallel")
        root = comm.global_rank(group, 0)
        with torch.no_grad():
            for t in params + list(module.buffers()):
                comm.broadcast(t.data, root, group=group, what="params")
        names = {id(p): n for n, p in module.named_parameters()}
        order = [p for p in reversed(params) if p.requires_grad]          # the order backward produces
        self.buckets = [Bucket(i, [order[j] for j in idx], names=[names[id(order[j])] for j in idx])
                        for i, idx in enumerate(assign_buckets(order, int(bucket_cap_mb * 2 ** 20)))]
        for b in self.buckets:        # one flat buffer per bucket for the whole run, as DDP keeps its buckets
            if len({(p.dtype, p.device) for p in b.params}) == 1:
                b.storage = b.params[0].new_empty(sum(p.numel() for p in b.params))
        self._where = {id(p): b.index for b in self.buckets for p in b.params}
        self._names = names
        self.require_sync = True
        self._queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in order]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.require_sync:
            return
        if not self._queued:      # once per backward: the engine calls _finish when backward is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        index = self._where[id(p)]
        trace.emit("grad_ready", param=self._names[id(p)], bucket=index)
        if self.overlap:
            grad_ready(self.buckets, index, group=self.group)

    def _finish(self) -> None:
        self._queued = False
        finish_buckets(self.buckets, group=self.group)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now: parameters, gradients, optimizer state (each storage once)."""
        params = unique_parameters(self.module.parameters())
        out = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
               "optimizer_state": optimizer_state_bytes(optimizer)}
        out["total"] = sum(out.values())
        return out
