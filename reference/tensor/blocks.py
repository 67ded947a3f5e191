"""Lecture 4a, part 3 — a transformer block cut along the tensor axis.

Single-process modules (the ground truth) and their tensor-parallel versions, built from them
with ``from_module`` (every rank passes the same full module and keeps its own shard).
Activations are (S, B, d), sequence first, as in Megatron.

    MLP            fc1 (d → d_ff), GELU, fc2 (d_ff → d)
    SelfAttention  qkv (d → 3d, laid out [q; k; v], heads contiguous in each), causal softmax
                   attention, proj (d → d)
    Block          x + drop(attn(ln1(x))), then + drop(mlp(ln2(x)))   (pre-LayerNorm)

    ParallelMLP            fc1 column-parallel → GELU → fc2 row-parallel: 1 all-reduce fwd, 1 bwd
    ParallelSelfAttention  H/W heads per rank: qkv column-parallel (q, k, v of MY heads),
                           attention is local, proj row-parallel:      1 all-reduce fwd, 1 bwd
    ParallelBlock          both, plus replicated LayerNorms: 2 all-reduces fwd, 2 bwd per block;
                           with ``sequence_parallel`` (arXiv:2205.05198) the LayerNorms and
                           dropouts work on S/W rows and each all-reduce becomes an all-gather
                           (entering) + a reduce-scatter (leaving): same bytes, 1/W activations.

Dropout and random streams.  Inside the tensor-parallel region (attention probabilities) each
rank holds different heads, so each needs its OWN random stream: head h draws its mask from a
generator seeded ``(seed, h)``, so rank r's streams differ from every other rank's and the union
over ranks is the single-process mask.  In the replicated region (after g, before the residual)
every rank must draw the SAME mask, or the replicas drift apart: the mask of the whole (S, B, d)
activation comes from one generator seeded ``seed`` on every rank; under sequence parallelism
each rank applies its own rows of it — masks that differ across ranks and whose union is the
single-process mask, at W× the random numbers a rank uses.  Megatron does it otherwise: a default
RNG state, alike on the tensor-parallel ranks, for replicated regions, and a per-tp-rank state
(``get_cuda_rng_tracker().fork()``) for attention dropout and, under sequence parallelism, for the
whole layer — each rank draws only its slice's mask, reproducible but not the single-process one.

With sequence parallelism the LayerNorm weights and the row-parallel biases act on this rank's
rows only, so each rank's gradient is a PARTIAL sum: :func:`sync_sequence_parallel_grads` sums
them over the group (forget it and they are 1/W-ish wrong, silently).

Activation recomputation (Korthikanti et al. §5), ``ParallelBlock(..., recompute=)``, with
``torch.utils.checkpoint`` (non-reentrant; per rank, e bytes a value, t = W)::

    "none"        keep everything                 sbh·(10 + 24/t + 5as/(ht)), or sbh·(34 + 5as/h)/t with SP
    "selective"   keep q, k, v; recompute the     sbh·(10 + 24/t), or 34·sbh/t: the 5as²b/t scores term
                  attention core in the backward  gone, for 4·b·s²·h/t FLOPs more (QKᵀ and ·V again)
    "full"        keep the block's input only     e·sbh, or e·sbh/t with SP; the whole forward again in
                                                  the backward: 24·s·b·h²/t + 4·b·s²·h/t FLOPs more

As Megatron's ``CheckpointFunction`` does, the whole region runs again (``early_stop=False``: torch's
default would stop at the last saved input, skipping the ·V matmul, or the last reduce of a block).
So "full" reruns the block's forward collectives too: tensor parallelism's two forward all-reduces,
or sequence parallelism's two all-gathers and two reduce-scatters, per block.  The attention core
sends nothing: "selective" adds no message.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm, trace
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["MLP", "SelfAttention", "Block", "ParallelMLP", "ParallelSelfAttention", "ParallelBlock",
           "sync_sequence_parallel_grads", "head_keep_mask", "head_dropout_mask", "hidden_dropout", "RECOMPUTE"]

RECOMPUTE = ("none", "selective", "full")


# ----------------------------------------------------------------------------------------------
# Dropout with explicit streams


def head_keep_mask(batch: int, heads: int, S: int, p: float, seed: int, first_head: int = 0) -> torch.Tensor:
    """(B, heads, S, S) boolean keep-mask for heads ``first_head …``: head h from its own generator
    seeded ``seed·1_000_003 + h`` — so different heads (and ranks) get different streams."""
    masks = []
    for h in range(first_head, first_head + heads):
        g = torch.Generator().manual_seed((seed * 1_000_003 + h) % 2 ** 63)
        masks.append(torch.rand(batch, S, S, generator=g, dtype=torch.float64) >= p)
    return torch.stack(masks, dim=1)


def head_dropout_mask(batch: int, heads: int, S: int, p: float, seed: int, first_head: int = 0,
                      dtype=torch.float64) -> torch.Tensor:
    """:func:`head_keep_mask` scaled by 1/(1-p), as numbers of ``dtype``."""
    return head_keep_mask(batch, heads, S, p, seed, first_head).to(dtype) / (1 - p)


def hidden_dropout(x: torch.Tensor, p: float, seed: int, full_shape=None, rows: slice | None = None) -> torch.Tensor:
    """Dropout in a replicated region: the mask of the whole activation ``full_shape`` (S, B, d)
    from one generator seeded ``seed`` (the same on every rank); ``rows``: this rank's sequence rows.
    The backward keeps the boolean mask of x's rows: one byte per element, as Megatron's."""
    if p == 0.0:
        return x
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(tuple(full_shape or x.shape), generator=g, dtype=torch.float64) >= p
    if rows is not None:
        keep = keep[rows].clone()                  # its own storage: a view would keep the whole mask alive
    return x * keep / (1 - p)


def attend(q, k, v, heads: int, *, causal: bool = True, dropout_p: float = 0.0, seed: int = 0,
           first_head: int = 0) -> torch.Tensor:
    """Softmax attention on (S, B, heads·hd) q, k, v → (S, B, heads·hd); heads are global ids
    ``first_head …`` for the dropout streams."""
    S, B, D = q.shape
    hd = D // heads
    q, k, v = (t.reshape(S, B, heads, hd).permute(1, 2, 0, 3) for t in (q, k, v))   # (B, h, S, hd)
    s = q @ k.transpose(-1, -2) / math.sqrt(hd)
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    prob = s.softmax(-1)
    if dropout_p > 0:
        prob = prob * head_keep_mask(B, heads, S, dropout_p, seed, first_head) / (1 - dropout_p)
    return (prob @ v).permute(2, 0, 1, 3).reshape(S, B, D)


# ----------------------------------------------------------------------------------------------
# Single process


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, *, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, dtype=dtype)
        self.fc2 = nn.Linear(d_ff, d_model, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, *, causal: bool = True, dropout_p: float = 0.0, dtype=None):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads, self.causal, self.dropout_p, self.seed = heads, causal, dropout_p, 0
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.proj = nn.Linear(d_model, d_model, dtype=dtype)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(attend(q, k, v, self.heads, causal=self.causal, dropout_p=self.dropout_p, seed=self.seed))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int | None = None, *, dropout_p: float = 0.0, dtype=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = SelfAttention(d_model, heads, dropout_p=dropout_p, dtype=dtype)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.mlp = MLP(d_model, d_ff or 4 * d_model, dtype=dtype)
        self.dropout_p, self.seed = dropout_p, 0

    def forward(self, x):
        self.attn.seed = self.seed
        x = x + hidden_dropout(self.attn(self.ln1(x)), self.dropout_p, 2 * self.seed + 1)
        return x + hidden_dropout(self.mlp(self.ln2(x)), self.dropout_p, 2 * self.seed + 2)


# ----------------------------------------------------------------------------------------------
# Tensor parallel


class ParallelMLP(nn.Module):
    """fc1 column-parallel (no gather), GELU on this rank's d_ff/W features, fc2 row-parallel."""

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear, name: str = "mlp"):
        super().__init__()
        self.fc1, self.fc2, self.name = fc1, fc2, name

    @classmethod
    def from_module(cls, mlp: MLP, group=None, *, sequence_parallel: bool = False, name: str = "mlp"):
        return cls(ColumnParallelLinear.from_linear(mlp.fc1, group, sequence_parallel=sequence_parallel,
                                                    name=f"{name}.fc1"),
                   RowParallelLinear.from_linear(mlp.fc2, group, sequence_parallel=sequence_parallel,
                                                 name=f"{name}.fc2"), name)

    def forward(self, x):
        h = self.fc1(x)
        with trace.span("compute", what="gelu", layer=self.name, shape=list(h.shape)):
            h = F.gelu(h)
        return self.fc2(h)


