"""Small helpers the notebooks share.

``needs("5a.1")`` wraps a notebook cell that runs code built on an exercise.  In the full course
it changes nothing.  In the student release, where the graded reference functions call the
learner's own code, a cell whose exercise is not done yet prints what to implement instead of
failing with a traceback::

    with needs("5a.1"):
        out, lse = merge_attention(o1, l1, o2, l2)
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


def _not_implemented(e: BaseException) -> str | None:
    if isinstance(e, NotImplementedError):
        return str(e) or "NotImplementedError"
    failures = getattr(e, "failures", None)  # reference.launch.WorldError
    if failures:
        for f in failures.values():
            if getattr(f, "exc_type", "") == "NotImplementedError":
                return f.message.split(": ", 1)[-1]
    return None


@contextmanager
def needs(*exercise_ids: str) -> Iterator[None]:
    """Run the block; if it stops on an exercise not implemented yet, say which and carry on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only NotImplementedError is swallowed, see below
        msg = _not_implemented(e)
        if msg is None:
            raise
        ids = ", ".join(exercise_ids)
        print(f"⏸  This cell needs your solution to exercise {ids}; implement it first, then run the cell again.\n"
              f"   ({msg.splitlines()[0][:200]})")
