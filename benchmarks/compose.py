"""Benchmark for lecture 5c (not a test): the composed run's data-parallel step against PyTorch's DDP.

    .venv/bin/python benchmarks/compose.py [--quick]

On ``--dp`` ranks × 1 thread (gloo), the tiny GPT (``--layers`` blocks of width ``--d-model``,
``--seq-len`` tokens, ``--batch`` sequences per step, float64), one Adam step per iteration:

    reference.compose (ParallelGPT on a dp-only grid, dp_cp all-reduce per tensor, the course's Adam)
    vs  torch.nn.parallel.DistributedDataParallel (bucketed all-reduce overlapped with backward) + torch.optim.Adam

Seconds per step = median over the steps after the first two, slowest rank; the two alternate
``--rounds`` times in one world and the best median of each is kept.  Printed: both and the ratio
of speeds (ours ÷ DDP, 1.0 = as fast); :func:`rows` returns the same figures for
``benchmarks/bench.py``.  ``tests/compose/test_peers.py`` checks both give the same losses and
parameters.  Figures from a shared 2-core machine are indicative only: quote the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from reference.launch import World  # noqa: E402


def ours_seconds(steps: int, *, batch: int, **config) -> list[float]:
    """Seconds of each composed training step on this rank (dp = world size)."""
    import torch.distributed as dist

    from reference.compose import Adam, build, train_step
    from reference.gpt import get_batch
    model, data = build({"dp": dist.get_world_size()}, batch_size=batch, **config)
    opt = Adam(model.parameters(), lr=3e-3)
    out = []
    for step in range(steps):
        x, y = get_batch(data, step, batch, model.cfg.seq_len)
        t0 = time.perf_counter()
        train_step(model, opt, x, y)
        out.append(time.perf_counter() - t0)
    return out


def ddp_seconds(steps: int, *, batch: int, **config) -> list[float]:
    from reference.compose.peers import ddp_worker
    return ddp_worker(steps, batch_size=batch, timed=True, **config)["seconds"]


def main(argv=None) -> list[dict]:
    """Measure, print, and return the figures as rows for ``benchmarks/bench.py``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, one round")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.d_model, a.seq_len, a.steps, a.rounds = 2, 32, 32, 6, 1
    config = dict(layers=a.layers, d_model=a.d_model, heads=4, d_ff=4 * a.d_model, seq_len=a.seq_len)
    best = {"ours": float("inf"), "DDP": float("inf")}
    with World(a.dp, timeout=300, echo=False) as w:
        for _ in range(a.rounds):
            for name, fn in (("ours", ours_seconds), ("DDP", ddp_seconds)):
                per_rank = w.run(fn, a.steps, batch=a.batch, **config).values
                slowest = max(statistics.median(s[2:]) for s in per_rank)
                best[name] = min(best[name], slowest)
    print(f"tiny GPT {a.layers}×{a.d_model}, {a.seq_len} tokens, batch {a.batch}, float64, dp = {a.dp}")
    print(f"  ours (reference.compose)   {best['ours'] * 1e3:8.2f} ms/step")
    print(f"  torch DDP + Adam           {best['DDP'] * 1e3:8.2f} ms/step")
    print(f"  speed ours ÷ DDP = {best['DDP'] / best['ours']:.2f}×")
    return [dict(pair=f"composed run dp={a.dp} (tiny GPT {a.layers}×{a.d_model}) vs DDP + Adam",
                 ours=best["ours"] * 1e3, peer=best["DDP"] * 1e3, unit="ms/step", ratio=best["DDP"] / best["ours"],
                 target=0.95)]


def rows(quick: bool = True) -> list[dict]:
    """The table's rows (``benchmarks/bench.py``): what the command line prints, as data."""
    return main(["--quick"] if quick else [])


if __name__ == "__main__":
    main()
