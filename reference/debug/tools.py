"""Lecture 6, part 1 — what PyTorch's own tools say about the same hangs (measured on torch 2.13, gloo).

    tool                              how it is switched on                 what it gives on gloo
    ────────────────────────────────  ────────────────────────────────────  ──────────────────────────────────
    TORCH_DISTRIBUTED_DEBUG=DETAIL    the environment, before the process   every collective's fingerprint (op,
                                      group starts                          shapes, dtypes) is checked across the
                                                                            ranks first: a mismatch becomes an
                                                                            error on every rank naming both sides
    the process group's timeout      ``new_group(..., timeout=)`` or        gloo's own "Timed out waiting …" error
                                      ``init_process_group(timeout=)``      on each rank still waiting
    the flight recorder               ``TORCH_FR_BUFFER_SIZE=N`` before     the last N collectives of each rank
                                      the process group starts; dump with   (op, sizes, sequence number, state) —
                                      ``torch._C._distributed_c10d.         supported for gloo in 2.13, but nothing
                                      _dump_fr_trace()``                    dumps it on a hang: no watchdog, so the
                                                                            rank dumps it itself (a thread here);
                                                                            ``torchfrtrace`` cannot read the dumps
    py-spy dump --pid P               a separate program (``pip install     each rank's Python stack, live: the
                                      py-spy``), needs ptrace permission     line of the program it is stuck on

Each function runs one case of :mod:`.hangs` on fresh ranks and returns plain data for the notebook.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from .hangs import _environment, default_faulty, hang_program, hang_report

__all__ = ["detail_report", "timeout_report", "flight_recorder", "read_flight_recorder", "py_spy", "spy_on",
           "py_spy_path", "program_frame", "start_world", "DETAIL", "flight_recorder_env"]


def start_world(world_size: int, *, timeout: float, env: dict | None = None):
    """A started world whose ranks run with ``env`` in their environment (read when they start; os.environ
    is the process's: start worlds with different environments one after the other, not in threads)."""
    from ..launch import World
    world = World(world_size, timeout=timeout, echo=False)
    with _environment(**(env or {})):
        world.start()
    return world


def _run(case: str, world_size: int, faulty, *, timeout: float, env: dict | None = None, world=None,
         **program) -> dict:
    from ..launch import WorldError
    faulty = tuple(default_faulty(case, world_size) if faulty is None else faulty)
    world = world if world is not None else start_world(world_size, timeout=timeout, env=env)
    try:
        t0 = time.perf_counter()
        try:
            values = world.run(hang_program, case, faulty, **program).values
            return {"finished": True, "values": values, "seconds": time.perf_counter() - t0}
        except WorldError as e:
            return {**hang_report(e, world_size), "finished": False, "seconds": time.perf_counter() - t0,
                    "case": case, "faulty": list(faulty)}
    finally:
        world.close()


DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def flight_recorder_env(entries: int = 64) -> dict:
    return {"TORCH_FR_BUFFER_SIZE": str(entries)}


def detail_report(case: str, world_size: int, faulty=None, *, timeout: float = 3.0, world=None) -> dict:
    """The report of ``case`` with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in every rank: collectives are
    checked against each other before they run (a mismatch becomes an error naming each side).
    ``world``: one started with :data:`DETAIL` (:func:`start_world`)."""
    return _run(case, world_size, faulty, timeout=timeout, env=DETAIL, world=world)


def timeout_report(case: str, world_size: int, faulty=None, *, group_timeout: float = 1.0,
                   timeout: float = 6.0, world=None) -> dict:
    """The report of ``case`` run in a process group with a ``group_timeout``-second timeout: gloo
    itself ends the wait with an error on each waiting rank (the launcher's ``timeout`` is longer)."""
    return _run(case, world_size, faulty, timeout=timeout, group_timeout=group_timeout, world=world)


def read_flight_recorder(directory: str, world_size: int) -> dict:
    """Each rank's entries in the dumps ``rank<r>.pkl`` of ``directory`` (None: no dump, the rank had finished
    or died first): ``{"seq": collective sequence number, "op": "gloo:all_reduce", "state", "sizes", "group"}``."""
    ranks = {}
    for r in range(world_size):
        path = os.path.join(directory, f"rank{r}.pkl")
        if not os.path.exists(path):
            ranks[r] = None
            continue
        with open(path, "rb") as f:
            dump = pickle.load(f)
        ranks[r] = [{"seq": e.get("collective_seq_id"), "p2p_seq": e.get("p2p_seq_id"), "op": e.get("profiling_name"),
                     "state": e.get("state"), "sizes": e.get("input_sizes"),
                     "group": (e.get("process_group") or [""])[0]} for e in dump.get("entries", [])]
    return ranks


def flight_recorder(case: str, world_size: int, faulty=None, *, entries: int = 64, dump_after: float = 0.3,
                    timeout: float = 4.0, world=None) -> dict:
    """Each rank's flight-recorder entries while ``case`` hangs: ``{"report": …, "ranks": {r: [entry, …]}}``
    (:func:`read_flight_recorder`).  The dump leaves out the entries' stack traces: symbolising them, while
    a collective is in flight, took from 2.7 s to longer than the run.  PyTorch's analyser ``torchfrtrace``
    (2.13) does not read these gloo dumps: it stops on ``KeyError: ('0', 0)`` looking up the default group."""
    with tempfile.TemporaryDirectory(prefix="flight-recorder-") as d:
        report = _run(case, world_size, faulty, timeout=timeout, env=flight_recorder_env(entries), world=world,
                      flight_recorder_dir=d, dump_after=dump_after)
        return {"report": report, "ranks": read_flight_recorder(d, world_size)}


def py_spy_path() -> str | None:
    """The ``py-spy`` program beside this Python (a virtualenv's bin/) or on the PATH, or None."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


def program_frame(dump: str, program: str = "hangs.py") -> str:
    """The innermost frame of ``dump`` (py-spy's text) in ``program``: ``"_skip (hangs.py:97)"``."""
    frames = re.findall(r"^\s+(\S+) \(([^)]*?):(\d+)\)", dump, flags=re.M)
    for name, path, line in frames:                 # py-spy prints the innermost frame first
        if path.endswith(program):
            return f"{name} ({os.path.basename(path)}:{line})"
    return ""


def _main_thread(dump: str) -> str:
    """The main thread's stack in py-spy's text (the rank program's helper threads left out)."""
    block = re.search(r'^Thread \S+ \([^)]*\): "MainThread"\n((?:\s+.*\n?)*)', dump, flags=re.M)
    return block.group(1).rstrip() if block else dump.strip()


def spy_on(pid_dir: str, world_size: int, *, wait: float = 0.5, limit: float = 4.0) -> dict:
    """``py-spy dump`` of every rank whose pid file (``rank<r>.pid``, :func:`.hangs.hang_program`'s
    ``pid_dir``) appears within ``limit`` seconds, ``wait`` seconds after the last appeared: {"dumps": {r: the
    main thread's stack}, "frames": {r: the program's line it is stuck on}, "innermost": {r: …}}, or
    {"error": why} without py-spy."""
    exe = py_spy_path()
    if exe is None:
        return {"error": "py-spy is not installed here (pip install py-spy)"}
    out: dict = {"dumps": {}, "frames": {}, "innermost": {}}
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and len(os.listdir(pid_dir)) < world_size:
        time.sleep(0.05)
    time.sleep(wait)                                   # let every rank reach where it hangs
    for r in range(world_size):
        try:
            pid = int(open(os.path.join(pid_dir, f"rank{r}.pid")).read())
        except (OSError, ValueError):
            continue
        proc = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        text = proc.stdout if proc.returncode == 0 else (proc.stderr or proc.stdout)
        out["dumps"][r] = _main_thread(text)
        out["frames"][r] = program_frame(text)
        first = re.search(r"^\s+(\S+) \(([^)]*?):(\d+)\)", text, flags=re.M)
        out["innermost"][r] = f"{first.group(1)} ({os.path.basename(first.group(2))}:{first.group(3)})" if first else ""
    return out


def py_spy(case: str, world_size: int, faulty=None, *, wait: float = 0.5, timeout: float = 4.0, world=None) -> dict:
    """``py-spy dump`` of every rank while ``case`` hangs (:func:`spy_on`), then the course's report:
    {"dumps", "frames", "innermost", "report"}; ``{"error": why}`` without py-spy."""
    if py_spy_path() is None:
        return {"error": "py-spy is not installed here (pip install py-spy)"}
    from ..launch import WorldError
    faulty = tuple(default_faulty(case, world_size) if faulty is None else faulty)
    world = world if world is not None else start_world(world_size, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="py-spy-") as d:
        result: dict = {}

        def run() -> None:
            try:
                result["values"] = world.run(hang_program, case, faulty, pid_dir=d).values
            except WorldError as e:
                result["report"] = hang_report(e, world_size)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            out = spy_on(d, world_size, wait=wait, limit=timeout)
        finally:
            thread.join()
            world.close()
    out["report"] = result.get("report")
    return out
