"""Grading one submission: the loop over exercises and checks, the time limits, and containing
what learner code leaves behind.

:func:`grade` is the one entry point (the notebook's ``check``, ``python -m exercises.grade``, the
autograder and the release builder all call it, directly).  Per exercise it starts
a fresh :class:`~exercises.grading.sandbox.Runner`, runs the visible checks, then the hidden ones,
each with its own time limit inside the submission's deadline, and hands every result to
``on_exercise`` as soon as the exercise is done (so a score is written even if a later exercise
never ends).  :func:`sweep` kills whatever processes the learner's code left behind.

The registry, the :class:`~exercises.grading.core.Context` checks are written against, and the
results live in :mod:`.core`.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from reference.zygote import zygote_pids

from . import core, machine
from .core import (START_ALLOWANCE, Check, CheckFailed, CheckResult, CheckTimedOut, Context, Exercise, ExerciseResult,
                   MachineBusy,
                   _guard_pairs, _preload_reference, load_checks, load_oracle_answers)
from .sandbox import Runner, preflight, remove_scratch

__all__ = ["contain", "sweep", "grade", "grade_patiently"]


_CONTAINED = False


def contain() -> bool:
    """Make this process adopt orphans (Linux ``PR_SET_CHILD_SUBREAPER``), so that a process a
    submission detaches (double fork, ``setsid``) is still found and killed after its exercise."""
    global _CONTAINED
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        _CONTAINED = libc.prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
    except Exception:
        _CONTAINED = False
    return _CONTAINED


def _descendants(pid: int) -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every descendant of ``pid``, from /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = {}, {pid}
    while frontier:
        nxt = {c for c, (p, _) in table.items() if p in frontier}
        out.update({c: table[c] for c in nxt})
        frontier = nxt
    return out


def sweep(keep: Sequence[int] = ()) -> int:
    """Kill every descendant of this process not in (or under) ``keep``; reap adopted zombies.
    Returns how many were killed.  Only does anything after :func:`contain`."""
    if not _CONTAINED:
        return 0
    me = os.getpid()
    desc = _descendants(me)
    spared, grown = set(keep), True
    while grown:              # and everything under a spared process
        under = {pid for pid, (ppid, _) in desc.items() if ppid in spared} - spared
        spared |= under
        grown = bool(under)
    killed = 0
    for pid, (ppid, state) in desc.items():
        if pid in spared:
            continue
        if state != "Z":
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    time.sleep(0.05 if killed else 0)
    for pid, (ppid, state) in _descendants(me).items():
        if ppid == me and pid not in spared and pid not in _OUR_CHILDREN:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return killed


_OUR_CHILDREN: set[int] = set()   # runners this process started (subprocess reaps those itself)


def grade(solutions: str = "exercises", ids: Sequence[str] | None = None, *, include_hidden: bool = True,
          progress: Callable[[str], None] | None = None, timeout: float | None = None,
          deadline: float | None = None,
          on_exercise: Callable[[list[ExerciseResult]], None] | None = None) -> list[ExerciseResult]:
    """Grade ``solutions`` (a package laid out like ``exercises``) on the chosen exercises.

    Each exercise gets its own runner process (started while the previous exercise is graded);
    ``timeout`` caps every check's time limit (default ``$GRADER_TIMEOUT`` or 60 s; without either,
    the limits grow on a slow or busy machine, see :func:`machine.machine_factor`); ``deadline``
    caps the whole submission (seconds, default ``$GRADER_DEADLINE`` or 480): checks left when it
    runs out fail, saying so.  ``on_exercise(results so far)`` is called after each exercise (the
    command line writes results.json there, so a grader killed later still leaves a score).
    Raises :class:`SetupError` before any check if learner code cannot be run as configured.
    """
    given = timeout is not None or "GRADER_TIMEOUT" in os.environ   # a limit given is taken as it is
    timeout = core.DEFAULT_TIMEOUT if timeout is None else timeout
    end = time.monotonic() + (core.DEADLINE if deadline is None else deadline)
    try:
        preflight(solutions)
    except BaseException:
        remove_scratch()       # the stripped course copy and the private /tmp folder it made
        raise
    registry = load_checks()
    if core.ORACLE.answers is None and core.ORACLE.record is None and core._SALT is None and core.stripped(registry):
        load_oracle_answers()   # a student release: graded reference functions have no bodies here
        # (never under fresh inputs: answers recorded for the published seeds cannot match them; never
        # where the reference has its bodies: there the truth is computed live, whatever file lies there)
    # Everything the verdicts need is imported now, before any learner code runs.
    _preload_reference()
    chosen = list(registry) if not ids else list(ids)
    unknown = [i for i in chosen if i not in registry]
    if unknown:
        raise ValueError(f"unknown exercise id(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    guard = _guard_pairs(registry, solutions)
    speed = machine.machine_factor()            # start-up allowances grow with it, always
    factor = 1.0 if given else speed             # the checks' limits too, unless a limit was given
    if progress and speed > 1:
        progress(f"(this machine is {speed:g}× slower or busier than the course's: "
                 + (f"every time limit × {factor:g})" if factor > 1 else f"start-up allowances × {speed:g})"))
    results: list[ExerciseResult] = []
    started: list[Runner] = []
    # Processes this one ran before grading (a kept-alive World of the caller's, a notebook's) are not the
    # submission's: the sweep after each exercise spares them.
    before = list(_descendants(os.getpid())) if _CONTAINED else []

    def new_runner(ex: Exercise) -> Runner:
        r = Runner(solutions, guard, ex.lockdown(), speed).start()
        started.append(r)
        _OUR_CHILDREN.add(r.proc.pid)
        return r

    upcoming = new_runner(registry[chosen[0]]) if chosen else None
    try:
        for k, ex_id in enumerate(chosen):
            runner, upcoming = upcoming, (new_runner(registry[chosen[k + 1]]) if k + 1 < len(chosen) else None)
            spare = [upcoming.proc.pid] if upcoming is not None and upcoming.proc is not None else []
            try:
                results.append(_grade_exercise(registry[ex_id], solutions, runner, include_hidden, progress, timeout,
                                               end, factor, speed))
            finally:
                runner.kill()
                sweep(keep=spare + before + sorted(zygote_pids()))   # the runners' zygote stays
            if on_exercise is not None:
                on_exercise(list(results))
    finally:
        for r in started:
            r.kill()
        remove_scratch()
    return results


def _grade_exercise(ex: Exercise, solutions: str, runner: Runner, include_hidden: bool,
                    progress: Callable[[str], None] | None, timeout: float,
                    end: float = float("inf"), factor: float = 1.0, speed: float = 1.0) -> ExerciseResult:
    """Run ``ex``'s checks in order with one runner.  A failing check never stops the others, but
    after a check ran out of time the rest are skipped (failed, with the reason), and so are the
    checks left when the submission's deadline ``end`` (``time.monotonic()``) has passed."""
    checks = []
    skip: str | None = None   # once a function says "not implemented" or runs out of time, the rest say so
    for c in ex.checks:
        if c.hidden and not include_hidden:
            continue
        left = end - time.monotonic()
        if skip is None and left < 1:
            skip = "skipped: the time for grading this submission ran out"
        if skip is not None:
            checks.append(CheckResult(ex.id, c.name, False, 0.0, c.points, skip, 0.0, c.hidden))
            continue
        if progress:
            progress(f"{ex.id} {c.name} ...")
        t0 = time.perf_counter()
        limit = (min(c.timeout, timeout) if timeout else c.timeout) * factor
        ctx = Context(solutions, ex, runner, max(1.0, min(limit, left - START_ALLOWANCE * speed / 2)), speed)
        try:
            c.fn(ctx)
            res = CheckResult(ex.id, c.name, True, c.points, c.points, "", 0.0, c.hidden)
        except MachineBusy as e:
            res = CheckResult(ex.id, c.name, False, 0.0, c.points, str(e), 0.0, c.hidden, busy=True)
        except CheckTimedOut as e:
            res = CheckResult(ex.id, c.name, False, 0.0, c.points, str(e), 0.0, c.hidden)
            skip = "skipped: an earlier check of this exercise ran out of time (see above)"
        except CheckFailed as e:
            res = CheckResult(ex.id, c.name, False, 0.0, c.points, str(e), 0.0, c.hidden)
        except Exception as e:  # a bug in a check must not stop the run; say so plainly
            res = CheckResult(ex.id, c.name, False, 0.0, c.points,
                              f"the grader failed on this check ({type(e).__name__}: {e}); "
                              "please report it.\n" + traceback.format_exc(limit=3), 0.0, c.hidden)
        res.seconds = time.perf_counter() - t0
        checks.append(res)
        if res.message.startswith("not implemented yet"):
            skip = "not implemented yet (see above)"
    _dedupe_diagnoses(checks)
    # error-path checks earn their points only next to a correct value: raising everywhere earns nothing
    # (and so does a trivial case, e.g. one rank returning a copy); feedback-only checks unlock nothing
    value_passed = any(r.passed for r, c in zip(checks, _run_checks(ex, include_hidden))
                       if not c.requires_value and c.points > 0)
    for r, c in zip(checks, _run_checks(ex, include_hidden)):
        if c.requires_value and r.passed and not value_passed:
            r.passed, r.score, r.held = False, 0.0, True
            r.message = ("this check passes, but its points count only once the same functions also "
                         "compute a correct result in another check of this exercise.")
    return ExerciseResult(ex, checks)


