"""What a submission can see and send, by construction (issue: grader round 3).

A rank is sent its own inputs only; what it sends back is decoded as plain values only; runner and
ranks are non-dumpable and capped; the ring exercises' messages are judged below Python (the
checked kernels) and counted outside the learner's processes (the referee, in the runner).
"""
from __future__ import annotations

import io
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch

from exercises.grading import core, referee
from tests.conftest import nobody_who_can_run


def echo(*args):
    """Rank function: what this rank was called with, and which rank it is."""
    import torch.distributed as dist
    return dist.get_rank(), args


def test_world_run_sends_each_rank_its_own_slice_only(world):
    w = world(2)
    res = w.run(echo, "shared", per_rank=[(torch.zeros(2),), (torch.ones(3),)])
    (r0, a0), (r1, a1) = res.values
    assert (r0, r1) == (0, 1)
    assert a0[0] == "shared" and a0[1].shape == (2,) and len(a0) == 2
    assert a1[0] == "shared" and a1[1].shape == (3,) and len(a1) == 2
    with pytest.raises(ValueError, match="one tuple of arguments per rank"):
        w.run(echo, per_rank=[(1,)])


def test_what_a_rank_sends_back_is_decoded_as_plain_values_only():
    from exercises.grading import runner
    from reference.trace import Event
    runner._RANK_GLOBALS.update(runner._RankUnpickler._allowed())
    w = runner.ForkedWorld(1)
    plain = ("ok", {"t": torch.arange(3.0), "i": torch.ones(2, dtype=torch.long)[1:], "d": torch.float64,
                    "s": torch.Size([2])}, [Event(rank=0, op="send")])
    got = w._decode(0, pickle.dumps(plain))
    assert torch.equal(got[1]["t"], plain[1]["t"]) and got[1]["d"] is torch.float64 and got[2][0].op == "send"

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))
    refused = w._decode(0, pickle.dumps(("ok", Boom(), [])))
    assert refused[0] == "error" and "does not accept" in refused[2] and "posix.system" in refused[2]


def test_the_referee_counts_each_ranks_messages_refuses_past_the_rules_and_logs_them():
    ref = referee.Referee("9.9")
    fd = ref.channel(world=7, rank=1)
    rank_end = socket.socket(fileno=fd)
    ref.begin(7, [None, referee.rules(max_elems=4, max_sends=2, max_total=6, block="one chunk", why="Why.")])

    def send(n: int) -> bytes:
        rank_end.sendall(referee.FRAME.pack(referee.SEND, 2, n, 8 * n))
        head = rank_end.recv(1)
        if head == referee.OK:
            return b""
        size = int.from_bytes(rank_end.recv(2), "little")
        return rank_end.recv(size)

    assert send(4) == b""                                   # one chunk
    assert b"at most one chunk" in send(5)                  # larger than one message may carry
    assert b"2 messages per rank" in send(1)                # a third message
    rank_end.sendall(referee.FRAME.pack(referee.MARK, 3, 0, 0))
    rank_end.sendall(referee.FRAME.pack(referee.POST, -1, 10, 80))
    time.sleep(0.05)
    log = ref.end(7, 2)
    assert log[0] == []
    assert log[1] == [(referee.SEND, 2, 4, True), (referee.SEND, 2, 5, False), (referee.SEND, 2, 1, False),
                      (referee.MARK, 3, 0, True), (referee.POST, -1, 10, True)]
    assert b"no graded call" in send(1)                     # between calls nothing is allowed
    rank_end.close()


def test_a_runner_that_does_not_start_in_time_is_waited_for_once_more_then_blamed_on_the_machine(no_orphans):
    from exercises.grading import sandbox
    r = sandbox.Runner("reference", factor=2.0).start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(core.MachineBusy, match="This is the machine, not your code"):
            r.wait_ready(0.01)          # loading and freezing the given code takes longer than 10 ms, twice
    finally:
        r.kill()
    assert time.perf_counter() - t0 >= 0.02
    assert core.START_ALLOWANCE * 2.0 == core.Context("x", None, None, 1.0, factor=2.0).start_allowance


CONFINED = r"""
import ctypes, os, resource, sys, time
from exercises.grading.confine import confine
confine(256)
libc = ctypes.CDLL(None)
print(libc.prctl(3, 0, 0, 0, 0), resource.getrlimit(resource.RLIMIT_AS)[1] < 2 ** 62, flush=True)
time.sleep(60)
"""

PEEK = r"""
import sys
try:
    open(f"/proc/{sys.argv[1]}/mem", "rb").read(1)
    print("read")
except OSError as e:
    print(type(e).__name__)
"""


@pytest.mark.skipif(nobody_who_can_run(sys.executable) is None,
                    reason="needs root, a user 'nobody', and this clone's interpreter runnable by nobody")
def test_a_confined_runner_is_non_dumpable_capped_and_unreadable_to_its_own_user(no_orphans):
    user = nobody_who_can_run(sys.executable)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kw = dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": root})
    victim = subprocess.Popen([sys.executable, "-c", CONFINED], stdout=subprocess.PIPE, text=True, **kw)
    try:
        assert victim.stdout.readline().split() == ["0", "True"]       # not dumpable; an address-space cap
        peek = subprocess.run([sys.executable, "-c", PEEK, str(victim.pid)], capture_output=True, text=True,
                              timeout=60, **kw)
        assert peek.stdout.strip() == "PermissionError", peek.stdout + peek.stderr
    finally:
        victim.kill()
        victim.wait()


def test_recorded_answers_are_plain_data_read_weights_only(tmp_path, monkeypatch):
    class Planted:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    bad = tmp_path / "oracle_answers.pt"
    torch.save({"k": Planted()}, bad)
    monkeypatch.setattr(core.ORACLE, "answers", None)
    with pytest.raises(core.SetupError, match="not a file of recorded reference answers"):
        core.load_oracle_answers(str(bad))
    good = tmp_path / "good.pt"
    buf = io.BytesIO()
    from exercises.grading.harness import plain
    torch.save(plain({"k": [torch.ones(1), (1, "F")]}, strict=True), buf)
    good.write_bytes(buf.getvalue())
    assert core.load_oracle_answers(str(good)) and core.ORACLE.answers["k"][1] == (1, "F")
