"""Lecture 5b, part 2 — the single-process MoE layer: the ground truth for expert parallelism.

``MoELayer`` routes T tokens with :func:`top_k_gating` and runs each expert on the tokens kept
in its buffer, one expert after the other (the common "loop over experts" implementation).  The
expert-parallel layer (:mod:`reference.moe.parallel`) must compute exactly this, outputs and
gradients, for each rank's tokens.

    x (T, d) ──router──▶ logits (T, E) ──top_k_gating──▶ expert_index, weight, kept, slot
       │                                                          │
       └──▶ for e in experts:  y[tokens kept by e] += w · FFN_e(x[tokens kept by e])  ◀─┘

The kept assignments are sorted once by (expert, slot), so each expert reads one contiguous
block of ``x[t]`` and one ``index_add`` scatters all weighted outputs back: the loop costs
O(k·T·d) memory traffic, not O(E·T·d) as a mask-per-expert loop would.

Experts are Switch/T5-style position-wise feed-forward blocks, here with GELU (GPT-2/BERT) and
biases: ``FFN(x) = W_2 · gelu(W_1 · x + b_1) + b_2``, d_model → d_ff → d_model.  An expert does
the same FLOPs per token as the dense FFN it replaces, so with k experts per token the compute
per token is k dense FFNs whatever E is; the parameters grow E-fold ("sparse, not just large").
"""
from __future__ import annotations

import torch
from torch import nn

from .. import trace
from .routing import expert_capacity, gshard_random_routing, load_balancing_loss, router_z_loss, top_k_gating

__all__ = ["Expert", "MoELayer", "route"]


class Expert(nn.Sequential):
    """One feed-forward expert: Linear(d_model, d_ff) → GELU → Linear(d_ff, d_model)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


def route(x: torch.Tensor, router: nn.Linear, *, k: int, capacity: int | None, num_experts: int,
          jitter: float = 0.0, random_second_expert: bool = False, training: bool = False,
          generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Router logits and the routing decision for tokens ``x`` (T, d) — shared by both layers.

    jitter: Switch's router jitter (§2.4): multiply the router's INPUT by U(1-ε, 1+ε) while
    training.  random_second_expert: GShard's random routing (see :func:`gshard_random_routing`).
    Both off by default: grading needs determinism.  They draw from ``generator`` (default: the
    global RNG), so an expert-parallel run matches a single-process one only if each rank's RNG
    is seeded as the single process's was for the same tokens.
    """
    h = x
    if training and jitter > 0:
        h = x * torch.empty_like(x).uniform_(1 - jitter, 1 + jitter, generator=generator)
    logits = router(h)                                                    # (T, E)
    routing = top_k_gating(logits, k, capacity)
    if training and random_second_expert and k == 2:
        routing = gshard_random_routing(routing, num_experts, capacity, generator=generator)
    return logits, routing


def emit_route(routing: dict[str, torch.Tensor], *, num_experts: int, capacity: int | None, k: int,
               where: str) -> None:
    """Record the routing decision as one ``route`` event (for the lecture's widget)."""
    if trace.is_recording():
        trace.emit("route", where=where, num_experts=num_experts, k=k, capacity=capacity,
                   expert_index=routing["expert_index"].tolist(),
                   weight=routing["weight"].detach().double().tolist(),
                   kept=routing["kept"].tolist(), slot=routing["slot"].tolist())


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer on one process.

    MoELayer(d_model, d_ff, num_experts, k=2, capacity_factor=1.0, dropless=False)

    forward(x: (T, d_model)) -> (y: (T, d_model), stats) where the T tokens are one routing group
    (capacity ``ceil(k·cf·T/E)``, or none if ``dropless``) and ``stats`` holds

        aux_loss           Switch load-balancing loss over these T tokens (scalar tensor)
        z_loss             ST-MoE router z-loss (scalar tensor)
        tokens_per_expert  (E,) long: assignments per expert BEFORE dropping
        kept_per_expert    (E,) long: assignments that got a slot = min(count_e, C)
        dropped            int: assignments dropped (k·T - kept)
        capacity           int, or None when dropless
        routing            the dict of :func:`top_k_gating` (probs, expert_index, weight, kept, slot)

    The routing decision is also recorded as a ``route`` trace event (``where="layer"``).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, k: int = 2, capacity_factor: float = 1.0,
                 dropless: bool = False, jitter: float = 0.0, random_second_expert: bool = False):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be between 1 and num_experts={num_experts}, got {k}")
        self.d_model, self.d_ff, self.num_experts = d_model, d_ff, num_experts
        self.k, self.capacity_factor, self.dropless = k, capacity_factor, dropless
        self.jitter, self.random_second_expert = jitter, random_second_expert
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(num_experts))

    def capacity(self, num_tokens: int) -> int | None:
        return None if self.dropless else expert_capacity(num_tokens, self.num_experts, self.k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"MoELayer expects tokens of shape (T, {self.d_model}), got {tuple(x.shape)}")
        T, E = x.shape[0], self.num_experts
        capacity = self.capacity(T)
        logits, routing = route(x, self.router, k=self.k, capacity=capacity, num_experts=E, jitter=self.jitter,
                                random_second_expert=self.random_second_expert, training=self.training)
        emit_route(routing, num_experts=E, capacity=capacity, k=self.k, where="layer")
        idx, w, kept, slot = routing["expert_index"], routing["weight"], routing["kept"], routing["slot"]

        # Kept assignments sorted by (expert, slot): each expert's buffer, in order, back to back.
        t, j = torch.nonzero(kept, as_tuple=True)
        e = idx[t, j]
        order = (e * (self.k * T) + slot[t, j]).argsort()
        t, j, e = t[order], j[order], e[order]
        kept_per_expert = torch.bincount(e, minlength=E)                          # = min(count_e, C)
        buffers = x[t].split(kept_per_expert.tolist())                           # expert e's tokens
        out = torch.cat([expert(xe) for expert, xe in zip(self.experts, buffers)])
        y = torch.zeros_like(x).index_add_(0, t, w[t, j].unsqueeze(-1).to(x.dtype) * out)

        stats = {
            "aux_loss": load_balancing_loss(routing["probs"], idx, E),
            "z_loss": router_z_loss(logits),
            "tokens_per_expert": torch.bincount(idx.flatten(), minlength=E),
            "kept_per_expert": kept_per_expert,
            "dropped": int((~kept).sum()),
            "capacity": capacity,
            "routing": routing,
        }
        return y, stats
