"""The grader: exercises, their checks, and how learner code is run without being trusted.

Who runs what::

    grader process (trusted)                    runner process (one per exercise, untrusted)
    ───────────────────────                     ────────────────────────────────────────────
    makes the inputs (fixed seeds)
    ctx.local(...) / ctx.ranks(W, ...)  ──────▶ imports the learner's module, calls it
                                                (ranks: reference.launch.World, kept per W)
    torch.load(weights_only=True)       ◀────── torch.save(outputs, traces, errors)
    computes the ground truth itself
    compares, names the likely mistake
    writes the score

The learner's code only ever runs in the runner and its ranks.  What comes back is loaded with
``weights_only=True`` (tensors, numbers, strings, lists, dicts — never code), the verdict is
computed here from values this process checks itself, and the score is written here.  A runner
that hangs, crashes or exits is killed with its whole process group; only the check that was
running fails (with a message), and the next check gets a fresh runner.

Checks are written as plain functions of a :class:`Context`; see ``exercises/grading/checks/``.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection as mpc
from typing import Any, Callable, Sequence

import torch

from . import feedback as fb

# ----------------------------------------------------------------------------------------------
# Registry


@dataclass
class Check:
    name: str
    fn: Callable[["Context"], None]
    points: float = 1.0
    timeout: float = 60.0
    hidden: bool = False


@dataclass
class Exercise:
    id: str                     # "0.1"
    title: str
    module: str                 # learner module inside the solutions package: "collectives"
    functions: Sequence[str]    # the names the exercise asks for
    checks: list[Check] = field(default_factory=list)

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks)

    def check(self, name: str, points: float = 1.0, timeout: float = 60.0, hidden: bool = False):
        """Decorator: register a check of this exercise."""
        def deco(fn: Callable[["Context"], None]) -> Callable[["Context"], None]:
            self.checks.append(Check(name, fn, points, timeout, hidden))
            return fn
        return deco


EXERCISES: dict[str, Exercise] = {}
CHECK_MODULES = ["exercises.grading.checks.collectives", "exercises.grading.checks.sequence",
                 "exercises.grading.checks.moe"]
HIDDEN_MODULES = ["exercises.grading.hidden"]   # teachers' checks; left out of the student release


def exercise(id: str, title: str, module: str, functions: Sequence[str]) -> Exercise:
    if id in EXERCISES:
        return EXERCISES[id]
    EXERCISES[id] = ex = Exercise(id, title, module, list(functions))
    return ex


def load_checks(extra: Sequence[str] = ()) -> dict[str, Exercise]:
    """Import every check module (hidden ones if present) and return the registry, sorted by id."""
    for name in list(CHECK_MODULES) + list(HIDDEN_MODULES) + list(extra):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # optional module absent (e.g. hidden checks in a student release)
            raise
    return dict(sorted(EXERCISES.items(), key=lambda kv: [int(p) if p.isdigit() else p for p in kv[0].split(".")]))


# ----------------------------------------------------------------------------------------------
# Outcomes


class CheckFailed(Exception):
    """Raised inside a check to fail it with a message for the learner."""


@dataclass
class CheckResult:
    exercise: str
    name: str
    passed: bool
    score: float
    max_score: float
    message: str = ""
    seconds: float = 0.0
    hidden: bool = False


@dataclass
class ExerciseResult:
    exercise: Exercise
    checks: list[CheckResult]

    @property
    def score(self) -> float:
        return sum(c.score for c in self.checks)

    @property
    def max_score(self) -> float:
        return sum(c.max_score for c in self.checks)


# ----------------------------------------------------------------------------------------------
# The runner: an untrusted process that calls learner code on request


@dataclass
class RanksResult:
    """What a multi-rank call brought back: values in rank order and the trace as plain dicts."""

    values: list[Any]
    trace: list[dict[str, Any]]
    output: str = ""

    def events(self, op: str | None = None, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.trace if (op is None or e["op"] == op) and (rank is None or e["rank"] == rank)]


class Runner:
    """A child process that imports learner code.  Killed (with its ranks) on a hang or a crash."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.conn = None

    def start(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from exercises.grading.runner import main; main({child.fileno()})"],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        child.close()
        self.conn = mpc.Connection(parent.detach())

    def call(self, request: tuple, timeout: float) -> dict:
        """Send a request; return the runner's reply (a dict), or raise CheckFailed."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        try:
            self.conn.send_bytes(pickle.dumps(request))
            if not self.conn.poll(timeout):
                self.kill()
                raise CheckFailed(f"your code did not finish within {timeout:g} s (an infinite loop, or a "
                                  "wait that never ends?); it was stopped.")
            data = self.conn.recv_bytes()
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.wait() if self.proc else None
            self.kill()
            if code is not None and code < 0:
                how = f"was killed by {signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else code}"
                raise CheckFailed(f"the process running your code {how} (a crash, e.g. a segfault).")
            raise CheckFailed(f"the process running your code exited (exit code {code}) before answering: "
                              "sys.exit / os._exit in your code?")
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckFailed(f"your code returned something the grader does not accept ({type(e).__name__}); "
                              "return tensors, numbers, lists, tuples or dicts.")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        elif self.proc is not None:
            try:  # the runner is gone; make sure its ranks are too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
        self.proc, self.conn = None, None


# ----------------------------------------------------------------------------------------------
# What a check sees


class Context:
    """Handed to every check.  Runs learner code through the runner; compares; fails with words."""

    def __init__(self, solutions: str, exercise: Exercise, runner: Runner, timeout: float):
        self.solutions = solutions
        self.exercise = exercise
        self.runner = runner
        self.timeout = timeout

    @property
    def module(self) -> str:
        """Dotted name of the learner module the exercise lives in, e.g. ``exercises.collectives``."""
        return f"{self.solutions}.{self.exercise.module}"

    # -- running learner code -----------------------------------------------------------------

    def local(self, harness: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``harness(module, *args)`` once in the runner process; return its value."""
        reply = self.runner.call(("local", harness, self.module, args), timeout or self.timeout)
        self._raise_on_error(reply)
        return reply["value"]

    def ranks(self, world_size: int, harness: str, *args: Any, timeout: float | None = None,
              world_timeout: float = 20.0) -> RanksResult:
        """Call ``harness(module, *args)`` on every rank of a world of ``world_size``."""
        budget = (timeout or self.timeout) + world_timeout + 10 * world_size
        reply = self.runner.call(("ranks", world_size, harness, self.module, args, world_timeout), budget)
        self._raise_on_error(reply)
        return RanksResult(reply["values"], reply["trace"], reply.get("output", ""))

    def _raise_on_error(self, reply: dict) -> None:
        err = reply.get("error")
        if not err:
            return
        kind = err.get("kind")
        if err.get("type") == "NotImplementedError":
            raise CheckFailed(f"not implemented yet: {err.get('message') or 'NotImplementedError'}")
        if kind == "timeout":
            blocked = err.get("blocked", {})
            lines = [f"deadlock: after {err.get('timeout', 0):g} s ranks {', '.join(map(str, sorted(blocked)))} "
                     "were still waiting."]
            lines += [f"    rank {r}: {'blocked in ' + b if b else 'running (no communication in progress)'}"
                      for r, b in sorted(blocked.items())]
            sends = [b for b in blocked.values() if b.startswith("send")]
            if blocked and len(sends) == len(blocked) and len(blocked) > 1:
                lines.append("    Likely mistake: a blocking ring — every rank sends first and waits for a "
                             "receiver that is itself sending. Post sends and receives together "
                             "(comm.exchange / batch_isend_irecv).")
            elif blocked and all(not b for b in blocked.values()):
                lines.append("    Likely mistake: a loop that never ends (no rank is communicating).")
            raise CheckFailed("\n".join(lines))
        if kind == "died":
            raise CheckFailed(f"a rank of your world died: {err.get('message')}")
        where = f" on rank {err['rank']}" if err.get("rank") is not None else ""
        tb = err.get("traceback", "")
        tail = "\n".join(tb.strip().splitlines()[-6:]) if tb else ""
        raise CheckFailed(f"your code raised {err.get('type')}{where}: {err.get('message')}"
                          + (f"\n    {tail.replace(chr(10), chr(10) + '    ')}" if tail else ""))

    # -- judging ---------------------------------------------------------------------------------

    def compare(self, got: Any, expected: torch.Tensor, what: str, **kw: Any) -> None:
        """Fail the check with feedback unless ``got`` matches ``expected`` (see feedback.compare)."""
        msg = fb.compare(got, expected, what, **kw)
        if msg is not None:
            raise CheckFailed(msg)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise CheckFailed(message)


# ----------------------------------------------------------------------------------------------
# Grading


def grade(solutions: str = "exercises", ids: Sequence[str] | None = None, *, include_hidden: bool = True,
          progress: Callable[[str], None] | None = None, timeout: float = 60.0) -> list[ExerciseResult]:
    """Grade ``solutions`` (a package laid out like ``exercises``) on the chosen exercises."""
    registry = load_checks()
    # Everything the verdicts need is imported now, before any learner code runs.
    importlib.import_module("reference")
    chosen = list(registry) if not ids else list(ids)
    unknown = [i for i in chosen if i not in registry]
    if unknown:
        raise ValueError(f"unknown exercise id(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    results = []
    for ex_id in chosen:
        ex = registry[ex_id]
        runner = Runner()
        checks = []
        missing: str | None = None   # once a function says "not implemented", later checks say so briefly
        try:
            for c in ex.checks:
                if c.hidden and not include_hidden:
                    continue
                if missing is not None:
                    checks.append(CheckResult(ex.id, c.name, False, 0.0, c.points, "not implemented yet (see above)",
                                              0.0, c.hidden))
                    continue
                if progress:
                    progress(f"{ex.id} {c.name} ...")
                t0 = time.perf_counter()
                ctx = Context(solutions, ex, runner, min(c.timeout, timeout) if timeout else c.timeout)
                try:
                    c.fn(ctx)
                    res = CheckResult(ex.id, c.name, True, c.points, c.points, "", 0.0, c.hidden)
                except CheckFailed as e:
                    res = CheckResult(ex.id, c.name, False, 0.0, c.points, str(e), 0.0, c.hidden)
                except Exception as e:  # a bug in a check must not stop the run; say so plainly
                    res = CheckResult(ex.id, c.name, False, 0.0, c.points,
                                      f"the grader failed on this check ({type(e).__name__}: {e}); "
                                      "please report it.\n" + traceback.format_exc(limit=3), 0.0, c.hidden)
                res.seconds = time.perf_counter() - t0
                checks.append(res)
                if res.message.startswith("not implemented yet"):
                    missing = res.message
        finally:
            runner.kill()
        results.append(ExerciseResult(ex, checks))
    return results
