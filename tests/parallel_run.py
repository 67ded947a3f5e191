"""``make test`` on two workers (pytest-xdist: the Makefile runs ``pytest -n 2``): what keeps the suite right there.

1. **Which tests go together** (:func:`make_scheduler`).  A test file runs on one worker, in its order: a
   notebook's cells share one kernel, a file's module fixtures (worlds, a lab, a browser) are made once.  The
   files that run longest are handed out first, so the two workers finish together; the browser test and the
   website's test run as one unit (the site is built from the notebooks as the browser ran them).
2. **Quiet while the release records its timings** (:class:`QuietLock`).  The release ships recordings whose
   timing story its notebook tells (``reference.notebook.recorded.StoryBroken``); a second worker's load would
   break it.  Every test holds the run's lock shared, the recording holds it alone.
3. **What is computed once per run** (:func:`once`).  The whole course graded, the student release: the first
   worker that needs one computes it under a file lock, the other reads it from the run's shared folder.

Without xdist (``pytest -p no:xdist`` or ``-n 0``) nothing here changes what runs: :func:`once` keeps a value in
memory and the lock is never taken.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
from pathlib import Path
from typing import Any
from collections.abc import Callable

# Files handed out first, in this order (the longest, by a worker's CPU-seconds on a 2-core machine: the browser
# test 400 with the grading and the release it waits for, round 3 64, hostile 109, robustness 88, attacks 58,
# ring backward 65, autograder 40, checkpoint 64); the rest follow by their number of tests.  A stale order only
# costs time, never a result.
LONGEST_FIRST = [
    "tests/notebook/test_browser.py",       # the student release built, then every notebook run in JupyterLab
    "tests/grading/test_round3.py",         # (the other worker starts on files that need neither the release
    "tests/grading/test_hostile.py",        #  nor the course's grades, while the first worker makes them)
    "tests/grading/test_robustness.py",
    "tests/grading/test_attacks.py",        # the reference graded on fresh inputs
    "tests/sequence/test_ring_backward.py",
    "tests/grading/test_autograder.py",
    "tests/compose/test_checkpoint.py",
]
# Units of more than one file: the website's test reads what the browser test ran (conftest's release_runs).
TOGETHER = {"tests/website/test_site.py": "tests/notebook/test_browser.py"}


def worker() -> str | None:
    """This process's xdist worker id ("gw0", ...), or None when the suite runs in one process."""
    return os.environ.get("PYTEST_XDIST_WORKER")


_FOLDER: list[Path] = []


def configure(config) -> None:
    """Called from conftest's ``pytest_configure``: in a worker, the run's shared folder is its basetemp's parent
    (xdist gives each worker ``<the run's basetemp>/popen-gwN``; pytest keeps the last three runs' folders)."""
    if worker() is not None and config.option.basetemp:
        _FOLDER[:] = [Path(config.option.basetemp).parent]


def run_folder() -> Path:
    """The folder every worker of this run shares."""
    return _FOLDER[0]


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A new folder ``name`` for a value :func:`once` computes: in the run's shared folder under xdist, else
    pytest's own temporary folder."""
    if not _FOLDER:
        return tmp_path_factory.mktemp(name)
    import shutil
    path = run_folder() / name
    shutil.rmtree(path, ignore_errors=True)        # what a worker that failed building it left
    path.mkdir()
    return path


# -- 1. the scheduler --------------------------------------------------------------------------------------------

def make_scheduler(config, log):
    """xdist's load scheduling by file (for ``--dist load``, the default with ``-n``, and ``loadfile``)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        """One unit per test file (``TOGETHER`` joins some), the longest first.

        pytest 9 names a test from its parsed id, so xdist's own ``loadgroup`` (which renames the test) no
        longer groups; the unit here comes from the name's file part, which every pytest keeps."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return TOGETHER.get(path, path)

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                config.option.loadscopereorder = False     # our order below, not xdist's by size
                units: dict[str, int] = {}
                for nodeid in next(iter(self.registered_collections.values())):
                    scope = self._split_scope(nodeid)
                    units[scope] = units.get(scope, 0) + 1
                rank = {p: i for i, p in enumerate(LONGEST_FIRST)}
                self._order = sorted(units, key=lambda s: (rank.get(s, len(rank)), -units[s]))
            super().schedule()

        def _assign_work_unit(self, node) -> None:
            order = getattr(self, "_order", None)
            if order:                      # move the next unit in our order to the front of xdist's queue
                while order and order[0] not in self.workqueue:
                    order.pop(0)
                if order:
                    self.workqueue.move_to_end(order.pop(0), last=False)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


# -- 2. the quiet lock -----------------------------------------------------------------------------------------------

class QuietLock:
    """A readers-writer lock over the run's workers (``flock`` on one file): tests hold it shared, a timing
    recording exclusively.  A no-op in a run of one process."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.mode = 0

    def _file(self) -> int:
        if self._fd is None:
            self._fd = os.open(run_folder() / "quiet.lock", os.O_RDWR | os.O_CREAT, 0o600)
        return self._fd

    def _set(self, mode: int) -> None:
        if worker() is None or not _FOLDER or mode == self.mode:
            return
        fcntl.flock(self._file(), mode)
        self.mode = 0 if mode == fcntl.LOCK_UN else mode

    def shared(self) -> None:
        self._set(fcntl.LOCK_SH)

    def release(self) -> None:
        self._set(fcntl.LOCK_UN)

    @contextlib.contextmanager
    def alone(self):
        """Run the block with no other worker inside a test (waits for the other's current test to end)."""
        before = self.mode
        self.release()              # never upgrade in place: two upgrading workers would wait for each other
        self._set(fcntl.LOCK_EX)
        try:
            yield
        finally:
            self.release()
            if before:
                self._set(before)

    @contextlib.contextmanager
    def stepped_out(self):
        """Run the block without holding the lock (waiting for another worker that may need it alone)."""
        before = self.mode
        self.release()
        try:
            yield
        finally:
            if before:
                self._set(before)


QUIET = QuietLock()


# -- 3. computed once per run --------------------------------------------------------------------------------------

_values: dict[str, Any] = {}


class _Pickler(pickle.Pickler):
    """Pickles a graded exercise by its id (its checks are functions, registered again by id on reading)."""

    def reducer_override(self, obj):
        from exercises.grading import core
        if isinstance(obj, core.Exercise):
            return registered_exercise, (obj.id,)
        return NotImplemented


def registered_exercise(ex_id: str):
    from exercises.grading import core
    return core.load_checks()[ex_id]


def once(name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per test run, whichever worker asks first; the others wait for it and read it.
    In a run of one process, once per process."""
    if name in _values:
        return _values[name]
    if worker() is None or not _FOLDER:
        _values[name] = compute()
        return _values[name]
    from filelock import FileLock
    folder = run_folder()
    data = folder / f"{name}.pickle"
    lock = FileLock(str(folder / f"{name}.lock"))
    with QUIET.stepped_out():           # wait without the quiet lock: the computing worker may need it alone
        lock.acquire()
    try:
        if not data.exists():
            value = compute()           # (holding the quiet lock shared, as any test)
            tmp = data.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
            tmp.rename(data)
            _values[name] = value
    finally:
        lock.release()
    if name not in _values:
        with open(data, "rb") as f:
            _values[name] = pickle.load(f)
    return _values[name]
