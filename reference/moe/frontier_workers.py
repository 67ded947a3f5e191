"""Lecture 5b, part 8 — the measurements behind "experts at frontier scale", and their rank functions.

Each function measures one claim of the lecture's frontier part (:mod:`.lecture` wraps them for the
notebook and records them for the student release):

    fine_grained_costs     the same FLOPs and parameters cut into more, narrower experts: rows sent per
                           token and router FLOPs grow with k (one process, FlopCounterMode)
    grouped_gemm_on_cpu    torch._grouped_mm on CPU is a loop of mm: the profiler's count, and its time
    nodes_per_token        node-limited routing: how many nodes a token's k experts span, with and without M
    ep_step                (rank) one timed forward + backward of a dropless expert-parallel layer, with its
                           load skewed by a bias (the busiest rank sets the step) or its all-to-all overlapped
    folded_dispatch        (rank) one expert-parallel forward over a grid's ep group: where its bytes go
    bias_drift             (rank) loss-free bias steps whose loads are counted over the ep group only, or over
                           every rank that routes tokens: do the replicas keep the same bias?
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch

from .. import comm
from .experts import make_expert, run_experts
from .layer import MoELayer
from .parallel import ExpertParallelMoE
from .routing import loss_free_bias_update, top_k_routing

__all__ = ["fine_grained_costs", "grouped_gemm_on_cpu", "nodes_per_token", "skewing_bias", "ep_step",
           "folded_dispatch", "bias_drift"]


# ---------------------------------------------------------------------------------- one process


def fine_grained_costs(configs: list[dict], *, d_model: int = 64, tokens: int = 256, seed: int = 0) -> list[dict]:
    """One forward of a dropless :class:`MoELayer` per configuration ({"num_experts", "k", "expert_ffn",
    "shared_experts"}), counted by torch's FlopCounterMode (the loop over experts: the counter sees every mm).

    Per configuration: the experts' parameters (routed + shared), the experts' FLOPs per token (routed +
    shared), the router's, the rows each token sends to routed experts (k: the dispatch all-to-all's rows),
    and the number of different expert combinations a token can choose, C(E, k).
    """
    from torch.utils.flop_counter import FlopCounterMode
    rows = []
    for cfg in configs:
        torch.manual_seed(seed)
        E, k, f, s = cfg["num_experts"], cfg["k"], cfg["expert_ffn"], cfg.get("shared_experts", 0)
        layer = MoELayer(d_model, f, E, k=k, dropless=True, shared_experts=s).double()
        x = torch.randn(tokens, d_model, dtype=torch.float64)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            _, stats = layer(x)
        per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
        router = sum(v for name, v in per_module.items() if name.endswith(".router"))
        experts = sum(p.numel() for p in layer.experts.parameters())
        shared = sum(p.numel() for p in layer.shared.parameters()) if s else 0
        rows.append({**cfg, "expert_params": experts + shared,
                     "expert_flops_per_token": (counter.get_total_flops() - router) / tokens,
                     "router_flops_per_token": router / tokens,
                     "rows_per_token": int(stats["tokens_per_expert"].sum()) / tokens,
                     "combinations": math.comb(E, k)})
    return rows


def grouped_gemm_on_cpu(num_experts: int = 32, d_model: int = 128, d_ff: int = 64, rows: int = 4096,
                        reps: int = 3, seed: int = 0) -> dict:
    """The experts (GELU, float32) on ``rows`` rows sorted by expert (uneven counts), one ``torch._grouped_mm``
    per matmul against a loop over the experts.

    Returns {"max_diff": the largest |grouped − loop| of the outputs, "grouped_calls": the ``_grouped_mm`` calls of
    one forward, "mm_per_grouped_call": the ``aten::mm`` calls torch's profiler counts inside the grouped forward
    per ``_grouped_mm`` call, "loop_mm_calls": the loop's (``aten::addmm``: its Linear layers), "grouped_s",
    "loop_s": the best forward + backward of ``reps``}.
    """
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(seed)
    experts = [make_expert(d_model, d_ff) for _ in range(num_experts)]
    counts = torch.distributions.Dirichlet(torch.ones(num_experts)).sample() * rows
    counts = counts.floor().long()
    counts[0] += rows - int(counts.sum())
    counts = counts.tolist()
    x = torch.randn(rows, d_model, requires_grad=True)
    g = torch.randn(rows, d_model)
    with torch.no_grad():
        diff = float((run_experts(experts, x, counts, "grouped") - run_experts(experts, x, counts, "loop"))
                     .abs().max())
    calls = {}
    for impl in ("grouped", "loop"):
        with _quiet_stderr(), torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            run_experts(experts, x, counts, impl)
        names = [e.name for e in prof.events()]
        calls[impl] = {"mm": names.count("aten::mm") + names.count("aten::addmm"),
                       "grouped": names.count("aten::_grouped_mm")}
    best = {}
    for impl in ("grouped", "loop"):
        run_experts(experts, x, counts, impl).backward(g)                # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run_experts(experts, x, counts, impl).backward(g)
            times.append(time.perf_counter() - t0)
        best[impl] = min(times)
    return {"num_experts": num_experts, "max_diff": diff, "grouped_calls": calls["grouped"]["grouped"],
            "mm_per_grouped_call": calls["grouped"]["mm"] / max(1, calls["grouped"]["grouped"]),
            "loop_mm_calls": calls["loop"]["mm"], "grouped_s": best["grouped"], "loop_s": best["loop"]}


def nodes_per_token(*, num_experts: int = 64, nodes: int = 8, k: int = 8, max_nodes: int = 4, tokens: int = 4096,
                    seed: int = 0) -> dict:
    """Route ``tokens`` random tokens (sigmoid router, DeepSeek-V3's) to their top ``k`` of ``num_experts``
    experts spread evenly over ``nodes`` nodes, without and with node-limited routing (``max_nodes``).

    Returns {"unlimited", "limited"}: each a histogram {nodes reached: tokens} and its mean.
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g, dtype=torch.float64)
    node_of_expert = torch.arange(num_experts) // (num_experts // nodes)
    out = {}
    for name, limit in (("unlimited", None), ("limited", max_nodes)):
        r = top_k_routing(logits, k, None, router="sigmoid", node_of_expert=node_of_expert, max_nodes=limit)
        reached = [len(set(row)) for row in node_of_expert[r["expert_index"]].tolist()]
        out[name] = {"histogram": {n: reached.count(n) for n in sorted(set(reached))},
                     "mean": sum(reached) / tokens, "max": max(reached)}
    return {**out, "num_experts": num_experts, "nodes": nodes, "k": k, "max_nodes": max_nodes}


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment: torch's profiler writes a line to it as it starts and stops
    (below Python, so a notebook would show it in the cell's output)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# ---------------------------------------------------------------------------------- rank functions

_LAYERS: dict = {}


def skewing_bias(num_experts: int, world_size: int, skew: float) -> torch.Tensor:
    """A choosing bias that adds ``skew`` to the scores of rank 0's experts: a knob for the load imbalance
    (the same bias loss-free balancing steps, here set by hand and pointed the wrong way)."""
    bias = torch.zeros(num_experts)
    bias[: num_experts // world_size] = skew
    return bias


def _ep_layer(cfg: dict, overlap: bool):
    """The seeded dropless layer of ``cfg`` on this rank (kept between calls: one per configuration), its
    tokens (seeded by rank) and upstream gradient."""
    key = (tuple(sorted(cfg.items())), overlap, comm.world_size())
    if key not in _LAYERS:
        torch.manual_seed(cfg.get("seed", 0))
        layer = MoELayer(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], k=cfg["k"], dropless=True,
                         balance="loss_free")
        g = torch.Generator().manual_seed(1 + comm.rank())
        x = torch.randn(cfg["tokens"], cfg["d_model"], generator=g)
        _LAYERS.clear()                              # one configuration alive at a time
        _LAYERS[key] = ExpertParallelMoE.from_layer(layer, overlap=overlap), x.requires_grad_(), torch.randn_like(x)
    return _LAYERS[key]


def ep_step(cfg: dict, *, skew: float = 0.0, overlap: bool = False) -> dict:
    """Rank function: one forward + backward of the dropless expert-parallel layer of ``cfg`` (float32,
    {"d_model", "d_ff", "num_experts", "k", "tokens"}), its choices skewed towards rank 0's experts by
    :func:`skewing_bias` (``skew``), its all-to-all in two overlapped halves if ``overlap``.

    Returns {"seconds": this rank's forward + backward (wall clock; the ranks start together), "experts_cpu_s":
    the CPU time its experts' forwards took, "tokens_per_expert": this rank's choices}.  The trace holds the
    all-to-alls and the experts' compute spans.
    """
    ep, x, g = _ep_layer(cfg, overlap)
    ep.expert_bias = skewing_bias(cfg["num_experts"], comm.world_size(), skew)
    x.grad = None
    cpu = [0.0]
    hooks = [h for expert in ep.local_experts() for h in _cpu_clock(expert, cpu)]
    try:
        comm.barrier()
        t0 = time.perf_counter()
        y, stats = ep(x)
        y.backward(g)
        seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    return {"seconds": seconds, "experts_cpu_s": cpu[0], "tokens_per_expert": stats["tokens_per_expert"].tolist()}


def _cpu_clock(module, total: list) -> tuple:
    """Hooks adding the CPU time this thread spends in ``module``'s forward to ``total[0]`` (``time.thread_time``:
    the work itself, not the time other processes on a shared machine took the core)."""
    started = []
    pre = module.register_forward_pre_hook(lambda _m, _i: started.append(time.thread_time()))

    def post(_m, _i, _o):
        total[0] += time.thread_time() - started.pop()
    return pre, module.register_forward_hook(post)


def folded_dispatch(sizes: dict, cfg: dict) -> dict:
    """Rank function: one dropless expert-parallel forward over the ep group of ``RankGrid(world, **sizes)``,
    every rank routing ``cfg["tokens"]`` tokens of its own (seeded by rank).  The trace's dispatch events
    say where each rank's rows went (:func:`reference.moe.placement.measured_cross_node_bytes`)."""
    from ..mesh import RankGrid
    grid = RankGrid(comm.world_size(), **sizes)
    group = grid.group("ep")
    torch.manual_seed(0)
    layer = MoELayer(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], k=cfg["k"], dropless=True)
    x = torch.randn(cfg["tokens"], cfg["d_model"], generator=torch.Generator().manual_seed(1 + comm.rank()))
    with torch.no_grad():
        _, stats = ExpertParallelMoE.from_layer(layer, group)(x)
    return {"ep_group": grid.ranks("ep"), "dispatched": stats["dispatched"]}


def bias_drift(num_experts: int = 8, steps: int = 20, rate: float = 1e-3, ep: int = 2, seed: int = 0) -> dict:
    """Rank function: ``steps`` loss-free bias updates from this rank's own (random, seeded by rank) loads,
    once counted over this rank's ep group (``ep`` consecutive ranks) and once over every rank.

    Returns {"ep_group": the bias after counting over the ep group, "every_rank": the bias after counting
    over all ranks} (float64): the replicas of an expert shard hold one bias only in the second case.
    """
    W, r = comm.world_size(), comm.rank()
    if W % ep:
        raise ValueError(f"ep={ep} must divide the world's {W} ranks")
    groups = [comm.new_group(list(range(s, s + ep))) for s in range(0, W, ep)]
    mine = groups[r // ep]
    g = torch.Generator().manual_seed(seed + 1 + r)
    loads = [torch.randint(0, 64, (num_experts,), generator=g).double() for _ in range(steps)]
    every = comm.new_group(list(range(W)))
    out = {}
    for name, group in (("ep_group", mine), ("every_rank", every)):
        bias = torch.zeros(num_experts, dtype=torch.float64)
        for load in loads:
            loss_free_bias_update(bias, load, rate, group=group)
        out[name] = bias.tolist()
    return out
