"""CPU time by thread role: how much of a rank's CPU went to compute and how much to its communication threads.

On a machine where ranks share few cores, a collective "overlapped" with the backward still needs CPU: gloo runs
each collective on its own threads (``pt_gloo_runloop``, ``gloo_tcp_loop``), which take cores the backward wants.
Lectures 3 and 5a print this beside the step time to show it.
"""
from __future__ import annotations

__all__ = ["thread_cpu_seconds"]


def thread_cpu_seconds() -> dict[str, float] | None:
    """CPU seconds this process's threads have used so far, by role: "compute" (the thread that calls this,
    where forward and backward run on CPU) and "communication" (gloo's threads: ``pt_gloo_runloop`` runs each
    collective, ``gloo_tcp_loop`` moves its bytes through sockets).  Read from Linux's
    ``/proc/self/task/<tid>/schedstat`` (nanoseconds on a CPU); None where there is no such file."""
    import os
    import threading
    me, out = threading.get_native_id(), {"compute": 0.0, "communication": 0.0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue                                         # a thread that ended meanwhile
        if int(tid) == me:
            out["compute"] += seconds
        elif "gloo" in name:
            out["communication"] += seconds
    return out
