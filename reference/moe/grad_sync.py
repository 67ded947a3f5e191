"""Lecture 5b, part 4 — expert parallelism combined with data parallelism: syncing gradients.

The grid.  N ranks all train on different data (data parallelism over the whole world, as in
DeepSpeed-MoE arXiv:2201.05596 and GShard): the dense parameters (attention, router, embeddings)
are replicated on all N.  The experts are sharded over expert-parallel groups of EP ranks, and
each expert is replicated once per EP group, i.e. over an expert-data-parallel group of
N / EP ranks.  N = 4, EP = 2, E = 4 experts::

                     EP group A        EP group B
                   ┌────────────┐    ┌────────────┐
     experts 0,1   │  rank 0    │    │  rank 2    │   expert-dp group {0, 2}
     experts 2,3   │  rank 1    │    │  rank 3    │   expert-dp group {1, 3}
                   └────────────┘    └────────────┘
     dp_group (dense params: router, attention, ...) = all 4 ranks {0, 1, 2, 3}

    dispatch/combine all-to-all:   inside an EP group     ({0,1}, {2,3})
    dense gradient all-reduce:     dp_group               ({0,1,2,3})
    expert gradient all-reduce:    expert_dp_group        ({0,2}, {1,3})

The objective is the mean over all N ranks of each rank's loss, L = (1/N) Σ_r L_r.

Dense parameters: rank r's gradient is ∂L_r/∂θ, so  ∂L/∂θ = (1/N) Σ_{r ∈ dp} ∂L_r/∂θ.

Experts: the all-to-all already brought every token of the EP group to the expert, so rank 0's
gradient of expert 0 is ∂(L_0 + L_1)/∂θ_e — the sum over its EP group.  Summing over the
expert-dp group {0, 2} adds group B's share: Σ_{all N ranks} ∂L_r/∂θ_e.  Divide by N, the FULL
data-parallel size:  ∂L/∂θ_e = (1/N) Σ_{r ∈ expert-dp} (rank r's gradient).

The classic bug divides by the expert-dp size N/EP instead, which is EP times too large (an
all-reduce "average" over the group the gradient was reduced in).  With EP = 2 every expert's
gradient comes out exactly 2×; the full course's ``tests/moe/test_parallel.py`` shows it.

The balance loss.  L_r = task_r + α·aux + β·z_r, where aux is ONE value for a group G of ranks
(the whole batch's, or the EP group's).  Each rank's backward reaches only its own tokens, so the
N-rank average above would give the router (1/|G|)·α·∂aux: the loss silently weakened to α/|G|.
The expert-parallel layer returns aux with its gradient scaled by |G| (``mean_share`` in
:mod:`reference.moe.parallel`), so this function stays a plain average and one step gives the
single-process gradient of  mean task + α·aux + β·z  over the whole batch.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import comm

__all__ = ["sync_moe_gradients"]


def sync_moe_gradients(dense_params: Iterable[torch.Tensor], expert_params: Iterable[torch.Tensor], *,
                       dp_group, expert_dp_group) -> None:
    """Average gradients in place for EP × DP training (exercise 5b.4).

    dense_params: replicated parameters; their ``.grad`` are all-reduced over ``dp_group`` (the
    ranks that see different data; None = the world) and divided by its size N.
    expert_params: this rank's experts; their ``.grad`` are summed over ``expert_dp_group`` (the
    ranks holding the same experts) and divided by N as well — not by the expert-dp size.
    Parameters without a gradient are skipped (the same ones on every rank).

    Graded on: the dense and expert gradients after your sync on 4 ranks with EP = 1, 2 and 4.
    """
    N = comm.world_size(dp_group)
    for p in dense_params:
        if p.grad is not None:
            comm.all_reduce(p.grad, group=dp_group, what="dense_grads")
            p.grad /= N
    for p in expert_params:
        if p.grad is not None:
            comm.all_reduce(p.grad, group=expert_dp_group, what="expert_grads")
            p.grad /= N
