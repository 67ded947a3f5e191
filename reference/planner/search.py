"""The search: every composition a model and a cluster allow, ranked by predicted step time, each with its
reasons — and :func:`explain`, which puts two plans side by side term by term and says what measurement
would settle which is faster.

Sizes are every divisor of the device count (3, 6, 35 … as well as powers of two): tp within a node and
dividing the heads, pp at most the layers, cp dividing the sequence into 2·cp zigzag chunks, dp the rest
(and dividing the batch).  For each, the ZeRO stages, recomputation, micro-batch sizes and interleaving
depths asked for.  Each :class:`~.plan.Plan` carries its reasons: what runs out first, and every time
term (compute, bubble, exposed communication per axis, optimizer) largest first.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from .counts import active_params
from .model import Cluster, Composition, Model
from .plan import Plan, plan

__all__ = ["divisors", "expert_grids", "search", "explain", "time_terms", "mfu_terms", "explain_mfu"]

# what to measure to settle a disagreement in each term
EVIDENCE = {
    "compute": "one layer's forward and backward on one device (torch.profiler / nsys) at this "
               "micro-batch and tp: the GEMM efficiency the model assumes is the open question",
    "bubble": "the idle time of the first and last pipeline stages in a timeline of one step",
    "optimizer": "the optimizer step's duration in a timeline",
    "tp": "the tensor-parallel all-reduces' share of a layer in an nsys timeline (are they overlapped?)",
    "pp": "the point-to-point send/recv time per micro-batch between stages",
    "dp": "the gradient all-reduce / reduce-scatter time after the last backward (is it overlapped?)",
    "cp": "the K/V exchange time against attention's compute per layer",
    "ep": "the dispatch and combine all-to-all time per MoE layer, and where its group sits (NVLink or the NIC)",
    "etp": "the expert-tensor all-gather and reduce-scatter time per MoE layer",
    "zero3": "the parameter all-gather time per layer against that layer's compute (is prefetch hiding it?)",
    "edp": "the expert gradients' reduction time after the backward",
}


def divisors(n: int, limit: int | None = None) -> list[int]:
    """Every divisor of ``n`` up to ``limit`` (default ``n``)."""
    return [d for d in range(1, min(n, limit or n) + 1) if n % d == 0]


def expert_grids(model: Model, tp: int, cp: int, dp: int, max_etp: int, etp_sizes=None) -> list[tuple[int, int]]:
    """Every (ep, etp) a sparse model's experts can be folded into over a stage's tp·cp·dp ranks: ep dividing the
    experts, etp dividing each expert's FFN (at most ``max_etp``, or among ``etp_sizes``), etp·ep dividing
    tp·cp·dp.  A dense model: [(1, tp)]."""
    if model.num_experts <= 1:
        return [(1, tp)]
    block = tp * cp * dp
    etps = etp_sizes or [x for x in divisors(block, max_etp) if model.d_expert % x == 0]
    return [(ep, etp) for ep in divisors(model.num_experts) for etp in etps if block % (ep * etp) == 0]


def search(model: Model, cluster: Cluster, *, zero_stages=(0, 1, 2, 3), recompute=("none", "selective", "full"),
           flash: bool = False, max_tp: int | None = None, virtual_stages=1, min_tokens_per_rank: int = 0,
           top: int = 10, micro_batches=None, base: Composition | None = None, cp_sizes=None, etp_sizes=None,
           tp_sizes=None) -> tuple[list[Plan], list[Plan]]:
    """Every composition this model and cluster allow: (the ``top`` that fit, fastest first; the ``top``
    that do not, least memory first).

    tp at most ``max_tp`` (default: one node), or among ``tp_sizes``.  ``virtual_stages``: an int or several to
    try (interleaving needs m a multiple of pp and no more chunks than layers).  ``micro_batches``: micro-batch
    sizes to try (default: the model's).  ``base``: a Composition whose other settings (scatter_gather,
    dp_overlap, cp_algorithm, distributed_optimizer, tp_overlap, moe_overlap, fp8, …) every candidate copies.
    ``cp_sizes``: the cp sizes allowed (default: every divisor); ``min_tokens_per_rank`` drops cp sizes leaving
    fewer tokens per rank.  A sparse model's experts are tried in every grid :func:`expert_grids` allows — every
    ep dividing the experts and every expert-tensor size (``etp_sizes``, default up to one node) — so the search
    places the all-to-all inside a node or across nodes, and its reasons say what each costs.
    """
    base = base or Composition()
    max_tp = max_tp or cluster.devices_per_node
    vs = (virtual_stages,) if isinstance(virtual_stages, int) else tuple(virtual_stages)
    bs = tuple(micro_batches) if micro_batches else (model.micro_batch,)
    n = cluster.devices
    cps = [c for c in (cp_sizes or divisors(n)) if model.seq_len / c >= min_tokens_per_rank]
    ok, bad = [], []
    for tp, pp, cp in itertools.product(tp_sizes or divisors(n, max_tp), divisors(n, model.layers), cps):
        if n % (tp * pp * cp) or model.heads % tp:
            continue
        dp = n // (tp * pp * cp)
        grids = expert_grids(model, tp, cp, dp, cluster.devices_per_node, etp_sizes)
        for (ep, etp), zero, rec, v, b in itertools.product(grids, zero_stages, recompute, vs, bs):
            if flash and rec == "selective":    # flash keeps no scores: selective would save nothing, recompute more
                continue
            if model.global_batch % (dp * b):
                continue
            m = model.global_batch // (dp * b)
            if v > 1 and (pp == 1 or m % pp or pp * v > model.layers):
                continue
            comp = replace(base, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp if model.num_experts > 1 else None,
                           zero=zero, recompute=rec, flash=flash, virtual_stages=v,
                           micro_batch=b if micro_batches else base.micro_batch, stage_layout=None, micro_batches=None)
            try:
                pl = plan(model, cluster, comp)
            except ValueError:
                continue
            (ok if pl.fits else bad).append(pl)
    ok.sort(key=lambda q: (q.step_time, q.total_memory))
    bad.sort(key=lambda q: q.total_memory)
    return ok[:top], bad[:top]


def time_terms(pl: Plan) -> dict[str, float]:
    """A plan's step split into terms that add up to it: compute, bubble, each exposed axis, optimizer
    (and "other" for what the simple model leaves unnamed)."""
    terms = {"compute": pl.compute_time, "bubble": pl.bubble_time, **pl.exposed, "optimizer": pl.optimizer_time}
    rest = pl.step_time - sum(terms.values())
    terms["CPU shared by ranks" if pl.cpu_floor and pl.step_time == pl.cpu_floor else "other"] = rest
    return {k: x for k, x in terms.items() if abs(x) > 1e-12}


def explain(chosen: Plan, other: Plan) -> list[str]:
    """Why the planner believes ``other`` is faster (or slower) than ``chosen``, with its own numbers:
    the step of each, every term that differs (largest difference first), the memory each leaves, and
    what measurement of the largest difference would settle it."""
    a, b = time_terms(chosen), time_terms(other)
    ratio = other.step_time / chosen.step_time - 1
    lines = [f"{chosen.comp}: step {chosen.step_time:.3g} s;  {other.comp}: step {other.step_time:.3g} s "
             f"({ratio:+.1%})"]
    diffs = sorted(((k, b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)), key=lambda kv: -abs(kv[1]))
    for k, d in diffs:
        if abs(d) > 1e-3 * chosen.step_time:
            lines.append(f"  {k}: {a.get(k, 0.0):.3g} s → {b.get(k, 0.0):.3g} s ({d:+.3g} s)")
    cap = chosen.cluster.memory - chosen.cluster.memory_margin
    lines.append(f"  memory: {chosen.total_memory / 1e9:.1f} GB → {other.total_memory / 1e9:.1f} GB of {cap / 1e9:.0f}")
    if diffs:
        key = diffs[0][0]
        lines.append(f"  to settle it, measure {EVIDENCE.get(key, key)}")
    return lines


def mfu_terms(pl: Plan) -> dict[str, float]:
    """Where a plan's MFU goes, as factors that multiply to it:

        MFU = model FLOPs / (step · devices · peak)
            = kernel efficiency × useful share × busy share
        kernel efficiency = model FLOPs at the plan's hardware rate: hardware FLOPs / (compute · devices · peak)
        useful share      = model FLOPs / hardware FLOPs (below 1 when recomputation repeats work)
        busy share        = compute / step (the rest is bubble, exposed communication, the optimizer)

    plus each time term's share of the step."""
    peak = pl.cluster.devices * pl.cluster.flops
    mf = pl.mfu * pl.step_time * peak
    hf = pl.hfu * pl.step_time * peak
    out = {"MFU": pl.mfu, "kernel efficiency": hf / (pl.compute_time * peak) if pl.compute_time else 0.0,
           "useful share": mf / hf if hf else 0.0, "busy share": pl.compute_time / pl.step_time}
    out.update({f"{k} share": x / pl.step_time for k, x in time_terms(pl).items()})
    return out


