"""``make bench``: every speed benchmark against its peer, one table of ratios (not a test).

    make bench                        # quick sizes: about a minute on 2 cores
    make bench FULL=1                 # each benchmark's own sizes, the targets' (about three minutes)
    .venv/bin/python benchmarks/bench.py [--full] [--only pipeline moe] [--no-peers] [--verbose]

Each benchmark runs in its own subprocess (they start process worlds; a fresh interpreter keeps one's
state out of the next) and calls its module's ``rows(quick)`` — the figures its own command line
prints, as data — handing them back as JSON on one stdout line marked ``BENCH-ROWS``; the rest of
what it printed goes to ``build/bench/<name>.log`` (``--verbose`` also shows it).  A row has ``pair``,
``ours`` and ``peer`` (in ``unit``), ``ratio`` = speed ours ÷ peer (the peer's time ÷ ours: above 1
ours is faster) and ``target`` (the course's) or ``aim`` (the benchmark's own, marked †) or neither (a
figure only), perhaps a ``note``; or ``pair`` and ``error`` when it could not be measured.  A
benchmark that fails, overruns its time limit or misses an optional peer becomes such a row (✗ and
the reason): the table is always printed.

Not in the table: ``grading.py`` (how long grading takes, no peer) and ``planner.py`` (the planner's
error against published runs: arithmetic, no speed).  A shared machine's figures vary: quote ratios.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOGS = os.path.join(ROOT, "build", "bench")
MARK = "BENCH-ROWS "

# module, what it compares, seconds allowed (quick, full) before it is stopped
BENCHMARKS = [
    ("compose", "the composed run vs DDP + Adam", 600, 1800),
    ("data_parallel", "DataParallel, ZeRO-1/2, FSDP vs DDP, ZeroRedundancyOptimizer, FSDP2", 900, 3600),
    ("tensor_parallel", "TP MLP and attention vs DTensor", 600, 3600),
    ("pipeline", "GPipe and 1F1B vs torch.distributed.pipelining", 600, 3600),
    ("moe", "expert parallelism vs one process (and fairscale)", 900, 5400),
    ("moe_frontier", "grouped GEMM vs the expert loop; the all-to-all hidden in two halves", 600, 1800),
    ("moe_twin", "our MoE layer vs torchtitan's MoE (values, then speed)", 600, 1800),
    ("ring_attention", "ring attention vs SDPA (and ring-attention-pytorch)", 900, 5400),
]


# ----------------------------------------------------------------------------------------------
# In the subprocess: one benchmark's rows


def child(name: str, quick: bool, peers: bool) -> None:
    for p in (HERE, ROOT):
        if p not in sys.path:
            sys.path.insert(0, p)
    mod = importlib.import_module(name)        # by its own name, as the ranks import its rank functions
    kw = {} if peers or "peer" not in inspect.signature(mod.rows).parameters else {"peer": False}
    rows = mod.rows(quick=quick, **kw)
    print(MARK + json.dumps(rows), flush=True)


# ----------------------------------------------------------------------------------------------
# In the parent: run each, show progress, collect


def _stop(proc: subprocess.Popen) -> None:
    """End the benchmark's subprocess and its ranks (its own process group, started here)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def _reason(tail: list[str], rc: int) -> str:
    """The last exception line of a failed benchmark's output, else its last line."""
    for line in reversed(tail):
        head = line.split(":", 1)[0].strip()
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return f"failed: {line.strip()[:160]}"
    return f"failed (exit {rc}): {tail[-1].strip()[:160] if tail else 'no output'}"


