"""Start ranks in a fraction of a second: fork them from a process that has imported torch once.

A rank started as a fresh interpreter spends about a second of CPU importing torch, more on a busy
machine; a world of N such ranks pays it N times at once, on two cores (lecture 0's worlds of 2, 3
and 4 took 35 s to start).  The *zygote* pays it once per notebook: a plain interpreter, started on
first use, that imports torch, ``torch.distributed`` and what ranks import next (:data:`PRELOAD`), and
then does nothing but fork.  Each rank it forks begins with torch in memory (shared, copy-on-write)
and goes straight to the rank program (:func:`reference.rank_program._rank_main`): the same process
group, pipe, traces and errors as a spawned rank::

    notebook kernel ──(one socket: "fork rank r" + the rank's end of its pipe)──▶ zygote
         ▲                                                                          │ os.fork()
         └──────────────── rank r's own pipe (results, output, status) ◀─────── rank r

Why a separate process and not ``os.fork()`` of the caller: a fork copies one thread only, and a
lock another thread held at that moment (a notebook kernel runs several) stays locked forever in
the child.  The zygote is single-threaded — it checks ``/proc/self/task`` before every fork and
refuses otherwise — and never runs torch code, so no OpenMP or intra-op thread pool exists to be
broken by the fork (``OMP_NUM_THREADS=1`` keeps the BLAS import from starting one).  Each rank then
sets its own thread count, environment, ``sys.path`` and working folder from the world that asked
for it.  Ranks stay in the caller's process group, so an interrupt reaches them as it reaches
spawned ranks; the zygote itself ignores it.

The zygote dies with its caller (end of file on its socket, or a new parent) and takes its ranks
with it.  :class:`reference.launch.World` uses it for gloo worlds on Linux unless
``COURSE_FORK_RANKS=0``.  A forked rank inherits the zygote's allocator: a world that measures
resident memory (``keep_freed_memory=False``) gets glibc's fixed thresholds set in each rank
(:func:`reference.rank_program.malloc_settings_from_environment`); ``COURSE_KEEP_FREED_MEMORY=0``
alone, which asks for glibc's own moving defaults, spawns fresh ranks.
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import connection as mpc
from multiprocessing.reduction import recv_handle, send_handle

__all__ = ["announce", "available", "fork_call", "fork_rank", "ForkedRank", "reap", "ZygoteUnavailable", "zygote_pid",
           "zygote_pids", "warm"]

# What ranks need and costs seconds to import: torch itself; torch._dynamo, which torch.optim imports the first
# time an optimizer is built (1.1 CPU-seconds in every rank that builds one, without it); and the distributed
# checkpoint (with DTensor), which the course's debugging recorder and checkpoints import.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint")


class ZygoteUnavailable(RuntimeError):
    """The zygote could not fork a rank (it died, or refused); the caller spawns the rank instead."""


def available() -> bool:
    """Whether ranks may be forked here: Linux (fork, /proc), and not switched off."""
    return sys.platform.startswith("linux") and os.environ.get("COURSE_FORK_RANKS", "1") != "0"


# ----------------------------------------------------------------------------------------------
# Inside the zygote


def serve(fd: int, private: bool = False) -> None:
    """The zygote's life: import torch, then fork a rank (or a call) for each request until the caller goes.

    ``private``: nobody may read or trace this process, not even its own user (``PR_SET_DUMPABLE`` 0) —
    the zygote of a grader's runners, whose learner code runs as the zygote's user."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # an interrupt is for the ranks, not for us
    if private:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)          # PR_SET_DUMPABLE
    parent = os.getppid()
    conn = mpc.Connection(fd)
    started_with = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _BASE_PATH[:] = [p for p in sys.path if p and p not in started_with]
    for name in PRELOAD:
        __import__(name)
    from . import sources
    sources.imported_since(set())                       # resolves torch's folders once, for every rank to come
    wake_r, wake_w = os.pipe()                          # SIGCHLD writes here: a rank to reap
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([conn.fileno(), wake_r], [], [], 1.0)
            if wake_r in ready:
                os.read(wake_r, 512)
            reap(children, conn)
            if conn.fileno() not in ready:
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "stop":
                break
            if msg[0] == "kill":
                if msg[1] in children:
                    os.kill(msg[1], signal.SIGKILL)
                continue
            rank_fd = recv_handle(conn)
            threads = len(os.listdir("/proc/self/task"))
            if threads != 1:
                os.close(rank_fd)
                conn.send(("refused", f"the zygote runs {threads} threads; forking it is not safe"))
                continue
            pid = os.fork()
            if pid == 0:                                                # never returns
                if msg[0] == "call":
                    _become_call(rank_fd, *msg[1:])
                _become_rank(rank_fd, *msg[1:])
            os.close(rank_fd)
            children.add(pid)
            conn.send(("pid", pid))
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os._exit(0)