DIAGNOSIS = ("Likely mistake:", "Also:", "(")


def _dedupe_diagnoses(checks: list[CheckResult]) -> None:
    """A likely mistake an earlier check of the exercise named in full is not repeated by the later
    ones: they point back to it (one mistake usually fails every check)."""
    first: dict[str, str] = {}
    for c in checks:
        if c.passed or not c.message:
            continue
        lines, pointed = [], False
        for line in c.message.splitlines():
            key = line.strip()
            if key.startswith(DIAGNOSIS) and key in first and first[key] != c.name:
                if not pointed:
                    lines.append(line[:len(line) - len(line.lstrip())]
                                 + f"Likely mistake: the same as in \"{first[key]}\" above.")
                    pointed = True
                continue
            if key.startswith(DIAGNOSIS):
                first.setdefault(key, c.name)
            lines.append(line)
        c.message = "\n".join(lines)


def grade_patiently(solutions: str, ids=None, *, tries: int = 3, **kw) -> list[ExerciseResult]:
    """:func:`grade`, then grade again (up to ``tries`` in all) each exercise a check of which failed only
    because the machine could not start the learner's process in time: what the teacher's builds use
    (``make release``, ``make autograder``), so that a busy machine costs time, never the build."""
    results = grade(solutions, ids, **kw)
    for _ in range(tries - 1):
        again = [r.exercise.id for r in results if any(c.busy for c in r.checks)]
        if not again:
            break
        redone = {r.exercise.id: r for r in grade(solutions, again, **kw)}
        results = [redone.get(r.exercise.id, r) for r in results]
    return results


def _run_checks(ex: Exercise, include_hidden: bool) -> list[Check]:
    return [c for c in ex.checks if include_hidden or not c.hidden]
