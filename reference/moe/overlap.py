"""Lecture 5b, part 5 — hiding the all-to-all behind the experts: two halves in flight.

A dropless expert-parallel layer does, one after the other, ``dispatch → experts → combine``: while
the all-to-all is on the wire the rank waits, and the all-to-all is MoE's heaviest message, on the
critical path.  Cut this rank's tokens in two halves A and B (DeepSeek-V3's DualPipe overlaps two
micro-batches the same way; Megatron-Core's ``--overlap-moe-expert-parallel-comm``) and post before
waiting::

    post dispatch A ─┐
    post dispatch B ─┼──────────┐
    wait A           ▼          │ in flight
                  experts A     │            while A's experts run, B's dispatch travels
    post combine A ─┐           ▼
    wait B          │        experts B       while B's experts run, A's combine travels
    post combine B  │            ─┐
    wait combine A ◀┘             │
    wait combine B ◀──────────────┘          y = A's rows + B's rows (+ the shared experts)

The routing (and the balance loss) is computed once over all T tokens: the halves only cut the
messages.  Forward only: the backward's all-to-alls (the adjoints, ``comm.all_to_all_autograd``'s
rule) run as in the plain layer.  On gloo an all-to-all posted with ``async_op=True`` runs on
gloo's own thread; whether it really hides depends on free cores (on a 2-core machine the copies
compete with the experts' matmuls, lecture 3's lesson).  :func:`hidden_fraction` measures it from
the trace: the share of the all-to-alls' time (post → wait returned) during which the same rank was
computing experts.
"""
from __future__ import annotations

import torch

from .. import comm, trace
from .assignments import _by_expert, _experts_per_rank

__all__ = ["overlapped_dropless", "hidden_fraction"]


class _Box:
    pending = None


class _Post(torch.autograd.Function):
    """Forward: post the all-to-all of the rows of ``x`` (``send`` rows to each rank, ``recv`` from each) and
    return its output buffer at once (filled when :class:`_Wait` runs).  Backward: the adjoint all-to-all."""

    @staticmethod
    def forward(ctx, x, send, recv, group, meta, box):
        ctx.splits, ctx.group, ctx.meta = (send, recv), group, meta
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        box.pending = comm.all_to_all_single_async(out, x.contiguous(), list(recv), list(send), group=group, **meta)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        meta = {**ctx.meta, "what": ctx.meta["what"] + ".backward", "tokens_per_dest": list(recv)}
        return comm._all_to_all_rows(grad.contiguous(), recv, send, ctx.group, meta), None, None, None, None, None


class _Wait(torch.autograd.Function):
    """Forward: wait for the all-to-all :class:`_Post` posted into ``out``.  Backward: nothing to do."""

    @staticmethod
    def forward(ctx, out, box):
        box.pending.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _post(x, send, recv, group, what, **meta):
    box = _Box()
    meta = {"what": what, "tokens_per_dest": list(send), **meta}
    return _Post.apply(x, list(send), list(recv), group, meta, box), box


def _half(routing: dict, lo: int, hi: int) -> dict:
    return {key: value[lo:hi] for key, value in routing.items()}


def overlapped_dropless(layer, x: torch.Tensor, routing: dict) -> torch.Tensor:
    """The dropless all-to-all path of an :class:`~reference.moe.parallel.ExpertParallelMoE` (``layer``),
    with this rank's T tokens cut in two halves whose messages overlap the other half's experts.

    x: (T, d); routing: :func:`~reference.moe.routing.top_k_gating`'s for all T tokens.  Returns the
    routed experts' weighted sum (T, d), equal to the plain path's.  One counts all-to-all first
    (both halves' counts: 2·E_local integers per destination), then the schedule in the module docstring.
    """
    E, group = layer.num_experts, layer.group
    W, E_local = _experts_per_rank(E, group)
    T, h = x.shape[0], x.shape[0] // 2
    halves = [(0, h), (h, T)]
    parts = [(lo, *_by_expert(_half(routing, lo, hi), E)) for lo, hi in halves]          # (lo, t, j, counts)
    counts = torch.stack([c.view(W, E_local) for *_, c in parts], 1)                    # (W, 2, E_local)
    with torch.no_grad():
        recv = comm.all_to_all_autograd(counts.reshape(-1), [2 * E_local] * W, [2 * E_local] * W, group=group,
                                        what="counts").view(W, 2, E_local)
    sends = [c.view(W, E_local).sum(1).tolist() for *_, c in parts]
    recvs = [recv[:, i].sum(1).tolist() for i in range(2)]
    posted = [_post(x.index_select(0, t + lo), sends[i], recvs[i], group, "dispatch", half=i)
              for i, (lo, t, _, _) in enumerate(parts)]
    back = []
    for i, (buf, box) in enumerate(posted):
        x_recv = _Wait.apply(buf, box)
        per_expert = recv[:, i].sum(0)
        with trace.span("compute", what="experts", tokens_per_expert=per_expert.tolist(), half=i):
            out = layer._run_experts_dropless(x_recv, recv[:, i])
        back.append(_post(out, recvs[i], sends[i], group, "combine", half=i))
    y = x.new_zeros(x.shape)
    for (lo, t, j, _), (buf, box) in zip(parts, back):
        rows = _Wait.apply(buf, box)
        w = routing["weight"][t + lo, j].unsqueeze(-1).to(rows.dtype)
        y = y.index_add(0, t + lo, w * rows)
    return y


def hidden_fraction(trace_, rank: int | None = None, whats=("dispatch", "combine")) -> dict:
    """From a trace: the all-to-alls (``what`` in ``whats``) of ``rank`` (None: every rank), their total time
    from post to the end of the wait, the part of it covered by the same rank's ``compute`` spans
    (``what="experts"``), and the fraction hidden = covered / total (0 when nothing overlaps).

    Returns {"all_to_all_s", "hidden_s", "fraction", "count"}.
    """
    events = [e for e in trace_ if rank is None or e.rank == rank]
    computes: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.op == "compute" and e.meta.get("what") == "experts":
            computes.setdefault(e.rank, []).append((e.start, e.end))
    total = hidden = 0.0
    count = 0
    for e in events:
        if e.op != "all_to_all" or e.meta.get("what") not in whats:
            continue
        count += 1
        total += e.end - e.start
        covered = _union_overlap(e.start, e.end, computes.get(e.rank, []))
        hidden += covered
    return {"all_to_all_s": total, "hidden_s": hidden, "fraction": hidden / total if total > 0 else 0.0,
            "count": count}


def _union_overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """Length of [a, b] covered by the union of ``spans``."""
    cut = sorted((max(a, s), min(b, e)) for s, e in spans if e > a and s < b)
    covered, end = 0.0, a
    for s, e in cut:
        s = max(s, end)
        if e > s:
            covered += e - s
            end = e
    return covered
