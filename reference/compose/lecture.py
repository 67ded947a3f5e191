"""The lecture 5c notebooks' runs (recorded for the student release, see ``reference.notebook.recorded``): the
tiny GPT's curves on one process, the composed runs in 3D and 4D on 8 ranks beside one process, the
planner against a measured run, and (the appendix) a checkpoint saved on one grid and resumed on another.
Their rank functions are in :mod:`.workers`.
"""
from __future__ import annotations

import torch

from ..mesh import RankGrid
from ..notebook.recorded import recordable

__all__ = ["tiny_gpt_curves", "composed_runs", "overlap_timeline", "planner_vs_run", "checkpoint_reshard",
           "COMPOSED_NEEDS"]


@recordable("05c.tiny_gpt_curves", needs=("5b.1", "5b.2"))
def tiny_gpt_curves(steps: int = 40, lr: float = 1e-2, d_model: int = 32, heads: int = 4, layers: int = 4,
                    d_ff: int = 64, seq_len: int = 32) -> dict:
    """Single-process loss curves of the tiny GPT, dense and with MoE blocks (4 experts, top-2).

    The MoE layer routes with the learner's ``top_k_gating`` and ``load_balancing_loss`` in the
    student release, so this demo is recordable: it replays the reference's curves until 5b.1 and
    5b.2 pass.
    """
    from ..gpt import train_single
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        size = dict(d_model=d_model, heads=heads, layers=layers, d_ff=d_ff, seq_len=seq_len)
        return {"dense": train_single(steps, lr=lr, **size),
                "moe": train_single(steps, lr=lr, num_experts=4, top_k=2, **size)}
    finally:
        torch.set_num_threads(old)


# Every graded function a composed step runs through (the release replays the recording until
# they all pass): lecture 3's buckets (the dp_cp all-reduce overlapped with backward, .overlap), tensor
# layers, the pipeline step, ring attention (forward and backward), the MoE layer and its gradient
# sync, the grid, the composed gradient sync and the byte estimate.
COMPOSED_NEEDS = ("3.2", "4.1", "4.2", "4.3", "4.4", "4.5", "5a.1", "5a.2", "5a.3", "5a.5", "5b.1", "5b.2", "5b.3",
                  "5b.4", "5c.1", "5c.2", "5c.3")


