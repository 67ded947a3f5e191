"""Rank functions only the data-parallel tests use (tests/data/test_parallel.py): bucket layouts,
and the failure modes (a rank with another model, a rank that skips backward)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from reference import comm
from reference.data.models import make_model
from reference.data.workers import batch


def bucket_layout(bucket_cap_mb: float, kind: str = "mlp") -> list[list[str]]:
    """The parameter names in each of DataParallel's buckets for ``make_model(kind)``."""
    from reference.data.ddp import DataParallel
    return [b.names for b in DataParallel(make_model(kind), bucket_cap_mb=bucket_cap_mb).buckets]


def mismatched_model(method: str = "ddp") -> None:
    """Rank 1 builds a wider model than the others: the wrapper must refuse on every rank."""
    from reference.data.ddp import DataParallel
    from reference.data.fsdp import FullyShardedDataParallel
    from reference.data.zero import ZeroOptimizer
    model = make_model("mlp", hidden=12 if comm.rank() == 1 else 10)
    if method == "ddp":
        DataParallel(model)
    elif method == "fsdp":
        FullyShardedDataParallel(model)
    else:
        ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=int(method[-1]), lr=0.1)


def skip_backward(method: str = "ddp") -> None:
    """Rank 1 never calls backward; the others wait for its gradients (a timeout, not a hang)."""
    from reference.data.ddp import DataParallel
    from reference.data.zero import ZeroOptimizer
    model = make_model("mlp")
    x, y = batch("mlp", 0, 0, 0, comm.rank())
    if method == "ddp":
        model = DataParallel(model)
        if comm.rank() != 1:
            F.mse_loss(model(x), y).backward()
    else:
        opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=int(method[-1]), lr=0.1)
        if comm.rank() != 1:
            F.mse_loss(model(x), y).backward()
            opt.step()
