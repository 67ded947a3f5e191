"""This machine as a planner :class:`~.model.Cluster`, measured rather than nominal — and the tiny GPT's step timed
on it, so that the planner's time model can be checked here (the full course's ``benchmarks/planner.py --here``).

Measured inside a live world of gloo ranks (one thread each, as every course world runs them):

    link      one message of n bytes between two ranks: half a ping-pong, best of several, at a sweep of sizes,
              α and β fitted (:mod:`.measure`, the same measurement lectures 0 and 3 make)
    GEMMs     float64 ``a @ b`` of cubes n³ from 16³ to 768³, best of a few: FLOP/s by the GEMM's FLOPs
              (``Cluster.gemm_sweep``: a GEMM in the plan runs at the sweep's rate for its size, overheads
              of small ones included)
    memory    a float64 copy of 16 MiB: bytes read and written per second (element-wise kernels, the optimizer)
    attention the fused attention block's FLOP/s (lecture 5a's ``sequence.scaling``), as a share of the GEMMs'

Every rank measures at once, so the figures are what a rank gets while the others work too.  The cluster's nodes
are the world: every group "inside a node"; ``cores`` the machine's CPU cores, which the ranks share — with more
ranks than cores the planner adds the floor a shared CPU puts under the step (:func:`.plan.plan`).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from .. import comm
from .measure import SIZES, fit_alpha_beta, pingpong_worker
from .model import GB, Cluster

__all__ = ["gemm_sweep_worker", "step_worker", "measured_cluster", "machine_cores"]

GEMM_SIZES = (16, 32, 64, 128, 192, 256, 384, 512, 768)


def machine_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _best(fn, repeats: int) -> float:
    fn()                                             # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_sweep_worker(repeats: int = 3) -> dict:
    """(every rank) {"gemm": ((FLOPs, FLOP/s), ...), "memory_bw": bytes/s, "attention_flops": FLOP/s}, float64."""
    from ..sequence.scaling import fit_block_times, measure_block_times
    g = torch.Generator().manual_seed(0)
    sweep = []
    for n in GEMM_SIZES:
        a, b = torch.randn(n, n, generator=g, dtype=torch.float64), torch.randn(n, n, generator=g, dtype=torch.float64)
        sweep.append((2.0 * n ** 3, 2.0 * n ** 3 / _best(lambda: a @ b, repeats)))
    x = torch.randn(2 << 20, generator=g, dtype=torch.float64)          # 16 MiB
    y = torch.empty_like(x)
    memory_bw = 2 * x.numel() * 8 / _best(lambda: y.copy_(x), repeats)
    heads, head_dim = 2, 32
    fit = fit_block_times(measure_block_times(sizes=(64, 128, 256), heads=heads, head_dim=head_dim, repeats=repeats,
                                              dtype=torch.float64), heads, head_dim)
    return {"gemm": tuple(sweep), "memory_bw": memory_bw, "attention_flops": fit.flops}


def measured_cluster(world, *, devices: int | None = None) -> tuple[Cluster, dict]:
    """(this machine as a Cluster of ``devices`` ranks (default: the world's), the measurements) — measured on
    ``world`` (a live :class:`reference.launch.World` of at least 2 ranks)."""
    kernels = world.run(gemm_sweep_worker).values
    links = world.run(pingpong_worker, SIZES).values[0]
    # every rank's rates: take the median rank's at each size (the ranks share the machine)
    gemm = tuple((f, statistics.median(k["gemm"][i][1] for k in kernels))
                 for i, (f, _) in enumerate(kernels[0]["gemm"]))
    memory_bw = statistics.median(k["memory_bw"] for k in kernels)
    attention = statistics.median(k["attention_flops"] for k in kernels)
    alpha, beta = fit_alpha_beta(SIZES, [links[n] for n in SIZES])
    peak = max(r for _, r in gemm)
    n = devices or world.world_size
    cluster = Cluster(f"{n} gloo ranks on this machine (measured)", devices=n, memory=8 * GB, flops=peak,
                      intra_bw=beta, inter_bw=beta, devices_per_node=n, hbm_bw=memory_bw, memory_efficiency=1.0,
                      sms=1, gemm_ceiling=1.0, attention_ceiling=min(1.0, attention / peak), alpha_intra=alpha,
                      alpha_inter=alpha, gemm_sweep=gemm, cores=machine_cores(),
                      source="measured here: reference.planner.machine")
    return cluster, {"gemm": gemm, "memory_bw": memory_bw, "attention_flops": attention, "link": links,
                     "alpha": alpha, "beta": beta}


def step_worker(sizes: dict, steps: int = 4, *, batch_size: int = 8, num_microbatches: int = 1,
                sequence_parallel: bool = False, **config) -> dict:
    """(every rank of a grid) seconds of each training step of the tiny GPT on ``sizes``, the ranks lined up by a
    barrier before each; the first step (warm-up) dropped."""
    from ..compose.train import train_step
    from ..compose.workers import build, make_optimizer
    from ..gpt import get_batch
    model, data = build(sizes, batch_size=batch_size, sequence_parallel=sequence_parallel,
                        num_microbatches=num_microbatches, **config)
    opt = make_optimizer(model)
    times = []
    for step in range(steps + 1):
        x, y = get_batch(data, step, batch_size, model.cfg.seq_len, 0)
        comm.barrier()
        t = time.perf_counter()
        train_step(model, opt, x, y, num_microbatches=num_microbatches)
        comm.barrier()
        times.append(time.perf_counter() - t)
    return {"seconds": times[1:], "coords": model.coords}
