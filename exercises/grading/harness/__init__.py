"""Grader-owned functions that run inside the ranks and call learner code.

Each takes the learner module's dotted name first; a multi-rank one takes this rank's own inputs
next (``mine``: the slice of the check's inputs the runner sent to this rank alone), then what
every rank shares.  They return plain values (tensors, numbers, lists, dicts) and never judge
anything: judging happens in the grader process.  One module per lecture (``data``, ``tensor``,
``pipeline``, ``sequence``, ``moe``, ``compose``); this package holds the generic ones and
:func:`guarded`, which every call goes through: it switches off what the exercise's learner may
not use (:func:`lock`), puts the given code back as it was frozen (:mod:`exercises.grading.frozen`),
runs the harness, and refuses a result computed with changed given code — checked after each
call of a learner function (:func:`function` returns it wrapped so).  The grader's checks
(``exercises/grading/checks/``) are not imported here.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any


def plain(obj: Any, strict: bool = False) -> Any:
    """A value as plain data (tensors detached, named tuples as tuples, dataclasses as dicts): what a
    rank sends back, so that the runner decodes nothing but plain values.  Anything else becomes a
    string naming its type, or (``strict``) raises TypeError."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone() if not obj.is_cuda else obj.detach().cpu()
    if isinstance(obj, (bool, int, float, str, type(None), torch.dtype, torch.Size)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [plain(o, strict) for o in obj] if isinstance(obj, list) else tuple(plain(o, strict) for o in obj)
    if isinstance(obj, dict):
        return {(k if isinstance(k, (str, int)) else str(k)): plain(v, strict) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: plain(getattr(obj, k), strict) for k in obj.__dataclass_fields__}
    if strict:
        raise TypeError(f"{type(obj).__name__} is not plain data")
    return f"<{type(obj).__name__} not returned>"


def function(module: str, name: str):
    """The learner's ``module.name``, wrapped: after each call the given code is compared with its
    snapshot by the verifier of :mod:`..frozen` — the one this wrapper was made with, read into the
    call's own frame before the learner's code runs — before any given code runs on.  The verifier
    knows the wrapper (:func:`..frozen.enlist`), so a wrapper changed to skip it is itself a change."""
    from .. import frozen
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        return fn
    box = [frozen.watch()]

    def checked(*args, **kwargs):
        watcher = box[0]
        value = fn(*args, **kwargs)
        if watcher is not None:
            frozen.raise_found(watcher.send(None))
        return value
    checked.__name__ = getattr(fn, "__name__", name)
    frozen.enlist(checked, box)
    return checked


def _check() -> None:
    """Compare the given code with its snapshot now (a harness that instruments given code itself,
    and takes the instruments off again, checks after that)."""
    from .. import frozen
    if frozen.watch() is not None:
        frozen.check()


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
        import os

        from ..allowed_comm import allow_only
        drivers = sorted(m for m in sys.modules if m == "reference" or m.startswith("reference."))
        fd = os.environ.get("GRADER_REFEREE_FD")
        allow_only(spec["comm"], ex, limits=spec.get("limits"), driver=spec.get("driver_comm", ()),
                   driver_modules=drivers if spec.get("driver_comm") else (), ring=bool(spec.get("ring")),
                   counted=spec.get("counted", ()), referee_fd=int(fd) if fd else None)


def import_learner(module: str) -> None:
    """Import the learner's module now (a harness that needs it imports it again; one that does not
    never asked for it: a missing module is left for the harness to report)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise


def guarded(module: str, spec: dict, harness: str, local: bool, *args: Any) -> Any:
    """On a rank: :func:`lock` the exercise, restore the frozen given code, then run
    ``harness(module, *args)`` (``local``) or ``harness(module, mine, *shared)`` (``args`` is
    ``(*shared, mine)``: this rank's own inputs come last from the runner), and refuse the result if
    the learner's code changed given code."""
    from .. import frozen
    if frozen.current() is None:          # a spawned rank (GRADER_SPAWN=1): freeze here, before any learner code
        lock(spec, in_rank=False)
        frozen.load_given()
        frozen.take()
    lock(spec, in_rank=True)
    watcher, raise_found = frozen.watch(), frozen.raise_found    # held in this frame from here on
    snapshot = frozen.current()
    snapshot.restore()
    raise_found(watcher.send(None))   # what an earlier call left behind is undone, or the call refused
    frozen.check_threads()            # the first call in this process counts the threads it started with
    import_learner(module)            # what the learner's module changes as it is imported ...
    snapshot.restore()                # ... is undone; what its functions change while they run is refused
    mod, _, name = harness.partition(":")
    fn = getattr(importlib.import_module(mod), name)
    value = fn(module, *args) if local else fn(module, args[-1], *args[:-1])
    found = watcher.send(None)        # the verifier this frame took before any learner code of this call
    if found:
        raise_found(found)
        raise RuntimeError("the given code was changed: " + "; ".join(found[:3]))   # raise_found was swapped
    return plain(value)


def call(module: str, name: str, args: Sequence[Any] = (), kwargs: dict | None = None,
         return_inputs: bool = False) -> Any:
    """``module.name(*args, **kwargs)`` in one process (``return_inputs``: as :func:`call_per_rank`)."""
    return call_per_rank(module, args, name, kwargs, return_inputs)


def raises(module: str, name: str, args: Sequence[Any] = (), kwargs: dict | None = None) -> str | None:
    """The name of the exception ``module.name(*args, **kwargs)`` raises, or None if it returns."""
    try:
        function(module, name)(*args, **(kwargs or {}))
    except Exception as e:
        return type(e).__name__
    return None


def call_per_rank(module: str, mine: Sequence[Any], name: str, kwargs: dict | None = None,
                  return_inputs: bool = False) -> Any:
    """On each rank: ``module.name(*mine, **kwargs)`` — ``mine`` is this rank's arguments.
    ``return_inputs``: ``{"value": ..., "inputs": mine as they are after the call, "aliases": which of them
    the value IS}`` (the grader compares them with what it sent: an exercise that promises to leave its
    input alone and return a new tensor)."""
    value = function(module, name)(*mine, **(kwargs or {}))
    if not return_inputs:
        return value
    return {"value": value, "inputs": list(mine), "aliases": [i for i, a in enumerate(mine) if a is value]}
