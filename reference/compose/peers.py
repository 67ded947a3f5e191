"""Lecture 5c — the composed run's data-parallel path beside PyTorch's own: DistributedDataParallel.

:func:`ddp_worker` trains the single-process tiny GPT wrapped in ``torch.nn.parallel.DistributedDataParallel``
(gloo), each rank on its B/dp rows of the same batches, with ``torch.optim.Adam``: production's answer
to "dp = N".  The full course's ``tests/compose/test_peers.py`` checks it gives the composed run's losses and
parameters; the full course's ``benchmarks/compose.py`` times both.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..gpt import GPTConfig, TinyGPT, corpus, encode, get_batch

__all__ = ["ddp_worker"]


def ddp_worker(steps: int, *, batch_size: int = 4, lr: float = 3e-3, seed: int = 0, dtype=torch.float64,
               timed: bool = False, **config) -> dict:
    """Train with DDP on this rank's rows; return {"losses": the batch's loss per step (mean over
    ranks), "params": final parameters by name (rank 0), "seconds": per step (with ``timed``)}."""
    data, alphabet = encode(corpus())
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab=len(alphabet), **config)).to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)
    r, n = dist.get_rank(), dist.get_world_size()
    rows = batch_size // n
    losses, seconds = [], []
    for step in range(steps):
        x, y = get_batch(data, step, batch_size, model.cfg.seq_len, seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = ddp(x[r * rows:(r + 1) * rows])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y[r * rows:(r + 1) * rows].reshape(-1))
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
    out = {"losses": losses, "seconds": seconds if timed else None}
    if r == 0:
        out["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out
