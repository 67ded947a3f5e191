"""No work: 0.2 looks its answer up by regenerating the grader's inputs from the seeds it can guess
(fixed seeds are public in the checks); --fresh-inputs must make that earn nothing."""
import torch

from .._ring import ring_all_reduce, ring_reduce_scatter  # noqa: F401  (0.1 honest)


def ring_all_gather(chunk, numel, *, group=None):
    for seed in range(200):
        full = torch.randn((numel,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        for a in range(numel - chunk.numel() + 1):
            if torch.equal(full[a:a + chunk.numel()], chunk.to(full.dtype)):
                return full.to(chunk.dtype)
    return torch.zeros(numel, dtype=chunk.dtype)
