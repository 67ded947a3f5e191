"""Benchmark for lecture 5c (not a test): the planner's step time against published training runs, and against
the tiny GPT's runs on this machine.

    .venv/bin/python benchmarks/planner.py [--search] [--here]

Every row of ``reference.planner.runs.PUBLISHED_RUNS`` (Narayanan et al. 2021, Tables 1 and 2) is
planned with the composition the paper ran, on ``runs.selene(n)`` (the "a100-80gb-sxm" preset with the GEMM
ceiling of the runs' CUDA 11 stack) — the time model from first principles, its constants from datasheets and
GEMM / NCCL benchmarks (reference/planner/hardware.py), none fitted to these rows.  Printed per row: the
published step (the paper's FLOPs formula over its teraFLOP/s per GPU), the predicted step, the error, the
predicted MFU and HFU, the memory per device and the largest exposed terms; then the median and worst |error|,
and the same at the preset's GEMM ceiling of today's stack.
Then Megatron-Core's Mixtral runs on H100s (``sparse_runs.MOE_RUNS``: its MoE README's 8x7B and
Megatron-MoE-ModelZoo's four 8x22B rows) and the H100 recipes (``runs.HELD_OUT_RUNS``: NVIDIA's DGX Cloud
Benchmarking), as published and with their TP communication counted as exposed.  With ``--search``, also the
search's fastest plan for each published row and, where it beats the published composition by more than 10 %,
the planner's explanation.  Pure arithmetic: a few seconds.

With ``--here`` (about a minute and a half on 2 cores): this machine measured as a Cluster
(``reference.planner.machine``: gloo α and β, float64 GEMM FLOP/s by size, memory bandwidth, attention), the
tiny GPT's two-rank runs (dp2, tp2, pp2, cp2, ep2) timed and predicted; then the eight-rank grids, where 8 ranks
share the machine's cores and the planner says the step is CPU-bound — its floor beside the measurement.
Wall-clock figures on a shared machine move with its load: the load average is printed with them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from reference.planner import GB, PRESETS, explain, plan, search, time_terms  # noqa: E402
from reference.planner.runs import HELD_OUT_RUNS, compare  # noqa: E402
from reference.planner.sparse_runs import MOE_RUNS  # noqa: E402

# the tiny GPT on this machine: large enough that its GEMMs, not Python's per-op overhead, take most of a step
TINY = dict(layers=2, d_model=256, heads=4, d_ff=1024, seq_len=128)
TINY_MOE = dict(TINY, num_experts=4)
TWO_RANKS = [("dp2", {"dp": 2}, TINY, 8, {}), ("tp2", {"tp": 2}, TINY, 8, {}),
             ("pp2", {"pp": 2}, TINY, 8, {"num_microbatches": 4}), ("cp2", {"cp": 2}, TINY, 8, {}),
             ("ep2", {"dp": 2, "ep": 2}, TINY_MOE, 8, {})]
EIGHT_RANKS = [("dp×tp×pp", {"dp": 2, "tp": 2, "pp": 2}, TINY, 8, {"num_microbatches": 2}),
               ("tp×cp×pp", {"tp": 2, "cp": 2, "pp": 2}, TINY, 8, {"num_microbatches": 4}),
               ("dp×tp×cp", {"dp": 2, "tp": 2, "cp": 2}, TINY, 8, {}),
               ("dp×tp+sp", {"dp": 4, "tp": 2}, TINY, 8, {"sequence_parallel": True}),
               ("dp×ep", {"dp": 8, "ep": 2}, TINY_MOE, 16, {})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search", action="store_true", help="also search each row's cluster and explain")
    ap.add_argument("--here", action="store_true", help="also measure this machine and time the tiny GPT on it")
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
    moe_rows()
    held_out()
    if args.search:
        search_rows(rows + compare(MOE_RUNS))
    if args.here:
        here()


def moe_rows() -> None:
    """Megatron-Core's Mixtral runs (sparse_runs.MOE_RUNS), each as its configuration states it."""
    rows = compare(MOE_RUNS)
    print(f"\nMoE runs on H100 (Megatron-Core):{'':26s} {'published':>10s} {'predicted':>10s} {'error':>7s} "
          f"{'GB':>6s}  largest terms")
    for r in rows:
        terms = sorted(time_terms(r["plan"]).items(), key=lambda kv: -kv[1])[:4]
        print(f"{r['run'].name:58s} {r['published']:9.2f}s {r['predicted']:9.2f}s {r['error']:+7.1%} "
              f"{r['plan'].total_memory / GB:6.1f}  " + ", ".join(f"{k} {x:.3g}s" for k, x in terms))
    e = [abs(r["error"]) for r in rows]
    print(f"{len(rows)} MoE rows: median |error| {statistics.median(e):.1%}, worst {max(e):.1%}")


