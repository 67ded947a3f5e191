"""Lecture 6, part 1 — six programs that really hang (or crash), each with its fix.

Every case is one rank function, :func:`hang_program`, run on real ranks.  The ranks at fault are a
parameter (``faulty``), so the same bug can be planted on any rank; ``fixed=True`` runs the repaired
program, which finishes.  Every message goes through :mod:`reference.comm` with ``step=``, so a
report names what each stuck rank was waiting for ("all_reduce (step 2)", "send to rank 1 (step 1)")::

    case      what goes wrong                                        what the fix does
    ────────  ─────────────────────────────────────────────────────  ──────────────────────────────────────
    order     the faulty ranks broadcast, then all-reduce; the       every rank issues the collectives in one
              others all-reduce, then broadcast                      order (no rank-dependent branch around them)
    skip      a faulty rank meets a NaN loss and `continue`s past    decide together: all-reduce the flag, and
              the step's all-reduce: its next all-reduce pairs       every rank skips the step, or none does
              with the others' current one, it finishes a step
              early and the others wait for it forever
    p2p       every rank sends to its right neighbour, then          post the send and the receive together
              receives from its left: every send waits for a        (comm.exchange), or order them even/odd
              receive nobody has posted
    pipeline  a hand-written 1F1B runs p−1−r warm-up forwards on     clamp the warm-up: min(p−1−r, m)
              stage r without clamping them to the m micro-
              batches there are (torchtitan issue 775): the early
              stages send activations no stage will receive
    group     a subgroup created only on its members (``if rank     every rank calls new_group for every group,
              in members: new_group(members)``): every later group  members or not, in the same order
              has another name on those ranks than on the others
    shape     an all-gather whose faulty ranks contribute a          check the shapes first (an all-gather of
              longer tensor: gloo aborts the rank whose receive      the sizes), or pad to one shape
              buffer is too small (SIGABRT); NCCL would hang or
              read garbage

:func:`run_hang` runs a case on a world with a short timeout and returns the course's report as plain
data (:func:`hang_report` of the :class:`reference.launch.WorldError`).  :mod:`.tools` runs the same
programs under PyTorch's own tools.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["CASES", "HangCase", "hang_program", "run_hang", "run_hangs", "hang_report", "default_faulty"]


@dataclass(frozen=True)
class HangCase:
    name: str
    title: str
    min_ranks: int
    fix: str


CASES = {c.name: c for c in (
    HangCase("order", "collectives issued in a different order on some ranks", 2,
             "issue the collectives in the same order on every rank"),
    HangCase("skip", "a rank skips a collective under a data-dependent branch", 2,
             "all-reduce the condition first, so every rank takes the same branch"),
    HangCase("p2p", "sends and receives that wait on each other", 2,
             "post each send with its receive (comm.exchange / batch_isend_irecv), or order them even/odd"),
    HangCase("pipeline", "a pipeline with fewer micro-batches than its schedule assumes", 3,
             "clamp the warm-up forwards to the micro-batches there are: min(p − 1 − r, m)"),
    HangCase("group", "a group created on some ranks only", 3,
             "every rank calls new_group for every group, in the same order, members or not"),
    HangCase("shape", "mismatched shapes in an all-gather", 2,
             "agree on the shape first (all-gather the sizes), then pad to it"),
)}


def default_faulty(case: str, world_size: int) -> tuple[int, ...]:
    """The ranks the notebook plants each bug on (every rank, for the p2p ring; rank 1 for group, see _group)."""
    if case == "p2p":
        return tuple(range(world_size))
    if case == "pipeline":                        # the stages whose warm-up exceeds one micro-batch
        return tuple(r for r in range(world_size) if world_size - 1 - r > 1)
    if case == "group":                           # a middle rank (see _group)
        return (1,)
    return (world_size - 1,)


# ----------------------------------------------------------------------------------------------
# The programs (each a few lines: the bug is one line of it)


def _order(r: int, faulty, fixed: bool, n: int, group, at: int = 0) -> dict:
    stats, config = torch.full((n,), float(r + 1)), torch.zeros(n)
    W = comm.world_size(group)
    root = comm.global_rank(group, min((q for q in range(W) if q not in faulty), default=0))   # a rank in order
    if fixed or r not in faulty:
        comm.all_reduce(stats, group=group, step=at)
        comm.broadcast(config, root, group=group, step=at)
    else:                                         # BUG: this rank's branch broadcasts first
        comm.broadcast(config, root, group=group, step=at)
        comm.all_reduce(stats, group=group, step=at)
    return {"sum": stats.tolist()}


def _skip(r: int, faulty, fixed: bool, n: int, group, steps: int = 3, bad_step: int = 1, at: int = 0) -> dict:
    losses = []
    for step in range(steps):
        loss = torch.full((n,), float(step + r))
        if r in faulty and step == bad_step:
            loss[0] = float("nan")                # a bad batch on this rank only
        if fixed:                                 # decide together: every rank skips, or none
            bad = torch.tensor([float(not torch.isfinite(loss).all())])
            comm.all_reduce(bad, group=group, step=at + step, what="skip_flag")
            if bad.item() > 0:
                continue
        elif not torch.isfinite(loss).all():
            continue                              # BUG: skips the all-reduce the others are in
        comm.all_reduce(loss, group=group, step=at + step)
        losses.append(loss[0].item())
    return {"losses": losses}


def _p2p(r: int, faulty, fixed: bool, n: int, group, at: int = 0) -> dict:
    nxt, prv = comm.ring_peers(group)
    mine, theirs = torch.full((n,), float(r)), torch.empty(n)
    if fixed or r not in faulty:                  # send and receive posted together
        comm.exchange([(mine, nxt)], [(theirs, prv)], group=group, step=at).wait()
    else:                                         # BUG: a blocking send first, on every rank of the ring
        comm.send(mine, nxt, group=group, step=at)
        comm.recv(theirs, prv, group=group, step=at)
    return {"received": theirs.tolist()}


def _pipeline(r: int, faulty, fixed: bool, n: int, group, num_microbatches: int = 1, at: int = 0) -> dict:
    """A hand-written 1F1B on p stages (stage = rank in ``group``), m = ``num_microbatches``; messages are
    labelled with their micro-batch's number counted from ``at``."""
    p, m = comm.world_size(group), num_microbatches
    prev, nxt = comm.global_rank(group, r - 1) if r else None, comm.global_rank(group, r + 1) if r < p - 1 else None
    warmup = p - 1 - r
    if fixed or r not in faulty:
        warmup = min(warmup, m)                   # BUG (on the faulty stages): no clamp to m
    done = []

    def forward(i: int) -> None:
        x = torch.full((n,), float(i)) if prev is None else comm.recv(torch.empty(n), prev, group=group, step=at + i)
        if nxt is not None:
            comm.send(x * 2, nxt, group=group, step=at + i)

    def backward(i: int) -> None:
        g = torch.ones(n) if nxt is None else comm.recv(torch.empty(n), nxt, group=group, step=at + i)
        if prev is not None:
            comm.send(g, prev, group=group, step=at + i)
        done.append(i)

    for i in range(warmup):
        forward(i)
    for i in range(max(m - warmup, 0)):          # steady state: one forward, one backward
        forward(warmup + i)
        backward(i)
    for i in range(len(done), m):                 # cool-down
        backward(i)
    return {"backward": done}


