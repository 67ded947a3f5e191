"""Benchmark for lecture 4b (not a test): the course's pipeline executor against torch.distributed.pipelining.

    .venv/bin/python benchmarks/pipeline.py [--quick]

On 2 ranks × 1 thread (gloo), the same float32 model (``--layers`` blocks of Linear(width, width) +
tanh, then a Linear, split in two equal stages), the same batch cut into ``m`` micro-batches,
MSE loss; one training step = zero_grad + forward + backward of the whole batch (no optimizer:
the pipeline is what is measured).  Per schedule (GPipe and 1F1B):

    reference.pipeline.run_pipeline    vs  torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B)

Seconds per step = median over ``--steps`` after 2 warm-up steps, slowest rank; the two
implementations alternate ``--rounds`` times in the same world and the best median of each is
kept, so the machine's load hits both.  Printed: both figures and the ratio of speeds (ours ÷ torch,
1.0 = as fast); :func:`rows` returns them for ``benchmarks/bench.py``.  Shapes are agreed once
before timing on both sides (torch caches them in its stages after the first step; we pass
``shapes=`` from ``infer_shapes``).  Figures from a shared 2-core machine are indicative only:
quote the ratios.

Where 1F1B's time went (cProfile and per-rank timelines, full sizes): the last stage, the busiest
rank, computes ~9 ms of a ~15–17 ms step; on gloo every ``isend`` and every posted ``irecv`` is a
socket write that wakes the peer (~0.1–0.2 ms each here), and the executor posted each receive one
message ahead — between two of its actions — through ``comm.exchange`` (~20 µs more per message);
1F1B ran at 0.8–0.95× torch.  Now a rank posts all of a sender's receives the first time it waits for
that sender (it is idle then; ``reference/pipeline/executor.py``, ``_Postbox``), and ``comm.exchange`` posts
gloo's sends and receives directly instead of through ``batch_isend_irecv`` (gloo runs a batch one
operation at a time anyway): same order of actions, bitwise the same gradients.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from reference.launch import World  # noqa: E402


def _model_and_batch(layers, width, batch):
    from reference.pipeline import split_model, workers
    model = workers.make_model(layers, width, out_features=width, dtype="float32")
    x, y = workers.make_batch(batch, width, out_features=width, dtype="float32")
    return split_model(model, dist.get_world_size())[dist.get_rank()], x, y


def time_steps(impl: str, schedule: str, num_microbatches: int, *, layers: int, width: int, batch: int,
               steps: int) -> float:
    """Median seconds per training step of ``impl`` ("ours" or "torch") on this rank."""
    from reference.pipeline import infer_shapes, run_pipeline, workers
    stage, x, y = _model_and_batch(layers, width, batch)
    r, p = dist.get_rank(), dist.get_world_size()
    if impl == "ours":
        shapes = infer_shapes([stage], (batch // num_microbatches, width), x.dtype)

        def step():
            run_pipeline(stage, schedule, x, y, workers.mse, num_microbatches=num_microbatches, shapes=shapes)
    else:
        from torch.distributed.pipelining import PipelineStage
        pipe = PipelineStage(stage, r, p, torch.device("cpu"))
        sched = workers.torch_schedule_class(schedule)(pipe, num_microbatches, loss_fn=workers.mse)

        def step():
            if r == 0:
                sched.step(x)
            else:
                sched.step(target=y)
    times = []
    for n in range(steps + 2):
        stage.zero_grad(set_to_none=False)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if n >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    """Measure, print, and return both schedules' pairs as rows for ``benchmarks/bench.py``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=None, help="default 512 (256 with --quick)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 20, 8 with --quick)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    width = args.width or (256 if args.quick else 512)
    m = args.microbatches
    kw = dict(layers=args.layers, width=width, batch=m * args.rows, steps=args.steps or (8 if args.quick else 20))
    t0 = time.perf_counter()
    out = []
    with World(2, timeout=600, echo=True, record=False) as world:
        print(f"2 ranks × 1 thread, {args.layers} × Linear({width}, {width}) float32 in 2 stages, "
              f"batch {kw['batch']} = {m} micro-batches × {args.rows} rows; seconds per step = median of "
              f"{kw['steps']}, best of {args.rounds} rounds")
        print(f"{'schedule':9s} {'ours s/step':>12s} {'torch s/step':>13s} {'ours/torch speed':>17s}")
        for name in ("gpipe", "1f1b"):
            best = {"ours": float("inf"), "torch": float("inf")}
            for _ in range(args.rounds):
                for impl in ("ours", "torch"):
                    best[impl] = min(best[impl], max(world.run(time_steps, impl, name, m, **kw).values))
            print(f"{name:9s} {best['ours']:12.4f} {best['torch']:13.4f} {best['torch'] / best['ours']:16.2f}×",
                  flush=True)
            out.append(dict(pair=f"pipeline {'GPipe' if name == 'gpipe' else '1F1B'} ({args.layers}×{width}, m={m}) "
                                 "vs torch.distributed.pipelining", ours=best["ours"] * 1e3, peer=best["torch"] * 1e3,
                            unit="ms/step", ratio=best["torch"] / best["ours"], target=1.0))
    print(f"\n(total {time.perf_counter() - t0:.0f} s; a shared, noisy machine: indicative figures, quote ratios)")
    return out


def rows(quick: bool = True) -> list[dict]:
    """The table's rows (``benchmarks/bench.py``): what the command line prints, as data."""
    return main(["--quick"] if quick else [])


if __name__ == "__main__":
    main()
