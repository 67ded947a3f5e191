"""Lecture 4a, part 2 — column- and row-parallel linear layers (Megatron-LM arXiv:1909.08053 §3).

A linear layer ``Y = X·Aᵀ + b`` with ``A`` (out, in) as ``nn.Linear`` stores it can be cut two ways
over W ranks::

    column-parallel: cut A's OUTPUT rows            row-parallel: cut A's INPUT columns
                                                                 in
       A (out, in)        Y = [Y_0 | Y_1 | ...]        A (out, in) ┌────┬────┐
     ┌──────────┐ rank 0                                           │ A_0│ A_1│   rank r holds A_r
     │   A_0    │ ─▶ Y_0 = X·A_0ᵀ + b_0                            │    │    │   (out, in/W)
     ├──────────┤ rank 1                                           └────┴────┘
     │   A_1    │ ─▶ Y_1 = X·A_1ᵀ + b_1              Y = Σ_r X_r·A_rᵀ  + b    (X_r = X[..., r-th slice])
     └──────────┘                                  one all-reduce (g), bias added ONCE after it
    X replicated in, Y split along its last dim    X split along its last dim in, Y replicated out

Column then row needs no communication in between: the column layer's output slice is exactly
the row layer's input slice.  So an MLP costs one all-reduce forward (g, after the row layer) and
one backward (f, before the column layer).

    column_parallel_linear, row_parallel_linear     the functional forms        (exercise 4.2)
    linear_shard                                    this rank's slice of an nn.Linear (exercise 4.2)
    LinearWithSequenceParallelGather                the column-parallel linear under sequence
                                                    parallelism that saves only x's S/W rows
    ColumnParallelLinear, RowParallelLinear         modules with ``from_linear``

Under sequence parallelism ``column_parallel_linear`` (exercise 4.2) is the plain composition
gather → ``F.linear``: autograd then saves the GATHERED input, S·B·in on every rank.  The modules
do what Megatron-Core does (Korthikanti et al. §4.2.2): save the S/W rows, all-gather them again
in the backward (:class:`LinearWithSequenceParallelGather`).

Each module says how its parameters are cut (``CUTS``, as Megatron marks a parameter
``tensor_model_parallel``): "column" (rows of the weight and the bias), "row" (columns of the
weight; the bias is "replicated").  :mod:`reference.compose` builds its shard table from them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .regions import (_gather_seq, _reduce_scatter_seq, copy_to_tensor_region, gather_from_sequence_region,
                      gather_from_tensor_region, reduce_from_tensor_region, reduce_scatter_to_sequence_region,
                      scatter_to_tensor_region)

__all__ = ["linear_shard", "column_parallel_linear", "row_parallel_linear", "LinearWithSequenceParallelGather",
           "linear_with_sequence_parallel_gather", "ColumnParallelLinear", "RowParallelLinear"]


def linear_shard(weight: torch.Tensor, bias: torch.Tensor | None, style: str, group=None):
    """This rank's contiguous shard of a full linear layer's ``weight`` (out, in) and ``bias`` (out,).

    style "column": rows ``r·out/W … (r+1)·out/W`` of the weight and the same slice of the bias.
    style "row":    columns ``r·in/W … (r+1)·in/W`` of the weight; the WHOLE bias (added once,
                    after the all-reduce).  Returns ``(weight_shard, bias_or_None)``, new tensors.
    ValueError (on every rank, nothing sent) if the cut dimension does not divide by W.

    Graded on: the column and row shards of a weight and bias on 2 and 3 ranks, bitwise.
    """
    W, r = comm.world_size(group), comm.rank(group)
    if style not in ("column", "row"):
        raise ValueError(f"style must be 'column' or 'row', got {style!r}")
    dim = 0 if style == "column" else 1
    n = weight.shape[dim]
    if n % W:
        raise ValueError(f"{style}-parallel: dimension {n} of the weight {tuple(weight.shape)} "
                         f"does not split evenly over {W} ranks")
    w = weight.detach().narrow(dim, r * n // W, n // W).clone()
    if bias is None:
        return w, None
    b = bias.detach().narrow(0, r * n // W, n // W).clone() if style == "column" else bias.detach().clone()
    return w, b


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
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"column-parallel linear: input has {x.shape[-1]} features, weight expects {weight.shape[-1]}")
    if gather_output and sequence_parallel:
        raise ValueError("column-parallel linear: gather_output is not supported with sequence_parallel")
    if sequence_parallel:
        x = gather_from_sequence_region(x, group, **meta)
    else:
        x = copy_to_tensor_region(x, group, **meta)
    y = F.linear(x, weight, bias)
    return gather_from_tensor_region(y, group, **meta) if gather_output else y


class LinearWithSequenceParallelGather(torch.autograd.Function):
    """``y = all-gather(x)·Wᵀ + b`` that keeps x's SHARD for the backward, not the gathered x.

    x: (S/W, ..., in) this rank's sequence rows; weight: (out/W, in); bias: (out/W,) or None;
    y: (S, ..., out/W).  Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication`` with
    ``sequence_parallel=True`` (Korthikanti et al., arXiv:2205.05198 §4.2.2)::

        forward                               backward  (dy: (S, ..., out/W))
        x_full = all-gather(x)       g-bar    x_full = all-gather(x), again      what="sp_regather"
        y = x_full·Wᵀ + b                     dx = reduce-scatter(dy·W)          g-bar  (dy·W: (S, ..., in), partial)
        saved: x (S/W rows) and W             dW = dyᵀ·x_full,  db = Σ dy

    Memory: S/W·B·in values kept instead of S·B·in (qkv's and fc1's inputs are 4 of the paper's
    34·sbh/t).  Bytes: one more all-gather of x per layer and backward, ``(W-1)/W · S·B·in`` per rank
    (Megatron overlaps it with the dX matmul, and the reduce-scatter with the dW matmul; here they run
    one after the other).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, meta):
        ctx.group, ctx.meta, ctx.has_bias = group, meta, bias is not None
        ctx.save_for_backward(x, weight)                    # the shard: what autograd keeps
        x_full = _gather_seq(x, group, operator="g-bar", direction="forward", **meta)
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])                  # (S·B, out/W)
        if need_w:                                          # (Megatron posts it first, overlapped with dX)
            x_full = _gather_seq(x, ctx.group, **{**ctx.meta, "operator": "g-bar", "direction": "backward",
                                                  "what": "sp_regather"})
        if need_x:
            dx = _reduce_scatter_seq(dy.matmul(weight), ctx.group, operator="g-bar", direction="backward",
                                     **ctx.meta)
        if need_w:
            dw = dy2.t().matmul(x_full.reshape(-1, x_full.shape[-1]))
        if need_b and ctx.has_bias:
            db = dy2.sum(0)
        return dx, dw, db, None, None


