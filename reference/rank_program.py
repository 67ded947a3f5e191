"""What runs inside one rank process of a :class:`reference.launch.World`.

:func:`_rank_main` joins the process group, then serves the parent: it receives a pickled function
and its arguments, runs it (recording a trace if asked), and sends back the value or the error.
Around it: the pipe to the parent (:class:`_Link`), the forwarding of everything the rank prints,
C-level output included (:class:`_OutputForwarder`), and the one-line status a timeout report
quotes — set by ``reference.comm`` and by thin wrappers around ``torch.distributed``'s blocking
calls (:func:`_install_status_wrappers`).  The parent side (starting ranks, collecting results,
turning failures into :class:`reference.launch.WorldError`) is ``reference/launch.py``.
"""
from __future__ import annotations

import ctypes
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection as mpc

from . import sources as _sources
from . import trace as _trace

START_TIMEOUT = 120.0       # seconds ranks may take to import torch and rendezvous

STATUS_BYTES = 240          # the status line a rank shares with its parent
STATUS_PERIOD = 0.1         # seconds between two sends of a changed status line


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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc's mallopt parameters (malloc.h)


def set_malloc_thresholds(mmap: int, trim: int) -> bool:
    """glibc's ``mallopt``: blocks from ``mmap`` bytes up get pages of their own (given back when freed),
    and free heap above ``trim`` bytes is given back.  True if glibc took both (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mmap))) and bool(libc.mallopt(M_TRIM_THRESHOLD, int(trim)))
    except (OSError, AttributeError):
        return False


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for the next step; True if it did (False off glibc).

    A training step allocates and frees the same large buffers every step: an all-to-all's message
    and its output, activations, gradients.  By default glibc gives blocks above a moving threshold
    back to the kernel and trims the top of its heap, so the next step faults fresh pages in again:
    2,500-11,000 minor page faults per step on each rank of expert parallelism's benchmark (d = 256, 10 MB
    messages), none with this.  Here blocks up to 32 MiB (the largest threshold glibc accepts) come
    from the heap, and up to 1 GiB of free heap stays mapped.  PyTorch's CPU performance guide gets
    the same from jemalloc or tcmalloc.  Every rank calls it at start, and so does the process that
    starts a world (:meth:`reference.launch.World.start`), so that a peer timed there runs alike.
    ``COURSE_KEEP_FREED_MEMORY=0`` in the environment leaves glibc's defaults.
    """
    if os.environ.get("COURSE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    return set_malloc_thresholds(32 << 20, 1 << 30)


def return_freed_memory(threshold: int = 64 << 10) -> bool:
    """The opposite of :func:`keep_freed_memory`: blocks from ``threshold`` bytes up get pages of their own
    and go back to the kernel when freed, and the heap is trimmed above ``threshold``, so what a process
    maps tracks what it holds.  The grader's memory checks call it in each rank before the learner's code:
    a cap on the address space then caps live tensors, not what the allocator happened to keep."""
    return set_malloc_thresholds(threshold, threshold)


def malloc_settings_from_environment() -> None:
    """What glibc reads from the environment when a process starts (``MALLOC_MMAP_THRESHOLD_``, and the
    trim threshold beside it), set through ``mallopt`` now: a rank forked from the zygote
    (:mod:`reference.zygote`) inherits the zygote's allocator, not its own start.  A fixed mmap threshold
    also fixes glibc's trim threshold, at 128 KiB unless ``MALLOC_TRIM_THRESHOLD_`` says otherwise."""
    mmap = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if mmap is not None:
        set_malloc_thresholds(int(mmap), int(os.environ.get("MALLOC_TRIM_THRESHOLD_", 128 << 10)))


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
    """What this rank is blocked in right now.  Setting it only stores the line: every collective
    and compute block sets it twice, and a message per change (a pickle, a write, and the parent
    woken to read it — on 2 cores, a context switch away from a rank) cost a composed step ~30 of
    them.  A daemon thread sends the line to the parent when it changed, every ``STATUS_PERIOD``
    seconds: a timeout report, seconds later, quotes what the rank has been blocked in since."""

    def __init__(self, link: _Link):
        self.link, self.value, self._sent = link, "", ""
        threading.Thread(target=self._publish, name="status", daemon=True).start()

    def set(self, text: str) -> None:
        self.value = text[:STATUS_BYTES]

    def _publish(self) -> None:
        while True:
            time.sleep(STATUS_PERIOD)
            text = self.value
            if text != self._sent:
                try:
                    self.link.send(("status", text))
                    self._sent = text
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
                 "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "all_to_all",
                 "all_to_all_single", "broadcast", "barrier", "gather", "scatter", "reduce"):
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


def _check_callable(fn: Callable) -> None:
    """ValueError, before any rank starts, for a function a rank could not import by name (see below)."""
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


def _report_sources(link: _Link, seen: set[str]) -> None:
    """Tell the parent which source files this task imported (:mod:`reference.sources`): a kept-alive
    world whose ranks imported a file that changed since starts afresh, so that it runs the edit."""
    found = _sources.imported_since(seen)
    if found:
        link.send(("sources", found))


def _rank_main(rank: int, fd: int, cfg: dict) -> None:
    """Entry point of one rank process (started by :meth:`World.start`)."""
    _die_with_parent(cfg["pdeathsig"])
    keep_freed_memory()
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
    from . import comm as _comm                 # (imports torch: after the rank reported its own start)
    seen: set[str] = set()                      # modules whose source files were reported (_report_sources)
    report = cfg.get("report_sources", True)    # (World's watch_sources)

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
        _comm.release_groups()                  # the last task's groups may serve this one (reference.comm)
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
            if report:
                _report_sources(link, seen)
            fwd.sync()
            with link.lock:
                conn.send_bytes(data)
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: report, keep serving
            events = list(_trace.stop()) if record else []
            if report:
                _report_sources(link, seen)
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
