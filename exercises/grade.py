"""Grade the exercises: ``python -m exercises.grade [EXERCISE_ID ...]``.

    python -m exercises.grade                     # every exercise, your `exercises` package
    python -m exercises.grade 0.1 5a.1            # some of them
    python -m exercises.grade --solutions reference   # grade another package laid out the same way
    python -m exercises.grade --gradescope results.json --junit results.xml

Learner code runs in separate, time-limited processes; this process computes and writes the score.
"""
from __future__ import annotations

import argparse
import sys
import time

from .grading import core, report, session


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exercises.grade", description=__doc__.splitlines()[0])
    p.add_argument("ids", nargs="*", metavar="EXERCISE_ID", help="exercise ids (default: all)")
    p.add_argument("--solutions", default="exercises", help="package to grade (default: exercises)")
    p.add_argument("--gradescope", metavar="PATH", help="write Gradescope results.json here")
    p.add_argument("--junit", metavar="PATH", help="write JUnit XML here")
    p.add_argument("--no-hidden", action="store_true", help="skip teachers' hidden checks")
    p.add_argument("--list", action="store_true", help="list the exercises and their checks, then stop")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="cap every check's time limit (default: $GRADER_TIMEOUT or 60)")
    p.add_argument("--oracle-answers", metavar="PATH",
                   help="ground truth recorded from the full reference (a student release ships one)")
    p.add_argument("--fresh-inputs", action="store_true",
                   help="draw every check's inputs from a secret seed (the autograder; needs the full reference)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="time for the whole submission (default: $GRADER_DEADLINE or 480)")
    args = p.parse_args(argv)

    if args.list:
        for ex in core.load_checks().values():
            print(f"{ex.id:6} {ex.title}  ({ex.points:g} points; {ex.module}: {', '.join(ex.functions)})")
            for c in ex.checks:
                print(f"         - {c.name} ({c.points:g}){' [hidden]' if c.hidden else ''}")
        return 0
    t0 = time.perf_counter()
    progress = None if args.quiet else (lambda s: print("  grading", s, file=sys.stderr, flush=True))
    session.contain()   # processes a submission detaches are still found and killed
    if args.oracle_answers:
        core.load_oracle_answers(args.oracle_answers)
    if args.fresh_inputs:
        core.fresh_inputs()

    def write(results: list, note: str = "") -> None:
        if args.gradescope:
            report.gradescope(results, args.gradescope, execution_time=time.perf_counter() - t0, output=note)
        if args.junit:
            report.junit(results, args.junit)

    try:
        results = session.grade(args.solutions, args.ids or None, include_hidden=not args.no_hidden, progress=progress,
                             timeout=args.timeout, deadline=args.deadline,
                             on_exercise=lambda done: write(done, "grading was stopped before the end; "
                                                                  "this is the score of the exercises graded so far"))
    except core.SetupError as e:
        print(f"the grader cannot run here: {e}", file=sys.stderr)
        write([], f"The grader could not run, so nothing was graded: {e}")
        return 2
    except ValueError as e:
        p.error(str(e))
    elapsed = time.perf_counter() - t0
    if args.solutions == "exercises" and not (args.fresh_inputs or args.gradescope or args.junit):
        from . import note_progress   # a learner grading in a terminal: the demos switch to their runs too
        note_progress(results)
    # Written here, last, by this process — after every runner and stray process is gone.
    print(report.summary_text(results))
    print(f"({elapsed:.1f} s)")
    if args.gradescope:
        report.gradescope(results, args.gradescope, execution_time=elapsed)
    if args.junit:
        report.junit(results, args.junit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
