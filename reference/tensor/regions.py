"""Lecture 4a, part 1 — the conjugate operators that connect a tensor-parallel region to the rest.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, figure 3) names two operators, ``f`` and ``g``.
A tensor-parallel region starts where every rank holds the SAME activation (replicated) and each
rank then works on its own slice of the weights; it ends where the ranks' partial results are
summed back into one replicated activation::

            replicated X                                 replicated Y
       ──────────▶ f ──▶ [ rank r: X·A_rᵀ → act → ·B_rᵀ ] ──▶ g ──────────▶
                  forward:  identity                          forward:  all-reduce (sum)
                  backward: all-reduce (sum)                  backward: identity

Why ``f``'s backward is an all-reduce: every rank used the same X, and each rank's branch
contributes its own part of ∂L/∂X.  The true gradient is the SUM of the parts — the adjoint of
"copy X to W ranks" is "sum W gradients".  ``g`` is the mirror image: its forward sums, so its
backward hands the (replicated) gradient to every rank unchanged.  Get either half wrong and the
forward still looks right while the gradients are silently wrong.

    copy_to_tensor_region        f   identity / all-reduce            (exercise 4.1)
    reduce_from_tensor_region    g   all-reduce / identity            (exercise 4.1)
    scatter_to_tensor_region         keep my slice of the last dim / all-gather it
    gather_from_tensor_region        all-gather the last dim / keep my slice

Megatron sequence parallelism (Korthikanti et al., arXiv:2205.05198 §4.2.2) shards the regions
between the tensor-parallel ones along the SEQUENCE (dim 0 here, activations are laid out
(S, B, d) as in Megatron, so a sequence shard is one contiguous block).  ``f`` becomes an
all-gather and ``g`` a reduce-scatter; their backwards swap:

    gather_from_sequence_region          all-gather dim 0 / reduce-scatter dim 0    ("g-bar")
    reduce_scatter_to_sequence_region    reduce-scatter dim 0 / all-gather dim 0    ("g")

A ring all-reduce IS a reduce-scatter followed by an all-gather, so sequence parallelism moves the
same bytes as plain tensor parallelism and saves the replicated activations' memory.

Every collective goes through :mod:`reference.comm` with ``operator`` ("f", "g", ...) and
``direction`` ("forward"/"backward") in its trace meta, plus whatever ``meta`` the caller passes
(the layers pass ``layer=``).  With one rank nothing is sent.
"""
from __future__ import annotations

import torch

from .. import comm

__all__ = ["copy_to_tensor_region", "reduce_from_tensor_region", "scatter_to_tensor_region",
           "gather_from_tensor_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region"]


# ----------------------------------------------------------------------------------------------
# f and g (exercise 4.1)
#
# Each autograd Function is defined once, on the first call, and kept as an attribute of its
# function.  It is defined inside the function's body, not beside it, because that class IS the
# exercise: the student release replaces the body, and the body needs nothing else of this module.


def copy_to_tensor_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum over ``group``) backward.

    x: a replicated activation (the same on every rank), any shape.  Returns x (a view) whose
    gradient is summed over the ranks on the way back: ∂L/∂x = Σ_r ∂L_r/∂x.  ``meta`` goes into
    the trace event of the backward all-reduce (with ``operator="f"``, ``direction="backward"``).

    Graded on: the forward value and the input gradient on 2–4 ranks (an autograd graph that reaches x).
    """
    if not hasattr(copy_to_tensor_region, "Function"):
        class CopyToTensorRegion(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group, meta):
                ctx.group, ctx.meta = group, meta
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                if comm.world_size(ctx.group) == 1:
                    return grad, None, None
                return comm.all_reduce(grad.contiguous().clone(), group=ctx.group, operator="f", direction="backward",
                                       **ctx.meta), None, None

        copy_to_tensor_region.Function = CopyToTensorRegion
    return copy_to_tensor_region.Function.apply(x, group, meta)


def reduce_from_tensor_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum over ``group``) forward, identity backward.

    x: this rank's partial result, any shape (the same shape on every rank).  Returns Σ_r x_r, the
    same on every rank; the gradient passes back unchanged to every rank's partial.  ``meta`` goes
    into the trace event of the forward all-reduce (with ``operator="g"``, ``direction="forward"``).

    Graded on: the forward value and the input gradient on 2–4 ranks (an autograd graph that reaches x).
    """
    if not hasattr(reduce_from_tensor_region, "Function"):
        class ReduceFromTensorRegion(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, group, meta):
                if comm.world_size(group) == 1:
                    return x.clone()
                return comm.all_reduce(x.contiguous().clone(), group=group, operator="g", direction="forward", **meta)

            @staticmethod
            def backward(ctx, grad):
                return grad, None, None

        reduce_from_tensor_region.Function = ReduceFromTensorRegion
    return reduce_from_tensor_region.Function.apply(x, group, meta)


