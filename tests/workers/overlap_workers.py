"""Rank functions for tests/compose/test_overlap.py: one composed step, its trace and synced gradients."""
from __future__ import annotations

from reference.compose import build, train_step
from reference.compose.workers import Adam
from reference.gpt import get_batch


def one_step(sizes: dict, *, overlap: bool, bucket_cap_mb: float = 1.0, num_microbatches: int = 1,
             schedule: str = "1f1b", sequence_parallel: bool = False, **config) -> dict:
    """One training step on the grid; this rank's gradients after the sync (by name) and its loss."""
    model, data = build(sizes, batch_size=4, sequence_parallel=sequence_parallel,
                        num_microbatches=num_microbatches, **config)
    x, y = get_batch(data, 0, 4, model.cfg.seq_len, 0)
    opt = Adam(model.parameters(), lr=3e-3)
    loss = train_step(model, opt, x, y, schedule=schedule, num_microbatches=num_microbatches, overlap=overlap,
                      bucket_cap_mb=bucket_cap_mb)
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def zero_step(sizes: dict, *, zero: int, overlap: bool, bucket_cap_mb: float = 1.0, num_microbatches: int = 1,
              schedule: str = "1f1b", sequence_parallel: bool = False, clip_grad_norm: float | None = None,
              steps: int = 2, batch_size: int = 4, **config) -> dict:
    """``steps`` steps with ZeRO ``zero`` (reference.compose.zero): the losses, this rank's shard of the
    last step's mean gradient (``shard.grad``), and its parameters after them (by name)."""
    from reference.compose.workers import make_optimizer
    model, data = build(sizes, batch_size=batch_size, sequence_parallel=sequence_parallel,
                        num_microbatches=num_microbatches, **config)
    opt = make_optimizer(model, zero)
    losses = []
    for step in range(steps):
        x, y = get_batch(data, step, batch_size, model.cfg.seq_len, 0)
        losses.append(train_step(model, opt, x, y, schedule=schedule, num_microbatches=num_microbatches,
                                 overlap=overlap, bucket_cap_mb=bucket_cap_mb, clip_grad_norm=clip_grad_norm))
    return {"losses": losses, "shard_grad": opt.dense.shard.grad.clone(), "norm": model.grad_norm,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