def run_one(name: str, title: str, limit: float, args, label: str) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", name]
    cmd += (["--full"] if args.full else []) + ([] if args.peers else ["--no-peers"])
    tty = sys.stdout.isatty() and not args.verbose
    found, tail = [], []
    t0 = time.perf_counter()
    print(f"{label} {name}: {title} ...", end="" if tty else "\n", flush=True)
    with open(os.path.join(LOGS, f"{name}.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))

        def read():
            for line in proc.stdout:
                if line.startswith(MARK):
                    found.append(line[len(MARK):])
                    continue
                log.write(line)
                tail.append(line.rstrip())
                del tail[:-30]
                if args.verbose:
                    print("    | " + line.rstrip(), flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out, shown = False, 0
        try:
            while proc.poll() is None:
                elapsed = time.perf_counter() - t0
                if elapsed > limit:
                    timed_out = True
                    _stop(proc)
                    break
                if tty:
                    print(f"\r{label} {name}: {title} ... {elapsed:4.0f} s", end="", flush=True)
                elif elapsed - shown >= 60:
                    shown = elapsed
                    print(f"{label} {name}: still running, {elapsed:.0f} s", flush=True)
                try:
                    proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            _stop(proc)
            raise
        finally:
            reader.join(timeout=10)
    seconds = time.perf_counter() - t0
    rows = []
    if found:
        try:
            rows = json.loads(found[-1])
        except json.JSONDecodeError as e:
            rows = [dict(pair=f"{name}: {title}", error=f"unreadable rows ({e})")]
    elif timed_out:
        rows = [dict(pair=f"{name}: {title}", error=f"no result within {limit:.0f} s: stopped")]
    else:
        rows = [dict(pair=f"{name}: {title}", error=_reason(tail, proc.returncode))]
    bad = sum(1 for r in rows if status(r) == "✗")
    print(f"{chr(13) if tty else ''}{label} {name}: {len(rows)} rows in {seconds:.0f} s"
          f"{f', {bad} ✗' if bad else ''}{' ' * 30 if tty else ''}", flush=True)
    return rows, seconds


# ----------------------------------------------------------------------------------------------
# The table


def status(r: dict) -> str:
    if r.get("error"):
        return "✗"
    goal = r.get("target", r.get("aim"))
    if goal is None:
        return ""
    return "✓" if r["ratio"] >= goal else "✗"


def _num(v, unit: str) -> str:
    if v is None:
        return "—"
    return (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}") + f" {unit}"


def table(rows: list[dict]) -> list[str]:
    head = ["pair", "ours", "peer", "speed ours ÷ peer", "target", "", "note"]
    body = []
    for r in rows:
        goal = r.get("target") if r.get("target") is not None else r.get("aim")
        mark = "" if r.get("target") is not None else "†"
        body.append([r["pair"], _num(r.get("ours"), r.get("unit", "")), _num(r.get("peer"), r.get("unit", "")),
                     "—" if r.get("error") else f"{r['ratio']:#.3g}×",
                     "—" if goal is None else f"≥ {goal:.3g}{mark}", status(r), r.get("error") or r.get("note") or ""])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    right = {1, 2, 3}

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return [line(head), rule, *(line(b) for b in body)]


def machine() -> str:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f"{torch.cuda.device_count()} GPU" if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPUs ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"{platform.system()}; load average {os.getloadavg()[0]:.2f} at the start")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="each benchmark's full sizes (default: quick sizes)")
    ap.add_argument("--only", nargs="+", choices=[b[0] for b in BENCHMARKS], help="run only these benchmarks")
    ap.add_argument("--no-peers", dest="peers", action="store_false",
                    help="skip the optional outside peers (fairscale, ring-attention-pytorch)")
    ap.add_argument("--verbose", action="store_true", help="also show what each benchmark prints")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, quick=not args.full, peers=args.peers)
    os.makedirs(LOGS, exist_ok=True)
    chosen = [b for b in BENCHMARKS if not args.only or b[0] in args.only]
    started = datetime.datetime.now(datetime.timezone.utc)
    header = [f"make bench{' FULL=1' if args.full else ''} ({'full' if args.full else 'quick'} sizes), "
              f"{started:%Y-%m-%d %H:%M} UTC",
              f"machine: {machine()}",
              "speed ours ÷ peer = the peer's time ÷ ours (above 1.00× ours is faster); ✓ when it reaches the target"]
    print("\n".join(header) + "\n", flush=True)
    t0 = time.perf_counter()
    rows, seconds = [], {}
    for i, (name, title, quick_limit, full_limit) in enumerate(chosen):
        try:
            got, seconds[name] = run_one(name, title, full_limit if args.full else quick_limit, args,
                                         f"[{i + 1}/{len(chosen)}]")
        except KeyboardInterrupt:
            print("\ninterrupted: the table so far")
            rows += [dict(pair=f"{n}: {t}", error="not run (interrupted)") for n, t, _, _ in chosen[i:]]
            break
        rows += got
    total = time.perf_counter() - t0
    marks = [status(r) for r in rows]
    missed = [m for m in marks if m == "✗"]
    footer = [f"{marks.count('✓')} of {marks.count('✓') + marks.count('✗')} rows reach their target or aim"
              + (f" ({len(missed)} ✗)" if missed else ""),
              "target = the course's; † = the benchmark's own aim (its docstring), not a course target; "
              "— = a figure only",
              "not in the table: grading.py (grading time, no peer), planner.py (planner error vs published runs)",
              "per benchmark: " + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items())
              + f"; total {total / 60:.1f} min ({total:.0f} s); logs in build/bench/",
              "one run on a shared machine: the seconds vary, the ratios are what to quote"]
    print("\n" + "\n".join(header) + "\n\n" + "\n".join(table(rows)) + "\n\n" + "\n".join(footer))
    with open(os.path.join(LOGS, "rows.json"), "w") as f:
        json.dump(dict(header=header, rows=rows, seconds=seconds, total=total), f, indent=1)


if __name__ == "__main__":
    main()
