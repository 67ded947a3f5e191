"""The given code, frozen before the learner's module is imported.

A check runs the learner's functions inside given drivers — ``reference.data.workers.train``
wrapping ``DataParallel``, the pipeline executor, the harnesses of ``exercises/grading/harness/``.
A submission could rebind one of them (``workers.train = torch's DDP``), swap a function's code,
or change a class or a module-level table, and earn points for work the library or the
single-process truth did.  So the runner, before any learner code runs, imports the given code
and takes a :class:`Snapshot` of it (every module of ``reference`` and ``exercises.grading``:
each name's object, each function's code and defaults, each class's attributes, each table's
contents); the ranks it forks inherit it.  Around every call of learner code the snapshot is
**restored** (what a submission changed at import, or in an earlier call, is put back) and then
**verified** (what it changed during this call fails the check, naming it).  A submission that
patches the given code therefore changes nothing it is graded on.
"""
from __future__ import annotations

import sys
import types
from typing import Any

PACKAGES = ("reference", "exercises.grading")
_TABLES = (dict, list, set)


def _is_given(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PACKAGES)


class Tampered(RuntimeError):
    """Raised when learner code changed the given code during a call."""


class Snapshot:
    """Every name of every given module loaded now, and what it held."""

    def __init__(self):
        self.names: list[tuple[dict, str, Any, Any]] = []        # (namespace, name, object, table copy)
        self.codes: list[tuple[types.FunctionType, Any, Any, Any]] = []
        self.modules: dict[str, types.ModuleType] = {}
        seen: set[int] = set()
        for modname, mod in list(sys.modules.items()):
            if not isinstance(mod, types.ModuleType) or not _is_given(modname):
                continue
            self.modules[modname] = mod
            self._namespace(vars(mod), modname, seen)

    def _namespace(self, ns: dict, owner: str, seen: set[int]) -> None:
        for name, obj in list(ns.items()):
            if not _frozen_name(name, obj) or (owner == __name__ and name in _OWN_STATE):
                continue
            self.names.append((ns, name, obj, _copy_table(obj) if name.isupper() else None))
            self._function(obj, owner, seen)
            if isinstance(obj, type) and obj.__module__ == owner and id(obj) not in seen:
                seen.add(id(obj))
                for attr, val in list(vars(obj).items()):
                    if isinstance(val, _CODE_LIKE) and (not attr.startswith("__") or attr in _DUNDERS):
                        self.names.append((obj, attr, val, None))
                        self._function(val, owner, seen)

    def _function(self, obj, owner: str, seen: set[int]) -> None:
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    self._function(f, owner, seen)
            return
        if isinstance(obj, types.FunctionType) and id(obj) not in seen and _is_given(obj.__module__ or ""):
            seen.add(id(obj))
            self.codes.append((obj, obj.__code__, obj.__defaults__, obj.__kwdefaults__))

    # -- around a call ---------------------------------------------------------------------------

    def changes(self) -> list[str]:
        """What differs from the snapshot now (short descriptions)."""
        out = []
        for owner, name, obj, table in self.names:
            ns = owner if isinstance(owner, dict) else vars(owner)
            now = ns.get(name, _MISSING)
            if now is not obj:
                out.append(f"{_where(owner, name)} was replaced")
            elif table is not None and not _same_table(obj, table):
                out.append(f"the contents of {_where(owner, name)} were changed")
        for fn, code, defaults, kwdefaults in self.codes:
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                out.append(f"the code of {fn.__module__}.{fn.__qualname__} was swapped")
        for modname, mod in self.modules.items():
            if sys.modules.get(modname) is not mod:
                out.append(f"module {modname} was replaced in sys.modules")
        return out

    def restore(self) -> None:
        """Put back every name, function code, table and module the snapshot holds."""
        for modname, mod in self.modules.items():
            sys.modules[modname] = mod
        for owner, name, obj, table in self.names:
            ns = owner if isinstance(owner, dict) else vars(owner)
            if ns.get(name, _MISSING) is not obj:
                if isinstance(owner, dict):
                    owner[name] = obj
                else:
                    type.__setattr__(owner, name, obj)
            if table is not None and not _same_table(obj, table):
                _refill(obj, table)
        for fn, code, defaults, kwdefaults in self.codes:
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults

    def verify(self) -> None:
        """Raise :class:`Tampered` (after restoring) if learner code changed the given code (the
        verifier of :func:`watch` does the comparing)."""
        check()


