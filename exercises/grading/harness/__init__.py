"""Grader-owned functions that run inside the runner (and its ranks) and call learner code.

Each takes the learner module's dotted name first.  They return plain values (tensors, numbers,
lists, dicts) and never judge anything: judging happens in the grader process.  One module per
lecture (``data``, ``tensor``, ``pipeline``, ``sequence``, ``moe``, ``compose``); this package holds the
generic ones and :func:`guarded`, which every multi-rank call goes through: it switches off what
the exercise's learner may not use (:func:`lock`), puts the given code back as it was frozen
(:mod:`exercises.grading.frozen`), runs the harness, and refuses a result computed with changed
given code.  The grader's checks (``exercises/grading/checks/``) are not imported here.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch


def function(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def lock(spec: dict, *, in_rank: bool) -> None:
    """Apply an exercise's lockdown (``Exercise.lockdown()``) in this process: its production
    shortcuts and mirrors switched off; in a rank also the communication its learner may not use
    (which needs the rank's process group up, and removes the store's data methods).  Idempotent."""
    import sys

    from ..shortcuts import hide_grader, switch_off, switch_off_mirrors
    hide_grader()
    ex = spec.get("exercise", "?")
    switch_off(spec.get("shortcuts", ()), ex)
    switch_off_mirrors(spec.get("mirrors", ()), ex)
    if in_rank and spec.get("comm") is not None:
        from ..allowed_comm import allow_only
        drivers = sorted(m for m in sys.modules if m == "reference" or m.startswith("reference."))
        allow_only(spec["comm"], ex, limits=spec.get("limits"), driver=spec.get("driver_comm", ()),
                   driver_modules=drivers if spec.get("driver_comm") else ())


def import_learner(module: str) -> None:
    """Import the learner's module now (a harness that needs it imports it again; one that does not
    never asked for it: a missing module is left for the harness to report)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise


def guarded(module: str, spec: dict, harness: str, *args: Any) -> Any:
    """On a rank: :func:`lock` the exercise, restore the frozen given code, run
    ``harness(module, *args)``, then refuse the result if the learner's code changed given code."""
    from .. import frozen
    if frozen.current() is None:          # a spawned rank (GRADER_SPAWN=1): freeze here, before any learner code
        lock(spec, in_rank=False)
        frozen.load_given()
        frozen.take()
    lock(spec, in_rank=True)
    snapshot = frozen.current()
    snapshot.restore()
    import_learner(module)            # what the learner's module changes as it is imported ...
    snapshot.restore()                # ... is undone; what its functions change while they run is refused
    mod, _, name = harness.partition(":")
    value = getattr(importlib.import_module(mod), name)(module, *args)
    snapshot.verify()
    return value


def call(module: str, name: str, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
    """``module.name(*args, **kwargs)`` in one process."""
    return function(module, name)(*args, **(kwargs or {}))


def raises(module: str, name: str, args: Sequence[Any] = (), kwargs: dict | None = None) -> str | None:
    """The name of the exception ``module.name(*args, **kwargs)`` raises, or None if it returns."""
    try:
        function(module, name)(*args, **(kwargs or {}))
    except Exception as e:
        return type(e).__name__
    return None


def call_per_rank(module: str, name: str, per_rank_args: Sequence[Sequence[Any]], kwargs: dict | None = None) -> Any:
    """On each rank r: ``module.name(*per_rank_args[r], **kwargs)``."""
    import torch.distributed as dist
    r = dist.get_rank()
    return function(module, name)(*per_rank_args[r], **(kwargs or {}))


def grad_per_rank(module: str, name: str, per_rank_args: Sequence[Sequence[Any]], grad_index: Sequence[int],
                  grad_outputs: Sequence[Any], kwargs: dict | None = None) -> dict[str, Any]:
    """On each rank r: call with ``per_rank_args[r]`` (the args at ``grad_index`` require grad), then
    backpropagate ``grad_outputs[r]`` (one per output; None to skip an output).

    Returns ``{"out": outputs, "grads": [grad of each arg in grad_index]}``.
    """
    import torch.distributed as dist
    r = dist.get_rank() if dist.is_initialized() else 0
    args = [a.detach().clone().requires_grad_(True) if i in grad_index else a for i, a in enumerate(per_rank_args[r])]
    out = function(module, name)(*args, **(kwargs or {}))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs[r]) if g is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return {"out": [o.detach() for o in outs] if isinstance(out, (tuple, list)) else out.detach(),
            "grads": [args[i].grad for i in grad_index]}