def linear_with_sequence_parallel_gather(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                         group=None, **meta) -> torch.Tensor:
    """:class:`LinearWithSequenceParallelGather`: x (S/W, ..., in) → (S, ..., out/W), saving x's S/W rows."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"column-parallel linear: input has {x.shape[-1]} features, weight expects {weight.shape[-1]}")
    return LinearWithSequenceParallelGather.apply(x, weight, bias, group, meta)


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
    if not input_is_parallel:
        x = scatter_to_tensor_region(x, group, **meta)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"row-parallel linear: input has {x.shape[-1]} features, weight expects {weight.shape[-1]}")
    partial = F.linear(x, weight)
    if sequence_parallel:
        y = reduce_scatter_to_sequence_region(partial, group, **meta)
    else:
        y = reduce_from_tensor_region(partial, group, **meta)
    return y + bias if bias is not None else y


class _ParallelLinear(nn.Module):
    """This rank's shard of an ``nn.Linear``: :func:`linear_shard` of ``linear`` (``from_linear``),
    or of a new ``nn.Linear(in_features, out_features)`` drawn from the same torch seed on every rank."""

    STYLE = ""    # "column" | "row": the dimension of the weight that linear_shard cuts

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None, name: str = "",
                 linear: nn.Linear | None = None):
        super().__init__()
        if linear is None:
            linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)  # same torch seed on every rank
        w, b = linear_shard(linear.weight, linear.bias, self.STYLE, group)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.name = group, sequence_parallel, name
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(b) if b is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs):
        """This rank's shard of a full ``nn.Linear`` (the same module on every rank), or of anything
        with its ``weight``, ``bias``, ``in_features``, ``out_features``."""
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                   linear=linear, **kwargs)

    def _meta(self):
        return {"layer": self.name} if self.name else {}

    def one_rank(self) -> bool:
        """A group of one rank (a grid without tp): the layer is a plain ``nn.Linear``, and ``forward``
        calls its kernel directly — f and g would be identities that still cost an autograd node (and
        g a copy) per call, several percent of a small model's step."""
        return comm.world_size(self.group) == 1


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear`` with its output features split over ``group``: ``.weight`` (out/W, in) holds
    rows ``r·out/W … (r+1)·out/W``, ``.bias`` the same slice.  Input replicated (or sequence-sharded
    with ``sequence_parallel``); output (..., out/W), or replicated with ``gather_output``.

    ``save_shard`` (sequence parallelism only, default True): keep x's S/W rows for the backward and
    gather them again there (:class:`LinearWithSequenceParallelGather`, as Megatron-Core does);
    False: :func:`column_parallel_linear`, which keeps the gathered S rows."""

    STYLE = "column"
    CUTS = {"weight": "column", "bias": "column"}    # how each parameter is cut; an instance may override it

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, dtype: torch.dtype | None = None, name: str = "",
                 linear: nn.Linear | None = None, save_shard: bool = True):
        super().__init__(in_features, out_features, bias=bias, group=group, sequence_parallel=sequence_parallel,
                         dtype=dtype, name=name, linear=linear)
        self.gather_output, self.save_shard = gather_output, save_shard

    def forward(self, x):
        if self.one_rank():                     # nothing to split or gather: nn.Linear's own kernel
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel and self.save_shard and not self.gather_output:
            return linear_with_sequence_parallel_gather(x, self.weight, self.bias, self.group, **self._meta())
        return column_parallel_linear(x, self.weight, self.bias, self.group, gather_output=self.gather_output,
                                      sequence_parallel=self.sequence_parallel, **self._meta())


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear`` with its input features split over ``group``: ``.weight`` (out, in/W) holds
    columns ``r·in/W … (r+1)·in/W``, ``.bias`` the whole bias, added once after the all-reduce.
    Input (..., in/W) (or replicated if not ``input_is_parallel``); output replicated (or
    sequence-sharded with ``sequence_parallel``)."""

    STYLE = "row"
    CUTS = {"weight": "row", "bias": "replicated"}    # the bias is added once, after the sum: whole on every rank

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False, dtype: torch.dtype | None = None, name: str = "",
                 linear: nn.Linear | None = None):
        super().__init__(in_features, out_features, bias=bias, group=group, sequence_parallel=sequence_parallel,
                         dtype=dtype, name=name, linear=linear)
        self.input_is_parallel = input_is_parallel

    def forward(self, x):
        if self.one_rank():                     # nothing to sum: nn.Linear's own kernel (bias fused)
            return F.linear(x, self.weight, self.bias)
        return row_parallel_linear(x, self.weight, self.bias, self.group, input_is_parallel=self.input_is_parallel,
                                   sequence_parallel=self.sequence_parallel, **self._meta())
