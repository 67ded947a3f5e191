"""Run a function on N local ranks and get every rank's result back — or a clear error.

    >>> from reference.launch import run_world
    >>> res = run_world(my_module.fn, 4, x, timeout=30)
    >>> res.values        # what fn returned on rank 0, 1, 2, 3
    >>> res.trace         # every event the ranks recorded (reference.trace)

Each rank is a real process with a real ``torch.distributed`` process group (gloo on CPU, nccl
when asked for CUDA).  Keep a world alive across notebook cells with :class:`World`::

    with World(4) as world:          # starting ranks costs seconds ...
        world.run(fn_a, x)           # ... running in them costs milliseconds
        world.run(fn_b, y)

Failures never hang and never leave processes behind.  They raise :class:`WorldError`, which names
the ranks and says what happened:

    exception    a rank raised: its type, message and traceback (the others are stopped at once)
    died         a rank was killed or crashed: how (signal or exit code)
    timeout      ranks still running after ``timeout``: what each was blocked in, where known
                 ("recv from rank 3 (step 2)")

``world_size < 1`` or a function the ranks cannot import raise ``ValueError`` before anything
starts.  Worker functions must live in an importable module (a ``.py`` file), not a notebook cell:
each rank is a separate Python process that imports the function by name.

Design notes.  Ranks are forked from a zygote that imported torch once (:mod:`reference.zygote`;
the first world of a process waits for that import, later ones start in a fraction of a second),
else started as fresh interpreters.  A kept-alive world whose ranks imported a file that changed
since starts afresh before its next run (:mod:`reference.sources`).  The parent owns the rendezvous
``TCPStore`` on an OS-chosen free port, so two worlds never collide and the port is released
when the world closes.  Parent and rank talk over one pipe per rank (pickled bytes); each rank's
file descriptors 1 and 2 are redirected into that pipe, so even C-level output is forwarded and
printed by the parent as ``[rank r] ...``.  A small shared buffer per rank holds what the rank is
blocked in (set by ``reference.comm`` and by thin wrappers around ``torch.distributed``'s blocking
calls), which is what a timeout report quotes.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection as mpc
from typing import Any

from . import sources as _sources
from . import trace as _trace
from . import zygote as _zygote
from .rank_program import START_TIMEOUT, _check_callable, _main_path, keep_freed_memory

__all__ = ["run_world", "World", "WorldError", "WorldResult", "RankFailure"]

DEFAULT_TIMEOUT = 60.0      # seconds a run may take
ERROR_GRACE = 1.0           # after a first error, how long to wait for other ranks' reports
OUTPUT_LIMIT = int(os.environ.get("COURSE_RANK_OUTPUT_KB", "256")) * 1024   # what a rank prints per run, kept


# ----------------------------------------------------------------------------------------------
# Results and errors


@dataclass
class RankFailure:
    rank: int
    kind: str                 # "exception" | "died" | "timeout"
    message: str              # one line
    exc_type: str = ""        # e.g. "ValueError" for kind == "exception"
    traceback: str = ""       # the rank's traceback, for kind == "exception"
    blocked_in: str = ""      # for kind == "timeout": what the rank was blocked in, if known


class WorldError(RuntimeError):
    """A world failed.  ``.kind`` is "exception", "died" or "timeout"; ``.failures`` maps each
    failing rank to a :class:`RankFailure`; ``.ranks`` lists them; ``.output`` is what the ranks
    printed; ``.trace`` the events recorded before the failure (from ranks that finished)."""

    def __init__(self, message: str, kind: str, failures: dict[int, RankFailure],
                 output: str = "", trace: _trace.Trace | None = None):
        super().__init__(message)
        self.kind = kind
        self.failures = failures
        self.output = output
        self.trace = trace if trace is not None else _trace.Trace()

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


@dataclass
class WorldResult:
    values: list[Any]
    trace: _trace.Trace
    output: str = ""
    seconds: float = 0.0
    world_size: int = 0

    def __iter__(self):  # values, trace = run_world(...)
        return iter((self.values, self.trace))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _dumps_args(args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps((args, kwargs))
    except Exception as e:
        raise ValueError(f"the arguments cannot be sent to the ranks: {e}") from e


# ----------------------------------------------------------------------------------------------
# The world


class World:
    """``world_size`` live ranks that run functions on request.

    backend:  "gloo" (default; CPU tensors) or "nccl" (each rank uses cuda:rank)
    timeout:  default seconds for :meth:`run`; the process groups' own timeout is set above it
    threads:  torch threads per rank (1 by default: ranks share the machine's cores)
    echo:     print what ranks print, prefixed ``[rank r]``, as it arrives
    record:   record trace events in the ranks during :meth:`run`
    keep_freed_memory:  ranks keep freed memory for the next step (:func:`reference.rank_program.keep_freed_memory`);
              False leaves glibc's defaults, under which a resident-memory peak measures what a step allocates
    watch_sources:  ranks report the source files they imported, and a run after one of them changed starts
              fresh ranks (below); False for a world that runs once (the report costs each new rank ~15 ms)

    After a failure the ranks are stopped; the next :meth:`run` starts fresh ones.  So it does when a
    file the ranks imported has changed since (the next run imports the edit).
    """

    def __init__(self, world_size: int, *, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 threads: int = 1, echo: bool = True, record: bool = True, keep_freed_memory: bool = True,
                 watch_sources: bool = True):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.world_size = world_size
        self.backend = backend or "gloo"
        self.timeout = float(timeout)
        self.threads = threads
        self.echo = echo
        self.record = record
        self.keep_freed_memory = keep_freed_memory
        self.watch_sources = watch_sources
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._status: list[Any] = []
        self._store = None
        self.port: int | None = None
        self.start_seconds: float | None = None
        self._sources: dict[str, tuple[int, int]] = {}   # files the ranks imported, (mtime_ns, size) then

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a forgotten world must not leave processes behind
        try:
            self.close()
        except Exception:
            pass

    def start(self) -> World:
        """Start the ranks and wait until every one has joined the process group."""
        if self.alive:
            return self
        self.close()
        from datetime import timedelta

        import torch.distributed as dist

        keep_freed_memory()                          # here too: peers timed in this process run alike
        t0 = time.perf_counter()
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=START_TIMEOUT),
                                    wait_for_workers=False)
        self.port = self._store.port
        pg_timeout = max(self.timeout * 2, 120.0)
        cfg = dict(world_size=self.world_size, backend=self.backend, port=self.port,
                   threads=self.threads, pg_timeout=pg_timeout, report_sources=self.watch_sources,
                   pdeathsig=threading.current_thread() is threading.main_thread())
        env = dict(os.environ)
        path = [p or os.getcwd() for p in sys.path]  # ranks import what the caller can import
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        env["OMP_NUM_THREADS"] = str(self.threads)
        env.pop("TORCHELASTIC_RUN_ID", None)
        if not self.keep_freed_memory:               # glibc's defaults, for measuring peak resident memory:
            env["COURSE_KEEP_FREED_MEMORY"] = "0"    # large blocks mapped on their own and unmapped when freed
            env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
        if self.echo and self._forks_ranks(env):
            _zygote.announce(self.world_size)        # the first world of a process waits for torch's import
        for rank in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            p = self._spawn_rank(rank, child_sock.fileno(), cfg, env)
            child_sock.close()
            self._procs.append(p)
            self._conns.append(mpc.Connection(parent_sock.detach()))
            self._status.append("")
        # Wait for "ready" from every rank.
        out: list[str] = []
        self._collect(lambda msg: msg[0] == "ready", START_TIMEOUT, out, phase="starting")
        self.start_seconds = time.perf_counter() - t0
        return self

    def _spawn_rank(self, rank: int, fd: int, cfg: dict, env: dict):
        """Start one rank process running :func:`_rank_main` on socket ``fd``.

        Returns an object with the ``subprocess.Popen`` interface (poll, wait, kill, pid).  A
        subclass may start ranks another way (the grader forks them from a preloaded process).
        By default a rank is forked from the zygote (:mod:`reference.zygote`, torch imported once)
        when :meth:`_forks_ranks` says so, else started as a fresh interpreter.
        """
        if self._forks_ranks(env):
            try:
                return _zygote.fork_rank(rank, fd, cfg, env, START_TIMEOUT)
            except _zygote.ZygoteUnavailable:
                pass                                 # a fresh interpreter, as below: slower, never worse
        return subprocess.Popen(
            [sys.executable, "-c", f"from reference.rank_program import _rank_main; _rank_main({rank}, {fd}, {cfg!r})"],
            pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL, close_fds=True)

    def _restart_if_sources_changed(self) -> None:
        """Ranks import a module once; if a file they imported changed since (the learner fixed their
        exercise, :mod:`reference.sources`), stop them: this run starts fresh ranks, which import the edit."""
        edited = _sources.changed(self._sources)
        if edited and self.alive and self.echo:
            print(f"({_sources.describe(edited)} changed since these ranks imported it: starting them afresh)",
                  flush=True)
        if edited:
            self.close()

    def _forks_ranks(self, env: dict) -> bool:
        """Fast start: fork the ranks from the zygote — gloo on Linux; not with glibc's moving allocator
        defaults asked for alone (a forked rank inherits the zygote's, a fresh one starts clean)."""
        return (_zygote.available() and self.backend == "gloo"
                and (env.get("COURSE_KEEP_FREED_MEMORY", "1") != "0" or "MALLOC_MMAP_THRESHOLD_" in env))

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and release the port."""
        procs, conns = self._procs, self._conns
        self._procs, self._conns, self._status = [], [], []
        self._sources = {}
        for c in conns:
            try:
                c.send_bytes(pickle.dumps(("stop",)))
            except Exception:
                pass
        deadline = time.monotonic() + 2.0
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - the kernel did not reap it
                pass
        for c in conns:
            try:
                c.close()
            except Exception:
                pass
        self._store = None  # the parent's TCPStore server goes with it, freeing the port

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        self.close()

    # -- running ----------------------------------------------------------------------------------

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, per_rank: Sequence[tuple] | None = None,
            **kwargs: Any) -> WorldResult:
        """Call ``fn(*args, **kwargs)`` on every rank; return values in rank order and the trace.

        ``per_rank``: one tuple of arguments per rank; rank r is called ``fn(*args, *per_rank[r],
        **kwargs)`` and is sent ``per_rank[r]`` only — no rank ever holds another rank's slice.
        """
        _check_callable(fn)
        if per_rank is not None and len(per_rank) != self.world_size:
            raise ValueError(f"per_rank must hold one tuple of arguments per rank ({self.world_size}), "
                             f"got {len(per_rank)}")
        payloads = [_dumps_args(tuple(args) + tuple(mine), kwargs) for mine in per_rank] if per_rank is not None \
            else [_dumps_args(args, kwargs)] * self.world_size
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._restart_if_sources_changed()
        self.start()
        t0 = time.perf_counter()
        head = (pickle.dumps(fn), self.record, _main_path(fn))
        for c, payload in zip(self._conns, payloads):
            c.send_bytes(pickle.dumps(("run", head[0], payload, head[1], head[2])))
        out: list[str] = []
        results = self._collect(lambda msg: msg[0] in ("ok",), timeout, out, phase="running")
        values = [results[r][1] for r in range(self.world_size)]
        tr = _trace.Trace(e for r in range(self.world_size) for e in results[r][2]).sorted()
        return WorldResult(values, tr, "".join(out), time.perf_counter() - t0, self.world_size)

    def _decode(self, rank: int, data: bytes) -> tuple:
        """One message from rank ``rank`` (a pickled tuple).  A subclass that does not trust its
        ranks decodes them more strictly (the grader's, :mod:`exercises.grading.runner`)."""
        return pickle.loads(data)

    def _collect(self, done: Callable[[tuple], bool], timeout: float, out: list[str], phase: str) -> dict:
        """Read messages until every rank has sent a message for which ``done`` holds.

        Raises WorldError on an exception, a dead rank or the timeout, after stopping the world.
        """
        n = self.world_size
        finished: dict[int, tuple] = {}
        failures: dict[int, RankFailure] = {}
        events: list = []
        deadline = time.monotonic() + timeout
        first_error_at: float | None = None
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        open_conns = set(range(n))
        printed: dict[int, int] = {}

        def handle(rank: int, msg: tuple) -> None:
            nonlocal first_error_at
            kind = msg[0]
            if kind == "status":
                self._status[rank] = msg[1]
            elif kind == "out":
                text = msg[1]
                kept = printed.get(rank, 0)
                printed[rank] = kept + len(text)
                if kept >= OUTPUT_LIMIT:
                    return                       # past the limit: read and dropped, memory stays bounded
                if kept + len(text) > OUTPUT_LIMIT:
                    text = text[:OUTPUT_LIMIT - kept] + (f"\n... (more output not shown: each rank keeps "
                                                         f"{OUTPUT_LIMIT // 1024} KiB per run)")
                lines = "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())
                out.append(lines)
                if self.echo:
                    sys.stdout.write(lines)
                    sys.stdout.flush()
            elif kind == "sources":
                self._sources.update(msg[1])
            elif kind == "error":
                _, exc_type, message, tb, evs = msg
                events.extend(evs)
                failures[rank] = RankFailure(rank, "exception", f"{exc_type}: {message}", exc_type, tb)
                first_error_at = first_error_at or time.monotonic()
            elif done(msg):
                finished[rank] = msg
                if kind == "ok":
                    events.extend(msg[2])

        def died(rank: int) -> None:
            nonlocal first_error_at
            open_conns.discard(rank)
            if rank in finished or rank in failures:
                return
            p = self._procs[rank]
            try:
                code = p.wait(2.0)
            except subprocess.TimeoutExpired:
                code = None
            if code is None:
                how = "closed its connection"
            elif code < 0:
                how = f"was killed by {_signal_name(-code)}"
            else:
                how = f"exited with code {code} (sys.exit, os._exit or a fatal error)"
            failures[rank] = RankFailure(rank, "died", f"rank {rank} {how} while {phase}")
            first_error_at = first_error_at or time.monotonic()

        while len(finished) + len(failures) < n:
            now = time.monotonic()
            if first_error_at is not None and now - first_error_at > ERROR_GRACE:
                break
            if now > deadline or not open_conns:
                break
            ready = mpc.wait([self._conns[r] for r in open_conns], timeout=min(0.1, max(0.0, deadline - now)))
            for obj in ready:
                r = conn_rank[id(obj)]
                try:
                    data = obj.recv_bytes()
                except (EOFError, OSError):
                    died(r)
                    continue
                handle(r, self._decode(r, data))

        if not failures and len(finished) == n:
            return finished

        output = "".join(out)
        tr = _trace.Trace(events).sorted()
        if not failures:  # timeout
            still = [r for r in range(n) if r not in finished]
            for r in still:
                blocked = self._status[r] if r < len(self._status) else ""
                where = (f"blocked in {blocked}" if blocked else
                         "running (no communication in progress: a loop, or a call the trace does not know)")
                failures[r] = RankFailure(r, "timeout", f"rank {r} {where}", blocked_in=blocked)
            self._kill()
            done_ranks = sorted(finished)
            lines = [f"timeout after {timeout:g} s while {phase}: ranks {_ranks(still)} did not finish "
                     f"(a deadlock, or a rank that never finishes)."]
            lines += [f"  {failures[r].message}" for r in still]
            if done_ranks:
                lines.append(f"  ranks {_ranks(done_ranks)} had finished.")
            if still and all(failures[r].blocked_in.startswith("send") for r in still) and len(still) > 1:
                lines.append("  Every waiting rank is blocked in a blocking send: a ring of send-then-recv "
                             "deadlocks. Post sends and receives together (batch_isend_irecv) or "
                             "order them even/odd.")
            raise WorldError("\n".join(lines), "timeout", failures, output, tr)

        self._kill()
        # The cause first: a dead rank, or a rank that raised on its own; then the ranks that only
        # failed because a peer went away ("Connection closed by peer").
        def consequence(f: RankFailure) -> bool:
            return f.kind == "exception" and any(m in f.message for m in _PEER_GONE)
        causes = [r for r in sorted(failures) if not consequence(failures[r])] or sorted(failures)
        kind = "died" if any(failures[r].kind == "died" for r in causes) else "exception"
        lines = []
        for r in causes:
            f = failures[r]
            lines.append(f"rank {r} raised {f.message}" if f.kind == "exception" else f.message)
        others = [r for r in sorted(failures) if r not in causes]
        if others:
            lines.append(f"(ranks {_ranks(others)} then failed because a peer was gone)")
        head = f"{len(causes)} of {n} ranks failed while {phase}: ranks {_ranks(causes)}."
        tbs = [f"\n--- rank {r} traceback ---\n{failures[r].traceback.rstrip()}"
               for r in causes if failures[r].traceback]
        msg = head + "\n  " + "\n  ".join(lines) + "".join(tbs[:1])
        if len(tbs) > 1:
            msg += "\n(the other ranks' tracebacks are in WorldError.failures)"
        raise WorldError(msg, kind, {r: failures[r] for r in causes}, output, tr)


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def _ranks(rs: list[int]) -> str:
    return ", ".join(str(r) for r in rs)


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
              backend: str | None = None, **kwargs: Any) -> WorldResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; see the module docstring.

    Returns a :class:`WorldResult`: ``.values`` (rank order), ``.trace``, ``.output``.
    Raises :class:`WorldError` naming the ranks on any failure; ``ValueError`` on bad arguments.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    _check_callable(fn)
    _dumps_args(args, kwargs)
    with World(world_size, backend=backend, timeout=timeout, watch_sources=False) as world:
        return world.run(fn, *args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Inside a rank


