"""The runner process: calls learner code for the grader and answers with ``torch.save`` bytes.

Started by :class:`exercises.grading.sandbox.Runner` (one per exercise, in its own session so that
the grader can kill it with everything it started).  Requests (pickled by the trusted grader):

    ("local", "pkg.mod:harness", module, args)            -> {"value": ...}
    ("ranks", W, "pkg.mod:harness", module, args, tmo)    -> {"values": [...], "trace": [...], "output": str}

A harness is a grader-owned function ``harness(module, *args)`` that imports the learner module
and calls it; in "ranks" it runs on every rank of a world of ``W`` ranks, kept per world size,
so a second call costs milliseconds.  Errors come back as ``{"error": {...}}``.

Speed.  A world started by ``reference.launch.World`` spawns fresh interpreters that each import
torch (about a second of CPU per rank here).  The runner has imported torch already, so its
worlds *fork* their ranks from it (:class:`ForkedWorld`): the same rank program
(``reference.rank_program._rank_main``), the same process group, traces, status reports and errors,
started in a fraction of a second.  Set ``GRADER_SPAWN=1`` to use spawned worlds instead.
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


def _resolve(path: str):
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _plain(obj: Any) -> Any:
    """Make a value loadable with weights_only=True (tensors, numbers, strings, lists, dicts)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if not obj.is_cuda else obj.detach().cpu()
    if isinstance(obj, (bool, int, float, str, type(None))):
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(o) for o in obj) if isinstance(obj, list) else tuple(_plain(o) for o in obj)
    if isinstance(obj, dict):
        return {(k if isinstance(k, (str, int)) else str(k)): _plain(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return f"<{type(obj).__name__} not returned>"


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
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if not pid:
                    break
                children.discard(pid)
                conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
            if not conn.poll(0.02):
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            _, rank, cfg = msg
            fd = recv_handle(conn)
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    os.closerange(3, fd)  # nothing else of the runner's stays open in the rank
                    os.closerange(fd + 1, 65536)
                    _rank_program._rank_main(rank, fd, cfg)
                    code = 0
                finally:
                    os._exit(code)
            os.close(fd)
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

    def fork_rank(self, rank: int, fd: int, cfg: dict) -> int:
        from multiprocessing.reduction import send_handle
        self.conn.send(("fork", rank, cfg))
        send_handle(self.conn, fd, self.pid)
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
    that has torch loaded already."""

    def _spawn_rank(self, rank: int, fd: int, cfg: dict, env: dict) -> _ForkedProc:
        global _ZYGOTE
        if _ZYGOTE is None:
            _ZYGOTE = _Zygote()
        return _ForkedProc(_ZYGOTE.fork_rank(rank, fd, dict(cfg, pdeathsig=True)), _ZYGOTE)


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


def _delegate(ref: str, learner: str, args: tuple, kwargs: dict):
    active = _LOCAL.__dict__.setdefault("active", set())
    if learner in active:
        raise RuntimeError(f"{learner.replace(':', '.')} calls the reference solution {ref.replace(':', '.')}; "
                           "while grading, that reference runs your own function, so this never ends. "
                           "Write the exercise yourself.")
    active.add(learner)
    try:
        return _resolve(learner)(*args, **kwargs)
    finally:
        active.discard(learner)


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


def main(fd: int, setup: str = "") -> None:
    import torch
    torch.set_num_threads(1)
    import torch.distributed  # noqa: F401  (loaded before any learner code, and before forking ranks)

    import exercises.grading.harness as harness
    from exercises.grading import frozen
    options = pickle.loads(bytes.fromhex(setup)) if setup else {}
    install_guard(options.get("guard", ()))
    # What the exercise's learner may not use is switched off, and the given code frozen, before
    # any learner code runs; the zygote (and every rank it forks) inherits both.
    spec = options.get("lockdown") or {}
    harness.lock(spec, in_rank=False)
    frozen.load_given()
    snapshot = frozen.take()
    if _world_class() is ForkedWorld:
        start_zygote()   # before any learner code or thread: its ranks start clean
    WorldError = _launch.WorldError

    conn = mpc.Connection(fd)
    worlds: dict[int, Any] = {}
    World = _world_class()

    def reply(obj: dict) -> None:
        buf = io.BytesIO()
        torch.save(_plain(obj), buf)
        conn.send_bytes(buf.getvalue())

    while True:
        try:
            req = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        try:
            if req[0] == "local":
                _, target, module, args = req
                snapshot.restore()
                harness.import_learner(module)       # what it changes at import is undone; while running, refused
                snapshot.restore()
                value = _resolve(target)(module, *args)
                snapshot.verify()
                reply({"value": value})
            elif req[0] == "ranks":
                _, w, target, module, args, tmo = req
                world = worlds.get(w)
                if world is None or not world.alive:
                    world = worlds[w] = World(w, timeout=tmo, echo=False)
                snapshot.restore()
                res = world.run(_resolve(target), module, *args, timeout=tmo)
                reply({"values": res.values, "trace": [e.to_dict() for e in res.trace], "output": res.output[-4000:]})
            elif req[0] == "ping":
                reply({"value": "pong"})
            else:
                reply({"error": {"kind": "exception", "type": "ValueError", "message": f"unknown request {req[0]!r}"}})
        except WorldError as e:
            err: dict[str, Any] = {"kind": e.kind, "message": str(e).splitlines()[0]}
            if e.kind == "timeout":
                err["blocked"] = {r: f.blocked_in for r, f in e.failures.items()}
                err["timeout"] = float(req[5]) if req[0] == "ranks" else 0.0
            elif e.kind == "exception":
                r = min(e.failures)
                f = e.failures[r]
                err.update(type=f.exc_type, message=f.message.split(": ", 1)[-1], rank=r, traceback=f.traceback)
            else:
                err["message"] = "; ".join(f.message for f in e.failures.values())
            reply({"error": err})
        except BaseException as e:  # learner code raised (or called sys.exit) in this process
            reply({"error": {"kind": "exception", "type": type(e).__name__, "message": str(e),
                             "traceback": traceback.format_exc()}})
    for world in worlds.values():
        world.close()
    os._exit(0)
