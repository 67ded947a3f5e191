"""Lecture 3, part 2 — ZeRO stages 1 and 2: shard the optimizer state (and the gradients).

Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*,
arXiv:1910.02054.  Data parallelism keeps N copies of everything; Adam's state (two moments per
parameter) is the largest part and is only ever used elementwise.  So flatten the Ψ trainable
elements into one vector, pad it to N·S (S = ⌈Ψ/N⌉), and let rank r own elements [r·S, (r+1)·S)::

    flat parameters   │ rank 0's shard │ rank 1's shard │ rank 2's shard │pad│
    Adam state        │  m, v (rank 0) │  m, v (rank 1) │  m, v (rank 2) │   │   ← only 1/N each

One step (:func:`zero_step`, exercise 3.3):

    stage 1   all-reduce the flat gradient (SUM, ÷ N); keep it whole; take my shard of it
    stage 2   reduce-scatter the flat gradient (SUM, ÷ N): I receive only my shard
    both      my optimizer updates my shard; all-gather the shards → every rank's full parameters

Communication per step, ring algorithms, per rank: DDP's all-reduce sends 2(N−1)/N·Ψ.  Stage 2
sends (N−1)/N·Ψ (reduce-scatter) + (N−1)/N·Ψ (all-gather): the same bytes as DDP, as the paper
says.  Stage 1 as written here (and as DDP + ``ZeroRedundancyOptimizer`` run it) all-reduces the
whole gradient and then all-gathers: 3(N−1)/N·Ψ, 1.5× — only the reduce-scatter makes it free.
Here the reduction runs once, in ``step``.  Production versions (DeepSpeed's ``overlap_comm``,
Megatron-Core's distributed optimizer) post it bucket by bucket during backward, as DDP does:
:class:`ShardBuckets` does that with lecture 3's buckets (``ZeroOptimizer(..., bucket_cap_mb=...)``,
fed by a gradient hook; the composed run's, lecture 5c).  Rank r owns a contiguous range, so a
bucket is a range of COLUMNS of the flat vector seen as N rows of S — the same S-slice [a, b) of
every rank's shard — and a reduce-scatter of its N·(b−a) elements hands rank r exactly its [a, b)::

    flat gradient as N × S     columns a … b        one bucket = these N pieces, packed row by row;
    row 0  (rank 0's shard)    │ ▓▓▓ │              reduce-scatter → rank r's shard[a:b]
    row 1  (rank 1's shard)    │ ▓▓▓ │              (stage 1: all-reduce, lecture 3's grad_ready)
    row N−1  … pad             │ ▓▓▓ │

Buckets go from the last column down (backward fills the flat vector from its end); one is ready
when every parameter it touches has its gradient, i.e. once row 0's piece is (the last 1/N of
backward).  The bytes are the one message's exactly: Σ (N−1)/N·N·(b−a) = (N−1)·S per rank.

The parameters become views into one flat buffer (as DeepSpeed's contiguous gradients and FSDP's
flat parameters do), so the shard the optimizer updates IS part of the model's memory.  Per-element
optimizers (SGD, Adam, AdamW, ...) give exactly the single-process result; optimizers that look at
a whole tensor (LAMB's trust ratio, Adafactor) would not.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable

import torch
from torch import nn

from .. import comm
from .ddp import Bucket, finish_buckets, grad_ready
from .replicas import check_same_shapes, optimizer_state_bytes, storage_bytes, unique_parameters

__all__ = ["shard_size", "zero_step", "ZeroOptimizer", "ShardBuckets"]


def shard_size(numel: int, world_size: int) -> int:
    """S = ⌈numel / N⌉ (at least 1): every rank's shard of a flat vector padded to N·S."""
    return max(1, math.ceil(numel / world_size))


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
    N, r = comm.world_size(group), comm.rank(group)
    S = shard.numel()
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    flat = torch.cat(pieces + [shard.new_zeros(N * S - sum(t.numel() for t in pieces))])   # one pass, no zero-fill
    if stage == 1:
        comm.all_reduce(flat, group=group, what="grads", stage=1).div_(N)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        shard.grad = flat[r * S:(r + 1) * S]
    else:
        mine = shard.new_empty(S)
        comm.reduce_scatter_tensor(mine, flat, group=group, what="grads", stage=2).div_(N)
        for p in params:
            p.grad = None
        shard.grad = mine
    optimizer.step()
    full = shard.new_empty(N * S)
    comm.all_gather_into_tensor(full, shard.detach(), group=group, what="params", stage=stage)
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any per-element ``torch.optim`` optimizer, on a plain module.

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()      # step does all the communication

    The trainable parameters are moved into one flat buffer (padded to N·S) and broadcast from
    rank 0; ``optimizer_class`` is built on this rank's S-element shard only, so its state is 1/N
    of the whole.  Frozen parameters are left alone (no gradient, no state).  No ``DataParallel``
    is needed: :func:`zero_step` averages the gradients itself.  ``bucket_cap_mb``: also build
    :class:`ShardBuckets` (``self.buckets``) to reduce during backward; a step whose buckets were
    armed finishes them instead of reducing in :func:`zero_step`.
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class, *, stage: int, group=None,
                 bucket_cap_mb: float | None = None, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stage 1 or 2, got {stage!r} (stage 3: FullyShardedDataParallel)")
        everything = unique_parameters(params)
        self.stage, self.group = stage, group
        self.params = [p for p in everything if p.requires_grad]
        self.frozen = [p for p in everything if not p.requires_grad]
        if not self.params:
            raise ValueError("ZeroOptimizer got no trainable parameters")
        check_same_shapes(everything, group, "set of parameters given to ZeroOptimizer")
        N, r = comm.world_size(group), comm.rank(group)
        self.numel = sum(p.numel() for p in self.params)
        S = shard_size(self.numel, N)
        self.flat = self.params[0].new_zeros(N * S)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                self.flat[offset:offset + p.numel()] = p.reshape(-1)
                p.data = self.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            comm.broadcast(self.flat, comm.global_rank(group, 0), group=group, what="params")
        self.shard = nn.Parameter(self.flat[r * S:(r + 1) * S])
        self.optimizer = optimizer_class([self.shard], **optimizer_kwargs)
        self.buckets = None if bucket_cap_mb is None else ShardBuckets(self, bucket_cap_mb)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, optimizer=None) -> None:
        """Reduce, ``optimizer.step()`` on the shard (default: ours; any object with ``step``), all-gather."""
        optimizer = self.optimizer if optimizer is None else optimizer
        if self.buckets is None or not self.buckets.armed:
            zero_step(self.params, self.shard, optimizer, stage=self.stage, group=self.group)
            return
        self.buckets.finish()                     # the reduction, posted during backward
        optimizer.step()
        full = torch.empty_like(self.flat)        # the parameters are views of flat: one copy updates them all
        comm.all_gather_into_tensor(full, self.shard.detach(), group=self.group, what="params", stage=self.stage)
        with torch.no_grad():
            self.flat.copy_(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + [self.shard]:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now (each storage once; the padding of the last shard included):
        params = N·S (+ frozen), grads = N·S after a stage-1 step, S after a stage-2 step,
        optimizer_state = what ``optimizer.state`` holds (Adam: 2·S + a 1-element step)."""
        out = {"params": storage_bytes(self.params + self.frozen),
               "grads": storage_bytes([p.grad for p in self.params] + [self.shard.grad]),
               "optimizer_state": optimizer_state_bytes(self.optimizer)}
        out["total"] = sum(out.values())
        return out


class ShardBuckets:
    """ZeRO's gradient reduction posted bucket by bucket during backward (the module docstring's picture).

    ``arm()`` before a step's backward; ``ready(p)`` once ``p.grad`` is complete (a hook calls it);
    the optimizer's step calls ``finish()``: post what is left (a parameter that got no gradient
    counts as zeros), wait, ÷ N.  Then stage 1: every ``p.grad`` is a view of the mean flat
    gradient and ``shard.grad`` my slice of it (as :func:`zero_step` leaves them); stage 2:
    ``shard.grad`` my S elements of the mean, every ``p.grad`` None.  Stage 1's buckets ARE lecture
    3's (:func:`.ddp.grad_ready` / :func:`.ddp.finish_buckets`: each piece a view of the flat
    parameters whose ``.grad`` is the same view of the flat gradient); stage 2 counts the same way
    and posts a reduce-scatter instead, strictly in bucket order too.
    """

    def __init__(self, zero: ZeroOptimizer, bucket_cap_mb: float):
        self.zero, self.group, self.stage = zero, zero.group, zero.stage
        N, S = comm.world_size(zero.group), zero.shard.numel()
        self.N, self.S, self.armed = N, S, False
        self.grad = zero.flat.new_zeros(N * S) if zero.stage == 1 else None   # stage 2: only during a step
        self.mine: torch.Tensor | None = None
        self.offset, starts, offset = {}, [], 0
        for p in zero.params:
            self.offset[id(p)] = (offset, p.numel())
            starts.append(offset)
            offset += p.numel()
        cols = max(1, int(bucket_cap_mb * 2 ** 20) // (N * zero.flat.element_size()))
        self.columns = [(max(0, b - cols), b) for b in range(S, 0, -cols)]    # from the last column down
        self.whose: dict[int, list[int]] = {id(p): [] for p in zero.params}
        self.pad: list[int] = []                                            # the bucket of each padding piece
        self.buckets = []
        for k, (a, b) in enumerate(self.columns):
            pieces = []
            for row in range(N):
                lo, hi = row * S + a, row * S + b
                i = max(0, bisect_right(starts, lo) - 1)
                while lo < hi:
                    if i < len(starts):
                        o, n = self.offset[id(zero.params[i])]
                        end, who = min(hi, o + n), self.whose[id(zero.params[i])]
                    else:
                        end, who = hi, self.pad
                    if end > lo:
                        piece = zero.flat[lo:end]
                        if self.grad is not None:
                            piece.grad = self.grad[lo:end]
                        pieces.append(piece)
                        who.append(k)
                    lo, i = end, i + 1
            self.buckets.append(Bucket(k, pieces))

    def arm(self) -> None:
        """The next backward is a step's: zero the flat gradient, count the padding as ready."""
        if self.grad is None:
            self.grad = self.zero.flat.new_zeros(self.N * self.S)
        else:
            self.grad.zero_()
        self.armed = True
        for bucket in self.buckets:
            bucket.ready = 0
        for k in self.pad:
            self.buckets[k].ready += 1

    def ready(self, p: torch.Tensor) -> None:
        """``p.grad`` is complete for this step: into the flat gradient; post every bucket now complete."""
        o, n = self.offset[id(p)]
        self.grad[o:o + n].copy_(p.grad.reshape(-1))
        if self.stage == 2:
            p.grad = None                          # its copy is in the flat gradient until the reduce-scatter
        for k in self.whose[id(p)]:
            if self.stage == 1:
                grad_ready(self.buckets, k, group=self.group)
            else:
                self.buckets[k].ready += 1
        if self.stage == 2:
            self._post(complete_only=True)

    def _post(self, complete_only: bool) -> None:
        """Stage 2's grad_ready: post, in bucket order, each complete bucket's reduce-scatter."""
        if self.mine is None:
            self.mine = self.grad.new_empty(self.S)
        rows = self.grad.view(self.N, self.S)
        for bucket, (a, b) in zip(self.buckets, self.columns):
            if bucket.work is not None:
                continue
            if complete_only and bucket.ready < len(bucket.params):
                break
            bucket.buffer = rows[:, a:b].reshape(-1)          # row r's piece = what rank r receives
            bucket.work = comm.reduce_scatter_tensor_async(self.mine[a:b], bucket.buffer, group=self.group,
                                                           what="grads", stage=2, bucket=bucket.index)

    def finish(self) -> None:
        """Every bucket reduced and ÷ N; the gradients left where :func:`zero_step` leaves them."""
        z, S, r = self.zero, self.S, comm.rank(self.group)
        self.armed = False
        if self.stage == 1:
            finish_buckets(self.buckets, group=self.group)
            for p in z.params:
                o, n = self.offset[id(p)]
                p.grad = self.grad[o:o + n].view_as(p)
            z.shard.grad = self.grad[r * S:(r + 1) * S]
            return
        self._post(complete_only=False)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.ready, bucket.buffer, bucket.work = 0, None, None
        for p in z.params:
            p.grad = None
        z.shard.grad, self.mine, self.grad = self.mine.div_(self.N), None, None
