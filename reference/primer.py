"""Lecture 0 demo workers: what the notebook runs on its ranks (ranks import functions by name,
so they live in a module, not in notebook cells)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives, comm


def hello() -> str:
    """Every rank reports who it is."""
    r, n = dist.get_rank(), dist.get_world_size()
    print(f"I am rank {r} of {n}")
    return f"rank {r}/{n} (pid-free, backend {dist.get_backend()})"


def pass_a_note() -> float:
    """Rank 0 sends a tensor to rank 1; rank 1 receives it.  Point-to-point in its simplest form."""
    r = dist.get_rank()
    note = torch.zeros(3)
    if r == 0:
        note = torch.tensor([1.0, 2.0, 3.0])
        comm.send(note, dst=1)
    elif r == 1:
        comm.recv(note, src=0)
    return float(note.sum())


def blocking_ring() -> None:
    """Every rank sends to its right-hand neighbour, then receives from its left.  Deadlocks on gloo."""
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(16)
    comm.send(t, (r + 1) % n, step=0)
    comm.recv(t, (r - 1) % n, step=0)


def ring_all_reduce(numel: int, impl: str = "reference.collectives") -> torch.Tensor:
    """Each rank contributes ``(rank + 1) * arange(numel)``; returns the all-reduced tensor."""
    import importlib
    fn = importlib.import_module(impl).ring_all_reduce
    r = dist.get_rank()
    x = torch.arange(numel, dtype=torch.float32) * (r + 1)
    return fn(x)


def library_all_reduce(numel: int) -> torch.Tensor:
    x = torch.arange(numel, dtype=torch.float32) * (dist.get_rank() + 1)
    return comm.all_reduce(x)


def ring_all_gather(numel: int) -> torch.Tensor:
    r, n = dist.get_rank(), dist.get_world_size()
    full = torch.arange(numel, dtype=torch.float32)
    a, b = collectives.chunk_bounds(numel, n)[(r + 1) % n]
    return collectives.ring_all_gather(full[a:b].clone(), numel)


def all_to_all(rows_per_peer: int) -> torch.Tensor:
    """Rank r sends block j (values 10·r + j) to rank j and receives block r from everyone."""
    r, n = dist.get_rank(), dist.get_world_size()
    send = torch.cat([torch.full((rows_per_peer,), 10.0 * r + j) for j in range(n)])
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send)
    return recv