RUNS = {
    "3D": dict(sizes={"dp": 2, "tp": 2, "pp": 2}, moe=False),
    "4D": dict(sizes={"dp": 2, "tp": 2, "pp": 2, "ep": 2}, moe=True),
    "3D, cp": dict(sizes={"dp": 2, "tp": 2, "cp": 2}, moe=False),
    "4D, cp": dict(sizes={"dp": 2, "tp": 2, "cp": 2, "ep": 2}, moe=True),
}
@recordable("05c.composed_runs", needs=COMPOSED_NEEDS)
def composed_runs(steps: int = 8, num_microbatches: int = 2, batch_size: int = 4, lr: float = 1e-2, layers: int = 4,
                  d_model: int = 32, heads: int = 4, d_ff: int = 64, seq_len: int = 16, num_experts: int = 4,
                  bucket_cap_mb: float = 0.02, world=None) -> dict:
    """Train the tiny GPT (float64) for ``steps`` steps on 8 ranks four times — with pipelines, 3D
    dp×tp×pp = 2×2×2 (dense) and 4D dp×tp×pp×ep = 2×2×2×2 (MoE blocks), 1F1B over ``num_microbatches``;
    with context parallelism, dp×tp×cp = 2×2×2 and dp×tp×cp×ep = 2×2×2×2 — and each on one process.

    Returns per run: "losses" (the grid's, equal on every rank), "single" (train_single's with the
    same micro-batching), "max_diff", "seconds", "sizes", per rank "measured" (wire bytes per axis
    from the trace) and "formula" (reference.compose.train.expected_bytes: its dp_cp, cp and pp
    entries are :func:`reference.compose.step_bytes`, exercise 5c.3), and "timeline": rank 0's last
    step as :func:`overlap_timeline` reads it (the dp_cp buckets: ``bucket_cap_mb``, 20 KiB by default,
    several per stage even for this tiny model).
    """
    import time

    from ..gpt import GPTConfig, corpus, encode, train_single
    from ..notebook.recorded import live_world
    from . import workers
    from .train import expected_bytes, measured_bytes
    base = dict(layers=layers, d_model=d_model, heads=heads, d_ff=d_ff, seq_len=seq_len)
    vocab = len(encode(corpus())[1])
    out = {}
    with live_world(8, {8: world} if world is not None else None) as w:
        for name, run in RUNS.items():
            config = dict(base, num_experts=num_experts) if run["moe"] else base
            sizes = run["sizes"]
            m = num_microbatches if sizes.get("pp", 1) > 1 else 1
            t0 = time.perf_counter()
            res = w.run(workers.train_worker, sizes, steps, batch_size=batch_size, lr=lr, params="none",
                        num_microbatches=m, bucket_cap_mb=bucket_cap_mb, **config)
            seconds = time.perf_counter() - t0
            losses = res.values[0]["losses"]
            same = dict(num_microbatches=m, dp=sizes["dp"]) if run["moe"] and m > 1 else {}
            single = train_single(steps, batch_size=batch_size, lr=lr, **same, **config)
            grid = RankGrid(8, **sizes)
            cfg = GPTConfig(vocab=vocab, **config)
            measured, formula = [], []
            for r, v in enumerate(res.values):
                rows = sum(sum(e.meta["tokens_per_expert"]) for e in res.trace.filter(op="compute", rank=r)
                           if e.meta.get("what") == "experts")
                measured.append(measured_bytes(res.trace, r, grid))
                formula.append(expected_bytes(cfg, grid, v["coords"], batch_size, expert_rows=rows, steps=steps))
            out[name] = dict(sizes=sizes, moe=run["moe"], losses=losses, single=single, seconds=seconds,
                             max_diff=max(abs(a - b) for a, b in zip(losses, single)),
                             coords=[v["coords"] for v in res.values], measured=measured, formula=formula,
                             timeline=overlap_timeline(res.trace, rank=0))
    return out


def overlap_timeline(trace, rank: int = 0) -> dict:
    """The last step of ``rank`` in a composed run's trace, in ms from its first gradient: "ready"
    (when each gradient's last accumulation happened, by bucket), "buckets" ((posted, done) of each
    bucket's dp_cp all-reduce, or ZeRO's reduce-scatter), "backward_end" (the last gradient ready) and
    "hidden" (the fraction of the all-reduces' time before backward ended).  A step ends with its loss all-reduce
    (``what="loss"``): the last step is what follows the one but last."""
    ends = sorted(e.end for e in trace.filter("all_reduce", rank=rank, what="loss"))
    since = ends[-2] if len(ends) > 1 else float("-inf")
    ready = [e for e in trace.filter("grad_ready", rank=rank) if e.start > since]
    ars = sorted((e for op in ("all_reduce", "reduce_scatter")          # ZeRO-2's buckets are reduce-scatters
                  for e in trace.filter(op, rank=rank, what="grads") if e.start > since), key=lambda e: e.start)
    if not ready:
        return {"ready": [], "buckets": [], "backward_end": 0.0, "hidden": 0.0}
    t0 = min(e.start for e in ready)
    end = max(e.start for e in ready)
    busy = sum(e.end - e.start for e in ars)
    before = sum(max(0.0, min(e.end, end) - e.start) for e in ars)
    ms = lambda t: 1e3 * (t - t0)                                         # noqa: E731
    return {"ready": [(ms(e.start), e.meta.get("bucket")) for e in ready],
            "buckets": [(e.meta.get("bucket", i), ms(e.start), ms(e.end)) for i, e in enumerate(ars)],  # posting order
            "backward_end": ms(end), "hidden": before / busy if busy else 0.0}


