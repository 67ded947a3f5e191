"""The referee: the grader's own count of an exercise's messages, kept outside the learner's processes.

Where the pattern of messages IS the exercise — a ring passes one block per step to its neighbour,
a bucket's all-reduce leaves while backward still runs — the rule is about a whole call: how many
messages, how large each, how many elements in all, and in what order with the harness's steps.
A rank cannot keep that count itself (the learner's code runs there, and could reset it), so the
checked kernels of :mod:`.allowed_comm` report to the runner, which runs no learner code:

    rank r (learner code)                           runner (given code only)
    checked send kernel ── FRAME(SEND, peer, n) ──▶ Referee: this call's rules for rank r
                        ◀── OK | NO + the words ──  counts, refuses, logs
    checked all-reduce  ── FRAME(POST, -1, n) ───▶  logged (3.2: when each bucket left)
    harness             ── FRAME(MARK, step) ────▶  logged (where the harness was)

Each rank has a socket of its own to the runner, made when the zygote forks it (before any
learner code).  The rules of a call (``Referee.begin``) come from the grader with the request; the
log of a call (``Referee.end``) goes back with the reply, so the grader judges the pattern from
records the learner's code could not write.  What a rank can do to its own socket — send more
frames, read its own verdicts — only counts against it or stalls it.
"""
from __future__ import annotations

import os
import select
import socket
import struct
import threading
from typing import Any

FRAME = struct.Struct("<iiqq")        # op, peer (or the harness's step for MARK), elements, bytes
SEND, POST, MARK = 1, 2, 3
OK, NO = b"\x00", b"\x01"
MAX_LOG = 20_000                      # records kept per rank and call; past it every send is refused

__all__ = ["FRAME", "SEND", "POST", "MARK", "OK", "NO", "Referee", "rules"]


def rules(*, max_elems: int | None = None, max_sends: int | None = None, max_total: int | None = None,
          block: str = "", why: str = "") -> dict[str, Any]:
    """One rank's rules for one call (plain values: they travel in the request).

    max_elems: elements one message may carry (``block`` says what that is, e.g. "one chunk, 4
    elements"); max_sends: messages in the call; max_total: elements in all; ``why``: the words for
    the pattern, shown with a refusal ("a ring all-reduce on 3 ranks sends 2·(N−1) = 4 chunks")."""
    return {"max_elems": max_elems, "max_sends": max_sends, "max_total": max_total, "block": block, "why": why}


class Referee:
    """In the runner: one socket per rank of every world it starts; a daemon thread answers sends."""

    def __init__(self, exercise: str = "?"):
        self.exercise = exercise
        self._lock = threading.Lock()
        self._channels: dict[int, list] = {}      # fd -> [world key, rank, socket, unread bytes]
        self._current: int | None = None          # the world whose call is in progress
        self._rules: list[dict | None] = []
        self._log: dict[int, list[tuple]] = {}
        self._count: dict[int, list[int]] = {}     # rank -> [sends, elements]
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None

    # -- the runner's side ------------------------------------------------------------------------

    def channel(self, world: int, rank: int) -> int:
        """A new socket for ``rank`` of ``world`` (a key); returns the rank's end, a file descriptor
        the caller hands to the rank and then closes."""
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        with self._lock:
            self._channels[mine.fileno()] = [world, rank, mine, bytearray()]
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="referee", daemon=True)
            self._thread.start()
        os.write(self._wake_w, b"x")
        return theirs.detach()

    def begin(self, world: int, per_rank: list[dict | None] | None) -> None:
        """A call of ``world`` starts, under ``per_rank[r]`` (None: no limits, messages still logged)."""
        with self._lock:
            self._current, self._rules = world, list(per_rank or [])
            self._log, self._count = {}, {}

    def end(self, world: int, world_size: int) -> list[list[tuple]]:
        """The call is over: every record of it, per rank — ``(op, peer, elements, allowed)``."""
        with self._lock:
            for fd, (w, *_rest) in list(self._channels.items()):
                if w == world:
                    self._pump(fd)
            log = [list(self._log.get(r, [])) for r in range(world_size)]
            self._current, self._rules, self._log, self._count = None, [], {}, {}
        return log

    # -- the thread -------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._lock:
                fds = list(self._channels)
            try:
                ready, _, _ = select.select(fds + [self._wake_r], [], [], 1.0)
            except (OSError, ValueError):          # a socket closed between the list and the select
                continue
            for fd in ready:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    self._pump(fd)

    def _pump(self, fd: int) -> None:
        """Read what ``fd`` holds now and act on every whole frame (called with the lock held)."""
        entry = self._channels.get(fd)
        if entry is None:
            return
        world, rank, sock, buf = entry
        while True:
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:                            # the rank is gone
                sock.close()
                del self._channels[fd]
                return
            buf += data
        while len(buf) >= FRAME.size:
            op, peer, n, nbytes = FRAME.unpack_from(buf)
            del buf[:FRAME.size]
            verdict = self._judge(world, rank, op, peer, n)
            if op == SEND:
                try:
                    sock.sendall(OK if verdict is None else NO + struct.pack("<H", len(verdict)) + verdict)
                except OSError:                      # a rank that does not read its verdicts is on its own
                    pass

    def _judge(self, world: int, rank: int, op: int, peer: int, n: int) -> bytes | None:
        """None to allow; else the refusal's words (bytes).  Every frame is logged."""
        if world != self._current:
            return b"no graded call is running on this world: the message is refused." if op == SEND else None
        log = self._log.setdefault(rank, [])
        if len(log) >= MAX_LOG:
            return (f"rank {rank} sent more than {MAX_LOG} messages in one graded call: refused.".encode()
                    if op == SEND else None)
        if op != SEND:
            log.append((op, peer, n, True))
            return None
        rule = self._rules[rank] if rank < len(self._rules) else None
        sends, total = self._count.setdefault(rank, [0, 0])
        why = f" {rule['why']}" if rule and rule.get("why") else ""
        words = None
        if rule and rule.get("max_elems") is not None and n > rule["max_elems"]:
            words = (f"rank {rank}: a message of {n} elements to rank {peer} is refused in exercise {self.exercise}: "
                     f"one message carries at most {rule.get('block') or str(rule['max_elems']) + ' elements'}.{why}")
        elif rule and rule.get("max_sends") is not None and sends + 1 > rule["max_sends"]:
            words = (f"rank {rank}: message {sends + 1} to rank {peer} is refused in exercise {self.exercise}: "
                     f"{rule['max_sends']} messages per rank is the whole pattern here.{why}")
        elif rule and rule.get("max_total") is not None and total + n > rule["max_total"]:
            words = (f"rank {rank}: a message of {n} elements to rank {peer} is refused in exercise {self.exercise}: "
                     f"it would make {total + n} elements sent in this call, and the pattern sends "
                     f"{rule['max_total']}.{why}")
        log.append((op, peer, n, words is None))
        self._count[rank] = [sends + 1, total + n]
        return None if words is None else words.encode()[:60_000]
