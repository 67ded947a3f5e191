"""Lecture 4b, beyond ZB-H1: the schedules production added since, laid out by the course's simulator.

    breadth-first   Lamy-Poirier, "Breadth-First Pipeline Parallelism", arXiv:2211.05953; torch's
                    ``ScheduleLoopedBFS``.  Interleaved chunks (loop placement), but every micro-batch through
                    chunk 0, then every one through chunk 1, …; backwards in reverse.  Interleaving's bubble
                    with GPipe's memory — and each chunk's weights are used by all m micro-batches in one go:
                    gathered once per step under FSDP, their gradients final while the other chunks' backwards
                    still run (the data-parallel reduce-scatter hides behind them).
    ZB-V            Qi et al., arXiv:2401.10241 (§6), torch's ``ScheduleZBVZeroBubble``.  Two chunks per rank
                    folded into a V, backward split into B and W as in ZB-H1: the W's fill the drain, the
                    short V fills the start, at 1F1B's peak memory (p micro-batches' worth on every rank).
    DualPipeV       DeepSeek-V3, arXiv:2412.19437 (§3.2.1: DualPipe), its V-shaped "cut-in-half" variant in
                    deepseek-ai/DualPipe; torch's ``ScheduleDualPipeV``.  The same V, and in the steady state
                    each rank runs the forward of one micro-batch beside the backward of another (torch's
                    OVERLAP_F_B): on a GPU the two share the device, so one's all-to-all hides behind the
                    other's compute.

The V placement (:func:`.schedules.virtual_stage` with ``placement="v"``), p = 4: a micro-batch runs down the
ranks through chunk 0 and back up through chunk 1, so its loss and its first backward are on rank 0, where it
started, and the hop between stage p − 1 and stage p is no message::

    virtual stage   0   1   2   3   4   5   6   7
    rank            0   1   2   3   3   2   1   0
                    ───── chunk 0 ────▶ ◀── chunk 1 ─────

What DualPipe overlaps inside one pair, schematically: an MoE layer's forward of micro-batch i and backward of
micro-batch j, each cut into attention, dispatch (all-to-all), expert MLP, combine (all-to-all); the backward
runs them in reverse.  Each all-to-all runs under the other micro-batch's compute (DeepSeek-V3's figure 4 cuts
finer, B and W apart, and gives the communication 20 of the H800's 132 SMs)::

    compute        │ attn F(i)    │ mlp B(j)      │ mlp F(i)      │ attn B(j)    │
    communication  │ combine B(j) │ dispatch F(i) │ dispatch B(j) │ combine F(i) │

One clock for all of them: F = B = W = 1 slot, a full backward (B and W in one pass, as 1F1B runs it) 2 slots
— :func:`clock` gives :func:`.schedules.simulate` those costs for any order.

Read in this order: :func:`breadth_first`, :func:`clock`, :func:`gradients_final` (how long before the step
ends each chunk's gradients are complete: what a data-parallel reduction of them can hide behind).
"""
from __future__ import annotations

from collections.abc import Sequence

from .schedules import Action, simulate

__all__ = ["breadth_first", "clock", "gradients_final"]


def breadth_first(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list[Action]:
    """Breadth-first (looped BFS) order of one rank: the forwards of micro-batches 0 … m−1 through chunk 0,
    then through chunk 1, …, chunk v−1; then the backwards, chunks and micro-batches in reverse.  Chunk c of
    rank r is virtual stage c·p + r, as in interleaved 1F1B.  The rank holds all m·v chunk-micro-batches at
    its peak (GPipe's memory); the bubble is interleaving's."""
    for what, x in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                    ("virtual_stages", virtual_stages)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {x!r}")
    if not 0 <= rank < num_stages:
        raise ValueError(f"rank {rank} is not a stage of a {num_stages}-stage pipeline")
    m, v = num_microbatches, virtual_stages
    return ([Action("F", i, c) for c in range(v) for i in range(m)]
            + [Action("B", i, c) for c in reversed(range(v)) for i in reversed(range(m))])


def clock(order: Sequence[Sequence[Action]], full_backwards: Sequence[tuple[int, Action]] = ()) -> list:
    """Per-rank slot costs for :func:`.schedules.simulate` on one clock: F = 1; in an order without W every B
    is a full backward, 2; in an order with W's, B (input gradient) = W (weight gradient) = 1, except the
    backwards listed in ``full_backwards`` as (rank, B action) — one pass computing both, 2 slots, its W then 0
    (DualPipeV mixes the two)."""
    split = any(Action(*a).kind == "W" for acts in order for a in acts)
    full = {(r, Action(*a)) for r, a in full_backwards}
    if split and full:
        full |= {(r, a._replace(kind="W")) for r, a in list(full)}

    def cost_of(rank: int):
        def cost(a: Action) -> float:
            if a.kind == "F":
                return 1.0
            if not split:
                return 2.0
            if (rank, a) in full:
                return 2.0 if a.kind == "B" else 0.0
            return 1.0
        return cost
    return [cost_of(r) for r in range(len(order))]


def gradients_final(order: Sequence[Sequence[Action]], *, cost=None, placement: str = "loop") -> list[dict]:
    """Per rank, ``{chunk: slots}``: how long before the step ends that chunk's weight gradients are complete
    (its last W, or its last B in an order without W) — the time a data-parallel all-reduce (or ZeRO's
    reduce-scatter) of those gradients can overlap with the rest of the step.  0: the reduction is exposed."""
    timeline = simulate(order, cost=cost, placement=placement)
    span = max((end for acts in timeline for _, end, _ in acts), default=0.0)
    split = any(a.kind == "W" for acts in timeline for _, _, a in acts)
    out = []
    for acts in timeline:
        last: dict[int, float] = {}
        for _, end, a in acts:
            if a.kind == ("W" if split else "B"):
                last[a.chunk] = max(last.get(a.chunk, 0.0), end)
        out.append({c: span - t for c, t in sorted(last.items())})
    return out
