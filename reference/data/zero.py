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
Here the stage 2 reduce-scatter runs once, in ``step``; the paper's (and DeepSpeed's) version
reduce-scatters bucket by bucket during backward so the full gradient never exists at once.

The parameters become views into one flat buffer (as DeepSpeed's contiguous gradients and FSDP's
flat parameters do), so the shard the optimizer updates IS part of the model's memory.  Per-element
optimizers (SGD, Adam, AdamW, ...) give exactly the single-process result; optimizers that look at
a whole tensor (LAMB's trust ratio, Adafactor) would not.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .. import comm
from .replicas import check_same_shapes, optimizer_state_bytes, storage_bytes, unique_parameters

__all__ = ["shard_size", "zero_step", "ZeroOptimizer"]


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
    """
    N, r = comm.world_size(group), comm.rank(group)
    S = shard.numel()
    flat = shard.new_zeros(N * S)
    offset = 0
    for p in params:
        if p.grad is not None:
            flat[offset:offset + p.numel()] = p.grad.reshape(-1)
        offset += p.numel()
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
    is needed: :func:`zero_step` averages the gradients itself.
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class, *, stage: int, group=None,
                 **optimizer_kwargs):
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

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self) -> None:
        zero_step(self.params, self.shard, self.optimizer, stage=self.stage, group=self.group)

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
