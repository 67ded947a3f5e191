"""Checks for lecture 3 (the data axis): the gradient all-reduce, buckets with overlap, a ZeRO-1/2
step, and ZeRO-3's collectives.

Ground truth is computed here, in the grader, by ONE process in float64: the mean of the ranks'
gradients for 3.1, and for the rest a single process training the same seeded model on the whole
batch (``reference.data.workers.train("single", ...)``, plain torch — no graded function).  The
learner's functions run inside the reference's own DataParallel / ZeroOptimizer /
FullyShardedDataParallel on real ranks (the grader makes those call the learner's code); each rank
is given its own gradients, or the seed of its own micro-batches, and nothing of another rank's.
How the work was done bears points where the values show it or the grader counts it outside the
learner's processes: 3.2's overlap (gradients replaced once a bucket is complete, and every post
counted by the referee as grad_ready returns), 3.3's sharding (the parameters outside a rank's
shard are garbage before zero_step).  What only the ranks' own trace or memory report shows (when
all-reduces ran, memory held) gives feedback and 0 points.

One module per exercise: :mod:`.allreduce` (3.1), :mod:`.buckets` (3.2), :mod:`.zero` (3.3 and
3.4); :mod:`.common` holds the exercises, their hints and the single-process truth.
"""
from __future__ import annotations

from . import allreduce, buckets, zero  # noqa: F401  (registers the checks, in order)
from .allreduce import _allreduce_case  # noqa: F401
from .buckets import _ddp_case, judge_posts  # noqa: F401
from .common import *  # noqa: F401,F403
from .common import HINTS, H, _compare_params, _data_seeds, _single  # noqa: F401
from .zero import _zero_case, garbage_kept, wrong_shard  # noqa: F401
