"""Bytes a collective puts on the wire, counted from a trace, and the activation memory of a block:
the numbers the lecture compares with what it measures.

A trace event's ``nbytes`` is the size of what the rank hands in (``reference.comm``).  On a ring
of W ranks, per rank (Patarasuk & Yuan's bandwidth-optimal all-reduce):

    all-reduce of N bytes        2·(W-1)/W · N   = a reduce-scatter + an all-gather
    reduce-scatter of N bytes      (W-1)/W · N   (nbytes = N, the whole input)
    all-gather of N/W bytes each   (W-1)/W · N   (nbytes = N/W, this rank's piece)

so Megatron sequence parallelism (all-gather + reduce-scatter where plain tensor parallelism has
one all-reduce) moves exactly the same bytes — plus, per column-parallel layer (qkv, fc1), the
all-gather of its input again in the backward that saving only the S/W rows costs
(:class:`.layers.LinearWithSequenceParallelGather`): per block and rank (activation A = S·B·d·b)::

    tensor parallelism         4 all-reduces                        8·(W-1)/W · A
    + sequence parallelism     4 all-gathers + 4 reduce-scatters    8·(W-1)/W · A
                               + 2 re-gathers (backward)          + 2·(W-1)/W · A

(gloo may implement reduce-scatter differently underneath; these are the bytes the algorithm needs.)

Activation memory (Korthikanti et al., arXiv:2205.05198 §4): what one layer keeps for the backward,
per rank, with s·b·h the activation, a heads, e bytes per value and m bytes per dropout-mask
element (their e = 2, m = 1: 16-bit activations, byte masks)::

    replicated   LayerNorm inputs 2, qkv and fc1 inputs 2 (·e), two dropout masks 2 (·m)   sbh·(4e + 2m) = 10·sbh
    split by t   q, k 2, v 1, proj input 1, GELU input 4, fc2 input 4 (·e)                 sbh·12e      = 24·sbh
    scores       softmax output e, dropout mask m, dropout output e                        a·s²·b·(2e + m) = 5·as²b

    tensor parallelism           sbh·(10 + 24/t + 5as/(ht))
    + sequence parallelism       sbh·(34 + 5as/h)/t        (the replicated part cut along s too)

:func:`layer_activation_bytes` is that (and §5's recomputation: "selective" drops the scores term,
"full" keeps e·sbh, ÷ t with SP); :func:`not_in_the_formula` what autograd also keeps that the paper
leaves out: each LayerNorm's mean and 1/σ (2 numbers per token) and the causal mask (s² booleans).
"""
from __future__ import annotations

from ..trace import Trace

__all__ = ["wire_bytes", "collectives", "layer_activation_bytes", "not_in_the_formula"]


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
                    "layer": e.meta.get("layer", ""), "what": e.meta.get("what", ""), "nbytes": e.nbytes,
                    "wire": wire_bytes(e.op, e.nbytes, W)})
    return out


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                           e: int = 2, m: int = 1, dropout: bool = True, recompute: str = "none") -> float:
    """Korthikanti et al.'s bytes of one transformer layer's saved activations per rank (table above):
    sequence s, micro-batch b, width h (FFN 4h), a heads, t tensor-parallel ranks, e bytes per value,
    m per dropout-mask element.  Without ``dropout`` there are no masks and no dropout output.
    ``recompute`` (§5): "selective" drops the scores term, "full" keeps the layer's input only,
    e·sbh (÷ t with sequence parallelism)."""
    if recompute == "full":
        return e * s * b * h / (t if sequence_parallel else 1)
    m = m if dropout else 0
    replicated, split = s * b * h * (4 * e + 2 * m), s * b * h * 12 * e
    scores = a * s * s * b * (e + (m + e if dropout else 0)) if recompute == "none" else 0
    return (replicated + split + scores) / t if sequence_parallel else replicated + (split + scores) / t


def not_in_the_formula(s: int, b: int, t: int = 1, *, sequence_parallel: bool = False, e: int = 2,
                       recompute: str = "none") -> float:
    """Bytes autograd also keeps for a block of :mod:`.blocks` that :func:`layer_activation_bytes` leaves
    out: the two LayerNorms' mean and 1/σ (4 numbers per token, e bytes each here: on S/t rows under
    sequence parallelism) and the causal attention mask (s² booleans, on every rank; recomputed with
    the scores under selective recomputation).  Nothing with full recomputation."""
    if recompute == "full":
        return 0
    return 4 * s * b * e / (t if sequence_parallel else 1) + (s * s if recompute == "none" else 0)