def reap(children: set[int], conn) -> None:
    """Collect the ranks that have ended (without waiting) and report each as ``("exit", pid, code)``
    on ``conn``; the grader's runner, which forks its ranks the same way, reaps them with it too."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        children.discard(pid)
        try:
            conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
        except OSError:
            return


def _take_state(fd: int, env: dict, path: list[str], cwd: str) -> None:
    """In a forked child: drop the zygote's state (its signal handlers, every other open file), take the
    caller's environment, import path and working folder."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.closerange(3, fd)                                # nothing of the zygote's stays open in the child
    os.closerange(fd + 1, 65536)
    os.environ.clear()
    os.environ.update(env)
    if "torch.distributed" in sys.modules:              # read at import, in the zygote: read it again
        sys.modules["torch.distributed"].set_debug_level_from_env()   # TORCH_DISTRIBUTED_DEBUG
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:
        pass


def _become_rank(fd: int, rank: int, cfg: dict, env: dict, path: list[str], cwd: str) -> None:
    """In the forked child: drop the zygote's state, take the world's, run the rank program."""
    code = 1
    try:
        _take_state(fd, env, path, cwd)
        from .rank_program import _rank_main, malloc_settings_from_environment
        malloc_settings_from_environment()
        _rank_main(rank, fd, dict(cfg, pdeathsig=True))   # the zygote has one thread: safe to tie to it
        code = 0
    finally:
        os._exit(code)


def _become_call(fd: int, target: str, args: tuple, env: dict, cwd: str) -> None:
    """In the forked child: a fresh interpreter's start, but for torch — run ``target(fd, *args)`` as
    ``python -c "from module import function; function(fd, *args)"`` would, in its own session, and exit
    as that interpreter would (the code of a ``SystemExit``, 1 after an uncaught exception).

    The import path is the one a fresh interpreter builds from ``env``'s ``PYTHONPATH``, and this package
    (imported from the zygote's own path) is forgotten: the child imports the course from its own."""
    code = 1
    try:
        os.setsid()
        _take_state(fd, env, _fresh_path(env), cwd)
        mine = __name__.split(".")[0]
        for name in [m for m in sys.modules if m == mine or m.startswith(mine + ".")]:
            del sys.modules[name]
        import importlib
        module, _, function = target.partition(":")
        try:
            getattr(importlib.import_module(module), function)(fd, *args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        import atexit
        atexit._run_exitfuncs()                         # what the interpreter runs at its exit
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


_BASE_PATH: list[str] = []          # the zygote's own import path without its PYTHONPATH (set on start)


def _fresh_path(env: dict) -> list[str]:
    """``sys.path`` of ``python -c`` started with ``env``: the working folder, PYTHONPATH, the rest."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [""] + extra + [p for p in _BASE_PATH if p not in extra]


# ----------------------------------------------------------------------------------------------
# In the caller


class _Zygote:
    """The caller's end: one zygote process, its socket, and the exit codes it reported."""

    def __init__(self, env: dict | None = None, private: bool = False, **popen):
        """``env``, ``popen`` (``user=``, ``cwd=``, ...): how to start it (default: as this process, with its
        import path); ``private``: see :func:`serve`."""
        ours, theirs = socket.socketpair()
        if env is None:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path)))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from reference.zygote import serve; serve({theirs.fileno()}, {private!r})"],
            pass_fds=(theirs.fileno(),), env=dict(env, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL,
            close_fds=True, **popen)
        theirs.close()
        self.conn = mpc.Connection(ours.detach())
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        self.owner = os.getpid()
        self.warm = False                               # torch imported: a fork answered

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def _read(self, timeout: float):
        """One message, with ``exit`` reports filed away; None when ``timeout`` passed without one."""
        if not self.conn.poll(timeout):
            return None
        msg = self.conn.recv()
        if msg[0] == "exit":
            self.exits[msg[1]] = msg[2]
        return msg

    def pump(self) -> None:
        with self.lock:
            try:
                while self._read(0) is not None:
                    pass
            except (EOFError, OSError):
                pass

    def fork(self, rank: int, fd: int, cfg: dict, env: dict, timeout: float) -> int:
        return self._request(("fork", rank, cfg, env, list(sys.path), os.getcwd()), fd, timeout, f"rank {rank}")

    def _request(self, msg: tuple, fd: int, timeout: float, what: str) -> int:
        """Send a fork request with ``fd`` for the child; the child's pid."""
        with self.lock:
            try:
                self.conn.send(msg)
                send_handle(self.conn, fd, self.proc.pid)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    msg = self._read(min(1.0, max(0.0, deadline - time.monotonic())))
                    if msg is None:
                        if self.proc.poll() is not None:
                            break
                        continue
                    if msg[0] == "pid":
                        self.warm = True
                        return msg[1]
                    if msg[0] == "refused":
                        raise ZygoteUnavailable(msg[1])
            except (EOFError, OSError) as e:
                raise ZygoteUnavailable(f"the zygote is gone ({e})") from None
        raise ZygoteUnavailable(f"the zygote did not fork {what} within {timeout:g} s")

    def kill(self, pid: int) -> None:
        with self.lock:
            try:
                self.conn.send(("kill", pid))
            except OSError:
                pass

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


