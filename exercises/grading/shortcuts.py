"""What an exercise's runner switches off: production libraries that would stand in for the work,
and given functions that would compute the answer.

Each exercise names what the learner must write (``exercise(..., shortcuts=..., mirrors=...)`` in
``exercises/grading/checks/``); its runner, and every rank the runner starts, apply that before
the learner's module is imported:

* **shortcuts** — PyTorch's own version of what the exercise teaches (:data:`CATALOGUE`):
  DTensor and ``loss_parallel`` for 4.1–4.3, ``torch.distributed.pipelining`` for 4.4–4.5, DDP's
  reducer and communication hooks for 3.2, ``ZeroRedundancyOptimizer`` for 3.3, FSDP for 3.4.
  What torch never imports itself is made unimportable (pipelining, ZeroRedundancyOptimizer,
  DDP's comm hooks).  FSDP and DTensor torch does import (an optimizer step loads ``torch._dynamo``,
  which loads both), so their entry points are switched off instead: the code of each is swapped
  for a ``RuntimeError`` naming the exercise.  Where the library rests on a C++ class, that class
  loses its methods — which Python cannot put back (DDP's ``Reducer``).  What these libraries
  *communicate* through is switched off at the dispatcher by
  the exercise's ``comm`` (:mod:`.allowed_comm`), which Python cannot undo either: DTensor's
  functional collectives, ZeroRedundancyOptimizer's broadcasts.
* **mirrors** — given functions of the course that compute a graded answer by another road
  (``reference.planner.counts.bubble_fraction`` for 4.6, ``RankGrid``'s groups for 5c.1, …).  In
  the exercise's runner their code is swapped the same way.

A swapped entry point is a guard, not a wall: a submission that reloads torch's modules from their
files gets them back.  What stops it there is that the grade is made of values such a shortcut
cannot produce under the exercise's communication rules and fresh inputs, and of the checks on
*how* (``docs/teachers.md`` lists every attack tried and what stops it).
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

_TP = "torch.distributed.tensor.parallel"


@dataclass(frozen=True)
class Shortcut:
    """One production library that would stand in for an exercise's work."""

    what: str
    # modules made unimportable (torch never imports them itself; what it did import is dropped)
    unimportable: tuple[str, ...] = ()
    # entry points whose code is swapped for a RuntimeError (for modules torch imports itself)
    entry_points: tuple[str, ...] = ()
    # (C++ class or module, methods removed): what Python cannot put back
    cxx: tuple[tuple[str, tuple[str, ...]], ...] = ()


CATALOGUE: dict[str, Shortcut] = {
    "dtensor": Shortcut(
        "DTensor (distribute_tensor, parallelize_module, ColwiseParallel, loss_parallel)",
        entry_points=("torch.distributed.tensor._api:DTensor.from_local",
                      "torch.distributed.tensor._api:DTensor.to_local",
                      "torch.distributed.tensor._api:DTensor.redistribute",
                      "torch.distributed.tensor._api:distribute_tensor",
                      "torch.distributed.tensor._api:distribute_module",
                      f"{_TP}.api:parallelize_module", f"{_TP}.loss:loss_parallel",
                      f"{_TP}.style:ColwiseParallel.__init__", f"{_TP}.style:RowwiseParallel.__init__",
                      f"{_TP}.style:SequenceParallel.__init__")),
    "pipelining": Shortcut("torch.distributed.pipelining (its schedules and stages)",
                           unimportable=("torch.distributed.pipelining",)),
    "ddp": Shortcut(
        "DistributedDataParallel's reducer and communication hooks",
        unimportable=("torch.distributed.algorithms.ddp_comm_hooks",),
        entry_points=("torch.nn.parallel.distributed:DistributedDataParallel.__init__",),
        cxx=(("torch._C._distributed_c10d", ("_compute_bucket_assignment_by_size", "_register_comm_hook",
                                             "_register_builtin_comm_hook")),
             ("torch._C._distributed_c10d.Reducer", ("__init__", "prepare_for_backward", "_run_comm_hook",
                                                     "_run_allreduce_hook", "_autograd_hook")))),
    "zero_redundancy_optimizer": Shortcut("torch.distributed.optim.ZeroRedundancyOptimizer",
                                          unimportable=("torch.distributed.optim",)),
    "fsdp": Shortcut("FSDP (fully_shard, FullyShardedDataParallel)",
                     entry_points=("torch.distributed.fsdp._fully_shard._fully_shard:fully_shard",
                                   "torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel.__init__")),
}

_applied: set[str] = set()

# The grader's own judging code: which inputs a check draws, its ground truth, the hidden checks.
# Submitted code has no business there; where it runs, these are not importable.
GRADER_ONLY = ("exercises.grading.checks", "exercises.grading.hidden", "exercises.grading.core",
               "exercises.grading.session", "exercises.grading.release")


def hide_grader() -> None:
    """Make the grader's checks unimportable in this process (the runner, its ranks).  Under
    ``GRADER_RUN_AS`` their files are not even there (``sandbox.runtime_dir``); locally the seeds
    of the autograder's fresh inputs are what keeps reading them worthless.  Idempotent."""
    if not any(isinstance(f, _Unimportable) and set(GRADER_ONLY) <= set(f.why) for f in sys.meta_path):
        _block({m: "{name} is the grader's own code (its checks and their answers); it is not importable where "
                   "your code runs." for m in GRADER_ONLY})


