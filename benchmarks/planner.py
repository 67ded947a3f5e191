"""Benchmark for lecture 5c (not a test): the planner's step time against published training runs.

    .venv/bin/python benchmarks/planner.py [--search]

Every row of ``reference.planner.runs.PUBLISHED_RUNS`` (Narayanan et al. 2021, Tables 1 and 2) is
planned with the composition the paper ran, on ``runs.selene(n)`` (the "a100-80gb-sxm" preset with the GEMM
ceiling of the runs' CUDA 11 stack) — the time model from first principles, its constants from datasheets and
GEMM / NCCL benchmarks (reference/planner/hardware.py), none fitted to these rows.  Printed per row: the
published step (the paper's FLOPs formula over its teraFLOP/s per GPU), the predicted step, the error, the
predicted MFU and HFU, the memory per device and the largest exposed terms; then the median and worst |error|,
and the same at the preset's GEMM ceiling of today's stack.
Then the held-out runs (``runs.HELD_OUT_RUNS``: NVIDIA's DGX Cloud recipes on H100s), as published and with
their TP communication counted as exposed.  With ``--search``, also the search's fastest plan for each
published row and, where it beats the published composition by more than 10 %, the planner's explanation.
Pure arithmetic: a few seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from reference.planner import GB, PRESETS, explain, search, time_terms  # noqa: E402
from reference.planner.runs import HELD_OUT_RUNS, compare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search", action="store_true", help="also search each row's cluster and explain")
    args = ap.parse_args()
    rows = compare()
    print(f"{'row':42s} {'GPUs':>5s} {'published':>10s} {'predicted':>10s} {'error':>7s} {'MFU':>5s} "
          f"{'HFU':>5s} {'GB':>5s}  largest terms")
    for r in rows:
        run, pl = r["run"], r["plan"]
        terms = sorted(time_terms(pl).items(), key=lambda kv: -kv[1])[:4]
        where = ", ".join(f"{k} {x:.3g}s" for k, x in terms)
        print(f"{run.name:42s} {run.cluster.devices:5d} {r['published']:9.2f}s {r['predicted']:9.2f}s "
              f"{r['error']:+7.1%} {pl.mfu:5.1%} {pl.hfu:5.1%} {pl.total_memory / GB:5.1f}  {where}")
    errors = [abs(r["error"]) for r in rows]
    print(f"\n{len(rows)} rows: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
          f"(signed mean {statistics.mean(r['error'] for r in rows):+.1%})")
    today = [abs(r["error"]) for r in compare(ceiling=PRESETS["a100-80gb-sxm"]["gemm_ceiling"])]
    print(f"at the preset's GEMM ceiling (today's stack, not the runs' CUDA 11): median |error| "
          f"{statistics.median(today):.1%}, worst {max(today):.1%}")
    held_out()
    if args.search:
        print("\nsearch (same micro-batch, full recomputation, cp 1, the row's other settings):")
        for r in rows:
            run, pub = r["run"], r["plan"]
            ok, _ = search(run.model, run.cluster, zero_stages=(0, 1, 3), recompute=("full",),
                           virtual_stages=sorted({1, run.comp.virtual_stages}), base=run.comp, cp_sizes=(1,),
                           top=1)
            best = ok[0]
            gap = pub.step_time / best.step_time - 1
            print(f"{run.name:42s} best {best.comp} ({gap:+.1%} for the published one)")
            if gap > 0.10:
                for line in explain(pub, best):
                    print("    " + line)


def held_out() -> None:
    """The held-out H100 runs (runs.HELD_OUT_RUNS), as published and with their TP communication exposed."""
    rows = compare(HELD_OUT_RUNS)
    exposed = compare(HELD_OUT_RUNS, tp_overlap=False)
    print(f"\nheld out (never used to build the model): {'published':>10s} {'predicted':>10s} {'error':>7s} "
          f"{'TP exposed':>11s} {'GB':>6s}")
    for r, x in zip(rows, exposed):
        print(f"{r['run'].name:42s} {r['published']:9.2f}s {r['predicted']:9.2f}s {r['error']:+7.1%} "
              f"{x['error']:+11.1%} {r['plan'].total_memory / GB:6.1f}" + ("" if r["plan"].fits else "  does not fit"))
    for label, rs in (("as published (TP overlapped)", rows), ("TP communication exposed", exposed)):
        e = [abs(r["error"]) for r in rs]
        print(f"{len(rs)} held-out rows, {label}: median |error| {statistics.median(e):.1%}, worst {max(e):.1%}, "
              f"{sum(r['error'] < 0 for r in rs)} too fast")


if __name__ == "__main__":
    main()
