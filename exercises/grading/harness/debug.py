"""Lecture 6's harness: calls of the learner's 6.1–6.3 in the runner and its ranks, returning plain values."""
from __future__ import annotations

from . import function as _fn


def diagnose_call(module: str, report: dict):
    return _fn(module, "diagnose_hang")(report)


def divergence_call(module: str, parallel: dict, single: dict, kwargs: dict):
    """The learner's first_divergence on two runs handed over as plain data (rebuilt as Runs here)."""
    from reference.debug.oracles import from_plain
    return _fn(module, "first_divergence")(from_plain(parallel), from_plain(single), **kwargs)


def accumulate_per_rank(module: str, batch: int, seq_len: int, num_microbatches: int, seed: int, data_seed: int,
                        min_len: int, empty: tuple = ()):
    """On each rank: the tiny GPT from ``seed`` (the same everywhere), this rank's micro-batches of the
    padded batch, the learner's accumulate_gradients over the world; its loss and gradients by name."""
    import torch.distributed as dist

    from reference.debug.accumulate import _model, microbatches, padded_batch
    r, W = dist.get_rank(), dist.get_world_size()
    model = _model(seed, seq_len=seq_len)
    x, y = padded_batch(batch, seq_len, seed=data_seed, min_len=min_len, empty=empty)
    loss = _fn(module, "accumulate_gradients")(model, microbatches(x, y, r, W, num_microbatches), group=None)
    return {"loss": float(loss) if isinstance(loss, (int, float)) or hasattr(loss, "item") else loss,
            "grads": {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}}
