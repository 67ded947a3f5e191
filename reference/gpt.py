"""Lecture 5c — a tiny GPT on one process: the ground truth every composed run must reproduce.

A character-level decoder-only transformer (GPT-2 layout, pre-LayerNorm), small enough to train
in float64 on a laptop core in seconds, and written so that each piece can later be replaced by
the parallel layer a lecture teaches — same parameter names, same shapes::

    idx (B, S) ─▶ tok_emb + pos_emb ─▶ [ Block ] × layers ─▶ ln_f ─▶ head ─▶ logits (B, S, V)

    Block:  x = x + attn(ln1(x))        Attention: qkv (d → 3d), causal softmax(q·kᵀ/√d_h)·v, proj (d → d)
            x = x + mlp(ln2(x))         MLP:       fc1 (d → d_ff), GELU, fc2 (d_ff → d)
                                        or MoE:    reference.moe.MoELayer over the B·S tokens

MoE blocks as frontier models build them (DeepSeekMoE arXiv:2401.06066, DeepSeek-V3 arXiv:2412.19437):
``expert_ffn`` (fine-grained experts narrower than d_ff), ``shared_experts`` (an FFN every token
uses, ``shared_experts·expert_ffn`` wide), ``dense_layers`` (the first k blocks keep a dense MLP),
``top_k`` up to 8, ``router`` "softmax" or "sigmoid", ``balance`` "aux" (Switch's loss ×
aux_loss_coef), "seq_aux" (per sequence), "loss_free" (a per-expert bias stepped by
``bias_update_rate`` after each optimizer step, :func:`train_single`) or "loss_free+seq_aux",
and ``z_loss_coef`` (ST-MoE's router z-loss).

``qkv.weight`` rows are [Q; K; V], each ``heads·d_h`` rows with the heads contiguous (head h owns
rows h·d_h … (h+1)·d_h − 1 of each third): a tensor-parallel split gives each rank whole heads by
taking the same row block from each third.  ``fc1`` splits by rows (columns of the product) and
``fc2`` by columns, as Megatron does.  ``Attention.attend(q, k, v)`` is the only place that sees
the whole sequence: context parallelism swaps it for ring attention.

The corpus is generated (a few KB of sentences about ranks passing messages), deterministic, and
character-level; :func:`get_batch` is a pure function of the step, so data-parallel ranks can
take their slice of the same global batch.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .moe import BALANCES, MoELayer
from .moe.routing import ROUTERS

__all__ = ["GPTConfig", "Attention", "MLP", "MoEMLP", "Block", "TinyGPT", "corpus", "encode", "get_batch",
           "train_single", "batch_grads"]


# ---------------------------------------------------------------------------------- data

_SUBJECTS = ["rank zero", "rank one", "rank two", "rank three", "the ring", "every stage", "the expert",
             "the router", "each replica", "the pipeline"]
_VERBS = ["sends", "receives", "reduces", "gathers", "splits", "passes", "holds", "averages"]
_OBJECTS = ["the gradient", "its shard", "the activations", "a block of keys", "the tokens", "the loss",
            "half the heads", "the next micro-batch"]
_TAILS = ["to its neighbour", "around the ring", "before the step", "over the group", "in one hop",
          "while it computes", "along the pipeline", "to every rank"]


def corpus(n_sentences: int = 400, seed: int = 0) -> str:
    """A deterministic text of short sentences (about 16 KB for the default 400)."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
                    for _ in range(n_sentences))


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    """Characters → ids (sorted alphabet).  Returns (ids (N,) long, alphabet)."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars


def get_batch(data: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and next-character targets, each (batch_size, seq_len).

    A pure function of (seed, step): every rank can rebuild it and take its own rows (data
    parallel) or columns (context parallel).
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2 ** 63)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + seq_len + 1] for s in starts.tolist()])
    return x, y


# ---------------------------------------------------------------------------------- model

@dataclass(frozen=True)
class GPTConfig:
    """Sizes.  The defaults give about 200K parameters (27-character alphabet)."""
    vocab: int
    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 4
    d_ff: int = 256
    num_experts: int = 0        # > 0: every ``moe_every``-th block has a MoE layer instead of the MLP
    top_k: int = 2
    moe_every: int = 2
    aux_loss_coef: float = 0.01
    expert_ffn: int | None = None   # each expert's width (default d_ff)
    shared_experts: int = 0
    dense_layers: int = 0           # the first k blocks stay dense
    router: str = "softmax"
    balance: str = "aux"
    bias_update_rate: float = 1e-3
    z_loss_coef: float = 0.0

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by heads={self.heads}")
        if self.num_experts and not 1 <= self.top_k <= min(8, self.num_experts):
            raise ValueError(f"top_k={self.top_k} must be between 1 and min(8, num_experts={self.num_experts})")
        if self.router not in ROUTERS or self.balance not in BALANCES:
            raise ValueError(f"router must be one of {ROUTERS} and balance one of {BALANCES}; "
                             f"got {self.router!r}, {self.balance!r}")
        if (self.expert_ffn is not None and self.expert_ffn < 1) or self.shared_experts < 0 or self.dense_layers < 0:
            raise ValueError(f"expert_ffn must be >= 1, shared_experts and dense_layers >= 0; got {self.expert_ffn}, "
                             f"{self.shared_experts}, {self.dense_layers}")

    @property
    def expert_width(self) -> int:
        """Each routed expert's hidden width: ``expert_ffn``, or d_ff."""
        return self.d_ff if self.expert_ffn is None else self.expert_ffn

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer >= self.dense_layers
                and layer % self.moe_every == self.moe_every - 1)


