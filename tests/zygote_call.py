"""The call tests/test_zygote.py forks from a zygote: it says what the process sees, then ends as asked.

It imports nothing of the course at the top, so that a test can hand it another ``reference`` on its path."""
from __future__ import annotations

import os
import pickle
import signal
import sys
from multiprocessing import connection as mpc


def report(fd: int, how: str = "report") -> None:
    """The forked call: say what this process sees, then end as ``how`` says."""
    conn = mpc.Connection(fd)
    import reference
    conn.send(pickle.dumps({"pid": os.getpid(), "sid": os.getsid(0), "uid": os.getuid(), "cwd": os.getcwd(),
                            "env": dict(os.environ), "path": list(sys.path), "torch": "torch" in sys.modules,
                            "reference": os.path.dirname(os.path.dirname(reference.__file__))}))
    if how == "exit":
        sys.exit(3)
    if how == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "raise":
        raise RuntimeError("the call failed")
