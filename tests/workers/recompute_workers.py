"""Rank functions of tests/compose/test_recompute.py: the tiny GPT trained on a grid with activation
recomputation (``ParallelGPT(..., recompute=)``), which the composed run's own worker does not take."""
from __future__ import annotations

import torch

from reference import comm
from reference.compose import ParallelGPT, check_sizes, full_state_dict
from reference.compose.workers import fit
from reference.gpt import GPTConfig, TinyGPT, corpus, encode
from reference.saved import SavedTensorMeter


def train_recompute(sizes: dict, recompute: str, steps: int, *, batch_size: int = 4, sequence_parallel: bool = False,
                    schedule: str = "1f1b", num_microbatches: int = 1, **config) -> dict:
    """``steps`` Adam steps; the losses, every parameter after them (rank 0, by single-process name), the
    last step's gradients of this rank's shards, and the peak bytes saved for the backward in step 1."""
    data, alphabet = encode(corpus())
    cfg = GPTConfig(vocab=len(alphabet), **config)
    grid = check_sizes(cfg, sizes, comm.world_size(), batch_size, sequence_parallel=sequence_parallel,
                       num_microbatches=num_microbatches)
    torch.manual_seed(0)
    model = ParallelGPT(TinyGPT(cfg).to(torch.float64), grid, sequence_parallel=sequence_parallel, recompute=recompute)
    kw = dict(batch_size=batch_size, schedule=schedule, num_microbatches=num_microbatches)
    with SavedTensorMeter(list(model.parameters()) + list(model.buffers())) as meter:
        losses = fit(model, data, 1, **kw)
    losses += fit(model, data, steps, start=1, **kw)
    grads = {name: s.param.grad.clone() for name, s in model.shards.items() if s.param.grad is not None}
    params = full_state_dict(model)
    return {"losses": losses, "coords": model.coords, "grads": grads, "activations": meter.peak,
            "params": params if comm.rank() == 0 else None}