def switch_off(names: Sequence[str], exercise: str) -> None:
    """Make the production shortcuts ``names`` (keys of :data:`CATALOGUE`) unavailable in this
    process.  Idempotent."""
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        raise ValueError(f"unknown shortcut(s) {unknown}; known: {sorted(CATALOGUE)}")
    blocked: dict[str, str] = {}
    for name in names:
        if name in _applied:
            continue
        cut = CATALOGUE[name]
        _swap(cut.entry_points, exercise, f"{cut.what} would stand in for what exercise {exercise} asks you to "
                                          "write yourself")
        for owner, methods in cut.cxx:
            obj = _resolve_dotted(owner)
            for m in methods if obj is not None else ():
                if m in vars(obj):
                    try:
                        delattr(obj, m)
                    except (AttributeError, TypeError):
                        pass
        blocked.update({m: f"{{name}} is switched off while exercise {exercise} is graded: {cut.what} would stand "
                           f"in for what the exercise asks you to write yourself." for m in cut.unimportable})
        _applied.add(name)
    if blocked:
        _block(blocked)


class _Unimportable:
    """A ``sys.meta_path`` finder that refuses some modules (and their submodules), saying why."""

    def __init__(self, why: dict[str, str]):
        self.why = why           # module -> message ("{name}": the module asked for)

    def find_spec(self, fullname, path=None, target=None):
        for mod, why in self.why.items():
            if fullname == mod or fullname.startswith(mod + "."):
                raise ImportError(why.format(name=fullname))
        return None


def _block(why: dict[str, str]) -> None:
    """Drop the modules ``why`` names (and their submodules) and refuse to import them again."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in why):
            parent, _, child = name.rpartition(".")
            del sys.modules[name]
            if parent in sys.modules and child in vars(sys.modules[parent]):
                delattr(sys.modules[parent], child)
    sys.meta_path.insert(0, _Unimportable(why))


def _resolve_dotted(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj
    return None


# ----------------------------------------------------------------------------------------------
# Mirrors: given functions that would compute the answer


def resolve(target: str):
    """``"pkg.mod:Class.method"`` → the function object (None if it does not exist)."""
    mod, _, qual = target.partition(":")
    try:
        obj = importlib.import_module(mod)
    except ImportError:
        return None
    for part in qual.split("."):
        obj = vars(obj).get(part) if isinstance(obj, type) else getattr(obj, part, None)
        if obj is None:
            return None
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    return obj


def expand(target: str) -> list[str]:
    """``"pkg.mod:*"`` → every function and method defined in that module; ``"pkg.mod:Class"`` → the
    class's own methods; anything else as it is.  Graded functions (swapped for a delegation to the
    learner's own while grading: their code comes from ``<grader: …>``) are left out."""
    mod, _, qual = target.partition(":")
    if qual != "*" and not isinstance(resolve(target), type):
        return [target]
    try:
        module = importlib.import_module(mod)
    except ImportError:
        return []
    owners = [module] if qual == "*" else [resolve(target)]
    out = []
    for owner in owners:
        for name, obj in list(vars(owner).items()):
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
            if isinstance(obj, property) and obj.fget is not None:
                obj = obj.fget
            if isinstance(obj, type) and owner is module and obj.__module__ == mod:
                out += [t for t in expand(f"{mod}:{obj.__qualname__}")]
            elif callable(obj) and getattr(obj, "__module__", None) == mod and hasattr(obj, "__code__") \
                    and not obj.__code__.co_filename.startswith("<grader:"):
                out.append(f"{mod}:{obj.__qualname__}")
    return out


def switch_off_mirrors(targets: Sequence[str], exercise: str) -> None:
    """Swap the code of each given function in ``targets`` (see :func:`expand`) for one that raises,
    saying that it computes exercise ``exercise``'s answer."""
    _swap([t for target in targets for t in expand(target)], exercise,
          f"it computes what exercise {exercise} asks you to compute, or part of it")


def _swap(targets: Sequence[str], exercise: str, why: str) -> None:
    """Swap the code of each function in ``targets`` for a ``RuntimeError`` saying ``why``.  Every
    alias sees the change (the code object is swapped, not the name); a target that does not
    exist (another torch version) is skipped."""
    for target in targets:
        fn = resolve(target)
        if isinstance(fn, property):
            fn = fn.fget
        code = getattr(fn, "__code__", None)
        if code is None or code.co_name == "_switched_off":
            continue
        shown = target.replace(":", ".")
        message = f"{shown} is switched off while exercise {exercise} is graded: {why}."
        # the new code keeps the old one's free variables (a method's __class__, a decorator's
        # func): a function's code can only be swapped for one with as many
        free = code.co_freevars
        src = ("def _outer():\n" + "".join(f"    {v} = None\n" for v in free)
               + "    def _switched_off(*args, **kwargs):\n"
               + (f"        {', '.join(free)}\n" if free else "")
               + f"        raise RuntimeError({message!r})\n    return _switched_off\n")
        ns: dict = {}
        exec(compile(src, f"<grader: {shown} is switched off in exercise {exercise}>", "exec"), {}, ns)
        fn.__code__ = ns["_outer"]().__code__
        fn.__defaults__, fn.__kwdefaults__ = None, None
