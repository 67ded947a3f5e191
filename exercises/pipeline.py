"""Lecture 4b exercises — the pipeline axis.  Reference: ``reference/pipeline/``.

    4.4  one_f_one_b                    the 1F1B order of one stage (warm-up, steady state, cool-down)
    4.5  forward_step, backward_step    one stage, one micro-batch: receive, compute, stash, send
    4.6  bubble_fraction                the idle fraction of a schedule, by formula

Given (not exercises): :class:`Action` (``Action("F", 3)`` = forward of micro-batch 3; fields
``kind``, ``microbatch``, ``chunk``), :class:`Link` (a stage's wires: ``is_first``, ``is_last``,
``recv_activation(i)``, ``send_activation(t, i)``, ``recv_gradient(i)``, ``send_gradient(t, i)``),
and the rest of ``reference.pipeline``: ``schedule``, ``simulate``, ``render``, ``run_pipeline``.
Check your work with ``check("4.4")`` in the notebook or ``python -m exercises.grade 4.4``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from reference.pipeline.executor import Link  # noqa: F401  (given: the stage's wires)
from reference.pipeline.schedules import Action  # noqa: F401  (given: one step of a stage's order)

__all__ = ["Action", "Link", "one_f_one_b", "forward_step", "backward_step", "bubble_fraction"]


# ----------------------------------------------------------------------------------------------
# 4.4 — the 1F1B order


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-Flush) order of one stage — exercise 4.4.

    Warm-up: min(m, p − stage − 1) forwards.  Steady state: one forward, then one backward (the
    oldest micro-batch in flight), until every forward has run.  Cool-down: the backwards left.
    Stage s thus holds at most p − s micro-batches' activations at once.

    Graded on: every stage's order for up to 24 stages and 6p micro-batches drawn at random, m = p and one stage,
    and the order run on 3 real ranks.
    """
    raise NotImplementedError(
        'Exercise 4.4 (one_f_one_b): Stage s must have sent some forwards down the pipe before the first '
        'backward can come back up: how many micro-batches are in flight below it when the last stage starts '
        'its first backward? After that, alternate. More help: hint("4.4").')


# ----------------------------------------------------------------------------------------------
# 4.5 — one stage, one micro-batch


def forward_step(module: nn.Module, microbatch: int, link: Link, stash: dict, *, inputs: torch.Tensor | None = None,
                 target: torch.Tensor | None = None, loss_fn: Callable | None = None,
                 num_microbatches: int = 1) -> torch.Tensor | None:
    """F of one micro-batch on one stage.

    x = ``inputs`` (first stage: this micro-batch's rows, (b/m, …)) or the activation received
    from the stage before (made a leaf that requires grad, so backward yields its gradient);
    y = module(x).  Last stage: loss = loss_fn(y, target) / num_microbatches, stash (x, loss),
    return loss.detach().  Other stages: send y (detached) to the next stage, stash (x, y),
    return None.  ``stash`` maps micro-batch → what :func:`backward_step` needs.

    Graded on: the loss and every gradient of real pipelines (GPipe, 1F1B) equal to one process's, and the messages
    your steps send, recorded by the grader's own Link.
    """
    raise NotImplementedError(
        'Exercise 4.5 (forward_step): The first stage reads inputs, the others link.recv_activation(microbatch); '
        'run the module; the last stage computes the loss, the others link.send_activation(...). Keep in stash '
        'what the backward of this micro-batch will need. More help: hint("4.5").')


def backward_step(microbatch: int, link: Link, stash: dict) -> None:
    """B of one micro-batch on one stage: take (x, y) out of the stash (freeing it), backprop the
    gradient received from the next stage (last stage: y is the loss, its own gradient is 1) —
    parameters' ``.grad`` accumulate — and send x's gradient to the stage before (if any).

    Graded on: the loss and every gradient of real pipelines (GPipe, 1F1B) equal to one process's, and the messages
    your steps send, recorded by the grader's own Link.
    """
    raise NotImplementedError(
        'Exercise 4.5 (backward_step): The mirror image of forward_step: what comes in is a gradient from the '
        'next stage (none on the last stage: there y is the loss), what goes out is the gradient of this stage\'s '
        'input. More help: hint("4.5").')


# ----------------------------------------------------------------------------------------------
# 4.6 — the bubble


def bubble_fraction(name: str, num_stages: int, num_microbatches: int, *, virtual_stages: int = 1) -> float:
    """The idle fraction of a schedule, by formula — exercise 4.6.

    name: "gpipe", "1f1b", "interleaved_1f1b" (v = ``virtual_stages`` chunks per rank) or "zb_h1".
    With every F, B (and W) one slot: idle slots / (p × the slots from the first start to the last end),
    which :func:`simulate` + :func:`measured_bubble` on :func:`schedule` measure (notebook 04b
    derives each case).  Raises ValueError for what :func:`schedule` refuses: an unknown name;
    p, m or v not an integer ≥ 1; interleaved_1f1b with v < 2 or m not a multiple of p; v ≠ 1
    with any other schedule; 1f1b or zb_h1 with m < p.

    Graded on: the bubble of GPipe, 1F1B and interleaved 1F1B for up to thousands of stages and millions of micro-
    batches (only a formula finishes in time), and ValueError for impossible sizes.
    """
    raise NotImplementedError(
        'Exercise 4.6 (bubble_fraction): Count in slots. While the first micro-batch travels down and the last '
        'one comes back, how many slots does each stage wait, and how many does it work in total? More help: '
        'hint("4.6").')
