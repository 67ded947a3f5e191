"""Where learner code runs: the runner process, and what it may see.

:class:`Runner` starts one child process per exercise that imports learner code and answers the
grader's requests (:mod:`exercises.grading.runner`); every reply is read with a deadline and a size
cap (:func:`receive`) and refused if its archive is not plain stored records.  With
``GRADER_RUN_AS`` the runner runs as that user, in its own group, with a minimal environment
(:func:`runner_env`), from a stripped copy of the course (:func:`runtime_dir`); :func:`preflight`
checks first that the user can run it at all.  The grader itself (:mod:`exercises.grading.core`)
never imports learner code.  The grader reads in one direction: :mod:`.core` (the registry and what
a check sees) → :mod:`.strip` and this module → :mod:`.session` (the grading loop) → :mod:`.release`.
"""
from __future__ import annotations

import atexit
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing import connection as mpc
from pathlib import Path

import torch

from reference import zygote as _zygote

from .core import START_ALLOWANCE, CheckFailed, CheckTimedOut, MachineBusy, SetupError

MAX_REPLY_BYTES = int(float(os.environ.get("GRADER_MAX_REPLY_MB", "64")) * 2 ** 20)  # one runner reply, at most
STARTED = b"S"       # what the runner sends once a request's ranks are up (before any learner code runs)