class ParallelSelfAttention(nn.Module):
    """H/W heads per rank.  ``qkv`` holds [q; k; v] rows of MY heads; ``proj`` my columns."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, heads: int, *, causal=True,
                 dropout_p=0.0, group=None, name: str = "attn"):
        super().__init__()
        W = comm.world_size(group)
        self.qkv, self.proj, self.heads, self.local_heads = qkv, proj, heads, heads // W
        self.first_head = comm.rank(group) * self.local_heads
        self.causal, self.dropout_p, self.seed, self.name = causal, dropout_p, 0, name
        self.recompute = "none"                  # "selective": the attention core again in the backward

    @classmethod
    def from_module(cls, attn: SelfAttention, group=None, *, sequence_parallel: bool = False, name: str = "attn"):
        W, H = comm.world_size(group), attn.heads
        if H % W:
            raise ValueError(f"{H} attention heads cannot be split evenly over {W} tensor-parallel ranks")
        d = attn.proj.in_features
        # Reorder the fused [q; k; v] rows to [q_0; k_0; v_0 | q_1; k_1; v_1 | ...] so that the
        # contiguous column-parallel shard of rank r is the q, k and v of rank r's heads.
        full = nn.Linear(d, 3 * d, dtype=attn.qkv.weight.dtype)
        with torch.no_grad():
            full.weight.copy_(attn.qkv.weight.view(3, W, d // W, d).transpose(0, 1).reshape(3 * d, d))
            full.bias.copy_(attn.qkv.bias.view(3, W, d // W).transpose(0, 1).reshape(3 * d))
        qkv = ColumnParallelLinear.from_linear(full, group, sequence_parallel=sequence_parallel, name=f"{name}.qkv")
        qkv.CUTS = {"weight": "qkv", "bias": "qkv"}        # column-parallel, rows [q_r; k_r; v_r] per rank
        proj = RowParallelLinear.from_linear(attn.proj, group, sequence_parallel=sequence_parallel, name=f"{name}.proj")
        return cls(qkv, proj, H, causal=attn.causal, dropout_p=attn.dropout_p, group=group, name=name)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        kw = dict(causal=self.causal, dropout_p=self.dropout_p, seed=self.seed, first_head=self.first_head)
        with trace.span("compute", what="attention", layer=self.name, heads=self.local_heads):
            if self.recompute == "selective":           # keeps q, k, v (one qkv output), not the S×S scores
                o = checkpoint(attend, q, k, v, self.local_heads, use_reentrant=False, early_stop=False, **kw)
            else:
                o = attend(q, k, v, self.local_heads, **kw)
        return self.proj(o)


class ParallelBlock(nn.Module):
    """:class:`Block` over a tensor-parallel group.  Input/output (S, B, d) replicated, or
    (S/W, B, d) this rank's sequence rows with ``sequence_parallel``.  ``recompute``: "none",
    "selective" or "full" (module docstring)."""

    def __init__(self, block: Block, group=None, *, sequence_parallel: bool = False, recompute: str = "none"):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        self.group, self.sequence_parallel, self.recompute = group, sequence_parallel, recompute
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelSelfAttention.from_module(block.attn, group, sequence_parallel=sequence_parallel)
        self.attn.recompute = "selective" if recompute == "selective" else "none"
        self.mlp = ParallelMLP.from_module(block.mlp, group, sequence_parallel=sequence_parallel)
        self.dropout_p, self.seed = block.dropout_p, 0

    @classmethod
    def from_module(cls, block: Block, group=None, *, sequence_parallel: bool = False,
                    recompute: str = "none") -> ParallelBlock:
        return cls(block, group, sequence_parallel=sequence_parallel, recompute=recompute)

    def _drop(self, x, seed):
        if not self.sequence_parallel:
            return hidden_dropout(x, self.dropout_p, seed)
        W, r, n = comm.world_size(self.group), comm.rank(self.group), x.shape[0]
        return hidden_dropout(x, self.dropout_p, seed, (n * W,) + tuple(x.shape[1:]), slice(r * n, (r + 1) * n))

    def forward(self, x):
        self.attn.seed = self.seed
        if self.recompute == "full":                 # keeps x; the whole forward again in the backward
            return checkpoint(self._forward, x, use_reentrant=False, early_stop=False)
        return self._forward(x)

    def _forward(self, x):
        x = x + self._drop(self.attn(self.ln1(x)), 2 * self.seed + 1)
        return x + self._drop(self.mlp(self.ln2(x)), 2 * self.seed + 2)

    def sequence_parallel_params(self):
        """Replicated parameters that see only this rank's rows under sequence parallelism."""
        return [self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias, self.attn.proj.bias,
                self.mlp.fc2.bias]


def sync_sequence_parallel_grads(params, group=None) -> None:
    """Sum (in place) the gradients of replicated parameters that saw only this rank's sequence rows
    (LayerNorm weights and biases, row-parallel biases) over the tensor-parallel ``group``."""
    comm.all_reduce_coalesced([p.grad for p in params], group=group, operator="sp-grad-sync", direction="backward")