_MISSING = object()
_OWN_STATE = ("_SNAPSHOT", "_WATCH")      # this module's own state: the watcher checks _WATCH itself
_CODE_LIKE = (types.FunctionType, type, types.ModuleType, staticmethod, classmethod, property)
_DUNDERS = ("__init__", "__call__", "__enter__", "__exit__", "__post_init__", "__getitem__")


def _frozen_name(name: str, obj) -> bool:
    """What the snapshot holds: every function, class and module a given module names, and its
    constants (UPPER_CASE names, tables included).  Other names are state the given code keeps
    and changes itself (caches, counters, the world it runs in)."""
    if name.startswith("__"):
        return False
    return isinstance(obj, _CODE_LIKE) or name.isupper()
_SNAPSHOT: Snapshot | None = None
_WATCH = None        # the verifier (a generator) made with the snapshot: see watch()


def take() -> Snapshot:
    """Freeze the given code loaded now (once per process; forked ranks inherit it), and make the
    verifier that compares it with the snapshot (:func:`watch`)."""
    global _SNAPSHOT, _WATCH
    if _SNAPSHOT is None:
        _SNAPSHOT = Snapshot()
        _WATCH = _watching(_SNAPSHOT)
        next(_WATCH)
        _WATCH.send(_WATCH)
    return _SNAPSHOT


def current() -> Snapshot | None:
    return _SNAPSHOT


def watch():
    """The verifier: ``watch().send(None)`` lists what differs from the snapshot now (empty: nothing).

    It is a generator made when the snapshot was taken, before any learner code ran.  Its code is
    fixed (a running generator's frame keeps its own code) and everything it uses — the snapshot's
    entries, ``dict.get``, ``is`` — was taken into that frame then, so rebinding ``Snapshot.verify``,
    ``Snapshot.changes`` or a builtin while learner code runs changes nothing it checks.  It also
    checks that it is still the one this module hands out, that no trace or profile function was
    set, and (once :func:`check_threads` set the baseline) that no thread was left running.
    """
    return _WATCH


def check(watcher=None) -> None:
    """Raise :class:`Tampered` if the given code differs from the snapshot now (restoring it first)."""
    raise_found((watcher or _WATCH).send(None))


def raise_found(found: list[str]) -> None:
    """Raise :class:`Tampered` naming what the verifier ``found`` changed (restoring it first)."""
    if found:
        _SNAPSHOT.restore()
        shown = "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
        raise Tampered(f"your code changed the course's given code while it ran ({shown}). The grader runs "
                       "its own copy of the given code and does not accept a result computed with a changed "
                       "one: leave reference/ and the grader as they are, start no threads or trace "
                       "functions, and write the exercise in your own functions.")


def enlist(wrapper, box: list) -> None:
    """Tell the verifier about a harness's wrapper of a learner function (``box`` holds the verifier the
    wrapper calls): from now on it checks that the wrapper still runs its own code and still calls it."""
    if _WATCH is not None:
        _WATCH.send(("enlist", wrapper, box))


def check_threads() -> None:
    """From now on (the first call in a process counts; later ones change nothing) the verifier
    also counts this process's Python threads: more than now means learner code left one running."""
    _WATCH.send(True)


