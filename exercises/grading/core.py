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
from .frozen import NOTEBOOK_PLUMBING
from .outcomes import CheckFailed, CheckTimedOut, MachineBusy, SetupError, raise_on_error  # noqa: F401  (re-exported)

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
    # Where the messages ARE the exercise: point-to-point only round the world's ring (r → r+1), each
    # send judged by the referee under the call's rules (exercises.grading.referee) ...
    ring: bool = False
    # ... families whose every post the referee logs (3.2: when each bucket's all-reduce left) ...
    counted: tuple[str, ...] = ()
    # ... and given code run on a graded function's arguments just before the learner's function
    # gets them ({function name: "module:harness"}; 3.3: the parameters outside the shard garbled).
    before: dict[str, str] = field(default_factory=dict)

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks)

    def lockdown(self) -> dict:
        """What the runner and every rank apply before the learner's module is imported (plain
        values: the runner receives them pickled)."""
        before = {}
        for name, hook in self.before.items():
            fn = reference_function(self, name)
            before[f"{fn.__module__}:{fn.__qualname__}"] = hook
        return {"exercise": self.id, "comm": self.comm, "limits": dict(self.limits),
                "driver_comm": tuple(self.driver_comm), "shortcuts": tuple(self.shortcuts),
                "mirrors": tuple(self.mirrors), "ring": self.ring, "counted": tuple(self.counted),
                "before": before}

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
             driver_comm: Sequence[str] = (), shortcuts: Sequence[str] = (), mirrors: Sequence[str] = (),
             ring: bool = False, counted: Sequence[str] = (), before: dict[str, str] | None = None) -> Exercise:
    """Register an exercise: its id, title, learner module and the functions it asks for, and
    what the learner must write themselves (see :class:`Exercise`)."""
    if id in EXERCISES:
        return EXERCISES[id]
    EXERCISES[id] = ex = Exercise(id, title, module, list(functions), comm=None if comm is None else tuple(comm),
                                  limits=dict(limits or {}), driver_comm=tuple(driver_comm),
                                  shortcuts=tuple(shortcuts), mirrors=tuple(mirrors), ring=ring,
                                  counted=tuple(counted), before=dict(before or {}))
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

START_ALLOWANCE = 30.0   # seconds a runner may take to start (or to start its ranks) on the course's machine,
                         # on top of a check's limit; × the machine factor on a slower or busier one


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
    # it failed because the machine could not start the learner's process in time (MachineBusy)
    busy: bool = False


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
    """What a multi-rank call brought back: values in rank order, the trace as plain dicts (recorded in
    the ranks: feedback), and what the runner saw itself — every checked message per rank, ``(op,
    peer, elements, allowed)`` as the referee logged it (:mod:`.referee`), and each rank's growth of
    mapped and of resident memory during the call, in bytes (when measured)."""

    values: list[Any]
    trace: list[dict[str, Any]]
    output: str = ""
    comm: list[list[tuple]] = field(default_factory=list)
    memory: list[tuple[int, int] | None] | None = None

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


def stripped(registry: dict[str, Exercise]) -> bool:
    """True in a student release: the graded reference functions are delegations to the learner's
    (``strip.delegate_source``), so ground truth must come from recorded answers."""
    for _, _, fn in graded_functions(registry)[:1]:
        try:
            return "as _yours" in inspect.getsource(fn)
        except (OSError, TypeError):
            return False
    return False


def load_oracle_answers(path: str | None = None) -> bool:
    """Use recorded reference answers instead of live calls (the student release ships them in
    ``exercises/grading/oracle_answers.pt``; :func:`grade` loads that file by itself, never under
    fresh inputs).  The file holds plain data only (the release writes it so) and is read with
    ``weights_only=True``: a file planted there by code the grader ran cannot run code when loaded."""
    path = path or ORACLE_FILE
    if not os.path.exists(path):
        return False
    try:
        ORACLE.answers = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001  (a damaged or planted file: say so, grade with what is left)
        raise SetupError(f"{path} is not a file of recorded reference answers ({type(e).__name__}); rebuild the "
                         "release (make release) or delete it.") from None
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

    def __init__(self, solutions: str, exercise: Exercise, runner, timeout: float, factor: float = 1.0):
        self.solutions = solutions
        self.exercise = exercise
        self.runner = runner
        self.timeout = timeout
        self.factor = factor            # the machine factor: start-up allowances grow with it

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

    @property
    def start_allowance(self) -> float:
        """Seconds a world may take to start, on top of a call's limit: :data:`START_ALLOWANCE` × the
        machine factor."""
        return START_ALLOWANCE * self.factor

    def local(self, harness: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``harness(module, *args)`` once in a process of the runner's; return its value."""
        t = timeout or self.timeout
        reply = self.runner.call(("local", harness, self.module, args, t), t + 5, start=self.start_allowance)
        self._raise_on_error(reply)
        return reply["value"]

    def ranks(self, world_size: int, harness: str, *args: Any, per_rank: Sequence[Any] | None = None,
              timeout: float | None = None, world_timeout: float | None = None,
              rules: Sequence[dict | None] | dict | None = None, fresh: bool = False,
              measure: bool = False, memory_cap: int | None = None) -> RanksResult:
        """Call ``harness(module, mine, *args)`` on every rank of a world of ``world_size``.

        ``per_rank[r]`` is rank r's own inputs (``mine`` on rank r; None without ``per_rank``): the
        runner sends it to rank r alone, so no rank holds another's.  ``rules``: the referee's rules
        for this call's checked messages (one dict for every rank, or one per rank:
        :func:`.referee.rules`); the log of every checked message comes back in ``.comm``.
        ``fresh``: a world of its own, started for this call (``measure``: the runner reads each
        rank's mapped and resident memory before and after, ``.memory``; ``memory_cap``: and caps what
        each rank may map during the call at that many bytes more).  The ranks get
        ``timeout`` (default: the check's time limit) to finish; after it a deadlock is reported
        with what each rank was blocked in.  ``world_timeout`` is an old name for the same thing.
        """
        if per_rank is not None and len(per_rank) != world_size:
            raise ValueError(f"per_rank has {len(per_rank)} entries for {world_size} ranks")
        run_timeout = min(x for x in (timeout, world_timeout, self.timeout) if x)
        budget = run_timeout + max(5, 2 * world_size)   # the ranks get run_timeout, then a deadlock report
        if isinstance(rules, dict):
            rules = [rules] * world_size
        measure = measure or memory_cap is not None
        opts = {"rules": list(rules) if rules is not None else None, "fresh": fresh or measure, "measure": measure,
                "memory_cap": memory_cap}
        reply = self.runner.call(("ranks", world_size, harness, self.module, args,
                                  list(per_rank) if per_rank is not None else None, run_timeout, opts), budget,
                                 start=self.start_allowance + 2 * world_size)
        self._raise_on_error(reply)
        return RanksResult(reply["values"], reply["trace"], reply.get("output", ""),
                           [[tuple(x) for x in log] for log in reply.get("comm") or []], reply.get("memory"))

    def _raise_on_error(self, reply: dict) -> None:
        raise_on_error(reply.get("error"), self.module)

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
    """Import the reference (minus the notebooks' plumbing) now, before learner code runs: what the grader judges
    with is then fixed in memory, whatever a submission does to files on disk."""
    import pkgutil
    ref = importlib.import_module("reference")
    for info in pkgutil.walk_packages(ref.__path__, "reference."):
        if info.name.startswith(NOTEBOOK_PLUMBING):   # no verdict needs them
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

