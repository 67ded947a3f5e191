"""Rank functions only the tensor-parallel tests use (tests/tensor/test_parallel.py): bad sizes, and a
backward that only one rank runs."""
from __future__ import annotations

from reference import comm
from reference.tensor import ParallelMLP
from reference.tensor.workers import build, parallel


def parallel_bad(kind: str, heads: int = 4, d_model: int = 12, S: int = 12, **cfg) -> dict:
    """Build ``kind`` with a shape the group cannot split (the error tests): must raise ValueError."""
    return parallel(kind, heads=heads, d_model=d_model, S=S, **cfg)


def only_rank0_backward(**cfg) -> None:
    """A mismatched program: only rank 0 runs the backward, so its f all-reduce has no partner."""
    m, x, dout = build("mlp", **cfg)
    pm = ParallelMLP.from_module(m)
    y = pm(x.clone().requires_grad_())
    if comm.rank() == 0:
        y.backward(dout)
