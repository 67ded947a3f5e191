"""How long grading takes: the whole course with the reference as the submission, per exercise and in all.

    python benchmarks/grading.py              # published inputs, then fresh inputs (as the autograder)
    python benchmarks/grading.py 3.2 4.5      # some exercises

A figure, not a test: a loaded machine is slower, and the tests hold the grade, not the time.  What a
class waits for on Gradescope is the fresh-input run (the reference's full marks are in
tests/grading/test_attacks.py); the per-exercise times show where the time goes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from exercises.grading import core, session  # noqa: E402


def run(ids, fresh: bool) -> tuple[float, list]:
    before = core._SALT
    if fresh:
        core.fresh_inputs()
    t0 = time.perf_counter()
    try:
        results = session.grade("reference", ids or None, include_hidden=True)
    finally:
        core._SALT = before
    return time.perf_counter() - t0, results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ids", nargs="*")
    a = p.parse_args(argv)
    for fresh in (False, True):
        seconds, results = run(a.ids, fresh)
        score, total = sum(r.score for r in results), sum(r.max_score for r in results)
        checks = sum(len(r.checks) for r in results)
        print(f"{'fresh' if fresh else 'published'} inputs: {len(results)} exercises, {checks} checks, "
              f"{score:g}/{total:g} points in {seconds:.1f} s")
        slow = sorted(((sum(c.seconds for c in r.checks), r.exercise.id) for r in results), reverse=True)[:5]
        print("   slowest exercises: " + ", ".join(f"{i} {s:.1f} s" for s, i in slow))


if __name__ == "__main__":
    main()