def _watching(snapshot: Snapshot):
    """The generator behind :func:`watch` (see there).  Threads are counted as the interpreter knows
    them (those that run Python code): a process group's own threads, gloo's, are not among them."""
    me = yield None
    holder = sys.modules[__name__].__dict__
    entries = tuple((owner if isinstance(owner, dict) else vars(owner), _where(owner, name), name, obj, table)
                    for owner, name, obj, table in snapshot.names)
    codes = tuple((fn, f"{fn.__module__}.{fn.__qualname__}", code, defaults, kwdefaults)
                  for fn, code, defaults, kwdefaults in snapshot.codes)
    modules = tuple(snapshot.modules.items())
    table_types = (dict, list, set)
    sys_modules, gettrace, getprofile, frames = sys.modules, sys.gettrace, sys.getprofile, sys._current_frames
    threads = None
    missing = object()
    wrappers: list = []                 # (wrapper, its code, its box): harness wrappers of learner functions
    found: list[str] = []
    while True:
        command = yield found
        found = []
        if command is True:
            if threads is None:
                threads = len(frames())
            continue
        if type(command) is tuple and len(command) == 3 and command[0] == "enlist":
            wrappers.append((command[1], command[1].__code__, command[2]))
            continue
        for wrapper, code, box in wrappers:
            if wrapper.__code__ is not code or len(box) != 1 or box[0] is not me:
                found.append("a wrapper the grader put round your function was changed")
        if holder.get("_WATCH", missing) is not me:
            found.append("the grader's verifier was replaced")
        for ns, where, name, obj, table in entries:
            now = ns.get(name, missing)
            if now is not obj:
                found.append(f"{where} was replaced")
            elif table is not None and type(obj) in table_types:
                same = len(obj) == len(table)
                if same and type(obj) is dict:
                    for k in table:
                        if obj.get(k, missing) is not table[k]:
                            same = False
                            break
                elif same and type(obj) is list:
                    for a, b in zip(obj, table):
                        if a is not b:
                            same = False
                            break
                elif same:
                    same = obj == table
                if not same:
                    found.append(f"the contents of {where} were changed")
        for fn, where, code, defaults, kwdefaults in codes:
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                found.append(f"the code of {where} was swapped")
        for modname, mod in modules:
            if sys_modules.get(modname) is not mod:
                found.append(f"module {modname} was replaced in sys.modules")
        if gettrace() is not None or getprofile() is not None:
            found.append("a trace or profile function was set (sys.settrace / sys.setprofile)")
        if threads is not None and len(frames()) > threads:
            found.append("a thread your code started is still running after it returned")


# never a check's driver: what only the notebooks use (drawing, recordings), and the composed run's checkpoints
# (torch.distributed.checkpoint itself the zygote has imported already: reference.zygote.PRELOAD)
NOTEBOOK_PLUMBING = ("reference.widgets", "reference.notebook", "reference.compose.checkpoint")


def load_given() -> None:
    """Import every given module a check's driver may use (the reference minus its notebook
    plumbing, and the grader's harnesses), so that the snapshot covers them."""
    import importlib
    import pkgutil
    for base in ("reference", "exercises.grading.harness"):
        pkg = importlib.import_module(base)
        for info in pkgutil.walk_packages(pkg.__path__, base + "."):
            if info.name.startswith(NOTEBOOK_PLUMBING):
                continue
            try:
                importlib.import_module(info.name)
            except Exception:   # a module under construction must not stop grading
                pass


def _where(owner, name: str) -> str:
    if isinstance(owner, dict):
        return f"{owner.get('__name__', '?')}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _copy_table(obj):
    if type(obj) in _TABLES:
        return obj.copy()
    return None


def _same_table(obj, table) -> bool:
    if isinstance(obj, dict):
        return obj.keys() == table.keys() and all(obj[k] is table[k] for k in obj)
    if isinstance(obj, list):
        return len(obj) == len(table) and all(a is b for a, b in zip(obj, table))
    return obj == table


def _refill(obj, table) -> None:
    obj.clear()
    if isinstance(obj, dict):
        obj.update(table)
    elif isinstance(obj, list):
        obj.extend(table)
    else:
        obj.update(table)