class Runner:
    """A child process that imports learner code.  Killed (with its ranks) on a hang or a crash.

    :meth:`start` returns at once: the runner imports torch in the background, so the grader
    starts the next exercise's runner while the current one is being graded.  ``guard`` lists
    ``(reference target, learner target)`` pairs: in the runner (and its ranks) those graded
    reference functions call the learner's own code, as in the student release — a submission
    cannot pass by calling the reference solution.  ``lockdown`` (``Exercise.lockdown()``) is what
    the exercise switches off before the learner's module is imported (:mod:`.shortcuts`).
    """

    def __init__(self, solutions: str = "exercises", guard: Sequence[tuple[str, str]] = (),
                 lockdown: dict | None = None, factor: float = 1.0):
        self.proc: subprocess.Popen | None = None
        self.conn = None
        self.ready = False
        self.solutions, self.guard, self.lockdown = solutions, list(guard), dict(lockdown or {})
        self.factor = factor          # the machine factor: the start-up allowance grows with it

    def start(self) -> Runner:
        """Start the runner: ``python -c "from exercises.grading.runner import main; main(fd, setup)"`` as
        ``GRADER_RUN_AS`` (or this user), in a session of its own, with :func:`runner_env` — forked from a
        zygote of that user that has imported torch already (:func:`reference.zygote.fork_call`: a second
        and more of CPU saved per exercise), or spawned if it cannot be (``GRADER_FORK_RUNNERS=0``)."""
        parent, child = socket.socketpair()
        setup = pickle.dumps({"guard": self.guard, "lockdown": self.lockdown}).hex()
        user = run_as()
        env, cwd = runner_env(user), runtime_dir() if user else os.getcwd()
        self.proc = None
        if _zygote.available() and os.environ.get("GRADER_FORK_RUNNERS", "1") != "0":
            try:
                self.proc = _zygote.fork_call("exercises.grading.runner:main", child.fileno(), (setup,), env=env,
                                              cwd=cwd, user=user, timeout=START_ALLOWANCE * self.factor)
            except _zygote.ZygoteUnavailable:
                self.proc = None
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from exercises.grading.runner import main; main({child.fileno()}, {setup!r})"],
                pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, cwd=cwd,
                **(dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[]) if user else {}))
        child.close()
        self.conn = mpc.Connection(parent.detach())
        self.ready = False
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the runner has loaded torch (not counted in any check's time limit): up to
        :data:`START_ALLOWANCE` × the machine factor; a runner that did not start in that time is
        started once more.  Twice too slow is the machine's doing, and the message says so."""
        timeout = START_ALLOWANCE * self.factor if timeout is None else timeout
        codes: list[int | None] = []
        pinged = False
        for attempt in range(2):
            try:
                if not pinged:
                    self.conn.send_bytes(pickle.dumps(("ping",)))
                    pinged = True
                receive(self.conn, timeout, 1 << 16)
                self.ready = True
                return
            except (EOFError, OSError, _Late, _TooBig):
                pass
            codes.append(self.proc.poll() if self.proc else None)
            if codes[-1] is not None and attempt == 0:     # it died: start another (a slow one is waited for)
                self.kill()
                self.start()
                pinged = False
        self.kill()
        if any(c not in (None, 0) and c > 0 for c in codes):
            raise CheckFailed(f"the grader could not start a process to run your code (exit codes {codes}): it "
                              "failed while loading the course, before your code ran.")
        raise MachineBusy(f"this machine is too busy right now: the grader could not start the process that runs "
                          f"your code within {timeout:.0f} s, twice (load average "
                          f"{_load():.1f} on {os.cpu_count()} cores). This is the machine, not your code: grade "
                          "again when it is quieter (or set GRADER_SLOWDOWN to allow more time).")

    def call(self, request: tuple, timeout: float, start: float | None = None) -> dict:
        """Send a request; return the runner's reply (a dict), or raise CheckFailed.

        ``start``: the request starts ranks first (a "local" or "ranks" request); the runner says
        :data:`STARTED` once they are up, which must come within ``start`` seconds — else the machine
        was too slow (:class:`MachineBusy`), not the learner's code — and then the reply within
        ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self.start()
        if not self.ready:
            self.wait_ready()
        try:
            self.conn.send_bytes(pickle.dumps(request))
            if start is not None:
                try:
                    first = receive(self.conn, start, MAX_REPLY_BYTES)
                except _Late:
                    self.kill()
                    raise MachineBusy(f"this machine is too busy right now: the processes that run your code did not "
                                      f"start within {start:.0f} s (load average {_load():.1f} on {os.cpu_count()} "
                                      "cores). This is the machine, not your code: grade again when it is quieter "
                                      "(or set GRADER_SLOWDOWN to allow more time).") from None
                data = first if first != STARTED else receive(self.conn, timeout, MAX_REPLY_BYTES)
            else:
                data = receive(self.conn, timeout, MAX_REPLY_BYTES)
        except _Late:
            self.kill()
            raise CheckTimedOut(f"your code did not finish within {timeout:g} s (an infinite loop, or a "
                                "wait that never ends?); it was stopped.") from None
        except _TooBig as e:
            self.kill()
            raise CheckFailed(f"your code sent back {e.size / 2 ** 20:.0f} MiB; the grader accepts at most "
                              f"{MAX_REPLY_BYTES / 2 ** 20:.0f} MiB per answer.") from None
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.wait() if self.proc else None
            self.kill()
            if code is not None and code < 0:
                name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else code
                how = f"was killed by {name}"
                raise CheckFailed(f"the process running your code {how} (a crash, e.g. a segfault).") from None
            raise CheckFailed(f"the process running your code exited (exit code {code}) before answering: "
                              "sys.exit / os._exit in your code?") from None
        refuse_unsafe_archive(data)
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckFailed(f"your code returned something the grader does not accept ({type(e).__name__}); "
                              "return tensors, numbers, lists, tuples or dicts.") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        elif self.proc is not None:
            try:  # the runner is gone; make sure its ranks are too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
        self.proc, self.conn, self.ready = None, None, False


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


class _Late(Exception):
    pass


class _TooBig(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def receive(conn, timeout: float, cap: int) -> bytes:
    """One message from a runner, framed as ``multiprocessing.connection`` frames it, read with a
    deadline for the WHOLE message (a header followed by silence cannot hang the grader) and a
    size cap checked from the header, before anything is allocated."""
    import select
    import struct
    fd, end = conn.fileno(), time.monotonic() + timeout

    def read(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Late()
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    size, = struct.unpack("!i", read(4))
    if size == -1:
        size, = struct.unpack("!Q", read(8))
    if size < 0 or size > cap:
        raise _TooBig(size)
    return read(size)


def refuse_unsafe_archive(data: bytes) -> None:
    """``torch.save`` writes uncompressed (stored) zip records; a compressed or oversized record
    could expand without bound inside ``torch.load``, so it is refused before loading."""
    import zipfile
    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise CheckFailed("your code returned something that is not a torch.save archive.") from None
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise CheckFailed("your code's answer holds a compressed record; the grader only accepts what "
                          "torch.save writes (return tensors, numbers, lists, tuples or dicts).")
    if sum(i.file_size for i in infos) > MAX_REPLY_BYTES:
        raise CheckFailed(f"your code's answer is larger than {MAX_REPLY_BYTES / 2 ** 20:.0f} MiB.")


# ----------------------------------------------------------------------------------------------
# Running as another user (GRADER_RUN_AS): checked before anything is graded


def run_as():
    """The ``pwd`` entry of ``$GRADER_RUN_AS`` (learner code runs as that user), or None."""
    name = os.environ.get("GRADER_RUN_AS") or None
    if name is None:
        return None
    import pwd
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise SetupError(f"GRADER_RUN_AS={name!r}: there is no such user on this machine.") from None


def runner_env(user) -> dict[str, str]:
    """The runner's environment.  As another user: a minimal one (nothing of the grader's own
    variables), with a home and a temporary folder of that user's own, and the stripped course of
    :func:`runtime_dir` first on its path."""
    path = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
    if user is None:
        return dict(os.environ, PYTHONPATH=path)
    path = os.pathsep.join([runtime_dir(), path])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": path, "LANG": "C.UTF-8",
           "HOME": _scratch(user), "TMPDIR": _scratch(user), "PYTHONDONTWRITEBYTECODE": "1"}
    env.update({k: v for k, v in os.environ.items() if k in ("GRADER_SPAWN", "OMP_NUM_THREADS")})
    return env


_SCRATCH: dict[int, str] = {}


def _scratch(user) -> str:
    """A private temporary folder owned by ``user`` (removed by :func:`remove_scratch`)."""
    if user.pw_uid not in _SCRATCH:
        import tempfile
        d = tempfile.mkdtemp(prefix="grader-run-")
        os.chown(d, user.pw_uid, user.pw_gid)
        os.chmod(d, 0o700)
        _SCRATCH[user.pw_uid] = d
    return _SCRATCH[user.pw_uid]


def remove_scratch() -> None:
    import shutil
    for d in list(_SCRATCH.values()) + list(_RUNTIME.values()):
        shutil.rmtree(d, ignore_errors=True)
    _SCRATCH.clear()
    _RUNTIME.clear()


_RUNTIME: dict[str, str] = {}


def runtime_dir() -> str:
    """The course as submitted code may see it (as another user, ``GRADER_RUN_AS``): a copy of
    ``reference/`` and ``exercises/`` in which every graded reference function is a delegation to
    the learner's own (as in the student release), without the hidden checks or recorded answers.
    The runner imports from here (and starts here), so reloading, re-importing or reading a
    reference module finds no solution; the bundle's own files are root's alone (``lock_source.sh``).
    Built once per grading, readable by everyone, writable by nobody but its owner."""
    if "dir" not in _RUNTIME:
        import tempfile

        from . import strip
        d = Path(tempfile.mkdtemp(prefix="grader-runtime-"))
        _RUNTIME["dir"] = str(d)
        atexit.register(remove_scratch)      # also when a caller never reaches grade()'s cleanup
        strip.copy_tree(["reference", "exercises"], d, strip.RUNTIME_LEAVE_OUT)
        strip.strip_solutions(d)
        for dirpath, dirnames, filenames in os.walk(d):
            os.chmod(dirpath, 0o755)
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), 0o644)
    return _RUNTIME["dir"]


_PROBE = r"""
import importlib, json, sys
out = {}
for what, name in (("course", "torch"), ("course", "reference.launch"), ("course", "exercises.grading.runner"),
                   ("submission", sys.argv[1])):
    try:
        importlib.import_module(name)
    except BaseException as e:
        out = {"what": what, "name": name, "error": f"{type(e).__name__}: {e}"}
        break