# ----------------------------------------------------------------------------------------------
# Scatter / gather along the last (hidden) dimension


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    W, r = comm.world_size(group), comm.rank(group)
    if x.shape[-1] % W:
        raise ValueError(f"last dimension {x.shape[-1]} does not split evenly over {W} ranks")
    return x.chunk(W, dim=-1)[r].contiguous()


def _gather_last(x: torch.Tensor, group, **meta) -> torch.Tensor:
    if comm.world_size(group) == 1:
        return x
    return torch.cat(comm.all_gather(x.contiguous(), group=group, **meta), dim=-1)


class _ScatterToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meta):
        ctx.group, ctx.meta = group, meta
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group, operator="scatter", direction="backward", **ctx.meta), None, None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meta):
        ctx.group = group
        return _gather_last(x, group, operator="gather", direction="forward", **meta)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None, None


def scatter_to_tensor_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Keep this rank's contiguous slice of the last dimension (forward); all-gather it (backward).

    x: (..., n) replicated → (..., n/W).  Used by a row-parallel layer whose input is not yet split.
    """
    return _ScatterToTensorRegion.apply(x, group, meta)


def gather_from_tensor_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """All-gather the last dimension (forward); keep this rank's slice of the gradient (backward).

    x: (..., n/W) → (..., n) replicated.  Used by a column-parallel layer with ``gather_output``.
    """
    return _GatherFromTensorRegion.apply(x, group, meta)


# ----------------------------------------------------------------------------------------------
# Sequence parallelism: all-gather / reduce-scatter along the sequence (dim 0)


def _gather_seq(x: torch.Tensor, group, **meta) -> torch.Tensor:
    if comm.world_size(group) == 1:
        return x
    return torch.cat(comm.all_gather(x.contiguous(), group=group, **meta), dim=0)


def _reduce_scatter_seq(x: torch.Tensor, group, **meta) -> torch.Tensor:
    W = comm.world_size(group)
    if x.shape[0] % W:
        raise ValueError(f"sequence length {x.shape[0]} does not split evenly over {W} ranks")
    if W == 1:
        return x.clone()
    chunks = list(x.contiguous().chunk(W, dim=0))
    out = torch.empty_like(chunks[0])
    return comm.reduce_scatter(out, chunks, group=group, **meta)


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meta):
        ctx.group, ctx.meta = group, meta
        return _gather_seq(x, group, operator="g-bar", direction="forward", **meta)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group, operator="g-bar", direction="backward", **ctx.meta), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meta):
        ctx.group, ctx.meta = group, meta
        return _reduce_scatter_seq(x, group, operator="g", direction="forward", **meta)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, operator="g", direction="backward", **ctx.meta), None, None


def gather_from_sequence_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Sequence parallelism's entry into a tensor-parallel region (replaces ``f``).

    x: (S/W, ...) this rank's sequence shard → (S, ...) the whole sequence (all-gather, forward);
    backward: reduce-scatter of the gradient, so each rank gets the SUM over ranks of its rows.
    """
    return _GatherFromSequenceRegion.apply(x, group, meta)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group=None, **meta) -> torch.Tensor:
    """Sequence parallelism's exit from a tensor-parallel region (replaces ``g``).

    x: (S, ...) this rank's partial sums → (S/W, ...) the summed rows of this rank's sequence shard
    (reduce-scatter, forward); backward: all-gather of the gradient.
    """
    return _ReduceScatterToSequenceRegion.apply(x, group, meta)
