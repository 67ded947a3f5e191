"""Lecture 5c — ZeRO on the composed grid: lecture 3's sharded optimizer over the dp_cp group.

ZeRO shards what data parallelism replicates, so on a composed grid it shards over the ranks that
hold the same tensors and average their gradients: the dp·cp ranks of ``dp_cp`` (Megatron-Core's
distributed optimizer shards over the same data-parallel-with-context group).  Each rank keeps
1/(dp·cp) of Adam's moments of ITS tensor/pipeline shard; tp and pp have already divided the rest::

    dense parameters of this rank ──flat──▶ │ dp_cp rank 0 │ dp_cp rank 1 │ … │   (reference.data.zero)
    stage 1: all-reduce the flat gradient, ÷ N; stage 2: reduce-scatter it, ÷ N; Adam on my
    shard; all-gather the shards → every rank's parameters

Experts are not sharded here: they are already split over ep, and after their edp sync (lecture
5b) a plain Adam updates them.  Under sequence parallelism the replicated LayerNorm gradients are
first summed over tp, as in :func:`.train.sync_gradients`.

Bytes on dp_cp per step (S = ⌈P/N⌉ elements, P the rank's dense parameters padded to N·S):
stage 1 sends 2(N−1)·S·b (all-reduce) + (N−1)·S·b (all-gather), 1.5× the plain all-reduce;
stage 2 sends (N−1)·S·b + (N−1)·S·b, the same as the all-reduce (lecture 3).

Overlap (train_step's default): the hooks of .overlap hand each complete dense gradient to lecture
3's :class:`reference.data.zero.ShardBuckets`, so ZeRO's reduce-scatters (stage 1: all-reduces)
are posted during backward, bucket by bucket, as DDP's all-reduces are; the step waits for them.
A bucket is the same columns of every rank's shard, so the bytes are the one message's exactly.
The sequence-parallel copies join their buckets after their sum over tp.  Without overlap the
reduction runs in lecture 3's :func:`reference.data.zero.zero_step`, one message.

Gradient clipping (``step(max_norm)``) goes between the reduction and Adam (the optimizer handed to
lecture 3's step runs the clip first): the norm is summed over the dp·cp shards (.clip.clip_zero_).
"""
from __future__ import annotations

from ..data.zero import ShardBuckets, ZeroOptimizer, shard_size
from ..moe import sync_moe_gradients
from ..tensor import sync_sequence_parallel_grads
from .clip import clip_zero_

__all__ = ["ComposedZero", "zero_bytes"]


class ComposedZero:
    """The optimizer of a composed run with ZeRO ``stage`` (1 or 2) over ``model.groups["dp_cp"]``.

    ``adam``: the per-element optimizer class (``reference.compose.workers.Adam``).  ``step()``
    synchronises the gradients itself (``syncs_gradients``: train_step must not call
    :func:`.train.sync_gradients` as well) and updates every parameter of this rank.
    """

    syncs_gradients = True

    def __init__(self, model, stage: int, adam, **adam_kwargs):
        self.model = model
        self.dense = ZeroOptimizer(model.dense_params(), adam, stage=stage, group=model.groups["dp_cp"],
                                   **adam_kwargs)
        self.experts = adam(model.expert_params(), **adam_kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)

    def step(self, max_norm: float | None = None) -> float | None:
        """Synchronise, (``max_norm``: clip to that global norm, .clip), update.  Returns the norm
        before clipping, or None without ``max_norm`` (then no extra message)."""
        m, d = self.model, self.dense
        sp = m.sequence_parallel_params()
        sync_sequence_parallel_grads(sp, group=m.groups["tp"])
        if d.buckets is not None and d.buckets.armed:   # the sp copies join ZeRO's buckets once summed over tp
            for p in sp:
                if p.requires_grad and p.grad is not None:
                    d.buckets.ready(p)
        if m.expert_params() and m.grid.dp * m.grid.cp > 1:
            sync_moe_gradients([], m.expert_params(), dp_group=m.groups["dp_cp"], expert_dp_group=m.groups["edp"])
        if max_norm is None:
            d.step()
            self.experts.step()
            return None
        # lecture 3's step, with the clip between its reduction and Adam
        clipped = _ClipFirst(lambda: clip_zero_(m, d, max_norm), d.optimizer)
        d.step(clipped)
        self.experts.step()
        return clipped.norm

    def shard_buckets(self, bucket_cap_mb: float = 1.0) -> ShardBuckets:
        """The dense ZeroOptimizer's :class:`~reference.data.zero.ShardBuckets` (made on first use): armed
        by train_step's gradient hooks (.overlap), its reduction flies during backward."""
        if self.dense.buckets is None:
            self.dense.buckets = ShardBuckets(self.dense, bucket_cap_mb)
        return self.dense.buckets


class _ClipFirst:
    """The optimizer ``zero_step`` is given: ``step()`` keeps ``clip()``'s norm, then steps ``optimizer``."""

    def __init__(self, clip, optimizer):
        self.clip, self.optimizer, self.norm = clip, optimizer, None

    def step(self) -> None:
        self.norm = self.clip()
        self.optimizer.step()


def zero_bytes(stage: int, dense_params: int, n: int, bytes_per_element: int) -> int:
    """Wire bytes one rank sends on dp_cp in one ZeRO ``stage`` step over ``n`` ranks (docstring above)."""
    if n <= 1:
        return 0
    S, b = shard_size(dense_params, n), bytes_per_element
    reduce = 2 * (n - 1) * n * S * b // n if stage == 1 else (n - 1) * n * S * b // n
    return reduce + (n - 1) * S * b
