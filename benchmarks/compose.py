"""Benchmark for lecture 5c (not a test): the composed run's data-parallel step against PyTorch's DDP.

    .venv/bin/python benchmarks/compose.py [--quick]

On ``--dp`` ranks × 1 thread (gloo), the tiny GPT (``--layers`` blocks of width ``--d-model``,
``--seq-len`` tokens, ``--batch`` sequences per step, float64), one Adam step per iteration:

    reference.compose (ParallelGPT on a dp-only grid: lecture 3's buckets posted from gradient hooks
                       during backward, the course's Adam, the batch's loss all-reduced for every rank)
    vs  torch.nn.parallel.DistributedDataParallel (bucketed all-reduce overlapped with backward) + torch.optim.Adam
        (its loss all-reduce is left out of its time: a handicap of ~0.2 ms/step for ours)

Seconds per step = median over the steps after the first ``--warmup``, slowest rank; the two
alternate ``--rounds`` times in one world (which goes first alternates too) and the best median of
each is kept.  Printed: both and the ratio of speeds (ours ÷ DDP, 1.0 = as fast); :func:`rows`
returns the same figures for ``benchmarks/bench.py``.  ``tests/compose/test_peers.py`` checks both
give the same losses and parameters.  Figures from a shared 2-core machine are indicative only:
quote the ratios, and their spread over several runs.

Where the time went (issue 28; 4×64, batch 8, dp = 2, 2026-12-06, a shared 2-core machine at load
3–8; cProfile and per-section timers on the ranks).  CPU time per step of rank 0's process (all
threads), by section, in two sets of rounds — the second on a quieter machine, so compare ours
with DDP within a set:

    set 1 (fixes 1, 3, 4 below in; attention still the ring's)
        ours  forward 6.6–8.5 ms, backward 9.1–11.3, finish 0.7–1.0, Adam 2.1–2.5    18.8–23.6 ms
        DDP   forward 6.0–7.5,    backward 8.0–9.5,  (in backward), Adam 2.0–2.5, loss 0.2   16.4–19.7 ms
    set 2 (all four)
        ours  forward 4.7–5.1,    backward 6.6–7.3,  finish 0.5–0.8, Adam 1.4–1.6    13.8–14.8 ms
        DDP   forward 4.8–5.3,    backward 6.9–7.3,  (in backward), Adam 1.5–1.7, loss 0.2   13.4–14.6 ms

1. The launcher's status line (reference/rank_program.py): every collective and every traced
   compute block set it twice, and each change was a pickled message to the parent — 30 per step,
   each a socket write that woke the parent process, which on 2 cores takes the CPU from a rank.
   cProfile: 11 % of ours' step under load (0.30 of 2.7 s in 27 steps); DDP's buckets, in C++,
   never paid it.  Now a store; a daemon thread sends the line when it changed, every 0.1 s.
2. Attention at cp = 1 ran the ring's Python autograd Function around its one fused block
   (checks, accumulators, copies): ~2 ms of forward + backward CPU per step, one process.  With
   one context rank ContextParallelAttention now calls torch's SDPA — the same CPU flash kernel,
   bitwise the same loss and gradients.
3. The loss report (one number over the world) was a second blocking sync after Adam; it is now
   posted once every gradient message is waited for and flies during the clip and Adam.
4. The trace: this benchmark recorded every event (``record=True``); DDP's all-reduces are not
   traced.  Both now run untraced, as the other benchmarks do.
Left as they are: the hooks (53 per step, ~5 µs each with lecture 3's grad_ready), the copy back
of the averaged buckets into ``.grad`` (DDP copies too, in C++), Adam (the same single-tensor
torch.optim.adam.adam on both sides).  The remaining gap is the last bucket's all-reduce, waited
for after backward by both.  The first ~4 steps after building are slow for ours (1.5–3×: the
world's other rank still building, first allocations), so the median now skips ``--warmup`` 4
(it skipped 2; ``--quick`` measured 4 steps of which most were warm-up).

5. (later the same day) ParallelGPT's linears at tp = 1 still went through f and g — identities that cost an
   autograd node each, and g a copy — and row-parallel layers added their bias in a separate kernel.  With one
   tensor-parallel rank ``Column/RowParallelLinear`` now call ``F.linear`` directly (nn.Linear's kernel, bias
   fused): CPU per step of one rank, 3 alternating runs each, 14.3–14.5 → 13.1–13.5 ms (−7 %).

Ratios (ours ÷ DDP; runs alternating with the code before the issue, same machine, same hour):
    full size, this script:        before 0.39–0.82, median 0.79 (5 runs);  after 0.89–1.74, median 1.01 (5)
    full size, the former script:  before 0.48–1.23, median 0.74 (23 runs); after 0.80–1.62, median 0.94 (9)
    --quick, this script:          before 0.50–0.67, median 0.64 (4 runs);  after 0.79–0.94, median 0.83 (4)
The quick size (a ~5 ms step) still pays ours' fixed costs: ParallelGPT's Python layers at tp = 1
(+0.25 ms of forward), the Python copy back of the buckets (+0.3 ms) — about 7 % more CPU per step.
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
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="first steps of each run left out of the median")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, two rounds")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.d_model, a.seq_len, a.steps, a.rounds = 2, 32, 32, 12, 2
    config = dict(layers=a.layers, d_model=a.d_model, heads=4, d_ff=4 * a.d_model, seq_len=a.seq_len)
    best = {"ours": float("inf"), "DDP": float("inf")}
    with World(a.dp, timeout=300, echo=False, record=False) as w:     # no trace: time the step only
        for i in range(a.rounds):
            pair = (("ours", ours_seconds), ("DDP", ddp_seconds))
            for name, fn in pair[::-1] if i % 2 else pair:
                per_rank = w.run(fn, a.steps, batch=a.batch, **config).values
                slowest = max(statistics.median(s[a.warmup:]) for s in per_rank)
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
