"""Lecture 3's harness: rank functions that run the learner's 3.1–3.4 inside the reference's own
DataParallel / ZeroOptimizer / FullyShardedDataParallel, and return plain values.  Each rank gets
its own inputs only (``mine``: its gradients, or the seed of its own micro-batches)."""
from __future__ import annotations

import os

import torch

from ..referee import FRAME, MARK
from . import function as _fn

WRITE = os.write          # taken now: the marks below go out through this very function


def grads_per_rank(module: str, mine: list[torch.Tensor | None]):
    """On each rank: parameters whose ``.grad`` are this rank's gradients ``mine``; the learner averages them."""
    params = []
    for g in mine:
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64) if g is None else torch.zeros_like(g))
        p.grad = None if g is None else g.clone()
        params.append(p)
    _fn(module, "all_reduce_gradients")(params)
    return [p.grad for p in params]


def buckets_of(module: str, sizes: list[int], dtypes: list[str], cap: int):
    params = [torch.zeros(n, dtype=getattr(torch, dt)) for n, dt in zip(sizes, dtypes)]
    return _fn(module, "assign_buckets")(params, cap)


def _mark(step: int) -> None:
    """Tell the referee where the harness is (after the ``step``-th call of grad_ready): the
    all-reduces the learner posted so far are counted before this mark, in the runner."""
    fd = os.environ.get("GRADER_REFEREE_FD")
    if fd:
        WRITE(int(fd), FRAME.pack(MARK, step, 0, 0))


def overlap_per_rank(module: str, mine: tuple, layout: list[list[int]]):
    """On each rank: buckets (``layout``: parameter indices per bucket, in gradient order) of
    parameters whose ``.grad`` are this rank's gradients ``mine[0]``; the learner's ``grad_ready``
    is called for each parameter in turn, as its hook would be, and after each call the referee gets
    a mark (the all-reduces posted by then are counted in the runner, where the learner's code cannot
    change the count).  As soon as buckets 0..b are all complete, bucket b's all-reduce must be in
    flight, so its parameters' ``.grad`` are then replaced by ``mine[1]`` (garbage; new tensors: a
    buffer already posted is untouched).  A reduction posted in time gives the true mean; one left to
    ``finish_buckets`` reduces the garbage.  Returns the ``.grad`` of every parameter after the
    learner's ``finish_buckets``."""
    from reference.data.ddp import Bucket
    grads, garbage = mine
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    buckets = [Bucket(i, [params[j] for j in idx]) for i, idx in enumerate(layout)]
    grad_ready, finish_buckets = _fn(module, "grad_ready"), _fn(module, "finish_buckets")
    arrived, replaced, step = [0] * len(layout), 0, 0
    for b, idx in enumerate(layout):
        for _ in idx:
            grad_ready(buckets, b)
            _mark(step)
            step += 1
            arrived[b] += 1
            while replaced < len(layout) and arrived[replaced] == len(layout[replaced]):
                for j in layout[replaced]:
                    params[j].grad = garbage[j].clone()
                replaced += 1
    finish_buckets(buckets)
    return [p.grad for p in params]


def train_per_rank(module: str, mine: int | None, method: str, kind: str, opt: str, kw: dict):
    """One training run of reference.data.workers.train on this rank (the wrappers call the learner's
    code); ``mine``: the seed of this rank's own micro-batches (the model's seed is in ``kw``)."""
    from reference.data import workers
    return workers.train(method, kind, opt, data_seed=mine, **kw)


def unused_per_rank(module: str, mine: int, cap_mb: float, seed: int = 0):
    from reference.data import workers
    return workers.unused_on_some_ranks(cap_mb, seed, data_seed=mine)


def collective_per_rank(module: str, mine: torch.Tensor, name: str, kw: dict):
    return _fn(module, name)(mine.clone(), **kw)


def garble_outside_shard(args: tuple, kwargs: dict) -> None:
    """Before the learner's ``zero_step(params, shard, optimizer, stage=, group=)``: overwrite every
    parameter element outside this rank's shard with garbage.  ZeRO all-gathers the owners' updated
    shards over them, so an honest step is right; an optimizer that steps every parameter itself
    (no sharding) steps the garbage."""
    from reference import comm
    params, shard = (list(args) + [None, None])[:2]
    params = kwargs.get("params", params)
    shard = kwargs.get("shard", shard)
    group = kwargs.get("group")
    if params is None or not isinstance(shard, torch.Tensor):
        return
    S, r = shard.numel(), comm.rank(group)
    lo, hi = r * S, (r + 1) * S
    g = torch.Generator().manual_seed(0xBAD)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat = p.view(-1)
            outside = torch.ones(n, dtype=torch.bool)
            a, b = max(lo - offset, 0), min(hi - offset, n)
            if a < b:
                outside[a:b] = False
            noise = torch.randn(n, generator=g, dtype=torch.float64).to(p.dtype) * 1e3 + 7.0
            flat[outside] = noise[outside]
            offset += n
