"""How a check ends: the outcomes a check raises, and the words for a runner's error reply.

:class:`CheckFailed` fails one check with a message for the learner; :class:`CheckTimedOut` also skips
the exercise's remaining checks; :class:`MachineBusy` says the machine, not the code, was too slow
to start; :class:`SetupError` stops grading before any check.  :func:`raise_on_error` turns what a
runner sent back into one of them.  (Re-exported by :mod:`.core`, where checks find them.)
"""
from __future__ import annotations


class CheckFailed(Exception):
    """Raised inside a check to fail it with a message for the learner."""


class MachineBusy(CheckFailed):
    """The grader could not start the process that runs the learner's code, twice, within the (scaled)
    allowance: the machine's fault, not the learner's.  The message says so."""


class CheckTimedOut(CheckFailed):
    """The learner's code ran out of time (its runner was killed): the exercise's remaining checks
    are skipped, so that a submission that hangs everywhere costs one time limit, not one per check."""


class SetupError(RuntimeError):
    """The grader cannot run here at all (e.g. ``GRADER_RUN_AS`` cannot reach the interpreter); the
    message says what to change.  Raised before any check runs."""


def raise_on_error(err: dict | None, module: str) -> None:
    """Turn the error a runner sent back (``reply["error"]``) into the learner's failure, with words:
    not implemented, a time-out (a deadlock named by what each rank was blocked in), changed given code,
    sys.exit, a dead rank, or an exception (with the learner's own frame where it began).  ``module``: the
    learner's module (its frames are the ones shown)."""
    if not err:
        return
    kind = err.get("kind")
    if err.get("type") == "NotImplementedError":
        raise CheckFailed(f"not implemented yet: {err.get('message') or 'NotImplementedError'}")
    if kind == "timeout":
        blocked = err.get("blocked", {})
        if blocked and all(not b for b in blocked.values()):
            raise CheckTimedOut(
                f"your code did not finish within {err.get('timeout', 0):g} s and no rank was communicating "
                f"(ranks {', '.join(map(str, sorted(blocked)))} were still running): a loop that never ends?")
        lines = [f"deadlock: after {err.get('timeout', 0):g} s ranks {', '.join(map(str, sorted(blocked)))} "
                 "were still waiting."]
        lines += [f"    rank {r}: {'blocked in ' + b if b else 'running (no communication in progress)'}"
                  for r, b in sorted(blocked.items())]
        sends = [b for b in blocked.values() if b.startswith("send")]
        if blocked and len(sends) == len(blocked) and len(blocked) > 1:
            lines.append("    Likely mistake: a blocking ring — every rank sends first and waits for a "
                         "receiver that is itself sending. Post sends and receives together "
                         "(comm.exchange / batch_isend_irecv).")
        raise CheckTimedOut("\n".join(lines))
    if err.get("type") == "Tampered":
        raise CheckFailed(err.get("message", "your code changed the course's given code."))
    if err.get("type") == "SystemExit":
        where = f" on rank {err['rank']}" if err.get("rank") is not None else ""
        raise CheckFailed(f"your code called sys.exit({err.get('message')}){where}: exiting never passes a "
                          "check; return the result instead.")
    if kind == "died":
        msg = f"a rank of your world died: {err.get('message')}"
        if "SIGABRT" in msg:
            msg += ("\n    Likely mistake: gloo aborts a rank when a message does not fit the buffer posted to "
                    "receive it — a send and its matching recv disagree on the size (which chunk, or which "
                    "way round the ring the data flows).")
        raise CheckFailed(msg)
    where = f" on rank {err['rank']}" if err.get("rank") is not None else ""
    tb = err.get("traceback", "")
    tail = "\n".join(tb.strip().splitlines()[-6:]) if tb else ""
    mine = _learner_frame(module, tb)
    if mine and mine not in tail:             # the failure surfaced in library code: show where it began
        tail = f"in your code:\n{mine}\n...\n{tail}"
    raise CheckFailed(f"your code raised {err.get('type')}{where}: {err.get('message')}"
                      + (f"\n    {tail.replace(chr(10), chr(10) + '    ')}" if tail else ""))

def _learner_frame(module: str, tb: str) -> str | None:
    """The deepest frame of ``tb`` in the learner's own module (its two lines), or None."""
    import re
    file = module.replace(".", "/") + ".py"
    frames = re.findall(r'(  File "[^"]*' + re.escape(file) + r'", line \d+, in [^\n]+\n(?:    [^\n]*)?)', tb)
    return frames[-1].rstrip() if frames else None
