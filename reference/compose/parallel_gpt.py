"""Lecture 5c, part 1 — this rank's piece of the tiny GPT, for any rank grid.

Every rank builds the same single-process :class:`reference.gpt.TinyGPT` from the seed and keeps
its own piece of it (``ParallelGPT(gpt, grid)``).  Nothing here is a new parallel layer: each
axis is the lecture's own, composed, and ``ParallelGPT.__init__`` applies them one after the
other, in this order (as picotron's and torchtitan's ``parallelize`` do):

    axis  what this rank keeps                               the lecture's layer
    ────  ─────────────────────────────────────────────────  ─────────────────────────────────────
    pp    blocks of my stage (contiguous, balanced), the      pipeline.balanced_sizes (the executor
          embeddings on the first, ln_f + head on the last    runs them: compose.train); a MoE layer's
                                                              aux loss enters backward on its own stage
                                                              (AuxLossAutoScaler, below)
    tp    my heads of qkv, my rows of fc1 / cols of fc2 and   tensor.ParallelSelfAttention.from_module,
          of proj, my slice of the (padded) vocabulary        ParallelMLP, VocabParallelEmbedding,
          (+ sequence_parallel: LayerNorms on S/tp rows)      ColumnParallelLinear, vocab_parallel_cross_entropy
    cp    my two zigzag chunks of the sequence; attention's   sequence.ring_attention, positions
          ``attend`` becomes ring attention over cp
    ep    experts e ∈ [r·E/ep, (r+1)·E/ep) of each MoE layer  moe.ExpertParallelMoE (dropless all-to-all),
          (each expert cut over etp: tp, or whole when the    its experts as tensor.Column/RowParallelLinear
          expert grid is folded, etp = 1: .moe_layer)         (.moe_layer.ExpertParallelMLP)
    dp    nothing: a full replica of the above (its rows of the batch come in compose.train)

Each step swaps modules for their parallel versions under the single-process names (the blocks
are kept by global layer index, the experts by global expert id), and each parallel layer says
how its parameters are cut (``CUTS``: "column", "row", "qkv", "vocab"; a module without it, such
as a LayerNorm, holds whole tensors), as Megatron marks its parameters ``tensor_model_parallel``.
So the shard table is read off the modules (:func:`shard_table`), with no second list of names::

    name (this rank's = the single process's)  module (CUTS)                       Shard
    ─────────────────────────────────────────  ──────────────────────────────────  ─────────────────────
    tok_emb.weight                             VocabParallelEmbedding              vocab
    pos_emb.weight, blocks.3.ln1.weight        Embedding, LayerNorm (none)         replicated
    blocks.3.attn.qkv.weight, .bias            ColumnParallelLinear (qkv: its own) qkv
    blocks.3.attn.proj.weight, .bias           RowParallelLinear                   row, replicated
    blocks.1.mlp.moe.router.weight             Linear (none)                       replicated
    blocks.1.mlp.moe.experts.5.0.weight        ColumnParallelLinear, under experts column, expert
    head.weight                                ColumnParallelLinear (vocab: own)   vocab

Activations are (S, B, d), sequence first as in Megatron, so sequence parallelism can cut dim 0.

Which group averages each gradient (compose.train does it; ``dp_cp`` = the dp·cp ranks that hold
the same shard and saw different tokens, ``edp`` = dp·cp/ep ranks that hold the same experts)::

    parameter                          sharded over    gradient averaged over    why
    ─────────────────────────────────  ─────────────   ─────────────────────────  ───────────────────────────
    qkv, proj.weight, fc1, fc2.weight  tp              dp_cp                      my shard, other tokens
    tok_emb, head (vocab rows)         tp              dp_cp
    ln1, ln2, ln_f, pos_emb,           — (tp copies)   dp_cp                      tp copies saw the same
    proj.bias, fc2.bias, router                                                   tokens: equal grads already
      … with sequence_parallel         — (tp copies)   Σ over tp, then dp_cp      each tp rank saw S/tp rows
      (a folded MoE layer's router     — (tp copies)   Σ over tp, then dp_cp      each tp rank routed 1/tp)
    shared experts (moe.shared)        tp              dp_cp                      as the MLP
    experts (0 = fc1, 2 = fc2)         ep × etp        Σ over edp, ÷ dp·cp        the all-to-all already
                                                                                  summed the ep group's tokens
    (any of them)                      pp (stages)     —                          one stage owns it

On 8 ranks, tp = cp = dp = 2 (rank = tp + 2·(cp + 2·dp), reference.mesh)::

                 cp 0      cp 1
        dp 0    [0  1]    [2  3]        [a b] = a tp group: the same tokens, different shards
        dp 1    [4  5]    [6  7]        dp_cp group of rank 0: {0, 2, 4, 6} — tp shard 0, all four
                                        quarters of the batch (2 sequences × 2 halves), so rank 0's
                                        qkv shard steps with the mean of these four gradients

The MoE router losses with pp > 1.  One process minimises L = CE + (1/N_moe)·Σ_l (α·aux_l + β·z_l)
over the model's N_moe MoE layers, but a stage's router losses never reach the last stage, where
the executor back-propagates CE/m per micro-batch.  As Megatron-Core does (``MoEAuxLossAutoScaler``),
each MoE layer returns its output through :class:`AuxLossAutoScaler` (.moe_layer): unchanged
forward, and in backward it also gives its α·aux + β·z the gradient 1/N_moe/m, so every stage
back-propagates its own router losses with the weight the single-process loss gives them, and no
extra message is sent.  With m micro-batches each aux loss is that of one micro-batch's tokens
(over dp_cp), as in Megatron; the ground truth is then ``train_single(…, microbatches=m, dp=dp)``.
With pp = 1, ``loss_fn`` adds α × the mean aux loss (and β × the mean z-loss) itself, as TinyGPT.loss does.

The vocabulary (27 characters) rarely divides by tp: as Megatron does, it is padded to a multiple
of tp with zero rows; the padded logits are set to −∞ before the loss, so the loss, every
gradient and the Adam step are exactly those of the unpadded model (the padded rows get zero
gradients and stay zero).  :func:`full_state_dict` cuts the padding off again.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm
from ..gpt import MLP, GPTConfig, MoEMLP, TinyGPT
from ..mesh import AxisGroups, RankGrid
from ..moe import ExpertParallelMoE
from .moe_layer import AuxLossAutoScaler, ExpertParallelMLP
from ..pipeline import balanced_sizes
from ..sequence import positions, ring_attention
from ..tensor import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, VocabParallelEmbedding,
                      vocab_parallel_cross_entropy)

__all__ = ["check_sizes", "padded_vocab", "ParallelGPT", "ContextParallelAttention", "ExpertParallelMLP",
           "AuxLossAutoScaler", "Shard", "shard_table", "full_state_dict", "SIZE_KEYS"]

SIZE_KEYS = ("dp", "tp", "pp", "cp", "ep", "etp")


# ----------------------------------------------------------------------------------------------
# Sizes: checked on every rank before any message


def check_sizes(cfg: GPTConfig, sizes: dict, world_size: int, batch_size: int, *, sequence_parallel: bool = False,
                num_microbatches: int = 1, zero: int = 0) -> RankGrid:
    """The :class:`RankGrid` of ``sizes`` for ``cfg``, or ValueError naming the size that does not fit.

    Pure arithmetic on arguments every rank has, so every rank raises the same error before any
    message (a rank that raised alone would leave its peers waiting in a collective).  Sequence
    parallelism with MoE layers raises NotImplementedError.
    """
    unknown = set(sizes) - set(SIZE_KEYS)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; sizes takes {', '.join(SIZE_KEYS)}")
    grid = RankGrid(world_size, **sizes)              # positive integers, tp·cp·dp·pp = world, etp·ep | tp·cp·dp
    tp, cp, dp, pp, ep, etp = grid.tp, grid.cp, grid.dp, grid.pp, grid.ep, grid.etp
    if cfg.heads % tp:
        raise ValueError(f"tp={tp} must divide the {cfg.heads} attention heads (each rank keeps whole heads)")
    if cfg.d_ff % tp:
        raise ValueError(f"tp={tp} must divide d_ff={cfg.d_ff} (fc1 rows / fc2 columns)")
    if cp > 1 and cfg.seq_len % (2 * cp):
        raise ValueError(f"cp={cp}: the zigzag layout cuts the sequence into 2·cp = {2 * cp} equal chunks; "
                         f"seq_len={cfg.seq_len} is not a multiple of {2 * cp}")
    if batch_size % dp:
        raise ValueError(f"dp={dp} must divide the batch of {batch_size} sequences")
    if ep > 1 and not cfg.num_experts:
        raise ValueError(f"ep={ep} needs MoE layers (num_experts > 0)")
    if cfg.num_experts and cfg.num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={cfg.num_experts}")
    if etp not in (1, tp):
        raise ValueError(f"etp={etp}: the composed run cuts experts over tp (etp = tp = {tp}) or not at all (etp = 1)")
    if cfg.num_experts and cfg.expert_width % etp:
        raise ValueError(f"etp={etp} must divide expert_ffn={cfg.expert_width} (each expert's fc1 rows / fc2 columns)")
    if cfg.num_experts and cfg.shared_experts and (cfg.shared_experts * cfg.expert_width) % tp:
        raise ValueError(f"tp={tp} must divide the shared experts' width {cfg.shared_experts}·{cfg.expert_width}")
    tokens = (batch_size // dp // max(1, num_microbatches)) * (cfg.seq_len // cp) if batch_size % dp == 0 else 0
    if cfg.num_experts and etp != tp and tokens % tp:
        raise ValueError(f"etp={etp} ≠ tp={tp}: each tp rank routes 1/tp of a micro-batch's {tokens} tokens "
                         f"on a rank, which must divide by tp")
    if pp > cfg.layers:
        raise ValueError(f"pp={pp} stages need at least {pp} layers, the model has {cfg.layers}")
    if num_microbatches < 1 or (batch_size // dp) % num_microbatches:
        raise ValueError(f"{num_microbatches} micro-batches must divide the {batch_size // dp} sequences of a dp rank")
    if pp == 1 and num_microbatches != 1:
        raise ValueError("num_microbatches is the pipeline's m: it needs pp > 1")
    if zero not in (0, 1, 2):
        raise ValueError(f"zero={zero!r}: the composed run takes ZeRO stage 0 (none), 1 or 2 (compose.zero)")
    if sequence_parallel and tp > 1 and (cfg.seq_len // cp) % tp:
        raise ValueError(f"sequence parallelism cuts each rank's {cfg.seq_len // cp} tokens over tp={tp}")
    moe = any(cfg.is_moe(i) for i in range(cfg.layers))
    if moe and sequence_parallel and tp > 1:
        raise NotImplementedError("sequence parallelism with MoE layers (each tp rank would route other tokens)")
    return grid


def padded_vocab(vocab: int, tp: int) -> int:
    """``vocab`` rounded up to a multiple of ``tp`` (Megatron's padding)."""
    return -(-vocab // tp) * tp


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (V, d) with zero rows appended up to ``rows`` (a new tensor)."""
    w = weight.detach()
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


# ----------------------------------------------------------------------------------------------
# Layers: the lectures' layers, wired for the grid


class ComposedBlock(nn.Module):
    """TinyGPT's pre-LayerNorm block, copied: x + attn(ln1(x)), then + mlp(ln2(x)).  The axes of
    :class:`ParallelGPT` swap its ``attn`` and ``mlp`` for their parallel versions.  ``recompute``
    "full": keep x only and run the block again in the backward, its tp, cp and ep messages included
    (as reference.tensor.ParallelBlock; "selective" is the attention's, ContextParallelAttention)."""

    def __init__(self, block, recompute: str = "none"):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn, self.mlp = copy.deepcopy(block.attn), copy.deepcopy(block.mlp)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self._forward, x, use_reentrant=False, early_stop=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ContextParallelAttention(nn.Module):
    """A :class:`reference.tensor.ParallelSelfAttention` (my heads, tp) whose ``attend`` becomes
    :func:`reference.sequence.ring_attention` over the cp group (my zigzag chunks of the sequence;
    cp = 1: torch's fused causal attention itself, the same CPU kernel as the ring's one block, without
    the ring's Python autograd around it).  It keeps the tp layer's ``qkv`` and ``proj``.
    x: (S_l, B, d), or (S_l/tp, B, d) with sequence parallelism.  ``recompute`` "selective": keep
    q, k, v and run the ring again in the backward (its K/V passes too, cp > 1).
    """

    def __init__(self, attn: ParallelSelfAttention, cp_group):
        super().__init__()
        self.qkv, self.proj, self.local_heads = attn.qkv, attn.proj, attn.local_heads
        self.cp_group, self.recompute = cp_group, "none"
        self.layout = "zigzag" if comm.world_size(cp_group) > 1 else "contiguous"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)                     # (S_l, B, heads/tp · d_h) each
        S, B, _ = q.shape
        q, k, v = (t.reshape(S, B, self.local_heads, -1).permute(1, 2, 0, 3) for t in (q, k, v))
        kw = dict(causal=True, layout=self.layout, group=self.cp_group)
        attend = ring_attention if self.layout == "zigzag" else _local_attention
        if self.recompute == "selective":
            out = checkpoint(attend, q, k, v, use_reentrant=False, early_stop=False, **kw)
        else:
            out = attend(q, k, v, **kw)
        return self.proj(out.permute(2, 0, 1, 3).reshape(S, B, -1))


def _local_attention(q, k, v, *, causal: bool, layout: str, group) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


# ----------------------------------------------------------------------------------------------
# The model: one pipeline stage of it


@dataclass
class Shard:
    """Where a single-process parameter lives on this rank, and how to put it back together.

    kind: "replicated" (the whole tensor), "column" (rows r·n/tp …, dim 0), "row" (columns, dim 1),
    "qkv" (column-parallel with [q_r; k_r; v_r] per rank), "vocab" (rows of the padded vocabulary).
    expert: the parameter belongs to an expert (lives on one ep rank, synced over edp).
    """
    param: nn.Parameter
    kind: str
    expert: bool = False


def shard_table(model: nn.Module) -> dict[str, Shard]:
    """Every parameter of ``model`` by name → its :class:`Shard`, read off the modules: the kind is
    the ``CUTS`` entry of the module that holds it ("replicated" if that module has no ``CUTS``:
    LayerNorms, pos_emb, the router), expert if it lies under an expert-parallel layer's ``experts``."""
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    table = {}
    for prefix, module in model.named_modules():
        cuts = getattr(module, "CUTS", None)
        for name, p in module.named_parameters(recurse=False):
            if cuts is not None and name not in cuts:           # or its gradient would be synchronised wrongly
                raise AssertionError(f"{prefix}: {type(module).__name__}.CUTS does not say how {name!r} is cut")
            kind = "replicated" if cuts is None else cuts[name]
            table[f"{prefix}.{name}" if prefix else name] = Shard(p, kind, id(p) in experts)
    return table


class ParallelGPT(nn.Module):
    """This rank's piece of ``gpt`` on ``grid``: one pipeline stage, cut over tp, cp and ep.

    ``forward(x)`` is the stage's forward: token ids (B, S_l) on the first stage (this rank's rows
    and zigzag columns), the previous stage's activation (S_l, B, d) otherwise; it returns the
    activation, or the logits (S_l, B, V_pad/tp) on the last stage.  ``loss_fn(logits, targets)``
    is TinyGPT's loss on those tokens (the same value on every tp rank; with pp > 1 the cross-
    entropy alone, the aux losses go through :class:`AuxLossAutoScaler`); with one stage
    ``loss(idx, targets)`` chains both.  ``shards`` maps every single-process parameter name this
    rank holds to its :class:`Shard`.  Must be built on every rank (it creates the grid's groups).

    Built one axis at a time: the pp step copies TinyGPT's modules of this stage, under their own
    names; each later step swaps some of them for their parallel versions under the same names.
    ``recompute`` (Korthikanti et al. §5): "selective" recomputes each attention core, "full" each
    block, in the backward (not with MoE layers: their router statistics would count twice).
    """

    def __init__(self, gpt: TinyGPT, grid: RankGrid, *, sequence_parallel: bool = False, recompute: str = "none"):
        super().__init__()
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
        if recompute == "full" and any(gpt.cfg.is_moe(i) for i in range(gpt.cfg.layers)):
            raise NotImplementedError("full recomputation with MoE layers (the router's statistics would count twice)")
        cfg = self.cfg = gpt.cfg
        me = self.coords = grid.coords()
        self.grid = grid
        axes = ["tp", "cp", "dp", "dp_cp", "pp"] + (["ep", "edp"] if cfg.num_experts else [])
        if cfg.num_experts and grid.etp != grid.tp:      # folded: the expert-tensor groups, the stage's routing ranks
            axes += ["etp", "tp_dp_cp"]
        self.groups = AxisGroups((axis, grid.group(axis)) for axis in axes)       # every rank, same order
        tp = self.groups["tp"]
        sp = self.sequence_parallel = sequence_parallel and grid.tp > 1

        # pp: the blocks of my stage (contiguous, balanced), the embeddings on the first, ln_f + head on the last
        sizes = balanced_sizes(cfg.layers, grid.pp)
        self.layer_ids = list(range(sum(sizes[:me["pp"]]), sum(sizes[:me["pp"] + 1])))
        self.is_first, self.is_last = me["pp"] == 0, me["pp"] == grid.pp - 1
        if self.is_first:
            self.tok_emb, self.pos_emb = copy.deepcopy(gpt.tok_emb), copy.deepcopy(gpt.pos_emb)
        self.blocks = nn.ModuleDict({str(i): ComposedBlock(gpt.blocks[i]) for i in self.layer_ids})
        if self.is_last:
            self.ln_f, self.head = copy.deepcopy(gpt.ln_f), copy.deepcopy(gpt.head)

        # tp (+ sequence parallelism): cut every linear, the embedding and the head
        self.vocab, Vp = cfg.vocab, padded_vocab(cfg.vocab, grid.tp)
        self.vocab_padded = Vp
        for i, block in self.blocks.items():
            attn = SimpleNamespace(heads=block.attn.heads, qkv=block.attn.qkv, proj=block.attn.proj, causal=True,
                                   dropout_p=0.0)                 # TinyGPT's Attention, as tensor's SelfAttention
            block.attn = ParallelSelfAttention.from_module(attn, tp, sequence_parallel=sp, name=f"blocks.{i}.attn")
            if isinstance(block.mlp, MLP):                        # (a MoE layer's experts: the ep step)
                block.mlp = ParallelMLP.from_module(block.mlp, tp, sequence_parallel=sp, name=f"blocks.{i}.mlp")
        if self.is_first:                                         # vocabulary padded with zero rows to Vp
            emb = nn.Embedding.from_pretrained(_pad_rows(self.tok_emb.weight, Vp), freeze=False)
            self.tok_emb = VocabParallelEmbedding.from_module(emb, tp, sequence_parallel=sp)
        if self.is_last:
            head = SimpleNamespace(weight=_pad_rows(self.head.weight, Vp), bias=None, in_features=cfg.d_model,
                                   out_features=Vp)
            self.head = ColumnParallelLinear.from_linear(head, tp, sequence_parallel=sp, name="head")
            self.head.CUTS = {"weight": "vocab"}                  # column-parallel over the padded vocabulary
            first_id = me["tp"] * (Vp // grid.tp)
            self.register_buffer("padding", torch.arange(first_id, first_id + Vp // grid.tp) >= cfg.vocab,
                                 persistent=False)
            self.has_padding = bool(self.padding.any())

        # cp: attention over my zigzag chunks becomes ring attention; the embedding adds their positions
        for block in self.blocks.values():
            block.attn = ContextParallelAttention(block.attn, self.groups["cp"])
            block.recompute, block.attn.recompute = recompute, "selective" if recompute == "selective" else "none"
        if self.is_first:
            pos = positions(cfg.seq_len, me["cp"], grid.cp, "zigzag" if grid.cp > 1 else "contiguous")
            if sp:                                                # my rows of my cp rank's tokens
                n = len(pos) // grid.tp
                pos = pos[me["tp"] * n:(me["tp"] + 1) * n]
            self.register_buffer("positions", pos, persistent=False)

        # ep: my experts of each MoE layer (dropless all-to-all), each expert cut over etp (.moe_layer)
        for i, block in self.blocks.items():
            if isinstance(block.mlp, MoEMLP):
                block.mlp = ExpertParallelMLP(block.mlp, self.groups, grid, me, cfg, name=f"blocks.{i}.mlp")
        self.moe_layers = [b.mlp for b in self.blocks.values() if isinstance(b.mlp, ExpertParallelMLP)]  # my stage's
        self.num_moe = sum(cfg.is_moe(i) for i in range(cfg.layers))                                 # the model's
        self.scale_aux_losses(1)

        # dp: nothing (a full replica of the above; my rows of the batch come in compose.train)

        # Every parameter, by its single-process name (the module names above are those), and its cut.
        self.shards: dict[str, Shard] = shard_table(self)
        self.grad_norm: float | None = None         # ‖g‖ before clipping, set by compose.train_step (compose.clip)

    # -- parameters by the group their gradient is synchronised over (see the module docstring) --

    def expert_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.shards.values() if s.expert]

    def dense_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.shards.values() if not s.expert]

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Replicated over tp but fed S/tp rows each under sequence parallelism (and the routers of folded
        MoE layers, each tp rank routing 1/tp of the tokens, .moe_layer): summed over tp."""
        if not self.sequence_parallel:
            return [p for mlp in self.moe_layers if mlp.splits for p in mlp.moe.router.parameters()]
        return [s.param for s in self.shards.values() if s.kind == "replicated" and not s.expert]

    # -- forward --------------------------------------------------------------------------------

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """ids (B, S_l) → (S_l, B, d) (or my S_l/tp rows with sequence parallelism)."""
        h = self.tok_emb(idx.t())
        return h + self.pos_emb(self.positions).unsqueeze(1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(S_l, B, d) → my vocabulary slice of the logits (S_l, B, V_pad/tp), padding at −∞."""
        z = self.head(self.ln_f(h))
        return z.masked_fill(self.padding, float("-inf")) if self.has_padding else z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.logits(x) if self.is_last else x

    def scale_aux_losses(self, num_microbatches: int) -> None:
        """Before a step (and at construction, m = 1).  pp > 1: every MoE layer of this stage gets
        ∂L/∂(α·aux + β·z) = 1 / N_moe / m (its weight in the single-process loss, per micro-batch)
        and its reported share is reset.  pp = 1: nothing (``loss_fn`` adds the router losses)."""
        for mlp in self.moe_layers:
            mlp.aux_scale = 1 / self.num_moe / num_microbatches if self.grid.pp > 1 else None
            mlp.aux_weighted = 0.0

    def update_expert_biases(self) -> None:
        """After the optimizer step: loss-free balancing's bias step of this stage's MoE layers, the loads
        summed over the ranks that route their tokens (one all-reduce of E numbers per layer)."""
        if self.cfg.balance.startswith("loss_free"):
            for mlp in self.moe_layers:
                mlp.update_bias()

    def aux_share(self) -> float:
        """pp > 1: Σ over this stage's MoE layers and the step's micro-batches of aux_scale · (α·aux + β·z), this
        stage's part of the reported loss (the last stage's loss holds the cross-entropy only); 0 with pp = 1."""
        return sum(mlp.aux_weighted for mlp in self.moe_layers)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of these tokens (targets (B, S_l)), + aux_loss_coef × mean MoE aux loss
        when this stage holds every MoE layer (pp = 1; with pp > 1 :class:`AuxLossAutoScaler` does it)."""
        per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1),
                                                 self.groups["tp"])
        lm = per_token.mean()
        if self.grid.pp > 1 or not self.moe_layers:
            return lm
        loss = lm + self.cfg.aux_loss_coef * torch.stack([mlp.aux_loss for mlp in self.moe_layers]).mean()
        if self.cfg.z_loss_coef:
            loss = loss + self.cfg.z_loss_coef * torch.stack([mlp.z_loss for mlp in self.moe_layers]).mean()
        return loss

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not (self.is_first and self.is_last):
            raise ValueError("loss() runs the whole model: with pp > 1 use compose.train's pipeline step")
        return self.loss_fn(self(idx), targets)

    def stage_shapes(self, microbatch: int) -> dict:
        """``{stage: ((input shape, dtype), (output shape, dtype))}`` of this stage's messages, for
        :func:`reference.pipeline.run_pipeline` (no shape hand-shake, no dry run through the layers)."""
        S = self.cfg.seq_len // self.grid.cp
        act = ((S // self.grid.tp if self.sequence_parallel else S, microbatch, self.cfg.d_model),
               next(self.parameters()).dtype)
        return {self.coords["pp"]: (act, act)}


# ----------------------------------------------------------------------------------------------
# Putting the parameters back together


def _unshard_tp(t: torch.Tensor, kind: str, model: ParallelGPT, expert: bool = False) -> torch.Tensor:
    W = model.grid.etp if expert else model.grid.tp
    if kind == "replicated" or W == 1:
        full = t.detach().clone()
    else:
        parts = comm.all_gather(t.detach().contiguous(), group=model.groups["tp"], what="unshard")
        full = torch.cat(parts, dim=1 if kind == "row" else 0)
        if kind == "qkv":                          # [q_0 k_0 v_0 | q_1 k_1 v_1 | …] → [q; k; v]
            d = full.shape[0] // 3
            full = full.view(W, 3, d // W, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
    return full[:model.vocab] if kind == "vocab" else full


def full_state_dict(model: ParallelGPT) -> dict[str, torch.Tensor]:
    """Every parameter of the single-process model, by its name, on every rank (collective).

    tp shards are all-gathered (traced ``what="unshard"``; an expert's over etp, which is tp or 1), then
    the experts of the ep group and the stages of the pp group are exchanged as Python objects.
    """
    full = {name: _unshard_tp(s.param, s.kind, model, s.expert) for name, s in model.shards.items()}
    for axis in ("ep", "pp"):
        if model.grid.sizes[axis] > 1:
            parts = [None] * model.grid.sizes[axis]
            dist.all_gather_object(parts, full, group=model.groups[axis])
            full = {k: v for part in parts for k, v in part.items()}
    return full