@recordable("05c.planner_vs_run", needs=COMPOSED_NEEDS)
def planner_vs_run(sizes: dict | None = None, num_microbatches: int = 2, batch_size: int = 4,
                   layers: int = 4, d_model: int = 32, heads: int = 4, d_ff: int = 64, seq_len: int = 16,
                   world=None) -> dict:
    """One measured step of the tiny GPT on the grid ``sizes`` (default dp = tp = pp = 2) beside the
    planner's prediction for each rank's stage: {rank: {"bytes": {axis: (planner, measured)},
    "memory": {kind: (planner, measured)}}} (reference.compose.memory.planner_vs_measured), plus "coords"."""
    from ..notebook.recorded import live_world
    from .memory import measure_worker, planner_vs_measured
    sizes = dict(sizes or {"dp": 2, "tp": 2, "pp": 2})
    config = dict(layers=layers, d_model=d_model, heads=heads, d_ff=d_ff, seq_len=seq_len)
    n = 1
    for degree in sizes.values():
        n *= degree
    with live_world(n, {n: world} if world is not None else None) as w:
        res = w.run(measure_worker, sizes, batch_size=batch_size, num_microbatches=num_microbatches, **config)
    return {"coords": [v["coords"] for v in res.values],
            "ranks": {r: planner_vs_measured(res, sizes, rank=r, batch_size=batch_size,
                                             num_microbatches=num_microbatches, **config)
                      for r in range(n)}}


@recordable("05c.checkpoint_reshard", needs=COMPOSED_NEEDS)
def checkpoint_reshard(steps: int = 4, save_after: int = 2, batch_size: int = 4, layers: int = 2, d_model: int = 16,
                       heads: int = 4, d_ff: int = 32, seq_len: int = 8, world=None) -> dict:
    """A checkpoint that outlives its grid, on 4 ranks: train ``save_after`` steps on dp × tp = 2 × 2 with ZeRO-1
    (Adam's moments sharded over dp) and save (``reference.compose.checkpoint``: every rank its own slices, in
    the single-process coordinates); then resume from it on tp = 4, in the same ranks, for the remaining steps;
    and train one process for all ``steps`` from the same seed.

    Returns "saved_on", "resumed_on", "losses_before" and "losses_after" (the two grids' losses), "single" (the
    one process's), "max_diff" (largest |grid − one process| over every step), "start" (the step the resumed run
    began at), "save_seconds" (the save's wall time on each rank, to the commit) and "bytes_per_rank" (what each
    rank wrote)."""
    import tempfile

    from ..gpt import train_single
    from ..notebook.recorded import live_world
    from . import workers
    config = dict(layers=layers, d_model=d_model, heads=heads, d_ff=d_ff, seq_len=seq_len)
    saved_on, resumed_on = {"dp": 2, "tp": 2}, {"tp": 4}
    with tempfile.TemporaryDirectory(prefix="course-ckpt-") as directory, \
            live_world(4, {4: world} if world is not None else None) as w:
        first = w.run(workers.train_worker, saved_on, save_after, batch_size=batch_size, zero=1, params="none",
                      checkpoint_dir=directory, **config).values
        second = w.run(workers.train_worker, resumed_on, steps, batch_size=batch_size, params="none",
                       checkpoint_dir=directory, resume=True, **config).values
    single = train_single(steps, batch_size=batch_size, **config)
    grid = first[0]["losses"] + second[0]["losses"]
    save = [v["saved"][-1] for v in first]
    return {"saved_on": saved_on, "resumed_on": resumed_on, "losses_before": first[0]["losses"],
            "losses_after": second[0]["losses"], "single": single, "start": second[0]["start"],
            "max_diff": max(abs(a - b) for a, b in zip(grid, single)),
            "save_seconds": [s.seconds for s in save], "bytes_per_rank": dict(save[0].bytes_per_rank)}
