"""Grader-owned functions that run inside the runner (and its ranks) and call learner code.

Each takes the learner module's dotted name first.  They return plain values (tensors, numbers,
lists, dicts) and never judge anything: judging happens in the grader process.
"""
from __future__ import annotations

import importlib
from typing import Any, Sequence

import torch


def function(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def with_allowed_comm(module: str, allowed: Sequence[str], exercise: str, harness: str, *args: Any) -> Any:
    """Switch off the communication the exercise does not offer (before the learner's module is
    imported in this rank), then run ``harness(module, *args)``."""
    from .allowed_comm import allow_only
    allow_only(allowed, exercise)
    mod, _, name = harness.partition(":")
    return getattr(importlib.import_module(mod), name)(module, *args)


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
