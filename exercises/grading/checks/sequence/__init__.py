"""Checks for lecture 5a (sequence parallelism): merge, sharding layouts, the ring forward, Ulysses,
the ring backward.

Ground truth is computed here, in float64, from scratch: full attention with an explicit mask over
global token positions, and token positions of each layout written out independently of the
learner's (and the reference's) code.  Inputs encode their own positions where it helps feedback:
a shard that comes back with the wrong tokens is described by the tokens it holds.

Each check is "make inputs → run learner code → judge"; the judging functions (``judge_*``) are
plain functions of the values that came back, so tests can feed them results of deliberately
wrong implementations.

One module per exercise: :mod:`.merge` (5a.1), :mod:`.shard` (5a.2), :mod:`.ring` (5a.3),
:mod:`.ulysses` (5a.4), :mod:`.ring_backward` (5a.5); :mod:`.common` holds the shared ground truth.
Importing this package registers the five exercises in that order.
"""
from __future__ import annotations

from ...harness.sequence import _Counter, ring_harness, tokens_tensor  # noqa: F401
from . import merge, ring, shard, ulysses, ring_backward  # noqa: E402,I001  (in registration order)
from .common import *  # noqa: F401,F403
from .common import _randn  # noqa: F401
from .merge import *  # noqa: F401,F403
from .merge import _merge_check  # noqa: F401
from .ring import *  # noqa: F401,F403
from .ring import _peers, _ring_run  # noqa: F401
from .ring_backward import *  # noqa: F401,F403
from .ring_backward import _assemble, _blocks  # noqa: F401
from .shard import *  # noqa: F401,F403
from .shard import _shard_cases, _shard_check, _short, _zigzag_variant  # noqa: F401
from .ulysses import *  # noqa: F401,F403
from .ulysses import _ulysses_check  # noqa: F401

HINTS = {**merge.HINTS, **shard.HINTS, **ring.HINTS, **ulysses.HINTS, **ring_backward.HINTS}