def _group(r: int, faulty, fixed: bool, n: int, group, at: int = 0) -> dict:
    # The skipped group shifts the counter that names groups: the members' new group and the others' next one
    # share a name, and so the store keys their gloo rendezvous uses (one per rank of the group).  Measured
    # (torch 2.13, gloo): skipped by a rank that is not the last, every rank stays inside new_group — every
    # stuck rank "running", in 20 runs of 20; skipped by the last rank, whose key the members' smaller group
    # does not use, their group sometimes forms and they block in the next all-reduce (1 run in 4 or so).
    # The members do not use their group right away: a collective on it would be seen as "blocked" whenever
    # the group formed.
    world = list(range(dist.get_world_size()))
    members = [q for q in world if q not in faulty]
    if fixed or r in members:                     # BUG: only the members create their group (kept for later)
        dist.new_group(members)
    everyone = dist.new_group(world)              # named by a counter: not the same group everywhere now
    t = torch.full((n,), float(r))
    comm.all_reduce(t, group=everyone, step=at)
    return {"sum": t.tolist()}


def _shape(r: int, faulty, fixed: bool, n: int, group, at: int = 0) -> dict:
    mine = torch.full((n + (r in faulty),), float(r))   # BUG: a faulty rank has one element more
    if fixed:                                     # agree on the longest first, then pad to it
        sizes = comm.all_gather(torch.tensor([mine.numel()]), group=group, step=at, what="sizes")
        longest = int(torch.cat(sizes).max())
        mine = torch.cat([mine, mine.new_zeros(longest - mine.numel())])
    parts = comm.all_gather(mine, group=group, step=at + 1)
    return {"sizes": [t.numel() for t in parts]}