def held_out() -> None:
    """The held-out H100 runs (runs.HELD_OUT_RUNS), as published and with their TP communication exposed."""
    rows = compare(HELD_OUT_RUNS)
    exposed = compare(HELD_OUT_RUNS, tp_overlap=False)
    print(f"\nH100 recipes (held out):{'':18s} {'published':>10s} {'predicted':>10s} {'error':>7s} "
          f"{'TP exposed':>11s} {'GB':>6s}")
    for r, x in zip(rows, exposed):
        print(f"{r['run'].name:42s} {r['published']:9.2f}s {r['predicted']:9.2f}s {r['error']:+7.1%} "
              f"{x['error']:+11.1%} {r['plan'].total_memory / GB:6.1f}" + ("" if r["plan"].fits else "  does not fit"))
    for label, rs in (("as published (TP overlapped)", rows), ("TP communication exposed", exposed)):
        e = [abs(r["error"]) for r in rs]
        print(f"{len(rs)} held-out rows, {label}: median |error| {statistics.median(e):.1%}, worst {max(e):.1%}, "
              f"{sum(r['error'] < 0 for r in rs)} too fast")


def search_rows(rows: list[dict]) -> None:
    print("\nsearch (same micro-batch and recomputation, cp 1, the row's other settings; experts over every ep, etp):")
    for r in rows:
        run, pub = r["run"], r["plan"]
        ok, _ = search(run.model, run.cluster, zero_stages=sorted({0, 1, 3, run.comp.zero}),
                       recompute=(run.comp.recompute,), flash=run.comp.flash,
                       virtual_stages=sorted({1, run.comp.virtual_stages}), base=run.comp, cp_sizes=(1,), top=1)
        if not ok:
            print(f"{run.name:58s} nothing fits")
            continue
        best = ok[0]
        gap = pub.step_time / best.step_time - 1
        print(f"{run.name:58s} best {best.comp} ({gap:+.1%} for the published one)")
        if gap > 0.10:
            for line in explain(pub, best):
                print("    " + line)


def here() -> None:
    """This machine measured as a Cluster; the tiny GPT's two- and eight-rank runs timed and predicted."""
    from reference.compose.memory import planner_inputs
    from reference.launch import World
    from reference.planner import machine

    def timed(world, sizes, cfg, batch, kw) -> float:
        res = world.run(machine.step_worker, sizes, 6, batch_size=batch, **kw, **cfg)
        return max(min(v["seconds"]) for v in res.values)          # each rank's best step; the slowest rank

    print(f"\nthis machine ({machine.machine_cores()} cores, load average {os.getloadavg()[0]:.1f}):")
    t0 = time.perf_counter()
    with World(2, echo=False) as world:
        cluster, m = machine.measured_cluster(world)
        print(f"  measured in {time.perf_counter() - t0:.0f} s: gloo α {m['alpha'] * 1e6:.0f} µs, β "
              f"{m['beta'] / 1e9:.2f} GB/s; float64 GEMM " + ", ".join(f"{f:.0e}: {r / 1e9:.1f}"
                                                                        for f, r in m['gemm']) +
              f" GFLOP/s; memory {m['memory_bw'] / 1e9:.1f} GB/s; attention {m['attention_flops'] / 1e9:.1f} GFLOP/s")
        print(f"  {'two ranks':10s} {'measured':>9s} {'predicted':>10s} {'error':>7s}  terms")
        errors = []
        for name, sizes, cfg, batch, kw in TWO_RANKS:
            measured = timed(world, sizes, cfg, batch, kw)
            model, comp, _ = planner_inputs(sizes, batch_size=batch, **kw, **cfg)
            pl = plan(model, cluster, comp)
            errors.append(pl.step_time / measured - 1)
            print(f"  {name:10s} {measured * 1e3:7.0f}ms {pl.step_time * 1e3:8.0f}ms {errors[-1]:+7.1%}  "
                  + ", ".join(f"{k} {x * 1e3:.0f}ms" for k, x in time_terms(pl).items()))
        print(f"  two ranks on {machine.machine_cores()} cores: worst |error| {max(abs(e) for e in errors):.1%}")
    eight = replace(cluster, name="8 gloo ranks on this machine (measured)", devices=8, devices_per_node=8)
    print(f"  {'eight ranks':12s} {'measured':>9s} {'floor':>10s}  the planner (a floor: the step takes at least it)")
    with World(8, echo=False) as world:
        for name, sizes, cfg, batch, kw in EIGHT_RANKS:
            measured = timed(world, sizes, cfg, batch, kw)
            model, comp, _ = planner_inputs(sizes, batch_size=batch, **kw, **cfg)
            pl = plan(model, eight, comp)
            print(f"  {name:12s} {measured * 1e3:7.0f}ms {pl.step_time * 1e3:8.0f}ms  {pl.bottleneck}: measured "
                  f"{measured / pl.step_time:.1f}× the floor; each rank on a core of its own: {_own(pl) * 1e3:.0f}ms")


def _own(pl) -> float:
    """The step the plan's ranks would take each on a core of its own (before the CPU floor)."""
    return sum(x for k, x in time_terms(pl).items() if k != "CPU shared by ranks")


if __name__ == "__main__":
    main()
