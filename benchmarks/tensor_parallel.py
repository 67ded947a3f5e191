"""Benchmark for lecture 4a (not a test): tensor parallelism on CPU ranks.

    .venv/bin/python benchmarks/tensor_parallel.py [--quick]

In one run: the reference parallel MLP and attention (reference.tensor, 2 ranks × 1 thread, gloo)
against PyTorch's DTensor tensor parallelism (``parallelize_module`` with ColwiseParallel /
RowwiseParallel, 2 ranks × 1 thread) and against one process with 2 threads, float32,
forward + backward, best of 5 steps (two alternating rounds), at a few sizes.  Prints seconds and the ratio
reference/DTensor speed (≥ 1 means the reference is faster); :func:`rows` returns the same figures for
``benchmarks/bench.py``.

Figures vary on a shared machine: quote the ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from reference.launch import World  # noqa: E402
from reference.tensor.blocks import MLP, SelfAttention  # noqa: E402
from reference.tensor.workers import bench  # noqa: E402


def single_process(kind: str, S: int, d: int, heads: int, iters: int, threads: int = 2) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = MLP(d, 4 * d) if kind == "mlp" else SelfAttention(d, heads)
    x = torch.randn(S, 1, d)
    best = float("inf")
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_()
        m(xi).square().mean().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> list[dict]:
    """Measure, print, and return the reference-vs-DTensor pairs as rows for ``benchmarks/bench.py``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one small size")
    args = ap.parse_args(argv)
    sizes = [(256, 256)] if args.quick else [(256, 256), (512, 512), (1024, 768)]
    heads, iters = 8, 5     # best of 3 read the largest attention at 0.89× once; best of 5: 1.03-1.19× in 4 rounds
    print(f"{'block':>5} {'S':>5} {'d':>5} {'reference 2x1':>14} {'DTensor 2x1':>12} {'1 proc 2 thr':>13} "
          f"{'ref speed / DTensor':>20}")
    out = []
    with World(2, timeout=600, echo=False, record=False) as world:
        for kind in ("mlp", "attn"):
            for S, d in sizes:
                ours = peer = one = float("inf")
                for _ in range(2):      # alternate the peers, keep each one's best: less bias from a busy machine
                    ours = min(ours, max(world.run(bench, kind, "reference", S, d, heads, iters).values))
                    peer = min(peer, max(world.run(bench, kind, "dtensor", S, d, heads, iters).values))
                    one = min(one, single_process(kind, S, d, heads, iters))
                print(f"{kind:>5} {S:>5} {d:>5} {ours:>13.4f}s {peer:>11.4f}s {one:>12.4f}s {peer / ours:>19.2f}x",
                      flush=True)
                out.append(dict(pair=f"TP {'MLP' if kind == 'mlp' else 'attention'} S={S} d={d} vs DTensor",
                                ours=ours * 1e3, peer=peer * 1e3, unit="ms/fwd+bwd", ratio=peer / ours, target=0.95))
    print("(best of", iters, "steps each; seconds per forward + backward; a shared machine: quote the ratios)")
    return out


def rows(quick: bool = True) -> list[dict]:
    """The table's rows (``benchmarks/bench.py``): what the command line prints, as data."""
    return main(["--quick"] if quick else [])


if __name__ == "__main__":
    main()
