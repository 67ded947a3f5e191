"""Teachers' hidden checks: run by the autograder, shown as hidden in Gradescope, never released.

``make release`` leaves this file out of the student release (the grader there simply finds no
hidden checks).  Add a check to any registered exercise with :func:`core.hidden_check`; it is
written like any other check (see ``checks/collectives.py``) and runs after the visible ones::

    @hidden_check("5a.1", "merge is symmetric in its two sides", points=1)
    def _(ctx):
        ...

Keep hidden checks about behaviour the lecture asked for (other sizes, dtypes, edge cases), so
that a student who passes every visible check for the right reasons passes these too.
"""
from __future__ import annotations

import torch

from .core import EXERCISES, hidden_check

H = "exercises.grading.harness"


if "0.1" in EXERCISES:
    @hidden_check("0.1", "sums an int64 tensor exactly on 3 ranks")
    def _(ctx):
        g = torch.Generator().manual_seed(101)
        xs = [torch.randint(-10**12, 10**12, (7,), generator=g, dtype=torch.int64) for _ in range(3)]
        res = ctx.ranks(3, f"{H}:call_per_rank", "ring_all_reduce", [(x,) for x in xs])
        want = torch.stack(xs).sum(0)
        for r in range(3):
            ctx.compare(res.values[r], want, "sum", rank=r, world_size=3, atol=0, rtol=0)


if "0.2" in EXERCISES:
    @hidden_check("0.2", "gathers float32 on 3 ranks with 7 elements (chunks of 3, 2, 2)")
    def _(ctx):
        from reference.collectives import chunk_bounds
        full = torch.arange(7, dtype=torch.float32) * 1.5
        bounds = chunk_bounds(7, 3)
        args = [(full[slice(*bounds[(r + 1) % 3])].clone(), 7) for r in range(3)]
        res = ctx.ranks(3, f"{H}:call_per_rank", "ring_all_gather", args)
        for r in range(3):
            ctx.compare(res.values[r], full, "gathered tensor", rank=r, world_size=3, atol=0, rtol=0)


if "4.1" in EXERCISES:
    from .checks import tensor as _tensor

    @hidden_check("4.1", "f and g on 4 ranks")
    def _(ctx):
        for which in ("f", "g"):
            _tensor._fg(ctx, which, 4, 401)


if "4.2" in EXERCISES:
    from .checks import tensor as _tensor

    @hidden_check("4.2", "parallel MLP on 4 ranks in float32, inputs ×30")
    def _(ctx):
        _tensor._mlp(ctx, 4, 402, scale=30.0, dtype=torch.float32, tol=2e-4)


if "4.3" in EXERCISES:
    from .checks import tensor as _tensor

    @hidden_check("4.3", "4 ranks, float64 logits ×30 with a +100 token, targets at every shard edge")
    def _(ctx):
        _tensor._xent(ctx, 4, 403, 30.0)
