"""The runner process: relays the grader's requests to ranks that call learner code, and answers with
``torch.save`` bytes.

Started by :class:`exercises.grading.sandbox.Runner` (one per exercise, in its own session so that
the grader can kill it with everything it started).  Requests (pickled by the trusted grader):

    ("local", "pkg.mod:harness", module, args, tmo)                       -> {"value": ...}
    ("ranks", W, "pkg.mod:harness", module, shared, per_rank, tmo, opts)  -> {"values": [...], "trace": [...],
                                                                              "output": str, "comm": [...]}

A harness is a grader-owned function that imports the learner module and calls it: ``harness(module,
*args)`` for "local", ``harness(module, mine, *shared)`` on rank r of a world of ``W`` ranks, where
``mine = per_rank[r]`` is that rank's own inputs — sent to rank r only.  Errors come back as
``{"error": {...}}``.

What runs where.  The runner itself runs no learner code: a "local" call runs in a one-rank world,
like every "ranks" call.  So the runner can hold every rank's inputs, keep the referee
(:mod:`.referee`: the count of each rank's messages) and read what ranks send back without trusting
it — their messages are decoded by :class:`_RankUnpickler`, which builds tensors, numbers, strings
and containers and nothing else.  Before anything else the runner makes itself non-dumpable (no
other process of its user can read its memory through ``/proc``) and caps its address space
(:func:`confine`); the zygote and every rank inherit both.

Speed.  A world started by ``reference.launch.World`` spawns fresh interpreters that each import
torch (about a second of CPU per rank here).  The runner has imported torch already, so its
worlds *fork* their ranks from it (:class:`ForkedWorld`): the same rank program
(``reference.rank_program._rank_main``), the same process group, traces, status reports and errors,
started in a fraction of a second.  Worlds are kept per size, so a second call costs milliseconds;
``opts["fresh"]`` asks for a world of its own (whose memory the runner then measures).  Set
``GRADER_SPAWN=1`` to use spawned worlds instead (no referee there: only the kernels' own rules hold).
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
import threading
import time
import traceback
from multiprocessing import connection as mpc
from typing import Any

from reference import launch as _launch
from reference import rank_program as _rank_program
from reference import zygote as _zygote

from .confine import confine
from .referee import Referee

STARTED = b"S"      # sent once a request's ranks are up (exercises.grading.sandbox.STARTED)


def _resolve(path: str):
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _plain(obj: Any) -> Any:
    """Make a value loadable with weights_only=True (the ranks sent it plain already: see
    ``exercises.grading.harness.plain``)."""
    from exercises.grading.harness import plain
    return plain(obj)


# ----------------------------------------------------------------------------------------------
# Worlds whose ranks are forked from the runner


class _Zygote:
    """A single-threaded child of the runner, forked before any learner code runs or any thread
    starts, that forks ranks on request.  Forking from the runner itself is not safe: the
    runner's TCPStore threads may hold C library locks (e.g. the resolver's) at the moment of a
    fork, and a rank born with such a lock held waits forever.  The zygote reaps its ranks and
    reports each exit status back, so the runner still knows how a rank died."""

    def __init__(self):
        parent, child = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                parent.close()
                self._serve(mpc.Connection(child.detach()))
                code = 0
            finally:
                os._exit(code)
        child.close()
        self.pid = pid
        self.conn = mpc.Connection(parent.detach())
        self.exits: dict[int, int] = {}

    # -- in the zygote -------------------------------------------------------------------------

    @staticmethod
    def _serve(conn) -> None:
        from multiprocessing.reduction import recv_handle
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: go when the runner goes
        except Exception:
            pass
        children: set[int] = set()
        while True:
            _zygote.reap(children, conn)
            if not conn.poll(0.02):
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            _, rank, cfg, with_referee = msg
            fd = recv_handle(conn)
            referee_fd = recv_handle(conn) if with_referee else None
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    keep = sorted(f for f in (fd, referee_fd) if f is not None)
                    for lo, hi in zip([3] + [k + 1 for k in keep], keep + [65536]):
                        os.closerange(lo, hi)  # nothing else of the runner's stays open in the rank
                    if referee_fd is not None:
                        os.environ["GRADER_REFEREE_FD"] = str(referee_fd)
                    _rank_program._rank_main(rank, fd, cfg)
                    code = 0
                finally:
                    os._exit(code)
            os.close(fd)
            if referee_fd is not None:
                os.close(referee_fd)
            children.add(pid)
            conn.send(("pid", pid))
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- in the runner -------------------------------------------------------------------------

    def pump(self, until_pid: bool = False):
        while until_pid or self.conn.poll(0):
            msg = self.conn.recv()
            if msg[0] == "exit":
                self.exits[msg[1]] = msg[2]
            elif msg[0] == "pid" and until_pid:
                return msg[1]
        return None

    def fork_rank(self, rank: int, fd: int, cfg: dict, referee_fd: int | None = None) -> int:
        from multiprocessing.reduction import send_handle
        self.conn.send(("fork", rank, cfg, referee_fd is not None))
        send_handle(self.conn, fd, self.pid)
        if referee_fd is not None:
            send_handle(self.conn, referee_fd, self.pid)
        return self.pump(until_pid=True)


_ZYGOTE: _Zygote | None = None


class _ForkedProc:
    """The little of ``subprocess.Popen`` that ``World`` uses, for a rank forked by the zygote."""

    def __init__(self, pid: int, zygote: _Zygote):
        self.pid, self.zygote, self.returncode = pid, zygote, None

    def poll(self):
        if self.returncode is None:
            try:
                self.zygote.pump()
            except (EOFError, OSError):
                self.returncode = -signal.SIGKILL
            if self.pid in self.zygote.exits:
                self.returncode = self.zygote.exits.pop(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return self.returncode

    def kill(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkedWorld(_launch.World):
    """A :class:`reference.launch.World` whose ranks are forked (by the zygote) from a process
    that has torch loaded already, each with a socket of its own to ``referee``; what they send
    back is decoded by :class:`_RankUnpickler`.  Its ranks report no source files: a check's world
    is never run again after an edit (``watch_sources``)."""

    def __init__(self, *args, referee: Referee | None = None, **kwargs):
        kwargs.setdefault("watch_sources", False)
        super().__init__(*args, **kwargs)
        self.referee = referee

    def _spawn_rank(self, rank: int, fd: int, cfg: dict, env: dict) -> _ForkedProc:
        global _ZYGOTE
        if _ZYGOTE is None:
            _ZYGOTE = _Zygote()
        channel = self.referee.channel(id(self), rank) if self.referee is not None else None
        try:
            return _ForkedProc(_ZYGOTE.fork_rank(rank, fd, dict(cfg, pdeathsig=True), channel), _ZYGOTE)
        finally:
            if channel is not None:
                os.close(channel)

    def _decode(self, rank: int, data: bytes) -> tuple:
        try:
            return _RankUnpickler(io.BytesIO(data)).load()
        except Exception as e:  # noqa: BLE001  (whatever the bytes were, it is this rank's failure)
            return ("error", "UnacceptableValue", f"rank {rank} sent back something the grader does not accept "
                    f"({type(e).__name__}: {str(e)[:200]}); return tensors, numbers, strings, lists, tuples or "
                    "dicts.", "", [])


class _RankUnpickler(pickle.Unpickler):
    """Unpickles what a rank sends back, building nothing but plain values: tensors (their storage
    through ``torch.load(weights_only=True)``), numbers, strings, containers, dtypes, sizes, devices
    and trace events.  Any other class or function a message names is refused, so a rank cannot run
    code in the runner through its reply."""

    @staticmethod
    def _allowed() -> dict[tuple[str, str], Any]:
        import collections

        import torch

        from reference import trace
        out: dict[tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
            ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
            ("reference.trace", "Event"): trace.Event,
            ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "complex"): complex,
            ("builtins", "slice"): slice}
        for name in dir(torch):
            if isinstance(getattr(torch, name, None), torch.dtype):
                out[("torch", name)] = getattr(torch, name)
        return out

    def find_class(self, module: str, name: str):
        found = _RANK_GLOBALS.get((module, name)) if _RANK_GLOBALS else None
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain value")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not plain values")


def _storage_from_bytes(b: bytes):
    import torch
    return torch.load(io.BytesIO(b), weights_only=True)


_RANK_GLOBALS: dict = {}


def start_zygote() -> None:
    """Fork the zygote now (call while this process is still single-threaded and clean)."""
    global _ZYGOTE
    if _ZYGOTE is None:
        _ZYGOTE = _Zygote()


def _world_class():
    return _launch.World if os.environ.get("GRADER_SPAWN") == "1" else ForkedWorld


# ----------------------------------------------------------------------------------------------
# Graded reference functions call the learner's code in here


_LOCAL = threading.local()
# given code run on a graded function's arguments just before the learner's function gets them
# ({"reference.data.zero:zero_step": "exercises.grading.harness.data:garble_outside_shard"}; set from the
# exercise's lockdown, then frozen like every other constant here)
BEFORE: dict[str, str] = {}


def _delegate(ref: str, learner: str, args: tuple, kwargs: dict):
    active = _LOCAL.__dict__.setdefault("active", set())
    if learner in active:
        raise RuntimeError(f"{learner.replace(':', '.')} calls the reference solution {ref.replace(':', '.')}; "
                           "while grading, that reference runs your own function, so this never ends. "
                           "Write the exercise yourself.")
    active.add(learner)
    try:
        if ref in BEFORE:
            _resolve(BEFORE[ref])(args, kwargs)
        value = _resolve(learner)(*args, **kwargs)
    finally:
        active.discard(learner)
    from . import frozen
    if frozen.watch() is not None:   # the given code the learner's call returns to must be the given code
        frozen.check()
    return value


def install_guard(pairs) -> None:
    """Make each graded reference function call the learner's function instead (``__code__`` is
    swapped, so every alias — ``from reference.x import f`` included — sees the change)."""
    for ref, learner in pairs:
        try:
            fn = _resolve(ref)
        except Exception:
            continue
        code = getattr(fn, "__code__", None)
        if code is None or code.co_freevars:
            continue
        src = (f"def {code.co_name}(*args, **kwargs):\n"
               f"    import importlib\n"
               f"    return importlib.import_module('exercises.grading.runner')._delegate({ref!r}, {learner!r}, "
               f"args, kwargs)\n")
        ns: dict = {}
        exec(compile(src, f"<grader: {ref} runs your {learner}>", "exec"), {}, ns)
        fn.__code__ = ns[code.co_name].__code__
        fn.__defaults__, fn.__kwdefaults__ = None, None


# ----------------------------------------------------------------------------------------------
# The request loop


def _peaks(pid: int) -> tuple[int, int] | None:
    """(VmPeak, VmHWM) of ``pid`` in bytes — its high-water marks of mapped and of resident memory —
    read from /proc by the runner (the rank's own code cannot change what the kernel reports)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            found = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                     if k in ("VmSize", "VmHWM")}
        return found["VmSize"], found["VmHWM"]
    except (OSError, KeyError, ValueError):
        return None


def _cap(world, mapped: list, headroom: int) -> None:
    """Cap each rank's address space (``RLIMIT_AS``, set from here, hard: the rank cannot raise it) at
    what it maps now plus ``headroom`` bytes: a call that needs more fails there with an allocation
    error, which the check turns into words."""
    import resource
    for p, peaks in zip(world._procs, mapped):
        if peaks is not None:
            resource.prlimit(p.pid, resource.RLIMIT_AS, (peaks[0] + headroom, peaks[0] + headroom))


def main(fd: int, setup: str = "") -> None:
    import torch
    torch.set_num_threads(1)
    import torch.distributed  # noqa: F401  (loaded before any learner code, and before forking ranks)

    import exercises.grading.harness as harness
    from exercises.grading import frozen
    confine()
    _RANK_GLOBALS.update(_RankUnpickler._allowed())
    options = pickle.loads(bytes.fromhex(setup)) if setup else {}
    install_guard(options.get("guard", ()))
    # What the exercise's learner may not use is switched off, and the given code frozen, before
    # any learner code runs; the zygote (and every rank it forks) inherits both.
    spec = options.get("lockdown") or {}
    if not options.get("guard"):        # the reference itself is graded: its own helpers stay on
        spec = dict(spec, mirrors=())
    BEFORE.update(spec.get("before") or {})
    harness.lock(spec, in_rank=False)
    frozen.load_given()
    frozen.take()
    forked = _world_class() is ForkedWorld
    if forked:
        start_zygote()   # before any learner code or thread: its ranks start clean
    WorldError = _launch.WorldError
    referee = Referee(spec.get("exercise", "?")) if forked else None

    conn = mpc.Connection(fd)
    worlds: dict[int, Any] = {}
    World = _world_class()

    def world_of(w: int, tmo: float, fresh: bool):
        kw = {"referee": referee} if forked else {}
        if fresh:
            return World(w, timeout=tmo, echo=False, **kw)
        world = worlds.get(w)
        if world is None or not world.alive:
            world = worlds[w] = World(w, timeout=tmo, echo=False, **kw)
        return world

    def reply(obj: dict) -> None:
        buf = io.BytesIO()
        torch.save(_plain(obj), buf)
        conn.send_bytes(buf.getvalue())

    while True:
        try:
            req = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        world = None
        try:
            if req[0] in ("local", "ranks"):
                if req[0] == "local":        # one rank, the harness gets the arguments as they are
                    _, target, module, args, tmo = req
                    w, shared, per_rank, opts = 1, (True, *args), None, {}
                else:
                    _, w, target, module, shared, per_rank, tmo, opts = req
                    shared = (False, *shared)
                    per_rank = [(mine,) for mine in per_rank] if per_rank is not None else [(None,)] * w
                world = world_of(w, tmo, bool(opts.get("fresh")))
                world.start()
                conn.send_bytes(STARTED)             # the ranks are up: from here on, the time is the code's
                before = [_peaks(p.pid) for p in world._procs] if opts.get("measure") else None
                if opts.get("memory_cap") and before is not None:   # a fresh world: no learner code ran in it yet
                    _cap(world, before, int(opts["memory_cap"]))
                if referee is not None:
                    referee.begin(id(world), opts.get("rules"))
                try:
                    res = world.run(harness.guarded, module, spec, target, *shared, per_rank=per_rank, timeout=tmo)
                finally:
                    comm = referee.end(id(world), w) if referee is not None else []
                if req[0] == "local":
                    reply({"value": res.values[0], "output": res.output[-4000:]})
                else:
                    out = {"values": res.values, "trace": [e.to_dict() for e in res.trace],
                           "output": res.output[-4000:], "comm": comm}
                    if before is not None:          # growth of each rank's peaks during the call: (mapped, resident)
                        after = [_peaks(p.pid) for p in world._procs]
                        out["memory"] = [None if a is None or b is None else (a[0] - b[0], a[1] - b[1])
                                         for a, b in zip(after, before)]
                    reply(out)
            elif req[0] == "ping":
                reply({"value": "pong"})
            else:
                reply({"error": {"kind": "exception", "type": "ValueError", "message": f"unknown request {req[0]!r}"}})
        except WorldError as e:
            err: dict[str, Any] = {"kind": e.kind, "message": str(e).splitlines()[0]}
            if e.kind == "timeout":
                err["blocked"] = {r: f.blocked_in for r, f in e.failures.items()}
                err["timeout"] = float(req[4] if req[0] == "local" else req[6])
            elif e.kind == "exception":
                r = min(e.failures)
                f = e.failures[r]
                err.update(type=f.exc_type, message=f.message.split(": ", 1)[-1], rank=None if req[0] == "local" else r,
                           traceback=f.traceback)
            else:
                err["message"] = "; ".join(f.message for f in e.failures.values())
            reply({"error": err})
        except BaseException as e:  # noqa: BLE001  (the runner's own failure: say so, keep serving)
            reply({"error": {"kind": "exception", "type": type(e).__name__, "message": str(e),
                             "traceback": traceback.format_exc()}})
        finally:
            if world is not None and world not in worlds.values():
                world._kill()           # a world of its own (fresh): gone with its call
    for world in worlds.values():
        world.close()
    os._exit(0)
