"""Benchmark for lecture 5b's frontier MoE pieces (not a test): the grouped GEMM against the per-expert loop, and
how much of the expert all-to-all the two overlapped halves hide.

    .venv/bin/python benchmarks/moe_frontier.py            # FULL sizes
    .venv/bin/python benchmarks/moe_frontier.py --quick

1. Experts as one ``torch._grouped_mm`` against the loop over experts (:func:`reference.moe.run_experts`), one
   process, 1 thread, float32, forward + backward of fine-grained experts (many, narrow: where the loop's
   per-expert calls cost most), the tokens' rows sorted by expert with uneven counts.  Both paths read the
   same ``nn.Linear`` weights; the grouped one stacks them at each call (counted in its time).  On CPU in
   torch 2.13 ``torch._grouped_mm`` is itself a loop: the profiler counts one ``aten::mm`` per expert per call,
   forward and backward (320 for 5 forwards of 32 experts × 2 matmuls), and the grouped path adds its biases
   row by row (10 adds of (N, f), ~27 % of its forward's CPU), so it came out 0.71–0.93× the loop in five runs
   (forward alone 0.43×).  On GPUs (CUTLASS grouped GEMM) each direction is one kernel: there it is the point.
2. The dropless expert-parallel layer on 2 ranks with ``overlap=False`` and ``overlap=True`` (two halves:
   one half's all-to-all in flight while the other half's experts run): the median step time of each and,
   from the trace, the fraction of the dispatch/combine all-to-alls' time (post → wait returned) covered by
   the same rank's expert computation (:func:`reference.moe.overlap.hidden_fraction`).  On 2 cores gloo's
   copies compete with the experts' matmuls for the same cores, so a hidden all-to-all need not make the
   step shorter (lecture 3's lesson); on GPUs the copies are NVLink/InfiniBand transfers.

The ranks import this file as the module ``moe_frontier`` (its directory is on ``sys.path``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from reference import comm  # noqa: E402
from reference.moe import ExpertParallelMoE, MoELayer, make_expert, run_experts  # noqa: E402
from reference.moe.overlap import hidden_fraction  # noqa: E402

_STATE: dict = {}


def grouped_vs_loop(*, num_experts: int, d_model: int, d_ff: int, rows: int, reps: int) -> dict:
    """Median seconds of forward + backward of the experts on ``rows`` rows, each path, interleaved."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    experts = [make_expert(d_model, d_ff) for _ in range(num_experts)]
    counts = torch.distributions.Dirichlet(torch.ones(num_experts)).sample() * rows
    counts = counts.floor().long()
    counts[0] += rows - int(counts.sum())
    x = torch.randn(rows, d_model, requires_grad=True)
    g = torch.randn(rows, d_model)
    times = {"grouped": [], "loop": [], "grouped forward": [], "loop forward": []}
    for impl in ("grouped", "loop"):                     # warm-up
        run_experts(experts, x, counts.tolist(), impl).backward(g)
    for _ in range(reps):
        for impl in ("grouped", "loop"):
            t0 = time.perf_counter()
            y = run_experts(experts, x, counts.tolist(), impl)
            t1 = time.perf_counter()
            y.backward(g)
            times[impl].append(time.perf_counter() - t0)
            times[impl + " forward"].append(t1 - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def ep_step(cfg: dict, overlap: bool) -> float:
    """Rank function: seconds of one forward + backward of the dropless expert-parallel layer on this rank."""
    key = (tuple(sorted(cfg.items())), overlap)
    if key not in _STATE:
        torch.manual_seed(0)
        layer = MoELayer(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], k=cfg["k"], dropless=True)
        x = torch.randn(cfg["tokens"], cfg["d_model"], generator=torch.Generator().manual_seed(1 + comm.rank()))
        _STATE[key] = ExpertParallelMoE.from_layer(layer, overlap=overlap), x.requires_grad_()
    ep, x = _STATE[key]
    dist.barrier()
    t0 = time.perf_counter()
    y, st = ep(x)
    (y.square().mean() + 0.01 * st["aux_loss"]).backward()
    return time.perf_counter() - t0


def hidden(world, cfg: dict, reps: int) -> dict:
    out = {}
    for overlap in (False, True):
        world.run(ep_step, cfg, overlap)                 # warm-up
    times = {False: [], True: []}
    fractions = {False: [], True: []}
    for _ in range(reps):
        for overlap in (False, True):
            res = world.run(ep_step, cfg, overlap)
            times[overlap].append(max(res.values))
            fractions[overlap].append(hidden_fraction(res.trace)["fraction"])
    for overlap in (False, True):
        out[overlap] = {"step": statistics.median(times[overlap]), "hidden": statistics.median(fractions[overlap])}
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 5
    rows = []
    gemm = dict(num_experts=32, d_model=128, d_ff=64, rows=8192) if args.quick else \
        dict(num_experts=64, d_model=256, d_ff=128, rows=16384)
    t = grouped_vs_loop(**gemm, reps=reps)
    print(f"1. experts E={gemm['num_experts']} d={gemm['d_model']} f={gemm['d_ff']}, {gemm['rows']} rows, float32, "
          f"1 thread, forward + backward: grouped {t['grouped'] * 1e3:.1f} ms, loop {t['loop'] * 1e3:.1f} ms "
          f"= {t['loop'] / t['grouped']:.2f}×; forward alone {t['loop forward'] / t['grouped forward']:.2f}×")
    rows.append(dict(pair=f"MoE experts E={gemm['num_experts']} d={gemm['d_model']} f={gemm['d_ff']}: one grouped GEMM "
                          "vs the per-expert loop", ours=gemm["rows"] / t["grouped"], peer=gemm["rows"] / t["loop"],
                     unit="rows/s", ratio=t["loop"] / t["grouped"], target=None,
                     note=f"forward alone {t['loop forward'] / t['grouped forward']:.2f}× (CPU: its backward is "
                          "a loop of mm)"))
    cfg = dict(d_model=128, d_ff=256, num_experts=8, k=2, tokens=1024) if args.quick else \
        dict(d_model=256, d_ff=512, num_experts=8, k=2, tokens=4096)
    from reference.launch import World
    torch.set_num_threads(1)
    with World(2, timeout=900, echo=True) as world:
        h = hidden(world, cfg, reps)
    print(f"2. dropless EP, 2 ranks, d={cfg['d_model']} E={cfg['num_experts']} top-{cfg['k']}, "
          f"{cfg['tokens']} tok/rank: overlap off {h[False]['step'] * 1e3:.1f} ms "
          f"(hidden {h[False]['hidden']:.0%}), on "
          f"{h[True]['step'] * 1e3:.1f} ms (hidden {h[True]['hidden']:.0%} of the all-to-all time, from the trace)")
    rows.append(dict(pair=f"MoE EP d={cfg['d_model']} {cfg['tokens']} tok/rank: all-to-all in overlapped halves vs "
                          "not (2 ranks)", ours=h[True]["step"] * 1e3, peer=h[False]["step"] * 1e3, unit="ms/step",
                     ratio=h[False]["step"] / h[True]["step"], target=None,
                     note=f"hidden: {h[True]['hidden']:.0%} of the all-to-all time (trace), {h[False]['hidden']:.0%} "
                          "without overlap"))
    return rows


def rows(quick: bool = True) -> list[dict]:
    return main(["--quick"] if quick else [])


if __name__ == "__main__":
    import importlib
    importlib.import_module("moe_frontier").main()
