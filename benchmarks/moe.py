"""Benchmark for lecture 5b (not a test): expert parallelism on CPU ranks.

    .venv/bin/python benchmarks/moe.py [--quick]

1. Throughput at equal work: the expert-parallel layer (W ranks × 1 thread, gloo all-to-all)
   against the common naive implementation — one process looping over the experts
   (``MoELayer``), with 1 thread and with W threads — on the same W·T tokens, the same routing
   groups, forward + backward, float32.
2. "Sparse, not just large": compute per token as the number of experts grows from 4 to 64 at
   fixed k.  FLOPs are counted from the routing (2 per multiply-add; dropless, so every token
   runs exactly k experts), time is measured (forward + backward, one process, 1 thread), and
   the parameter count is printed beside them.

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
from reference.moe import MoELayer  # noqa: E402
from reference.moe.workers import time_expert_parallel  # noqa: E402


def time_single_process(cfg: dict, world_size: int, threads: int) -> float:
    """Seconds per forward + backward of MoELayer over the W ranks' token groups, in one process."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.get("seed", 0))
    layer = MoELayer(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], k=cfg["k"],
                     capacity_factor=cfg.get("capacity_factor", 1.0), dropless=cfg.get("dropless", False))
    xs = [torch.randn(cfg["tokens"], cfg["d_model"], generator=torch.Generator().manual_seed(100 + r))
          for r in range(world_size)]
    best = float("inf")
    for _ in range(cfg["iters"] + 1):
        t0 = time.perf_counter()
        outs = [layer(x) for x in xs]
        sum(y.square().mean() + 0.01 * st["aux_loss"] for y, st in outs).backward()
        best = min(best, time.perf_counter() - t0)
    return best


def flops_per_token(d_model: int, d_ff: int, num_experts: int, k: int) -> tuple[int, int]:
    """Forward FLOPs per token: (experts, router).  An expert: two matmuls, d·d_ff MACs each."""
    return k * 2 * (2 * d_model * d_ff), 2 * d_model * num_experts


def throughput(args) -> None:
    W = args.ranks
    cfg = dict(d_model=args.d_model, d_ff=args.d_ff, num_experts=8, k=2, capacity_factor=1.25,
               tokens=args.tokens, iters=args.iters)
    print(f"\n1. Tokens per second, forward + backward, E=8 experts, top-2, capacity factor 1.25, "
          f"d_model={cfg['d_model']}, d_ff={cfg['d_ff']}, {W}×{cfg['tokens']} tokens, float32")
    with World(W, timeout=600, echo=False, record=False) as world:   # no trace: time the layer only
        for dropless in (False, True):
            c = dict(cfg, dropless=dropless)
            res = world.run(time_expert_parallel, c, timeout=600)
            ep = max(v["seconds"] for v in res.values)
            one = time_single_process(c, W, 1)
            many = time_single_process(c, W, W)
            n = W * c["tokens"]
            mode = "dropless" if dropless else "capacity"
            print(f"   {mode:9s} expert-parallel {W} ranks × 1 thread : {n / ep:10.0f} tok/s")
            print(f"   {mode:9s} one process, loop over experts, 1 thread : {n / one:10.0f} tok/s"
                  f"   (EP tokens/s ÷ this = {one / ep:.2f})")
            print(f"   {mode:9s} one process, loop over experts, {W} threads: {n / many:10.0f} tok/s"
                  f"   (EP tokens/s ÷ this = {many / ep:.2f})")
    torch.set_num_threads(1)


def sparse_scaling(args) -> None:
    d, d_ff, k, T = args.d_model, args.d_ff, 2, args.scaling_tokens
    print(f"\n2. Compute per token as experts grow (top-{k}, dropless, d_model={d}, d_ff={d_ff}, "
          f"T={T} tokens, one process, 1 thread, forward + backward)")
    print("   time = CPU seconds of this one-thread process (robust to other load on the machine);"
          " wall-clock beside it")
    print(f"   {'E':>3} {'params (M)':>11} {'fwd FLOPs/token':>16} {'(experts+router)':>17} "
          f"{'CPU µs/token':>13} {'vs first':>8} {'wall µs/token':>14}")
    torch.set_num_threads(1)
    layers, best, wall, stats = {}, {}, {}, {}
    for E in args.experts:
        torch.manual_seed(0)
        layers[E] = MoELayer(d, d_ff, E, k=k, dropless=True)
        best[E] = wall[E] = float("inf")
    x = torch.randn(T, d)
    for _ in range(args.rounds):           # rounds interleave the sizes: load drifts hit all alike
        for E, layer in layers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            y, stats[E] = layer(x)
            y.square().mean().backward()
            best[E] = min(best[E], time.process_time() - c0)
            wall[E] = min(wall[E], time.perf_counter() - t0)
    rows, base = [], None
    for E, layer in layers.items():
        assigned = int(stats[E]["kept_per_expert"].sum())   # = k·T, dropless
        fe, fr = flops_per_token(d, d_ff, E, k)
        counted = (assigned * fe / k + T * fr) / T            # from the routing actually taken
        params = sum(p.numel() for p in layer.parameters()) / 1e6
        us = best[E] / T * 1e6
        base = base or us
        rows.append((E, params, counted, us))
        print(f"   {E:>3} {params:>11.2f} {counted:>16,.0f} {fe:>9,}+{fr:<7,} {us:>13.2f} {us / base:>7.2f}× "
              f"{wall[E] / T * 1e6:>14.2f}")
    E0, p0, f0, u0 = rows[0]
    E1, p1, f1, u1 = rows[-1]
    print(f"   E {E0} → {E1}: parameters ×{p1 / p0:.1f}, counted FLOPs/token ×{f1 / f0:.3f}, "
          f"measured CPU time/token ×{u1 / u0:.2f} (flat means within 15%: "
          f"{'yes' if abs(u1 / u0 - 1) <= 0.15 else 'no'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.d_ff, args.tokens, args.iters = 128, 512, 1024, 2
        args.scaling_tokens, args.experts, args.rounds = 8192, [4, 16, 64], 3
    else:
        args.d_model, args.d_ff, args.tokens, args.iters = 256, 1024, 4096, 3
        args.scaling_tokens, args.experts, args.rounds = 8192, [4, 8, 16, 32, 64], 4
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} "
          "(part 1 is wall-clock: other load on the machine slows it)")
    throughput(args)
    sparse_scaling(args)


if __name__ == "__main__":
    main()
