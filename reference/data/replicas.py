"""What every data-parallel rank must agree on before training: the same parameters.

Shared by :mod:`.ddp`, :mod:`.zero` and :mod:`.fsdp`:

    unique_parameters   a module's parameters, a tied one once, in registration order
    check_same_shapes   ValueError on EVERY rank, naming the ranks, if the models differ — before
                        any gradient is communicated (a mismatched all-reduce would hang or mix data)
    storage_bytes       bytes held by a set of tensors, each storage counted once (views, tied weights)
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import comm

__all__ = ["unique_parameters", "check_same_shapes", "storage_bytes"]


def unique_parameters(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without repeats (a tied weight appears once), order kept."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def check_same_shapes(params: list[torch.Tensor], group=None, what: str = "model") -> None:
    """Raise ``ValueError`` on every rank of ``group`` if any rank's parameter shapes differ from rank 0's.

    One all-gather of three int64 numbers per rank: (number of tensors, total elements, a hash of
    the shapes and dtypes).  Python's hash of a tuple of ints and strs of dtypes is not salted for
    ints, so we hash the shapes only and compare dtypes through their element sizes.
    """
    shapes = tuple((tuple(p.shape), p.element_size(), bool(p.requires_grad)) for p in params)
    mine = torch.tensor([len(params), sum(p.numel() for p in params), hash(shapes) % (2 ** 61)], dtype=torch.int64)
    if comm.world_size(group) == 1:
        return
    every = comm.all_gather(mine, group=group, what="shape_check")
    bad = [r for r, t in enumerate(every) if not torch.equal(t, every[0])]
    if bad:
        raise ValueError(f"the {what} differs across ranks: rank(s) {', '.join(map(str, bad))} hold parameters "
                         f"whose number, shapes, dtypes or trainable flags differ from rank 0's "
                         f"(rank {comm.rank(group)} has {len(params)} tensors, {int(mine[1])} elements). "
                         "Every data-parallel rank must build the same model.")


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors`` (None skipped), each storage counted once.

    A freed storage (resized to 0, as FSDP does between uses) counts 0.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq and a 1-element step)."""
    if optimizer is None:
        return 0
    return storage_bytes(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