def explain_mfu(pl: Plan, published: tuple[float, float] | float | None = None) -> list[str]:
    """The plan's MFU taken apart (:func:`mfu_terms`), beside a published MFU (one figure or a range)."""
    f = mfu_terms(pl)
    lines = [f"{pl.comp}: MFU {f['MFU']:.0%} = kernels at {f['kernel efficiency']:.0%} of peak × "
             f"{f['useful share']:.0%} of their FLOPs useful × {f['busy share']:.0%} of the step computing"]
    if published is not None:
        lo, hi = (published, published) if isinstance(published, float) else published
        lines.append(f"  published: {lo:.0%}" + (f"–{hi:.0%}" if hi != lo else ""))
    if pl.cluster.mfu is not None or not pl.cluster.first_principles:
        lines.append(f"  kernels: one assumed MFU ({pl.cluster.fixed_mfu:.0%}) — the cluster has no device figures")
    if f["useful share"] < 0.999:
        lines.append(f"  recomputation ({pl.comp.recompute}) repeats {1 / f['useful share'] - 1:.0%} more FLOPs")
    m = pl.model
    if m.causal:        # model FLOPs count every score (Narayanan/PaLM); causal kernels compute half of them
        scores = 6 * m.layers * m.seq_len * m.heads * m.d_head
        share = scores / (scores * 2 + 6 * active_params(m))
        if share >= 0.005:
            lines.append(f"  {share:.0%} of the model FLOPs are masked scores no causal kernel computes (counted, "
                         "as Narayanan et al. and PaLM count them)")
    for k, x in sorted(((k, x) for k, x in f.items() if k.endswith(" share") and k not in
                        ("useful share", "busy share", "compute share")), key=lambda kv: -kv[1]):
        if x >= 0.005:
            lines.append(f"  {k[:-6]}: {x:.0%} of the step")
    return lines

