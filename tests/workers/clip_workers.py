"""Rank functions only the clipping tests use (tests/compose/test_clip.py): the global gradient norm
of one synchronised step, by the right rule and by the classic wrong ones."""
from __future__ import annotations

import math

import torch

from reference import comm
from reference.compose import full_state_dict, workers
from reference.compose.clip import global_grad_norm, owns
from reference.compose.train import train_step
from reference.gpt import get_batch


class _NoStep:
    """An optimizer that leaves the parameters alone: the gradients stay as train_step synchronised them."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


def _tp_counted_on_every_tp_rank(shard, coords: dict) -> bool:
    """The classic bug: one copy per dp·cp, but a tp-replicated LayerNorm counted on every tp rank."""
    return coords["edp"] == 0 if shard.expert else coords["dp"] == 0 and coords["cp"] == 0


def step0_norms(sizes: dict, *, batch_size: int = 4, num_microbatches: int = 1, sequence_parallel: bool = False,
                **config) -> dict:
    """The gradients of step 0, synchronised as train_step does; their global norm by :func:`owns`
    ("norm"), with tp copies counted tp times ("tp_counted_tp_times"), and this rank's own squares
    only, never all-reduced ("local_only": a different number on every rank)."""
    model, data = workers.build(sizes, batch_size=batch_size, num_microbatches=num_microbatches,
                                sequence_parallel=sequence_parallel, **config)
    x, y = get_batch(data, 0, batch_size, model.cfg.seq_len, 0)
    train_step(model, _NoStep(), x, y, num_microbatches=num_microbatches)
    local = sum(float(s.param.grad.double().square().sum()) for s in model.shards.values()
                if s.param.grad is not None)
    return {"norm": global_grad_norm(model),
            "tp_counted_tp_times": global_grad_norm(model, owns=_tp_counted_on_every_tp_rank),
            "local_only": math.sqrt(local), "coords": model.coords,
            "replicated_on_tp": sorted(k for k, s in model.shards.items() if s.kind == "replicated"),
            "owned_here": sorted(k for k, s in model.shards.items() if owns(s, model.coords))}


def train_scaled_head(sizes: dict, steps: int, head_scale: float, *, batch_size: int = 4, lr: float = 3e-3,
                      num_microbatches: int = 1, zero: int = 0, sequence_parallel: bool = False,
                      clip_grad_norm: float | None = None, **config) -> dict:
    """:func:`reference.compose.workers.train_worker` with the head's weight × ``head_scale`` at
    initialisation (on its shards: the same as on the whole tensor): logits and gradients that large."""
    model, data = workers.build(sizes, batch_size=batch_size, num_microbatches=num_microbatches, zero=zero,
                                sequence_parallel=sequence_parallel, **config)
    if model.is_last:
        with torch.no_grad():
            model.head.weight.mul_(head_scale)
    norms = []
    losses = workers.fit(model, data, steps, batch_size=batch_size, lr=lr, num_microbatches=num_microbatches,
                         zero=zero, clip_grad_norm=clip_grad_norm,
                         on_step=lambda step, loss: norms.append(model.grad_norm))
    full = full_state_dict(model)
    return {"losses": losses, "grad_norms": norms, "coords": model.coords,
            "params": full if comm.rank() == 0 else None}
