"""Lecture 4a exercises — the tensor axis.  Reference: ``reference/tensor/``.

    4.1  copy_to_tensor_region, reduce_from_tensor_region           Megatron's f and g
    4.2  linear_shard, column_parallel_linear, row_parallel_linear  a parallel MLP
    4.3  vocab_parallel_cross_entropy                               the loss over a split vocabulary

Given (already written for you): the traced collectives in ``reference.comm`` (``comm.all_reduce``,
``comm.all_gather``, ``comm.reduce_scatter``; plain ``torch.distributed`` works too) and the other
region operators in ``reference.tensor.regions`` (scatter/gather, the sequence-parallel pair).
Exercise 4.2 builds on 4.1: once you have written f and g, the reference calls yours.
Stuck?  ``hint("4.1")`` gives the next hint.  Check your work with ``check("4.1")`` in the
notebook or ``python -m exercises.grade 4.1`` in a terminal.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (F.linear)

from reference import comm  # noqa: F401  (traced all_reduce)
from reference.tensor.regions import (  # noqa: F401
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)

__all__ = ["copy_to_tensor_region", "reduce_from_tensor_region", "linear_shard", "column_parallel_linear",
           "row_parallel_linear", "vocab_parallel_cross_entropy"]


# ----------------------------------------------------------------------------------------------
# 4.1 — f and g


def copy_to_tensor_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum over ``group``) backward.

    x: a replicated activation (the same on every rank), any shape.  Returns x (a view) whose
    gradient is summed over the ranks on the way back: ∂L/∂x = Σ_r ∂L_r/∂x.  ``meta`` goes into
    the trace event of the backward all-reduce (with ``operator="f"``, ``direction="backward"``).

    Graded on: the forward value and the input gradient on 2–4 ranks (an autograd graph that reaches x).
    """
    raise NotImplementedError(
        "Exercise 4.1 (copy_to_tensor_region): f is the identity going forward, g sums the ranks' partial "
        "results going forward. Every rank used the same x: what must f's backward do? And what is the "
        'gradient of a sum with respect to each of its terms? More help: hint("4.1").')


def reduce_from_tensor_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum over ``group``) forward, identity backward.

    x: this rank's partial result, any shape (the same shape on every rank).  Returns Σ_r x_r, the
    same on every rank; the gradient passes back unchanged to every rank's partial.  ``meta`` goes
    into the trace event of the forward all-reduce (with ``operator="g"``, ``direction="forward"``).

    Graded on: the forward value and the input gradient on 2–4 ranks (an autograd graph that reaches x).
    """
    raise NotImplementedError(
        "Exercise 4.1 (reduce_from_tensor_region): f is the identity going forward, g sums the ranks' "
        "partial results going forward. Every rank used the same x: what must f's backward do? And what "
        'is the gradient of a sum with respect to each of its terms? More help: hint("4.1").')


# ----------------------------------------------------------------------------------------------
# 4.2 — column- and row-parallel linears


def linear_shard(weight: torch.Tensor, bias: torch.Tensor | None, style: str, group=None):
    """This rank's contiguous shard of a full linear layer's ``weight`` (out, in) and ``bias`` (out,).

    style "column": rows ``r·out/W … (r+1)·out/W`` of the weight and the same slice of the bias.
    style "row":    columns ``r·in/W … (r+1)·in/W`` of the weight; the WHOLE bias (added once,
                    after the all-reduce).  Returns ``(weight_shard, bias_or_None)``, new tensors.
    ValueError (on every rank, nothing sent) if the cut dimension does not divide by W.

    Graded on: the column and row shards of a weight and bias on 2 and 3 ranks, bitwise.
    """
    raise NotImplementedError(
        'Exercise 4.2 (linear_shard): nn.Linear stores weight as (out, in): one style cuts the output '
        'features, the other the input features. Ask of each layer: how does its input enter the '
        'tensor-parallel region, where are the partial products summed, and when is the bias added? More '
        'help: hint("4.2").')


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None, *,
                           gather_output: bool = False, sequence_parallel: bool = False, **meta) -> torch.Tensor:
    """``Y_r = X·A_rᵀ + b_r`` on this rank's rows A_r of the weight.

    x: (..., in) replicated — or, with ``sequence_parallel``, (S/W, ..., in) this rank's sequence
    shard, all-gathered first.  weight: (out/W, in); bias: (out/W,) or None.
    Returns (..., out/W), or (..., out) replicated with ``gather_output``.
    x enters the region through ``f`` (copy_to_tensor_region), so its gradient is summed over ranks.
    ``meta`` (e.g. ``layer="mlp.fc1"``) goes into the trace of every collective.

    Graded on: a parallel MLP's output and every gradient equal to one process's (2–4 ranks, float32 inputs ×30);
    each rank is given its own slices only.
    """
    raise NotImplementedError(
        'Exercise 4.2 (column_parallel_linear): nn.Linear stores weight as (out, in): one style cuts the '
        'output features, the other the input features. Ask of each layer: how does its input enter the '
        'tensor-parallel region, where are the partial products summed, and when is the bias added? More '
        'help: hint("4.2").')


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None, *,
                        input_is_parallel: bool = True, sequence_parallel: bool = False, **meta) -> torch.Tensor:
    """``Y = Σ_r X_r·A_rᵀ + b`` on this rank's columns A_r of the weight.

    x: (..., in/W) this rank's slice (or (..., in) replicated when ``input_is_parallel`` is False,
    then sliced).  weight: (out, in/W); bias: (out,) the whole bias, or None.
    Returns (..., out) replicated: the partial products summed by ``g`` (reduce_from_tensor_region),
    THEN the bias added once.  With ``sequence_parallel`` the sum is a reduce-scatter along dim 0
    and the result is this rank's sequence shard (S/W, ..., out).

    Graded on: a parallel MLP's output and every gradient equal to one process's (2–4 ranks, float32 inputs ×30);
    each rank is given its own slices only.
    """
    raise NotImplementedError(
        'Exercise 4.2 (row_parallel_linear): nn.Linear stores weight as (out, in): one style cuts the '
        'output features, the other the input features. Ask of each layer: how does its input enter the '
        'tensor-parallel region, where are the partial products summed, and when is the bias added? More '
        'help: hint("4.2").')


# ----------------------------------------------------------------------------------------------
# 4.3 — vocabulary-parallel cross-entropy


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy from vocabulary-sharded logits (exercise 4.3).

    logits_shard: (tokens, V/W), this rank's vocabulary ids ``r·V/W … (r+1)·V/W - 1``;
    target: (tokens,) GLOBAL word ids (``ignore_index`` marks tokens without a loss).
    Returns (tokens,) the same on every rank, equal to ``F.cross_entropy(full_logits, target,
    reduction="none")`` (0 where ignored), differentiable in ``logits_shard``.
    Three all-reduces of ``tokens`` numbers each — max, sum of exponentials, target logit — and
    none of vocabulary size; the backward sends nothing: grad = (softmax - one_hot(target)) · dℓ.

    Graded on: the per-token loss and the gradient of your shard equal to one process's (2–4 ranks, logits ×30,
    targets on shard edges, ignored targets); an all-reduce here may carry a few numbers per token, no more.
    """
    raise NotImplementedError(
        'Exercise 4.3 (vocab_parallel_cross_entropy): Never gather the V logits. Which three numbers per '
        'token must the ranks agree on to compute log Σ_v exp(z_v) - z_target without overflow? More '
        'help: hint("4.3").')
