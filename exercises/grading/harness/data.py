"""Lecture 3's harness: rank functions that run the learner's 3.1–3.4 inside the reference's own
DataParallel / ZeroOptimizer / FullyShardedDataParallel, and return plain values."""
from __future__ import annotations

import torch

from . import function as _fn


def grads_per_rank(module: str, per_rank: list[list[torch.Tensor | None]]):
    """On each rank: parameters whose ``.grad`` are this rank's gradients; the learner averages them."""
    import torch.distributed as dist
    params = []
    for g in per_rank[dist.get_rank()]:
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64) if g is None else torch.zeros_like(g))
        p.grad = None if g is None else g.clone()
        params.append(p)
    _fn(module, "all_reduce_gradients")(params)
    return [p.grad for p in params]


def buckets_of(module: str, sizes: list[int], dtypes: list[str], cap: int):
    params = [torch.zeros(n, dtype=getattr(torch, dt)) for n, dt in zip(sizes, dtypes)]
    return _fn(module, "assign_buckets")(params, cap)


def overlap_per_rank(module: str, per_rank: list, garbage: list, layout: list[list[int]]):
    """On each rank: buckets (``layout``: parameter indices per bucket, in gradient order) of
    parameters whose ``.grad`` are this rank's gradients; the learner's ``grad_ready`` is called for
    each parameter in turn, as its hook would be.  As soon as buckets 0..b are all complete, bucket
    b's all-reduce must be in flight, so its parameters' ``.grad`` are then replaced by
    ``garbage`` (new tensors: a buffer already posted is untouched).  A reduction posted in time
    gives the true mean; one left to ``finish_buckets`` reduces the garbage.  Returns the ``.grad``
    of every parameter after the learner's ``finish_buckets``."""
    import torch.distributed as dist

    from reference.data.ddp import Bucket
    r = dist.get_rank()
    params = []
    for g in per_rank[r]:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    buckets = [Bucket(i, [params[j] for j in idx]) for i, idx in enumerate(layout)]
    grad_ready, finish_buckets = _fn(module, "grad_ready"), _fn(module, "finish_buckets")
    arrived, replaced = [0] * len(layout), 0
    for b, idx in enumerate(layout):
        for _ in idx:
            grad_ready(buckets, b)
            arrived[b] += 1
            while replaced < len(layout) and arrived[replaced] == len(layout[replaced]):
                for j in layout[replaced]:
                    params[j].grad = garbage[r][j].clone()
                replaced += 1
    finish_buckets(buckets)
    return [p.grad for p in params]


def train_per_rank(module: str, method: str, kind: str, opt: str, kw: dict):
    """One training run of reference.data.workers.train on this rank (the wrappers call the learner's code)."""
    from reference.data import workers
    return workers.train(method, kind, opt, **kw)


def unused_per_rank(module: str, cap_mb: float, seed: int = 0):
    from reference.data import workers
    return workers.unused_on_some_ranks(cap_mb, seed)


def collective_per_rank(module: str, name: str, per_rank: list[torch.Tensor], kw: dict):
    import torch.distributed as dist
    return _fn(module, name)(per_rank[dist.get_rank()].clone(), **kw)
