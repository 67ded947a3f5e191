"""Checks for lecture 5c (composition): the rank groups of a grid (5c.1), gradient
synchronisation on a composed grid (5c.2), and a planner's byte estimate checked against the
bytes a real run sends (5c.3).

One module per exercise: :mod:`.groups` (5c.1), :mod:`.grad_sync` (5c.2), :mod:`.step_bytes`
(5c.3); what runs beside the learner's code is ``exercises.grading.harness.compose``.  Importing this package
registers the three exercises in that order.
"""
from __future__ import annotations

from . import grad_sync, groups, step_bytes  # noqa: E402,I001  (imported above, in registration order)
from .grad_sync import *  # noqa: F401,F403
from .groups import *  # noqa: F401,F403
from .groups import _case, _explain  # noqa: F401
from .step_bytes import *  # noqa: F401,F403

HINTS = {**groups.HINTS, **grad_sync.HINTS, **step_bytes.HINTS}