class Attention(nn.Module):
    """Causal multi-head self-attention: x (B, S, d) → (B, S, d)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads, self.d_head = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ/√d_h + causal mask)·v for q, k, v of shape (B, heads, S, d_h)."""
        S = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        future = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(-1) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split(self.heads * self.d_head, dim=-1)
        q, k, v = (t.view(B, S, self.heads, self.d_head).transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v)                                   # (B, heads, S, d_h)
        return self.proj(out.transpose(1, 2).reshape(B, S, self.heads * self.d_head))


class MLP(nn.Module):
    """fc1 → GELU → fc2: (B, S, d) → (B, S, d)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEMLP(nn.Module):
    """A dropless MoE layer (reference.moe.MoELayer) over the B·S tokens of the batch.

    Dropless, so a token's output does not depend on which other tokens share its routing group;
    the balance loss does (it is a mean over the group, or over each sequence) and is kept in
    ``self.aux_loss``, the router z-loss in ``self.z_loss``.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, k: int, **options):
        super().__init__()
        self.moe = MoELayer(d_model, d_ff, num_experts, k=k, dropless=True, **options)
        self.aux_loss = self.z_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        sequence = torch.arange(B, device=x.device).repeat_interleave(S)
        y, stats = self.moe(x.reshape(B * S, d), sequence, B)
        self.aux_loss, self.z_loss = stats["aux_loss"], stats["z_loss"]
        return y.view(B, S, d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.heads)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = (MoEMLP(cfg.d_model, cfg.expert_width, cfg.num_experts, cfg.top_k, router=cfg.router,
                           shared_experts=cfg.shared_experts, balance=cfg.balance,
                           bias_update_rate=cfg.bias_update_rate) if cfg.is_moe(layer)
                    else MLP(cfg.d_model, cfg.d_ff))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """idx (B, S) long → logits (B, S, vocab).  ``loss(idx, targets)`` adds the MoE aux loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, S = idx.shape
        if S > self.cfg.seq_len:
            raise ValueError(f"sequence of {S} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(S, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, plus aux_loss_coef × the mean balance loss of the MoE layers
        (and z_loss_coef × their mean z-loss, if not 0)."""
        logits = self(idx)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        moe = [b.mlp for b in self.blocks if isinstance(b.mlp, MoEMLP)]
        if not moe:
            return lm
        loss = lm + self.cfg.aux_loss_coef * torch.stack([m.aux_loss for m in moe]).mean()
        if self.cfg.z_loss_coef:
            loss = loss + self.cfg.z_loss_coef * torch.stack([m.z_loss for m in moe]).mean()
        return loss

    def update_expert_biases(self) -> None:
        """After each optimizer step: every MoE layer's loss-free bias step (nothing for other balances)."""
        for b in self.blocks:
            if isinstance(b.mlp, MoEMLP):
                b.mlp.moe.update_bias()