_current: _Zygote | None = None
_lock = threading.Lock()


def _zygote() -> _Zygote:
    global _current
    with _lock:
        if _current is None or not _current.alive():
            _current = _Zygote()
        return _current


def zygote_pid() -> int | None:
    """The zygote's process id, if this process has one running (tests tell it from a leftover rank)."""
    z = _current
    return z.proc.pid if z is not None and z.alive() else None


def zygote_pids() -> set[int]:
    """Every zygote this process runs: the ranks' and those of :func:`fork_call` (they outlive a task)."""
    return {z.proc.pid for z in [_current, *_callers.values()] if z is not None and z.alive()}


def warm() -> bool:
    """True once this process's zygote has torch imported (its next ranks start in milliseconds)."""
    z = _current
    return bool(z is not None and z.alive() and z.warm)


def announce(world_size: int) -> None:
    """Say, before the first world of this process starts, why it takes seconds and later ones do not."""
    if not warm():
        print(f"starting {world_size} rank{'s' if world_size > 1 else ''}: the first world imports torch once for "
              "every rank to come (seconds); later worlds start in a fraction of a second", flush=True)


@atexit.register
def _stop() -> None:
    for z in [_current, *_callers.values()]:
        if z is not None and z.owner == os.getpid():
            z.stop()


class ForkedRank:
    """The part of ``subprocess.Popen`` a :class:`reference.launch.World` uses, for a forked rank."""

    def __init__(self, pid: int, zygote: _Zygote):
        self.pid, self._zygote, self.returncode = pid, zygote, None

    def poll(self) -> int | None:
        if self.returncode is None:
            z = self._zygote
            z.pump()
            if self.pid in z.exits:
                self.returncode = z.exits.pop(self.pid)
            elif z.proc.poll() is not None:             # the zygote is gone, and its ranks with it
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self._zygote.kill(self.pid)


_callers: dict[int | None, _Zygote] = {}     # user id (None: ours) -> a private zygote for fork_call


def fork_call(target: str, fd: int, args: tuple, *, env: dict, cwd: str, user=None, timeout: float) -> ForkedRank:
    """Start ``target(fd, *args)`` (``"module:function"``) as ``python -c`` with ``env``, in ``cwd``, as ``user``
    (a ``pwd`` entry, or None: this process's user) would, in a session of its own — but forked from a
    private zygote of that user that has torch imported already: milliseconds instead of a second and
    more of CPU.  (The grader starts a runner per exercise this way.)  The zygote, started on first use
    with ``env`` and ``cwd``, holds nothing but torch; nobody may trace or read it (:func:`serve`).
    Raises :class:`ZygoteUnavailable` if it cannot; the caller then starts the process itself."""
    key = None if user is None else user.pw_uid
    with _lock:
        z = _callers.get(key)
        if z is None or not z.alive():
            popen = {} if user is None else dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
            z = _callers[key] = _Zygote(env, private=True, cwd=cwd, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, **popen)
    try:       # a warm zygote answers in milliseconds: one that does not was stopped or is stuck
        pid = z._request(("call", target, tuple(args), env, cwd), fd, min(timeout, 10.0) if z.warm else timeout,
                         target)
    except ZygoteUnavailable:
        with _lock:
            if _callers.get(key) is z:
                del _callers[key]
        z.proc.kill()                                   # the next call starts a new one
        z.proc.wait()
        raise
    return ForkedRank(pid, z)


def fork_rank(rank: int, fd: int, cfg: dict, env: dict, timeout: float) -> ForkedRank:
    """Fork rank ``rank`` of a world from the zygote (started on first use), on socket ``fd``.

    ``env`` becomes the rank's environment.  Raises :class:`ZygoteUnavailable` if it cannot."""
    z = _zygote()
    return ForkedRank(z.fork(rank, fd, cfg, env, timeout), z)
