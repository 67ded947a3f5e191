"""Benchmark for lecture 3 (not a test): the course's data-parallel wrappers against PyTorch's own.

    .venv/bin/python benchmarks/data_parallel.py [--quick]

On 2 ranks × 1 thread (gloo), the same float32 model (6 × Linear(512, 512) + tanh, 64 rows per rank),
AdamW, one training step = forward + backward + step + zero_grad, median of 10 after 3 warm-ups:

    DataParallel            vs  torch.nn.parallel.DistributedDataParallel
    ZeroOptimizer stage 1   vs  DistributedDataParallel + ZeroRedundancyOptimizer
    ZeroOptimizer stage 2   vs  the same (PyTorch has no stage 2 of its own on one node)
    FullyShardedDataParallel vs FSDP2 fully_shard (each Linear, then the root)

and the fraction of DataParallel's all-reduce time hidden behind backward (from one traced backward,
buckets of about two layers).  Each pair runs in the same world, interleaved, so the machine's load hits both;
figures from a shared 2-core machine are indicative only: quote the ratios.  :func:`rows` returns the
pairs' figures for ``benchmarks/bench.py`` (``--pairs-only``: no traced backward).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reference.data import lecture  # noqa: E402
from reference.data.workers import time_steps  # noqa: E402
from reference.launch import World  # noqa: E402
from reference.widgets.buckets import timeline_stats  # noqa: E402

PAIRS = [("ddp", "torch_ddp"), ("zero1", "torch_zero1"), ("zero2", "torch_zero1"), ("fsdp", "torch_fsdp")]
# The table's label and target of each pair (the course's performance targets): speed ours ÷ PyTorch at least this.
LABELS = {"ddp": ("DataParallel vs DDP", 0.95),
          "zero1": ("ZeRO-1 vs DDP + ZeroRedundancyOptimizer", 0.95),
          "zero2": ("ZeRO-2 vs DDP + ZeroRedundancyOptimizer", 0.95),
          "fsdp": ("FSDP vs FSDP2 fully_shard", 1.0)}


def main(argv=None) -> list[dict]:
    """Measure, print, and return the speed pairs as rows for ``benchmarks/bench.py``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    ap.add_argument("--rounds", type=int, default=3, help="alternate ours/theirs this many times; best of each")
    ap.add_argument("--pairs-only", action="store_true", help="the speed pairs only, not the traced backward")
    args = ap.parse_args(argv)
    kw = dict(layers=6, width=256 if args.quick else 512, rows=64, steps=5 if args.quick else 10)
    t0 = time.perf_counter()
    out = []
    with World(2, timeout=600, echo=False, record=False) as world:
        print(f"2 ranks × 1 thread, {kw['layers']} × Linear({kw['width']}, {kw['width']}) float32, {kw['rows']} rows "
              f"per rank, AdamW; seconds per step = median over {kw['steps']} steps, best of {args.rounds} rounds")
        print(f"{'ours':10s} {'PyTorch':12s} {'ours s/step':>12s} {'PyTorch s/step':>15s} {'ours/PyTorch speed':>19s}")
        for ours, theirs in PAIRS:
            best = {ours: float("inf"), theirs: float("inf")}
            for _ in range(args.rounds):
                for m in (ours, theirs):
                    best[m] = min(best[m], max(world.run(time_steps, m, **kw).values))
            print(f"{ours:10s} {theirs:12s} {best[ours]:12.4f} {best[theirs]:15.4f} {best[theirs] / best[ours]:18.2f}×",
                  flush=True)
            label, target = LABELS[ours]
            out.append(dict(pair=f"{label} ({kw['layers']}×{kw['width']})", ours=best[ours] * 1e3,
                            peer=best[theirs] * 1e3, unit="ms/step", ratio=best[theirs] / best[ours], target=target))
    if not args.pairs_only:
        runs = lecture.ddp_runs(layers=kw["layers"], width=kw["width"], rows=kw["rows"], repeats=3)
        print("\nDataParallel, one traced backward per setting (rank 0):")
        for label, run in runs["timelines"].items():
            s = timeline_stats(run["trace"])[0]
            print(f"  {label:36s} all-reduce hidden behind backward {100 * s['hidden_fraction']:3.0f} %, "
                  f"exposed tail {1e3 * s['exposed']:6.1f} ms, "
                  f"backward {1e3 * (s['backward_end'] - s['backward_start']):6.1f} ms")
    print(f"\n(total {time.perf_counter() - t0:.0f} s; a shared, noisy machine: indicative figures, quote ratios)")
    return out


def rows(quick: bool = True) -> list[dict]:
    """The table's rows (``benchmarks/bench.py``): the speed pairs the command line prints, as data."""
    return main((["--quick"] if quick else []) + ["--pairs-only"])


if __name__ == "__main__":
    main()