# ---------------------------------------------------------------------------------- training

def train_single(steps: int, *, batch_size: int = 4, lr: float = 3e-3, seed: int = 0, dtype=torch.float64,
                 model: TinyGPT | None = None, text: str | None = None, num_microbatches: int = 1, dp: int = 1,
                 clip_grad_norm: float | None = None, grad_norms: list | None = None, optimizer=None,
                 start_step: int = 0, on_step=None, **config) -> list[float]:
    """Train the tiny GPT on one process with Adam; return the loss of every step.

    ``config`` overrides :class:`GPTConfig` fields (e.g. ``layers=2, num_experts=4``).  Parameters
    are initialised with ``torch.manual_seed(seed)``; batches come from :func:`get_batch`.  Pass
    ``model`` to keep training one (it is trained in place).

    ``num_microbatches`` m > 1 (with ``dp``): accumulate each step's gradient over the m micro-batches
    a pipeline on dp replicas runs — micro-batch i = rows i·b/m … (i+1)·b/m − 1 of each replica's
    b = B/dp rows — with loss = Σ_i loss_i / m.  The same cross-entropy (up to rounding); the MoE
    aux loss becomes the mean over micro-batches of each one's aux loss, as Megatron's pipeline
    computes it (routing group = one micro-batch's tokens).

    ``clip_grad_norm`` c: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` once per step,
    after the whole step's gradient (all its micro-batches) and before Adam; each step's norm before
    clipping is appended to ``grad_norms`` if a list is given (reference.compose.clip does the same on a grid).

    To continue a run (reference.compose.checkpoint): ``optimizer``, the ``torch.optim`` optimizer of
    ``model`` to keep using (default: a fresh ``torch.optim.Adam(lr)``), and ``start_step``: only steps
    ``start_step`` … ``steps`` − 1 run (their losses are returned).  ``on_step(step, loss)`` is called
    after each step.
    """
    data, alphabet = encode(text if text is not None else corpus())
    if model is None:
        torch.manual_seed(seed)
        model = TinyGPT(GPTConfig(vocab=len(alphabet), **config)).to(dtype)
    groups = None
    if num_microbatches > 1:
        if batch_size % dp or (batch_size // dp) % num_microbatches:
            raise ValueError(f"{num_microbatches} micro-batches on dp={dp} replicas must divide each replica's "
                             f"{batch_size}/{dp} rows")
        b, n = batch_size // dp, batch_size // dp // num_microbatches
        groups = [torch.cat([torch.arange(r * b + i * n, r * b + (i + 1) * n) for r in range(dp)])
                  for i in range(num_microbatches)]
    opt = optimizer if optimizer is not None else torch.optim.Adam(model.parameters(), lr=lr)

    def step_opt():
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            if grad_norms is not None:
                grad_norms.append(float(norm))
        opt.step()
        model.update_expert_biases()                  # loss-free balancing: the loads of this step

    losses = []
    for step in range(start_step, steps):
        x, y = get_batch(data, step, batch_size, model.cfg.seq_len, seed)
        if groups is not None:
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for rows in groups:
                loss = model.loss(x[rows], y[rows]) / num_microbatches
                loss.backward()
                total += loss.item()
            step_opt()
            losses.append(total)
        else:
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            step_opt()
            losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def batch_grads(step: int = 0, *, batch_size: int = 4, seed: int = 0, dtype=torch.float64, text: str | None = None,
                **config) -> dict[str, torch.Tensor]:
    """The gradient of step ``step``'s batch loss at initialisation, by parameter name (zeros for a
    parameter the batch does not reach, e.g. an expert no token chose): what every composed run's
    synchronised gradients must put back together (exercise 5c.2)."""
    data, alphabet = encode(text if text is not None else corpus())
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab=len(alphabet), **config)).to(dtype)
    x, y = get_batch(data, step, batch_size, model.cfg.seq_len, seed)
    model.loss(x, y).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}
