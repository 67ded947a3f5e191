"""Lecture 5c, part 2½ — the grid's data-parallel all-reduce overlapped with backward: lecture 3's buckets.

:func:`.train.sync_gradients` (exercise 5c.2) waits for backward to end, then sends every dense
gradient in one all-reduce over dp_cp.  Production trainers (PyTorch DDP, Megatron-Core's
distributed data parallel, torchtitan) do not wait: a bucket's all-reduce is posted the moment
its last gradient is ready, while backward still computes the earlier layers.  This is lecture
3's own machinery — :func:`reference.data.ddp.assign_buckets`, :func:`~reference.data.ddp.grad_ready`,
:func:`~reference.data.ddp.finish_buckets` — hooked onto the grid's dense parameters, over dp_cp::

    backward     ██ head ██ block 1 ██ block 0 ██ embeddings │
    bucket 0          └── all-reduce over dp_cp ───┐         │ finish: wait for each bucket,
    bucket 1                     └── all-reduce ───────┐     │ ÷ dp·cp, .grad ← its slice
    bucket 2                                  └── all-reduce ─┘
    then (after backward, as sync_gradients does): the sequence-parallel copies (Σ over tp, then
    the mean over dp_cp) and the experts (Σ over edp, ÷ dp·cp)

Which gradients ride in the buckets: every dense parameter of this rank except the
sequence-parallel copies (a LayerNorm that saw S/tp rows needs its Σ over tp first; they are few
and small) — the experts keep lecture 5b's sync (their group is edp, not dp_cp).

Pipelines.  With pp > 1 the executor runs one backward per micro-batch and ``.grad`` accumulates
m times; a gradient is complete only at its m-th accumulation, so the hook counts, and a
parameter joins its bucket then.  (1F1B's last backward is micro-batch m−1's: the buckets fly
during the cool-down.  ZB-H1's weight passes accumulate with ``autograd.backward(inputs=…)``: the
hook fires there too.)  Anything not yet posted when backward ends is posted by ``finish``, so
every rank issues the same all-reduces in the same order (grad_ready posts strictly in bucket order).

ZeRO (.zero): the same hooks, armed with ``zero=`` lecture 3's :class:`reference.data.zero.ShardBuckets`,
hand each complete dense gradient (the sequence-parallel copies after their tp sum) to ZeRO's buckets,
whose reduce-scatters (stage 2; stage 1: all-reduces) then fly during backward; the ZeRO step waits.

Bytes: the same as one all-reduce of the concatenation (ring bytes add up: 2(n−1)/n per element;
exactly, when n divides the bucket's bytes·2(n−1)), in several messages; the trace calls them
``what="grads"``, the axis dp_cp (.train.axis_of), each with its ``bucket``.
"""
from __future__ import annotations

import torch

from .. import comm, trace
from ..data.ddp import Bucket, assign_buckets, finish_buckets, grad_ready
from ..moe import sync_moe_gradients
from ..tensor import sync_sequence_parallel_grads

__all__ = ["OverlappedGradSync", "overlapped_sync", "sync_the_rest"]


class OverlappedGradSync:
    """Hooks on the dense parameters of a :class:`.parallel_gpt.ParallelGPT`: ``arm(m)`` before a step's
    backward(s), ``finish()`` after — then every dense, non-sequence-parallel ``.grad`` is the mean over
    dp_cp.  ``arm(m, zero=buckets)`` (a ZeRO step, :class:`reference.data.zero.ShardBuckets`): the
    same hooks hand each complete gradient to ZeRO's buckets instead, whose reduce-scatters (stage 2)
    or all-reduces (stage 1) then fly during backward; the ZeRO step finishes them.  Unarmed
    (evaluation), the hooks do nothing."""

    def __init__(self, model, *, bucket_cap_mb: float = 1.0):
        self.group, self.n = model.groups["dp_cp"], model.grid.dp * model.grid.cp
        sp = {id(p) for p in model.sequence_parallel_params()}
        names = {id(p): name for name, p in model.named_parameters()}
        dense = [p for p in model.dense_params() if p.requires_grad]
        params = [p for p in dense if id(p) not in sp]
        order = list(reversed(params))                     # backward reaches the last layers first
        self.buckets = [Bucket(i, [order[j] for j in idx], names=[names[id(order[j])] for j in idx])
                        for i, idx in enumerate(assign_buckets(order, int(bucket_cap_mb * 2 ** 20)))]
        self._where = {id(p): b.index for b in self.buckets for p in b.params}
        self._names = names
        self._sp = sp
        self._count: dict[int, int] = {}
        self.expected, self.armed, self.zero = 1, False, None
        hooked = list(reversed(dense))                     # ZeRO's flat gradient holds the sp copies too
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in hooked] if self.n > 1 else []

    def arm(self, num_microbatches: int = 1, zero=None) -> None:
        """The next ``num_microbatches`` backward passes are one step's: post each bucket when complete
        (``zero``: ZeRO's :class:`~reference.data.zero.ShardBuckets`, armed here, get the gradients)."""
        self.expected, self.armed, self.zero = num_microbatches, True, zero
        self._count.clear()
        if zero is not None:
            zero.arm()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        key = id(p)
        if key in self._sp:                                # summed over tp after backward first
            return
        seen = self._count[key] = self._count.get(key, 0) + 1
        if seen == self.expected:                          # its last accumulation of this step
            if self.zero is not None:
                trace.emit("grad_ready", param=self._names[key], bucket=self.zero.whose[key][0])
                self.zero.ready(p)
                return
            index = self._where[key]
            trace.emit("grad_ready", param=self._names[key], bucket=index)
            grad_ready(self.buckets, index, group=self.group)

    def finish(self) -> None:
        """Post what is left, wait for every bucket, ÷ dp·cp (lecture 3's finish_buckets).  A parameter
        that got no gradient this step is reduced as zeros (every rank posts the same messages) and
        keeps ``.grad = None``, as :func:`.train.sync_gradients` leaves it."""
        self.armed = False
        if self.zero is not None:                          # a ZeRO step finishes its own buckets
            self.zero = None
            return
        if self.n == 1:
            return
        missing = [p for b in self.buckets for p in b.params if p.grad is None]
        finish_buckets(self.buckets, group=self.group)
        for p in missing:
            p.grad = None

    def remove(self) -> None:
        """Take the hooks off (the model trains with :func:`.train.sync_gradients` again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def overlapped_sync(model, *, bucket_cap_mb: float = 1.0) -> OverlappedGradSync:
    """The model's :class:`OverlappedGradSync`, made (and its hooks registered) on first use."""
    sync = getattr(model, "_overlapped_sync", None)
    if sync is None:
        sync = OverlappedGradSync(model, bucket_cap_mb=bucket_cap_mb)
        model._overlapped_sync = sync
    return sync


def sync_the_rest(model) -> None:
    """After :meth:`OverlappedGradSync.finish`: what the buckets left out, as sync_gradients does it."""
    sp = model.sequence_parallel_params()
    sync_sequence_parallel_grads(sp, group=model.groups["tp"])
    n = model.grid.dp * model.grid.cp
    if n > 1:
        grads = [p.grad for p in sp if p.grad is not None]
        comm.all_reduce_coalesced(grads, group=model.groups["dp_cp"], what="dense_grads")
        for g in grads:
            g /= n
        sync_moe_gradients([], model.expert_params(), dp_group=model.groups["dp_cp"],
                           expert_dp_group=model.groups.get("edp"))