_PROGRAMS = {"order": _order, "skip": _skip, "p2p": _p2p, "pipeline": _pipeline, "group": _group, "shape": _shape}


def _dump_flight_recorder_after(seconds: float, path: str) -> None:
    """A daemon thread that writes this rank's flight-recorder buffer (torch's pickle) to ``path`` after
    ``seconds``: gloo has no watchdog that dumps it on a timeout, as NCCL's does.  Without the entries'
    stack traces: symbolising them waits on the collective in flight (seconds, more on a busy machine)."""
    def dump() -> None:
        import time
        time.sleep(seconds)
        data = torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    threading.Thread(target=dump, daemon=True).start()


def hang_program(case: str, faulty=(), *, fixed: bool = False, size: int = 4, group_timeout: float | None = None,
                 pid_dir: str | None = None, flight_recorder_dir: str | None = None, dump_after: float = 1.0,
                 **options) -> dict:
    """Rank function: run ``case`` (one of :data:`CASES`) with its bug on the ranks in ``faulty``.

    ``fixed``: the repaired program.  ``group_timeout``: run it in a group of every rank with that
    many seconds of timeout (the process group's own timeout then ends the hang with an error).
    ``pid_dir``: each rank writes ``rank<r>.pid`` there first (for ``py-spy dump --pid``).
    ``flight_recorder_dir``: each rank dumps its flight recorder there after ``dump_after`` seconds
    (``TORCH_FR_BUFFER_SIZE`` must be set when the world starts).  ``options``: the case's own
    (``steps``, ``bad_step`` for skip; ``num_microbatches`` for pipeline), and ``at``: that many steps of
    the run (one all-reduce each) go well first, the case's messages are labelled from step ``at`` on.
    """
    if case not in CASES:
        raise ValueError(f"unknown hang case {case!r}; the cases are {', '.join(CASES)}")
    r, W = dist.get_rank(), dist.get_world_size()
    if W < CASES[case].min_ranks and not fixed:
        raise ValueError(f"case {case!r} needs at least {CASES[case].min_ranks} ranks, got {W}")
    if pid_dir is not None:
        with open(os.path.join(pid_dir, f"rank{r}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if flight_recorder_dir is not None:
        _dump_flight_recorder_after(dump_after, os.path.join(flight_recorder_dir, f"rank{r}.pkl"))
    group = comm.new_group(list(range(W)), timeout=group_timeout) if group_timeout else None
    at = options.pop("at", 0)
    for step in range(at):                        # the steps of the run before the one that hangs, all in step
        comm.all_reduce(torch.ones(1), group=group, step=step, what="earlier_step")
    return _PROGRAMS[case](r, set(faulty), fixed, size, group, at=at, **options)


# ----------------------------------------------------------------------------------------------
# Running a case and reading the course's report


def hang_report(err, world_size: int) -> dict:
    """The course's report of a failed world as plain data (what exercise 6.1 reads)::

        {"kind": "timeout" | "exception" | "died", "message": the WorldError's text,
         "world_size": W,
         "ranks": {r: {"state": "blocked" | "running" | "finished" | "raised" | "died" | "peer gone",
                       "blocked_in": what it was waiting in ("" if nothing), "error": its one-line error}}}

    "blocked": waiting in a communication the trace knows; "running": stuck where the trace sees no
    communication; "finished": returned while others were stuck; "peer gone": failed only because
    another rank died or raised first.
    """
    ranks = {}
    for r in range(world_size):
        f = err.failures.get(r)
        if f is None:
            ranks[r] = {"state": "finished" if err.kind == "timeout" else "peer gone", "blocked_in": "", "error": ""}
        elif f.kind == "timeout":
            ranks[r] = {"state": "blocked" if f.blocked_in else "running", "blocked_in": f.blocked_in, "error": ""}
        else:
            ranks[r] = {"state": "raised" if f.kind == "exception" else "died", "blocked_in": "", "error": f.message}
    return {"kind": err.kind, "message": str(err), "world_size": world_size, "ranks": ranks}


def run_hang(case: str, world_size: int, faulty=None, *, fixed: bool = False, timeout: float = 3.0,
             world=None, **program) -> dict:
    """Run ``case`` on ``world_size`` fresh ranks (or the kept ``world``, which a hang restarts) with
    its bug on ``faulty`` (default :func:`default_faulty`); wait at most ``timeout`` seconds.

    Returns ``{"finished": True, "values": ...}`` for a run that ended, else :func:`hang_report` plus
    ``"seconds"`` (from the call to the report) and ``"case"``, ``"faulty"``.
    """
    import time

    from ..launch import World, WorldError
    faulty = tuple(default_faulty(case, world_size) if faulty is None else faulty)
    own = world is None
    w = World(world_size, timeout=timeout, echo=False) if own else world
    w.start()                                     # (starting ranks is not part of the hang's seconds)
    t0 = time.perf_counter()
    try:
        values = w.run(hang_program, case, faulty, fixed=fixed, timeout=timeout, **program).values
        return {"finished": True, "values": values, "case": case, "faulty": list(faulty)}
    except WorldError as e:
        report = hang_report(e, world_size)
        return {**report, "finished": False, "case": case, "faulty": list(faulty),
                "seconds": time.perf_counter() - t0}
    finally:
        if own:
            w.close()


@contextmanager
def _environment(**values: str):
    """Set environment variables while ranks are started (they copy the environment), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v



def run_hangs(cases, timeout: float = 2.0, env: dict | None = None) -> list[dict]:
    """Several cases at once, each on its own fresh world: ``cases`` lists ``(name, world_size, faulty,
    options)``; ``options`` holds the program's keywords, ``"fixed": True`` for the repaired program and
    ``"env": {...}`` for environment variables its ranks start with (TORCH_DISTRIBUTED_DEBUG=DETAIL).
    Returns per case :func:`hang_report` + "seconds" (from the run to the report), or {"finished": True,
    "values": ...}.  All worlds start, then run, together: one world start's wait, not one per case."""
    import time

    from ..launch import World
    worlds = [World(w, timeout=o.get("world_timeout", timeout), echo=False) for _, w, _, o in cases]

    def together(jobs) -> None:
        threads = [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    envs = sorted({tuple(sorted(o.get("env", {}).items())) for _, _, _, o in cases})
    for env_items in envs:                        # ranks copy the environment when they start
        with _environment(**dict(env_items)):
            together([worlds[i].start for i, c in enumerate(cases) if tuple(sorted(c[3].get("env", {}).items()))
                      == env_items])
    out: list = [None] * len(cases)

    def run(i: int) -> None:
        name, w, faulty, options = cases[i]
        program = {k: v for k, v in options.items() if k not in ("env", "world_timeout")}
        t0 = time.perf_counter()
        try:
            out[i] = {"finished": True, "values": worlds[i].run(hang_program, name, tuple(faulty), **program).values}
        except Exception as e:                    # noqa: BLE001 - a WorldError is the point
            if not hasattr(e, "failures"):
                raise
            out[i] = {**hang_report(e, w), "finished": False, "seconds": time.perf_counter() - t0}
    try:
        together([lambda i=i: run(i) for i in range(len(cases))])
    finally:
        for world in worlds:
            world.close()
    return out
