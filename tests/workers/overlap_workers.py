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
