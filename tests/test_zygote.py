"""reference.zygote.fork_call: a process forked from a zygote that imported torch starts as ``python -c`` would.

The grader starts each exercise's runner this way (exercises/grading/sandbox.py), so what a runner sees — its
environment, import path, working folder, session, user — and how its end is reported (exit code, signal) must
be a fresh interpreter's, and the zygote must hold nothing a runner could use.  Each test here would fail if the
child kept the zygote's state instead of the caller's.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
from multiprocessing import connection as mpc

import pytest

from reference import zygote

pytestmark = pytest.mark.skipif(not zygote.available(), reason="forking needs Linux")


def _call(how: str, env: dict, cwd: str, user=None):
    ours, theirs = socket.socketpair()
    try:
        proc = zygote.fork_call("tests.zygote_call:report", theirs.fileno(), (how,), env=env, cwd=cwd, user=user,
                                timeout=120)
    finally:
        theirs.close()
    conn = mpc.Connection(ours.detach())
    assert conn.poll(60), "the forked call sent nothing"
    seen = pickle.loads(conn.recv())
    conn.close()
    return proc, seen, proc.wait(timeout=30)


def _env(tmp_path, **extra) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": os.pathsep.join([str(tmp_path), root]),
            "COURSE_MARK": "mine", **extra}


def test_a_forked_call_sees_the_callers_environment_path_folder_and_a_session_of_its_own(tmp_path, no_orphans):
    (tmp_path / "work").mkdir()
    _, first, _ = _call("report", _env(tmp_path, COURSE_MARK="first"), str(tmp_path))
    proc, seen, code = _call("report", _env(tmp_path), str(tmp_path / "work"))     # the same zygote, warm
    assert code == 0 and seen["pid"] == proc.pid
    assert seen["torch"], "torch was not imported in the zygote"
    assert first["env"]["COURSE_MARK"] == "first" and seen["env"]["COURSE_MARK"] == "mine"   # each call's own
    assert "PYTEST_CURRENT_TEST" not in seen["env"]
    assert seen["path"][:3] == ["", str(tmp_path), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    assert seen["cwd"] == str(tmp_path / "work")
    assert seen["sid"] == proc.pid and proc.pid not in zygote.zygote_pids()
    # the course was imported again from the call's own path (the zygote's copy was forgotten)
    assert seen["reference"] == os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert proc.pid not in {p for p in _children(os.getpid())}, "the call is the zygote's child, not ours"


def test_the_call_is_imported_from_the_path_it_is_given_not_the_zygotes(tmp_path, no_orphans):
    """A second course on the call's path comes first: its own ``reference`` is the one imported."""
    other = tmp_path / "other"
    (other / "reference").mkdir(parents=True)
    (other / "reference" / "__init__.py").write_text("")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(other), env["PYTHONPATH"]])
    _, seen, _ = _call("report", env, str(tmp_path))
    assert seen["reference"] == str(other)


@pytest.mark.parametrize("how,code", [("exit", 3), ("raise", 1), ("segfault", -signal.SIGSEGV)])
def test_its_end_is_reported_as_a_fresh_interpreters(tmp_path, how, code, no_orphans):
    _, _, got = _call(how, _env(tmp_path), str(tmp_path))
    assert got == code


def test_a_stopped_zygote_is_replaced_and_the_caller_told(tmp_path, no_orphans):
    _call("report", _env(tmp_path), str(tmp_path))             # warm
    pid = zygote._callers[None].proc.pid                       # this user's zygote of calls
    os.kill(pid, signal.SIGSTOP)
    try:
        ours, theirs = socket.socketpair()
        with pytest.raises(zygote.ZygoteUnavailable):
            zygote.fork_call("tests.zygote_call:report", theirs.fileno(), ("report",), env=_env(tmp_path),
                             cwd=str(tmp_path), timeout=2)
        ours.close()
        theirs.close()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert pid not in zygote.zygote_pids()
    _, seen, code = _call("report", _env(tmp_path), str(tmp_path))   # a new zygote
    assert code == 0 and pid not in zygote.zygote_pids()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_as_another_user_the_call_runs_as_that_user_and_nobody_can_read_the_zygote(tmp_path, no_orphans):
    import pwd
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody here")
    _, seen, code = _call("report", _env(tmp_path), "/", user=user)
    assert code == 0 and seen["uid"] == user.pw_uid and seen["cwd"] == "/"
    z = zygote._callers[user.pw_uid].proc.pid
    assert os.stat(f"/proc/{z}").st_uid == user.pw_uid            # the zygote runs as that user ...
    assert os.stat(f"/proc/{z}/mem").st_uid == 0                   # ... but is not dumpable: its memory is root's


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out
