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
This module imports nothing else of the grader: where learner code runs is :mod:`.sandbox`, the
grading loop :mod:`.session`, the student release and the autograder bundle :mod:`.release`.
"""
from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import feedback as fb

# ----------------------------------------------------------------------------------------------
# Registry


@dataclass
class Check:
    name: str
    fn: Callable[[Context], None]
    points: float = 1.0
    timeout: float = 60.0
    hidden: bool = False
    # An error-path check ("bad input raises ValueError") that a stub raising everywhere would
    # pass: its points count only if a value check of the same exercise passed too.
    requires_value: bool = False


@dataclass
class Exercise:
    id: str                     # "0.1"
    title: str
    module: str                 # learner module inside the solutions package: "collectives"
    functions: Sequence[str]    # the names the exercise asks for
    checks: list[Check] = field(default_factory=list)
    # What the learner must write, and so what the exercise's runner and ranks switch off:
    # communication the learner's code may use (None: all); e.g. ("p2p",) when the exercise is to
    # build a collective from messages (see exercises.grading.allowed_comm) ...
    comm: tuple[str, ...] | None = None
    # ... at most this many elements per call of a checked family ({"all_reduce": 16}) ...
    limits: dict[str, int] = field(default_factory=dict)
    # ... families only the given code may use (DataParallel broadcasts the first parameters) ...
    driver_comm: tuple[str, ...] = ()
    # ... production libraries that would stand in for the work (exercises.grading.shortcuts) ...
    shortcuts: tuple[str, ...] = ()
    # ... and given functions that compute the answer by another road ("module:qualname").
    mirrors: tuple[str, ...] = ()

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks)

    def lockdown(self) -> dict:
        """What the runner and every rank apply before the learner's module is imported (plain
        values: the runner receives them pickled)."""
        return {"exercise": self.id, "comm": self.comm, "limits": dict(self.limits),
                "driver_comm": tuple(self.driver_comm), "shortcuts": tuple(self.shortcuts),
                "mirrors": tuple(self.mirrors)}

    def check(self, name: str, points: float = 1.0, timeout: float = 60.0, hidden: bool = False,
              requires_value: bool = False):
        """Decorator: register a check of this exercise."""
        def deco(fn: Callable[[Context], None]) -> Callable[[Context], None]:
            self.checks.append(Check(name, fn, points, timeout, hidden, requires_value))
            return fn
        return deco


EXERCISES: dict[str, Exercise] = {}
DEFAULT_TIMEOUT = float(os.environ.get("GRADER_TIMEOUT", "60"))   # seconds per check, at most
DEADLINE = float(os.environ.get("GRADER_DEADLINE", "480"))   # seconds for a whole submission (Gradescope: 10 min)
CHECK_MODULES = ["exercises.grading.checks.collectives", "exercises.grading.checks.data",
                 "exercises.grading.checks.tensor", "exercises.grading.checks.sequence",
                 "exercises.grading.checks.pipeline", "exercises.grading.checks.moe",
                 "exercises.grading.checks.compose", "exercises.grading.checks.debug"]
HIDDEN_MODULES = ["exercises.grading.hidden"]   # teachers' checks; left out of the student release


def exercise(id: str, title: str, module: str, functions: Sequence[str], *,
             comm: Sequence[str] | None = None, limits: dict[str, int] | None = None,
             driver_comm: Sequence[str] = (), shortcuts: Sequence[str] = (), mirrors: Sequence[str] = ()) -> Exercise:
    """Register an exercise: its id, title, learner module and the functions it asks for, and
    what the learner must write themselves (see :class:`Exercise`)."""
    if id in EXERCISES:
        return EXERCISES[id]
    EXERCISES[id] = ex = Exercise(id, title, module, list(functions), comm=None if comm is None else tuple(comm),
                                  limits=dict(limits or {}), driver_comm=tuple(driver_comm),
                                  shortcuts=tuple(shortcuts), mirrors=tuple(mirrors))
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
    return dict(sorted(EXERCISES.items(), key=lambda kv: exercise_order(kv[0])))


def exercise_order(ex_id: str) -> list[tuple[int, Any]]:
    """Sort key for ids like "0.2", "5a.1", "5b.10": numbers as numbers, letters as letters."""
    import re
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.findall(r"\d+|[^\d.]+", ex_id)]


# ----------------------------------------------------------------------------------------------
# Outcomes

START_ALLOWANCE = 30.0   # seconds a runner may take to start its ranks, on top of a check's limit


class CheckFailed(Exception):
    """Raised inside a check to fail it with a message for the learner."""


class CheckTimedOut(CheckFailed):
    """The learner's code ran out of time (its runner was killed): the exercise's remaining checks
    are skipped, so that a submission that hangs everywhere costs one time limit, not one per check."""


class SetupError(RuntimeError):
    """The grader cannot run here at all (e.g. ``GRADER_RUN_AS`` cannot reach the interpreter); the
    message says what to change.  Raised before any check runs."""


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
    # it passed, but its points wait for a value check of the same exercise (Check.requires_value)
    held: bool = False


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


# ----------------------------------------------------------------------------------------------
# Ground truth from the reference, live or recorded


class Oracle:
    """Calls reference functions for checks.  ``record`` keeps every answer keyed by a digest of the
    call; ``answers`` (set in a student release) replaces live calls by those recorded answers."""

    def __init__(self):
        self.record: dict[str, Any] | None = None
        self.answers: dict[str, Any] | None = None

    @staticmethod
    def key(target: str, args: tuple, kwargs: dict) -> str:
        import hashlib
        h = hashlib.sha256(target.encode())

        def feed(x: Any) -> None:
            if isinstance(x, torch.Tensor):
                t = x.detach().cpu().contiguous()
                h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
            elif isinstance(x, (list, tuple)):
                h.update(b"[")
                for y in x:
                    feed(y)
                h.update(b"]")
            elif isinstance(x, dict):
                h.update(b"{")
                for k in sorted(x, key=str):
                    h.update(str(k).encode())
                    feed(x[k])
                h.update(b"}")
            else:
                h.update(repr(x).encode())
        feed(args)
        feed(kwargs)
        return h.hexdigest()

    def call(self, target: str, args: tuple, kwargs: dict) -> Any:
        if self.answers is not None:
            k = self.key(target, args, kwargs)
            if k not in self.answers:
                raise CheckFailed(f"this check's reference answer was not recorded in this copy of the course "
                                  f"({target}); ask your teacher for an updated release.")
            return self.answers[k]
        mod, _, name = target.partition(":")
        value = getattr(importlib.import_module(mod), name)(*args, **kwargs)
        if self.record is not None:
            self.record[self.key(target, args, kwargs)] = value
        return value


ORACLE = Oracle()
ORACLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle_answers.pt")


def load_oracle_answers(path: str | None = None) -> bool:
    """Use recorded reference answers instead of live calls (the student release ships them in
    ``exercises/grading/oracle_answers.pt``; :func:`grade` loads that file by itself)."""
    path = path or ORACLE_FILE
    if not os.path.exists(path):
        return False
    # Written by the teacher's release build (exercises/grading/release.py); may hold the
    # reference's own result types, hence a full load.
    ORACLE.answers = torch.load(path, weights_only=False)
    return True


# ----------------------------------------------------------------------------------------------
# Fresh inputs: seeds salted with a secret only the grading side knows

_SALT: bytes | None = None


def fresh_inputs(secret: bytes | None = None) -> None:
    """From now on :meth:`Context.seed` mixes every seed with ``secret`` (default: 32 random
    bytes).  The autograder calls this before grading; ground truth must then be computed live
    from the full reference (recorded answers cannot cover inputs drawn from a secret)."""
    global _SALT
    _SALT = secret if secret is not None else os.urandom(32)


def salted_seed(n: int) -> int:
    """``n`` itself, or (after :func:`fresh_inputs`) a 31-bit seed derived from the secret and ``n``.

    31 bits, like the published seeds, so that the arithmetic drivers do with a seed (``seed ·
    1_000_003 + step``) stays inside the 64-bit integer ``torch.Generator.manual_seed`` takes."""
    if _SALT is None:
        return int(n)
    import hashlib
    return int.from_bytes(hashlib.sha256(_SALT + str(int(n)).encode()).digest()[:8], "little") >> 33


# ----------------------------------------------------------------------------------------------
# What a check sees


class Context:
    """Handed to every check.  Runs learner code through the runner; compares; fails with words."""

    def __init__(self, solutions: str, exercise: Exercise, runner, timeout: float):
        self.solutions = solutions
        self.exercise = exercise
        self.runner = runner
        self.timeout = timeout

    @property
    def module(self) -> str:
        """Dotted name of the learner module the exercise lives in, e.g. ``exercises.collectives``."""
        return f"{self.solutions}.{self.exercise.module}"

    # -- inputs ----------------------------------------------------------------------------------

    def seed(self, n: int) -> int:
        """The seed to draw a check's inputs from: ``torch.Generator().manual_seed(ctx.seed(7))``.

        Every check draws its random inputs through this.  Graded locally it returns ``n`` itself
        (so the student release's recorded answers match); in the autograder (``--fresh-inputs``)
        it mixes ``n`` with a secret drawn when grading starts, so every submission is graded on
        inputs nobody has seen before and a table of recorded answers earns nothing.
        """
        return salted_seed(n)

    # -- running learner code -----------------------------------------------------------------

    def local(self, harness: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``harness(module, *args)`` once in the runner process; return its value."""
        reply = self.runner.call(("local", harness, self.module, args), timeout or self.timeout)
        self._raise_on_error(reply)
        return reply["value"]

    def ranks(self, world_size: int, harness: str, *args: Any, timeout: float | None = None,
              world_timeout: float | None = None) -> RanksResult:
        """Call ``harness(module, *args)`` on every rank of a world of ``world_size``.

        The ranks get ``timeout`` (default: the check's time limit) to finish; after it a
        deadlock is reported with what each rank was blocked in.  ``world_timeout`` is an old
        name for the same thing.
        """
        run_timeout = min(x for x in (timeout, world_timeout, self.timeout) if x)
        budget = run_timeout + START_ALLOWANCE + 2 * world_size
        # every rank first switches off what the exercise's learner may not use, restores the
        # given code, and afterwards checks that the learner's code left it alone
        args = (self.exercise.lockdown(), harness, *args)
        harness = "exercises.grading.harness:guarded"
        reply = self.runner.call(("ranks", world_size, harness, self.module, args, run_timeout), budget)
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
            if blocked and all(not b for b in blocked.values()):
                raise CheckTimedOut(
                    f"your code did not finish within {err.get('timeout', 0):g} s and no rank was communicating "
                    f"(ranks {', '.join(map(str, sorted(blocked)))} were still running): a loop that never ends?")
            lines = [f"deadlock: after {err.get('timeout', 0):g} s ranks {', '.join(map(str, sorted(blocked)))} "
                     "were still waiting."]
            lines += [f"    rank {r}: {'blocked in ' + b if b else 'running (no communication in progress)'}"
                      for r, b in sorted(blocked.items())]
            sends = [b for b in blocked.values() if b.startswith("send")]
            if blocked and len(sends) == len(blocked) and len(blocked) > 1:
                lines.append("    Likely mistake: a blocking ring — every rank sends first and waits for a "
                             "receiver that is itself sending. Post sends and receives together "
                             "(comm.exchange / batch_isend_irecv).")
            raise CheckTimedOut("\n".join(lines))
        if err.get("type") == "Tampered":
            raise CheckFailed(err.get("message", "your code changed the course's given code."))
        if err.get("type") == "SystemExit":
            where = f" on rank {err['rank']}" if err.get("rank") is not None else ""
            raise CheckFailed(f"your code called sys.exit({err.get('message')}){where}: exiting never passes a "
                              "check; return the result instead.")
        if kind == "died":
            msg = f"a rank of your world died: {err.get('message')}"
            if "SIGABRT" in msg:
                msg += ("\n    Likely mistake: gloo aborts a rank when a message does not fit the buffer posted to "
                        "receive it — a send and its matching recv disagree on the size (which chunk, or which "
                        "way round the ring the data flows).")
            raise CheckFailed(msg)
        where = f" on rank {err['rank']}" if err.get("rank") is not None else ""
        tb = err.get("traceback", "")
        tail = "\n".join(tb.strip().splitlines()[-6:]) if tb else ""
        mine = self._learner_frame(tb)
        if mine and mine not in tail:             # the failure surfaced in library code: show where it began
            tail = f"in your code:\n{mine}\n...\n{tail}"
        raise CheckFailed(f"your code raised {err.get('type')}{where}: {err.get('message')}"
                          + (f"\n    {tail.replace(chr(10), chr(10) + '    ')}" if tail else ""))

    def _learner_frame(self, tb: str) -> str | None:
        """The deepest frame of ``tb`` in the learner's own module (its two lines), or None."""
        import re
        file = self.module.replace(".", "/") + ".py"
        frames = re.findall(r'(  File "[^"]*' + re.escape(file) + r'", line \d+, in [^\n]+\n(?:    [^\n]*)?)', tb)
        return frames[-1].rstrip() if frames else None

    # -- ground truth ----------------------------------------------------------------------------

    def oracle(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """Ground truth from a reference function, ``"reference.moe:top_k_gating"``, run here.

        Use this (never a direct call) whenever the truth comes from a function that is itself an
        exercise: the student release has no solution bodies, so there the value is looked up in
        the answers recorded from the full reference when the release was built.
        """
        return ORACLE.call(target, args, kwargs)

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


def reference_function(ex: Exercise, name: str) -> Callable:
    """The reference implementation of one of ``ex``'s functions (``reference.<module>.<name>``,
    or, for a package, the submodule that defines it)."""
    import pkgutil
    base = f"reference.{ex.module}"
    mod = importlib.import_module(base)
    fn = getattr(mod, name, None)
    if fn is None and hasattr(mod, "__path__"):
        for info in pkgutil.walk_packages(mod.__path__, base + "."):
            sub = importlib.import_module(info.name)
            cand = getattr(sub, name, None)
            if callable(cand) and getattr(cand, "__module__", None) == info.name:
                fn = cand
                break
    if fn is None or not callable(fn):
        raise LookupError(f"exercise {ex.id}: no reference function {name!r} in {base}")
    return inspect.unwrap(fn)


def graded_functions(registry: dict[str, Exercise] | None = None) -> list[tuple[Exercise, str, Callable]]:
    """``(exercise, name, reference function)`` for every function an exercise asks for."""
    out = []
    for ex in (registry or load_checks()).values():
        for name in ex.functions:
            out.append((ex, name, reference_function(ex, name)))
    return out


def _guard_pairs(registry: dict[str, Exercise], solutions: str) -> list[tuple[str, str]]:
    """(reference function, learner function) pairs the runner makes delegate (see :class:`Runner`)."""
    if solutions.split(".")[0] == "reference":
        return []
    pairs = []
    for ex in registry.values():
        for name in ex.functions:
            try:
                fn = reference_function(ex, name)
            except Exception:  # a reference still under construction: nothing to guard
                continue
            pairs.append((f"{fn.__module__}:{fn.__qualname__}", f"{solutions}.{ex.module}:{name}"))
    return pairs


def _preload_reference() -> None:
    """Import the reference (minus widgets) now, before learner code runs: what the grader judges
    with is then fixed in memory, whatever a submission does to files on disk."""
    import pkgutil
    ref = importlib.import_module("reference")
    for info in pkgutil.walk_packages(ref.__path__, "reference."):
        if info.name.startswith(("reference.widgets", "reference.notebook")):
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # a module under construction must not stop grading
            pass


def hidden_check(exercise_id: str, name: str, points: float = 1.0, timeout: float = 60.0):
    """Decorator for teachers' hidden checks (``exercises/grading/hidden.py``): registered on an
    existing exercise, run by the autograder, shown as hidden in results.json, never released."""
    def deco(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        if exercise_id not in EXERCISES:
            raise KeyError(f"hidden check {name!r}: no exercise {exercise_id!r} (known: {', '.join(EXERCISES)})")
        return EXERCISES[exercise_id].check(name, points=points, timeout=timeout, hidden=True)(fn)
    return deco