print(json.dumps(out))
"""


def preflight(solutions: str) -> None:
    """With ``GRADER_RUN_AS``: check, before grading, that the user can run the interpreter and
    import the course and the submission; otherwise raise :class:`SetupError` saying what to change
    (one message, instead of every check failing on its own)."""
    user = run_as()
    if user is None:
        return
    import json
    cmd = [sys.executable, "-c", _PROBE, solutions.split(".")[0]]
    fix = (f"Make the course, its interpreter and the submission readable (and folders and the interpreter "
           f"executable) by {user.pw_name!r} — e.g. keep them outside a private (mode 700) home folder, or "
           f"`chmod -R o+rX` them — or unset GRADER_RUN_AS to run learner code as yourself.")
    try:
        r = subprocess.run(cmd, env=runner_env(user), cwd=runtime_dir(), capture_output=True, text=True, timeout=120,
                           user=user.pw_uid, group=user.pw_gid, extra_groups=[])
    except PermissionError as e:
        raise SetupError(f"GRADER_RUN_AS={user.pw_name!r} cannot run the grader's Python {sys.executable} "
                         f"({e.strerror}). {fix}") from None
    except subprocess.TimeoutExpired:
        raise SetupError(f"GRADER_RUN_AS={user.pw_name!r}: importing the course as that user took over "
                         "120 s.") from None
    try:
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (r.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise SetupError(f"GRADER_RUN_AS={user.pw_name!r} cannot run the grader's Python {sys.executable} "
                         f"({tail[0]}). {fix}") from None
    if found:
        where = "the submission" if found["what"] == "submission" else "the course"
        raise SetupError(f"GRADER_RUN_AS={user.pw_name!r} cannot import {where} ({found['name']}: "
                         f"{found['error']}). {fix}")
