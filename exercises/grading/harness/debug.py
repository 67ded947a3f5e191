"""Lecture 6's harness: calls of the learner's 6.1–6.3 in the runner and its ranks, returning plain values."""
from __future__ import annotations

from . import function as _fn


def diagnose_call(module: str, report: dict):
    return _fn(module, "diagnose_hang")(report)


def divergence_call(module: str, parallel: dict, single: dict, kwargs: dict):
    """The learner's first_divergence on two runs handed over as plain data (rebuilt as Runs here)."""
    from reference.debug.records import from_plain
    return _fn(module, "first_divergence")(from_plain(parallel), from_plain(single), **kwargs)


def accumulate_per_rank(module: str, mine: list, state: dict, config: dict):
    """On each rank: the tiny GPT of ``config`` with the weights ``state`` (the same everywhere), the learner's
    accumulate_gradients over this rank's own micro-batches ``mine`` (a list of (x, y); no rank gets another's);
    its loss and gradients by name."""
    from reference.gpt import GPTConfig, TinyGPT
    model = TinyGPT(GPTConfig(**config)).double()
    model.load_state_dict(state)
    loss = _fn(module, "accumulate_gradients")(model, [(x, y) for x, y in mine], group=None)
    return {"loss": float(loss) if isinstance(loss, (int, float)) or hasattr(loss, "item") else loss,
            "grads": {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}}
