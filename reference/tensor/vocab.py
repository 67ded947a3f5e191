"""Lecture 4a, part 4 — the vocabulary axis: embedding and loss without ever holding all V logits.

With a vocabulary of V words split over W ranks, rank r owns word ids ``r·V/W … (r+1)·V/W - 1``
(Megatron-LM arXiv:1909.08053 §3, "parallelising the input and output embedding")::

    embedding (V, d)          logits (tokens, V)
    ┌────────┐ rank 0         ┌──────┬──────┐
    │ E_0    │ ids 0…V/W-1    │ Z_0  │ Z_1  │  rank r computes Z_r = H·E_rᵀ: (tokens, V/W)
    ├────────┤ rank 1         └──────┴──────┘
    │ E_1    │ ids V/W…                       never gathered: that would be tokens·V numbers
    └────────┘

Embedding: each rank looks up the ids it owns, writes zeros for the others, and one all-reduce
(g) sums the rows: exactly one rank contributed each token's row.

Cross-entropy ``ℓ_t = log Σ_v exp(z_tv) - z_t,target`` from the shards with three all-reduces of
ONE number per token (never of V/W numbers):

    1. m_t   = max over ranks of max_v z_tv        (all-reduce MAX)  — for stability
    2. Σ_t   = Σ over ranks of Σ_v exp(z_tv - m_t)  (all-reduce SUM)
    3. z_t*  = the target's logit, from the rank that owns it, 0 elsewhere (all-reduce SUM)
    ℓ_t = log Σ_t - (z_t* - m_t)

Backward needs no communication: ∂ℓ_t/∂z_tv = softmax_tv - [v = target], and softmax_tv =
exp(z_tv - m_t)/Σ_t is computable from the local shard and the two reduced numbers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .regions import reduce_from_tensor_region, reduce_scatter_to_sequence_region

__all__ = ["vocab_range", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def vocab_range(vocab_size: int, group=None) -> tuple[int, int]:
    """``(first, last + 1)`` word ids this rank owns; ValueError if V does not divide by W."""
    W, r = comm.world_size(group), comm.rank(group)
    if vocab_size % W:
        raise ValueError(f"vocabulary of {vocab_size} cannot be split evenly over {W} ranks")
    n = vocab_size // W
    return r * n, (r + 1) * n


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(V, d)`` with rows ``r·V/W … (r+1)·V/W`` on rank r (``.weight``: (V/W, d)):
    of ``embedding`` (``from_module``), or of a new one drawn from the same torch seed on every rank.

    forward(ids (...)) → (..., d) replicated (one all-reduce); with ``sequence_parallel``, ids are
    (S, ...) and the result is this rank's sequence rows (S/W, ..., d) (one reduce-scatter).
    """

    CUTS = {"weight": "vocab"}    # rows of the vocabulary (reference.compose reads it)

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, sequence_parallel: bool = False,
                 dtype=None, embedding: nn.Embedding | None = None):
        super().__init__()
        self.num_embeddings, self.group, self.sequence_parallel = num_embeddings, group, sequence_parallel
        self.first, self.last = vocab_range(num_embeddings, group)
        if embedding is None:
            embedding = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype)   # same torch seed on every rank
        self.weight = nn.Parameter(embedding.weight.detach()[self.first:self.last].clone())

    @classmethod
    def from_module(cls, emb: nn.Embedding, group=None, *, sequence_parallel: bool = False):
        """This rank's rows of a full ``nn.Embedding`` (the same module on every rank)."""
        return cls(emb.num_embeddings, emb.embedding_dim, group=group, sequence_parallel=sequence_parallel,
                   embedding=emb)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32) \
                or (ids.numel() and (ids.min() < 0 or ids.max() >= self.num_embeddings)):
            raise ValueError(f"ids must be integers in [0, {self.num_embeddings})")
        mine = (ids >= self.first) & (ids < self.last)
        local = torch.where(mine, ids - self.first, torch.zeros_like(ids))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(rows, self.group, layer="embedding")
        return reduce_from_tensor_region(rows, self.group, layer="embedding")


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
    if logits_shard.dim() != 2 or target.dim() != 1 or target.shape[0] != logits_shard.shape[0]:
        raise ValueError(f"logits_shard must be (tokens, V/W) and target (tokens,), got "
                         f"{tuple(logits_shard.shape)} and {tuple(target.shape)}")
    W, r = comm.world_size(group), comm.rank(group)
    n = logits_shard.shape[1]
    first = r * n

    class VocabParallelCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            m = z.max(dim=1).values
            if W > 1:
                comm.all_reduce(m, torch.distributed.ReduceOp.MAX, group=group, what="max", layer="loss")
            e = torch.exp(z - m.unsqueeze(1))
            sum_exp = e.sum(dim=1)
            if W > 1:
                comm.all_reduce(sum_exp, group=group, what="sum_exp", layer="loss")
            ignored = target == ignore_index
            local = target - first
            mine = (local >= 0) & (local < n) & ~ignored
            idx = torch.where(mine, local, torch.zeros_like(local))
            z_target = torch.where(mine, z.gather(1, idx.unsqueeze(1)).squeeze(1) - m, torch.zeros_like(m))
            if W > 1:
                comm.all_reduce(z_target, group=group, what="target_logit", layer="loss")
            loss = torch.where(ignored, torch.zeros_like(m), torch.log(sum_exp) - z_target)
            ctx.save_for_backward(e / sum_exp.unsqueeze(1), idx, mine, ignored)
            return loss

        @staticmethod
        def backward(ctx, grad):
            softmax, idx, mine, ignored = ctx.saved_tensors
            g = softmax.clone()
            rows = torch.nonzero(mine, as_tuple=True)[0]
            g[rows, idx[rows]] -= 1
            g[ignored] = 0
            return g * grad.unsqueeze(1)

    return VocabParallelCrossEntropy.apply(logits_shard)
