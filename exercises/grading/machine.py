"""How much headroom this machine needs: every check's time limit was set on the course's idle 2-core
machine; a slower or busier one gets more (:func:`machine_factor`), unless the limit is given
(``timeout=``, ``--timeout``, ``$GRADER_TIMEOUT``)."""
from __future__ import annotations

import os
import time

import torch

PROBE_SECONDS = 0.02   # the probe below on the course's machine, idle (best of three: 0.016 s)


def machine_factor() -> float:
    """How many times longer than the course's machine this one takes right now, from 1 to 3:
    the larger of a timed probe (float64 matmuls and a Python loop: what checks spend time on)
    against :data:`PROBE_SECONDS`, and the load average per core.  ``$GRADER_SLOWDOWN`` sets it."""
    if "GRADER_SLOWDOWN" in os.environ:
        return max(1.0, float(os.environ["GRADER_SLOWDOWN"]))

    def probe() -> float:
        a = torch.linspace(-1, 1, 200 * 200, dtype=torch.float64).reshape(200, 200)
        t0, x = time.perf_counter(), 0
        for _ in range(24):
            a = torch.tanh(a @ a)
        for i in range(400_000):
            x += i
        return time.perf_counter() - t0
    slow = min(probe() for _ in range(3)) / PROBE_SECONDS
    try:
        busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):   # no load average (Windows)
        busy = 1.0
    return round(min(3.0, max(1.0, slow, busy)), 2)
