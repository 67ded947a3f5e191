"""Checks for lecture 5b (the expert axis): gating, the load-balancing loss, dispatch/combine,
and gradient synchronisation under expert × data parallelism.

Ground truth always comes from the reference through ``ctx.oracle`` (single process, float64);
the multi-rank truth is the single-process answer for each rank's tokens, which is what the
expert-parallel layer is defined to compute.  Detectors look at properties of the learner's
answer (which slots a second choice took, whether the weights of a half-dropped token sum to 1,
which experts' tokens arrived on a rank) rather than re-implementing the exercise here.

One module per exercise: :mod:`.gating` (5b.1), :mod:`.aux` (5b.2), :mod:`.dispatch` (5b.3),
:mod:`.grad_sync` (5b.4), :mod:`.bias` (5b.5); :mod:`.common` the shared names (the rank-side harness is
``exercises.grading.harness.moe``).  Importing this package
registers the five exercises in that order.
"""
from __future__ import annotations

from . import aux, bias, dispatch, gating, grad_sync  # noqa: E402,I001  (each registers its exercise)
from .aux import *  # noqa: F401,F403
from .aux import _aux_case, _aux_inputs, _ratio  # noqa: F401
from .bias import *  # noqa: F401,F403
from .bias import _case as _bias_case, _draw as _bias_draw, _loads as _bias_loads  # noqa: F401
from .common import *  # noqa: F401,F403
from .dispatch import *  # noqa: F401,F403
from .dispatch import _dispatch_case, _dispatch_inputs, _expected_buffers  # noqa: F401
from .gating import *  # noqa: F401,F403
from .gating import _gating_case, _logits, _second_before_first_logits, _slots_by_choice  # noqa: F401
from .grad_sync import *  # noqa: F401,F403
from .grad_sync import _grad_sync_case  # noqa: F401

HINTS = {**gating.HINTS, **aux.HINTS, **dispatch.HINTS, **grad_sync.HINTS, **bias.HINTS}
