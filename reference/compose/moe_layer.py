"""Lecture 5c, part 1 (experts) — TinyGPT's MoE layer on the grid: the expert grid folded over the stage.

:class:`ExpertParallelMLP` swaps a TinyGPT ``MoEMLP`` for lecture 5b's
:class:`reference.moe.ExpertParallelMoE` over this rank's ep group, its experts cut over the
expert-tensor group, under the single-process names (``moe.experts.5.0.weight``).  Two layouts:

    etp = tp (unfolded, Megatron's default)        etp = 1 < tp (folded; DeepSeek-V3's EP 64 over TP 2 × DP 32)
    ─────────────────────────────────────────      ───────────────────────────────────────────────────────────
    every tp rank routes ALL the stage's tokens     the tp ranks hold the same tokens, so each routes only its
    (the same ones: tp copies); the ep group is     1/tp of them (split, as sequence parallelism would leave them);
    carved from dp·cp, each expert cut over tp      the ep group may take the tp ranks too (ep up to tp·cp·dp),
    like the dense MLP                              each expert whole on one rank; outputs all-gathered over tp

    x (S·B, d) ──route──▶ all-to-all(ep) ──▶ experts (cut over etp) ──▶ all-to-all(ep) ──▶ y
    folded:  x ──keep my 1/tp rows──▶ … the same over ep … ──▶ y_mine ──all-gather over tp──▶ y

The split's backward all-gathers the input gradient (each tp rank saw other rows); the gather's
backward keeps this rank's rows (the gradient above is the same on every tp rank).  The router
then has each tp rank's share of its gradient: it is summed over tp like a sequence-parallel
LayerNorm (:meth:`.parallel_gpt.ParallelGPT.sequence_parallel_params`), then averaged over dp_cp.
The balance loss covers every rank that routes (dp_cp, or the whole stage when folded), with its
gradient scaled by dp·cp (:func:`reference.moe.parallel.mean_share`) so the tp-sum and the
dp_cp-mean give α·∂aux exactly.  Shared experts are dense: they run on all the tokens, cut over tp
like the MLP.  Loss-free balancing counts the loads over the same routing ranks (:meth:`update_bias`).

The router loss with pp > 1.  One process minimises L = CE + α·mean_l aux_l + β·mean_l z_l over the
model's N_moe MoE layers, but a stage's router losses never reach the last stage, where the
executor back-propagates CE/m per micro-batch.  As Megatron-Core does (``MoEAuxLossAutoScaler``),
the layer returns its output through :class:`AuxLossAutoScaler`: unchanged forward, and in
backward it also gives its router loss α·aux + β·z the gradient 1/N_moe/m, so every stage
back-propagates its own router losses with the weight the single-process loss gives them.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..moe import ExpertParallelMoE
from ..tensor import ColumnParallelLinear, RowParallelLinear

__all__ = ["ExpertParallelMLP", "AuxLossAutoScaler"]


class AuxLossAutoScaler(torch.autograd.Function):
    """``AuxLossAutoScaler.apply(y, aux, scale)``: y unchanged forward; backward passes y's gradient
    through and also gives ``aux`` the gradient ``scale`` (= ∂L/∂aux), so the aux loss is back-
    propagated on the stage that computed it (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_y, torch.full_like(aux, ctx.scale), None


class _KeepMyRows(torch.autograd.Function):
    """Forward: this tp rank's 1/tp of the rows.  Backward: all-gather the rows' gradients over tp."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(comm.world_size(group))[comm.rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, "backward"), None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather every tp rank's rows.  Backward: keep this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(comm.world_size(ctx.group))[comm.rank(ctx.group)].contiguous(), None


def _gather_rows(x: torch.Tensor, group, direction: str) -> torch.Tensor:
    return torch.cat(comm.all_gather(x.contiguous(), group=group, operator="moe-gather", direction=direction))


def _mean_over(value: torch.Tensor, group) -> torch.Tensor:
    """The mean of ``value`` over ``group`` in value, 1/|G| of its gradient locally (one all-reduce)."""
    n = comm.world_size(group)
    share = value / n
    total = share.detach().clone().reshape(1)
    comm.all_reduce(total, group=group, what="z_loss")
    return share + (total[0] - share.detach())


class ExpertParallelMLP(nn.Module):
    """TinyGPT's MoE layer over (ep, etp): the module docstring.  ``groups``: the model's AxisGroups;
    ``coords``: this rank's; ``cfg``: the GPTConfig.  Experts are kept by global id, so
    ``moe.experts.5.0.weight`` is the single-process name.

    ``aux_scale`` None (pp = 1): ``aux_loss`` and ``z_loss`` are left for ``loss_fn``.  A number (pp > 1):
    the output goes through :class:`AuxLossAutoScaler` with that weight for the router loss
    α·aux + β·z, and ``aux_weighted`` accumulates aux_scale · (α·aux + β·z) over the step's micro-batches.
    """

    def __init__(self, moe_mlp, groups, grid, coords: dict, cfg, *, name: str = "mlp"):
        super().__init__()
        layer = moe_mlp.moe
        self.splits = grid.etp != grid.tp                    # folded: each tp rank routes 1/tp of the tokens
        self.tp_group = groups["tp"]
        self.router_group = groups["tp_dp_cp"] if self.splits else groups["dp_cp"]
        self.moe = ExpertParallelMoE.from_layer(layer, groups["ep"], aux_group=self.router_group,
                                                aux_ranks=grid.dp * grid.cp)
        expert_group = groups["tp"] if grid.etp == grid.tp else groups["etp"]
        ids = range(self.moe.first_expert, self.moe.first_expert + len(self.moe.experts))
        self.moe.experts = nn.ModuleDict({
            str(e): _cut(fc1, fc2, expert_group, f"{name}.moe.experts.{e}") for e, (fc1, _, fc2) in
            zip(ids, self.moe.experts)})
        if layer.shared_experts:                             # dense: all the tokens, cut over tp like the MLP
            self.moe.shared = _cut(layer.shared[0], layer.shared[2], self.tp_group, f"{name}.moe.shared")
        self.has_shared = bool(layer.shared_experts)
        self.moe.add_shared = False                          # run below, on all the tokens
        self.dp_rank, self.dp, self.coefs = coords["dp"], grid.dp, (cfg.aux_loss_coef, cfg.z_loss_coef)
        self.aux_loss = self.z_loss = None
        self.aux_scale: float | None = None
        self.aux_weighted = 0.0

    def update_bias(self) -> None:
        """Loss-free balancing's step, the loads summed over every rank that routes this stage's tokens."""
        self.moe.update_bias(self.router_group)

    def router_loss(self) -> torch.Tensor:
        """α·aux + β·z of the last forward (β·z only when β ≠ 0, as TinyGPT.loss adds it)."""
        aux_coef, z_coef = self.coefs
        return aux_coef * self.aux_loss + (z_coef * self.z_loss if z_coef else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S, B, d = x.shape
        tokens = x.reshape(S * B, d)                                             # row s·B + b
        sequence = (torch.arange(B, device=x.device) + self.dp_rank * B).repeat(S)
        mine = tokens
        if self.splits:
            tp = comm.world_size(self.tp_group)
            mine, sequence = _KeepMyRows.apply(tokens, self.tp_group), sequence.chunk(tp)[comm.rank(self.tp_group)]
        y, stats = self.moe(mine, sequence, B * self.dp)
        z = stats["z_loss"]
        if self.splits:
            y = _GatherRows.apply(y, self.tp_group)
            if self.coefs[1]:
                z = _mean_over(z, self.tp_group)
        if self.has_shared:
            y = y + self.moe.shared(tokens)
        self.aux_loss, self.z_loss = stats["aux_loss"], z
        if self.aux_scale is not None:
            loss = self.router_loss()
            y = AuxLossAutoScaler.apply(y, loss, self.aux_scale)
            self.aux_weighted += self.aux_scale * float(loss.detach())
        return y.view(S, B, d)


def _cut(fc1: nn.Linear, fc2: nn.Linear, group, name: str) -> nn.Sequential:
    """fc1 → GELU → fc2 as a column- then row-parallel pair over ``group`` (Megatron's MLP cut)."""
    return nn.Sequential(ColumnParallelLinear.from_linear(fc1, group, name=f"{name}.0"), nn.GELU(),
                         RowParallelLinear.from_linear(fc2, group, name=f"{name}.2"))
