"""Bytes a collective puts on the wire, counted from a trace — the numbers the lecture compares.

A trace event's ``nbytes`` is the size of what the rank hands in (``reference.comm``).  On a ring
of W ranks, per rank (Patarasuk & Yuan's bandwidth-optimal all-reduce):

    all-reduce of N bytes        2·(W-1)/W · N   = a reduce-scatter + an all-gather
    reduce-scatter of N bytes      (W-1)/W · N   (nbytes = N, the whole input)
    all-gather of N/W bytes each   (W-1)/W · N   (nbytes = N/W, this rank's piece)

so Megatron sequence parallelism (all-gather + reduce-scatter where plain tensor parallelism has
one all-reduce) moves exactly the same bytes.  (gloo may implement reduce-scatter differently
underneath; these are the bytes the algorithm needs.)
"""
from __future__ import annotations

from ..trace import Trace

__all__ = ["wire_bytes", "collectives"]


def wire_bytes(op: str, nbytes: int, W: int) -> float:
    """Bytes one rank sends for one collective on a ring of W ranks (see the table above)."""
    if W == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (W - 1) / W * nbytes
    if op == "reduce_scatter":
        return (W - 1) / W * nbytes
    if op == "all_gather":
        return (W - 1) * nbytes
    raise ValueError(f"no ring cost for {op!r}")


def collectives(trace: Trace, rank: int = 0, W: int | None = None) -> list[dict]:
    """Rank ``rank``'s collectives in order: op, operator, direction, layer, nbytes, wire bytes."""
    out = []
    W = W or len(trace.ranks) or 1
    for e in trace.filter(op=("all_reduce", "all_gather", "reduce_scatter"), rank=rank):
        out.append({"op": e.op, "operator": e.meta.get("operator", ""), "direction": e.meta.get("direction", ""),
                    "layer": e.meta.get("layer", ""), "nbytes": e.nbytes, "wire": wire_bytes(e.op, e.nbytes, W)})
    return out
