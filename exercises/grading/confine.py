"""What every process that runs learner code is made, before any of it runs: unreadable to other
processes of its user, and bounded in memory.  The runner applies it to itself (the zygote and every
rank it forks inherit both); it imports nothing heavy, so it is applied first."""
from __future__ import annotations

import os
import sys


def confine(headroom_mb: float | None = None) -> None:
    """Make this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: no other process of its user
    reads its memory through ``/proc/<pid>/mem`` or ptrace) and cap its address space
    (``RLIMIT_AS``: what it maps now plus ``headroom_mb``, ``$GRADER_MAX_MEMORY_MB`` or 2048 MiB).
    Both are inherited by every process it forks; neither can be undone by an unprivileged one."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import resource
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)        # PR_SET_DUMPABLE, 0
    except Exception:
        pass
    headroom = float(os.environ.get("GRADER_MAX_MEMORY_MB", "2048")) if headroom_mb is None else headroom_mb
    try:
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        cap = mapped + int(headroom * 2 ** 20)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError, StopIteration):
        pass
