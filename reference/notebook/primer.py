"""Lecture 0 demo workers: what the notebook runs on its ranks (ranks import functions by name,
so they live in a module, not in notebook cells)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives, comm
from .recorded import live_world, recordable


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


def gather_to_one_all_reduce(numel: int) -> torch.Tensor:
    """The simple all-reduce: every rank sends its tensor to rank 0, rank 0 adds them up and sends
    the sum back to each.  Rank 0's link carries (N−1)·n bytes out and (N−1)·n in."""
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float32) * (r + 1)
    if r == 0:
        buf = torch.empty_like(x)
        for src in range(1, n):
            x += comm.recv(buf, src, step=0)
        for dst in range(1, n):
            comm.send(x, dst, step=1)
    else:
        comm.send(x, 0, step=0)
        comm.recv(x, 0, step=1)
    return x


# ----------------------------------------------------------------------------------------------
# The notebook's demos: recorded from the reference for the student release (reference.notebook.recorded)


@recordable("00.ring_all_reduce", needs=("0.1",), ignore=("worlds",))
def ring_all_reduce_run(n: int = 4, numel: int = 16, worlds: dict | None = None) -> dict:
    """One ring all-reduce on ``n`` ranks: its trace (for the widget) and rank 0's result."""
    with live_world(n, worlds) as w:
        res = w.run(ring_all_reduce, numel)
    return {"trace": res.trace, "result": res.values[0], "n": n, "numel": numel}


@recordable("00.bytes_per_collective", needs=("0.1", "0.2"), ignore=("worlds",))
def bytes_per_collective(numel: int = 12 * 1024, sizes: tuple = (2, 3, 4), worlds: dict | None = None) -> dict:
    """Bytes sent and received per rank, measured from traces, for the ring all-reduce, the
    gather-to-one all-reduce and the ring all-gather of ``numel`` float32 on each world size."""
    rows = []
    for n in sizes:
        with live_world(n, worlds) as w:
            ring = w.run(ring_all_reduce, numel).trace
            naive = w.run(gather_to_one_all_reduce, numel).trace
            gather = w.run(ring_all_gather, numel).trace
        rows.append({"N": n,
                     "ring_sent": ring.bytes_by_rank("send"), "ring_recv": ring.bytes_by_rank("recv"),
                     "one_sent": naive.bytes_by_rank("send"), "one_recv": naive.bytes_by_rank("recv"),
                     "gather_sent": gather.bytes_by_rank("send")})
    return {"numel": numel, "bytes": numel * 4, "rows": rows}
