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
each rank is a fresh Python process that imports the function by name.

Design notes.  Ranks are ``multiprocessing`` spawn children.  The parent owns the rendezvous
``TCPStore`` on an OS-chosen free port, so two worlds never collide and the port is released
when the world closes.  Parent and rank talk over one pipe per rank (pickled bytes); each rank's
file descriptors 1 and 2 are redirected into that pipe, so even C-level output is forwarded and
printed by the parent as ``[rank r] ...``.  A small shared buffer per rank holds what the rank is
blocked in (set by ``reference.comm`` and by thin wrappers around ``torch.distributed``'s blocking
calls), which is what a timeout report quotes.
"""
from __future__ import annotations

import ctypes
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
from dataclasses import dataclass
from multiprocessing import connection as mpc
from typing import Any, Callable

from . import trace as _trace

__all__ = ["run_world", "World", "WorldError", "WorldResult", "RankFailure"]

DEFAULT_TIMEOUT = 60.0      # seconds a run may take
START_TIMEOUT = 120.0       # seconds ranks may take to import torch and rendezvous
ERROR_GRACE = 1.0           # after a first error, how long to wait for other ranks' reports
STATUS_BYTES = 240
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


# ----------------------------------------------------------------------------------------------
# Checks made before anything starts


def _check_callable(fn: Callable) -> None:
    if not callable(fn):
        raise ValueError(f"run_world needs a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)            # "<stdin>" for `python -`
    if module == "__main__" and (main_file is None or not os.path.isfile(main_file)):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in a notebook cell, an interactive session, "
            "`python -c` or a script read from standard input; each rank is a fresh process and can only "
            "import functions from a file. Put it in a .py file (e.g. my_workers.py next to the notebook) "
            "and import it, or save your script as a file and run `python my_script.py`.")
    if "<lambda>" in getattr(fn, "__qualname__", "") or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"{fn.__qualname__!r} is a lambda or a nested function; ranks can only import "
            "module-level functions. Define it at the top level of a module.")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"the ranks cannot receive {fn!r}: it does not pickle ({e})") from e


def _main_path(fn: Callable) -> str | None:
    """The script file a function defined in ``__main__`` lives in (ranks load it, see below)."""
    if getattr(fn, "__module__", None) != "__main__":
        return None
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(path) if path else None


def _load_main(path: str | None) -> None:
    """In a rank: make ``__main__`` the caller's script, as multiprocessing's spawn does.

    The file runs once per rank under the name ``__mp_main__`` (so its ``if __name__ ==
    "__main__":`` block does not run again), and ``sys.modules["__main__"]`` points at it, so that
    pickled references like ``__main__.work`` resolve.  Its folder joins ``sys.path`` for its imports.
    """
    if path is None or getattr(sys.modules.get("__mp_main__"), "__file__", None) == path:
        return
    import runpy
    import types
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


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

    After a failure the ranks are stopped; the next :meth:`run` starts fresh ones.
    """

    def __init__(self, world_size: int, *, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 threads: int = 1, echo: bool = True, record: bool = True):
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
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._status: list[Any] = []
        self._store = None
        self.port: int | None = None
        self.start_seconds: float | None = None

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def __enter__(self) -> "World":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a forgotten world must not leave processes behind
        try:
            self.close()
        except Exception:
            pass

    def start(self) -> "World":
        """Start the ranks and wait until every one has joined the process group."""
        if self.alive:
            return self
        self.close()
        from datetime import timedelta

        import torch.distributed as dist

        t0 = time.perf_counter()
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=START_TIMEOUT),
                                    wait_for_workers=False)
        self.port = self._store.port
        pg_timeout = max(self.timeout * 2, 120.0)
        cfg = dict(world_size=self.world_size, backend=self.backend, port=self.port,
                   threads=self.threads, pg_timeout=pg_timeout,
                   pdeathsig=threading.current_thread() is threading.main_thread())
        env = dict(os.environ)
        path = [p or os.getcwd() for p in sys.path]  # ranks import what the caller can import
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        env["OMP_NUM_THREADS"] = str(self.threads)
        env.pop("TORCHELASTIC_RUN_ID", None)
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
        """
        return subprocess.Popen(
            [sys.executable, "-c", f"from reference.launch import _rank_main; _rank_main({rank}, {fd}, {cfg!r})"],
            pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL, close_fds=True)

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and release the port."""
        procs, conns = self._procs, self._conns
        self._procs, self._conns, self._status = [], [], []
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

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> WorldResult:
        """Call ``fn(*args, **kwargs)`` on every rank; return values in rank order and the trace."""
        _check_callable(fn)
        payload = _dumps_args(args, kwargs)
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.start()
        t0 = time.perf_counter()
        task = pickle.dumps(("run", pickle.dumps(fn), payload, self.record, _main_path(fn)))
        for c in self._conns:
            c.send_bytes(task)
        out: list[str] = []
        results = self._collect(lambda msg: msg[0] in ("ok",), timeout, out, phase="running")
        values = [results[r][1] for r in range(self.world_size)]
        tr = _trace.Trace(e for r in range(self.world_size) for e in results[r][2]).sorted()
        return WorldResult(values, tr, "".join(out), time.perf_counter() - t0, self.world_size)

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
                    msg = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    died(r)
                    continue
                handle(r, msg)

        if not failures and len(finished) == n:
            return finished

        output = "".join(out)
        tr = _trace.Trace(events).sorted()
        if not failures:  # timeout
            still = [r for r in range(n) if r not in finished]
            for r in still:
                blocked = self._status[r] if r < len(self._status) else ""
                where = f"blocked in {blocked}" if blocked else "running (no communication in progress: a loop, or a call the trace does not know)"
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
    with World(world_size, backend=backend, timeout=timeout) as world:
        return world.run(fn, *args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Inside a rank


class _Link:
    """The rank's end of its pipe; several threads send on it."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg)
        with self.lock:
            self.conn.send_bytes(data)


_SYNC = "\x00sync\x00"


class _OutputForwarder:
    """Redirect file descriptors 1 and 2 into a pipe read by a thread that forwards the text."""

    def __init__(self, link: _Link):
        self.link = link
        self.synced = threading.Event()
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", 0), write_through=True, line_buffering=True)
        self.reader = os.fdopen(r, "r", errors="replace")
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.reader:
            if _SYNC in line:
                before = line.replace(_SYNC, "").rstrip("\n")
                if before:
                    self.link.send(("out", before + "\n"))
                self.synced.set()
                continue
            try:
                self.link.send(("out", line))
            except Exception:
                return

    def sync(self, timeout: float = 2.0) -> None:
        """Return once everything printed so far has been forwarded."""
        self.synced.clear()
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, (_SYNC + "\n").encode())
        self.synced.wait(timeout)


def _die_with_parent(use_pdeathsig: bool) -> None:
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


class _Status:
    """What this rank is blocked in right now; every change is sent to the parent at once."""

    def __init__(self, link: _Link):
        self.link, self.value = link, ""

    def set(self, text: str) -> None:
        text = text[:STATUS_BYTES]
        if text != self.value:
            self.value = text
            try:
                self.link.send(("status", text))
            except Exception:
                pass


def _install_status_wrappers(status: _Status) -> None:
    """Wrap torch.distributed's communication calls in this rank so that

    * a blocking call announces itself to the parent (named in a timeout report),
    * a call made outside ``reference.comm`` is still traced (bytes, peer) while recording, so
      learners' code that calls ``torch.distributed`` directly is measured like the reference,
    * ``Work.wait()`` from ``batch_isend_irecv`` is safe to call twice (on gloo a second wait hangs).
    """
    import torch.distributed as dist

    _trace.set_status_sink(status.set)

    def size(t) -> int:
        if isinstance(t, (list, tuple)):
            return sum(size(x) for x in t)
        return t.numel() * t.element_size() if hasattr(t, "element_size") else 0

    def parse(name: str, args: tuple, kwargs: dict) -> tuple[int | None, int]:
        key = {"send": "dst", "recv": "src", "broadcast": "src"}.get(name)
        peer = (kwargs.get(key, args[1] if len(args) > 1 else None)) if key else None
        data = {"all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
                "all_gather_single": 1, "reduce_scatter_single": 1,
                "all_to_all": 1, "all_to_all_single": 1, "scatter": 1, "gather": 0}.get(name, 0)
        tensor = args[data] if len(args) > data else kwargs.get("tensor", kwargs.get("input"))
        return peer, size(tensor)

    op_name = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
               "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
               "all_to_all_single": "all_to_all"}

    def wrap(name: str, f: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if _trace.in_span():  # reference.comm describes and records it, with more detail
                return f(*args, **kwargs)
            peer, nbytes = parse(name, args, kwargs)
            with _trace.span(op_name.get(name, name), peer=peer, nbytes=nbytes, raw=True):
                return f(*args, **kwargs)
        wrapped.__wrapped__ = f
        wrapped.__name__ = name
        wrapped.__doc__ = f.__doc__
        return wrapped

    for name in ("send", "recv", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast", "barrier",
                 "gather", "scatter", "reduce"):
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))

    original_batch = dist.batch_isend_irecv

    class _OnceWork:
        def __init__(self, work, what: str, events: list):
            self._work, self._what, self._events, self._done = work, what, events, False

        def wait(self, *a, **k):
            if self._done:
                return True
            mine = not status.value
            if mine:
                status.set(self._what)
            try:
                r = self._work.wait(*a, **k)
            finally:
                if mine:
                    status.set("")
            self._done = True
            if self._events and _trace.is_recording():
                t_end = time.perf_counter()
                for op, peer, nb, t_post in self._events:
                    _trace.emit(op, peer=peer, nbytes=nb, start=t_post, end=t_end, raw=True)
            return r

        def __getattr__(self, item):
            return getattr(self._work, item)

    def batch_isend_irecv(p2p_op_list):
        t_post = time.perf_counter()
        parts, events = [], []
        for op in p2p_op_list:
            is_send = "send" in getattr(op.op, "__name__", "")
            parts.append(f"{'send to' if is_send else 'recv from'} rank {op.peer}")
            events.append(("send" if is_send else "recv", op.peer, size(op.tensor), t_post))
        what = "waiting on batch_isend_irecv (" + ", ".join(parts) + ")"
        works = original_batch(p2p_op_list)
        record = not _trace.in_span()
        # torch returns one Work for the whole batch on some backends: give the events to the first.
        return [_OnceWork(w, what, events if (record and i == 0) else []) for i, w in enumerate(works)]

    batch_isend_irecv.__doc__ = original_batch.__doc__
    dist.batch_isend_irecv = batch_isend_irecv


def _rank_main(rank: int, fd: int, cfg: dict) -> None:
    """Entry point of one rank process (started by :meth:`World.start`)."""
    _die_with_parent(cfg["pdeathsig"])
    conn = mpc.Connection(fd)
    link = _Link(conn)
    fwd = _OutputForwarder(link)
    status = _Status(link)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        world_size = cfg["world_size"]
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(cfg["port"]), SPLITTING_PG_TIMEOUT=str(cfg["pg_timeout"]))
        if cfg["backend"] == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        store = dist.TCPStore("127.0.0.1", cfg["port"], None, False, timedelta(seconds=START_TIMEOUT))
        dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg["pg_timeout"]))
        _install_status_wrappers(status)
    except BaseException as e:
        fwd.sync()
        link.send(("error", type(e).__name__, str(e), traceback.format_exc(), []))
        return
    fwd.sync()
    link.send(("ready",))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        _, fn, payload, record, main_path = msg
        if record:
            _trace.start(rank)
        try:
            _load_main(main_path)
            fn = pickle.loads(fn)
            args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            events = list(_trace.stop()) if record else []
            try:
                data = pickle.dumps(("ok", value, events))
            except Exception as e:
                raise TypeError(f"rank {rank} returned a value that cannot be sent back to the "
                                f"caller ({type(value).__name__}): {e}") from e
            fwd.sync()
            with link.lock:
                conn.send_bytes(data)
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: report, keep serving
            events = list(_trace.stop()) if record else []
            fwd.sync()
            tb = traceback.format_exc()
            try:
                link.send(("error", type(e).__name__, str(e), tb, events))
            except Exception:
                link.send(("error", type(e).__name__, str(e), tb, []))
        finally:
            status.value = ""
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)
