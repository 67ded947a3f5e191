"""Lecture 5b, part 2 — the single-process MoE layer: the ground truth for expert parallelism.

``MoELayer`` routes T tokens with :func:`top_k_gating` (:func:`top_k_routing` with the frontier options
below) and runs each expert on the tokens kept
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
biases: ``FFN(x) = W_2 · gelu(W_1 · x + b_1) + b_2``, d_model → d_ff → d_model (or SwiGLU,
:mod:`.experts`).  An expert does the same FLOPs per token as the dense FFN it replaces, so with k
experts per token the compute per token is k dense FFNs whatever E is; the parameters grow E-fold
("sparse, not just large").

Frontier MoE layers (DeepSeekMoE arXiv:2401.06066, DeepSeek-V3 arXiv:2412.19437) add, all options here:

    d_ff = expert_ffn small      fine-grained experts: many narrow experts, top-k up to 8
    shared_experts = s           one FFN of width s·d_ff that EVERY token goes through, added to the
                                 routed experts' sum:  y_t = shared(x_t) + Σ_j w_tj · FFN_{e_tj}(x_t)
    router = "sigmoid"           per-expert sigmoid scores, weights normalised over the chosen k
    balance = "loss_free"        a bias per expert for choosing (``expert_bias``), stepped after each
                                 optimizer step from the loads counted since (:meth:`MoELayer.update_bias`)
    balance = "seq_aux"          the balance loss per sequence, averaged (pass ``sequence`` to forward)
    max_nodes = M                node-limited routing over ``node_of_expert``
    experts_impl                 "loop" (default), "grouped" (one ``torch._grouped_mm``) or "auto" (.experts);
                                 the loop by default: on CPU the grouped GEMM is no faster forward + backward
                                 (the full course's benchmarks/moe_frontier.py), and torch's FlopCounterMode does
                                 not count
                                 ``_grouped_mm`` (1,024 of 132,096 FLOPs per token seen, d 64, f 256, top-2)

``stats["aux_loss"]`` is the balance loss to back-propagate (weighted by your α): Switch's for
"aux", the sequence-wise one for "seq_aux" and "loss_free+seq_aux" (DeepSeek-V3's guard), and a
zero for "loss_free" (the bias does the balancing).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import trace
from .experts import Expert, make_expert, run_experts
from .routing import (ROUTERS, check_node_limit, expert_capacity, gshard_random_routing, loss_free_bias_update,
                      router_z_loss, sequence_balance_loss, top_k_routing)

__all__ = ["Expert", "MoELayer", "route", "BALANCES", "balance_loss"]

BALANCES = ("aux", "loss_free", "seq_aux", "loss_free+seq_aux")


def route(x: torch.Tensor, router: nn.Linear, *, k: int, capacity: int | None, num_experts: int,
          jitter: float = 0.0, random_second_expert: bool = False, training: bool = False,
          generator: torch.Generator | None = None,
          gating: dict | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Router logits and the routing decision for tokens ``x`` (T, d) — shared by both layers.

    jitter: Switch's router jitter (§2.4): multiply the router's INPUT by U(1-ε, 1+ε) while
    training.  random_second_expert: GShard's random routing (see :func:`gshard_random_routing`).
    Both off by default: grading needs determinism.  They draw from ``generator`` (default: the
    global RNG), so an expert-parallel run matches a single-process one only if each rank's RNG
    is seeded as the single process's was for the same tokens.  ``gating``: :func:`top_k_routing`'s
    keyword arguments (router kind, bias, node_of_expert, max_nodes).
    """
    h = x
    if training and jitter > 0:
        h = x * torch.empty_like(x).uniform_(1 - jitter, 1 + jitter, generator=generator)
    logits = router(h)                                                    # (T, E)
    routing = top_k_routing(logits, k, capacity, **(gating or {}))
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


def balance_loss(balance: str, probs: torch.Tensor, expert_index: torch.Tensor, num_experts: int, *, group=None,
                 sequence: torch.Tensor | None = None, num_sequences: int | None = None) -> torch.Tensor:
    """The loss ``balance`` back-propagates: Switch's over the whole routing group ("aux"), the
    sequence-wise one ("seq_aux", "loss_free+seq_aux"), none ("loss_free": a zero that keeps the graph)."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if balance == "loss_free":
        return probs.sum() * 0.0
    if balance == "aux":
        sequence = num_sequences = None
    return sequence_balance_loss(probs, expert_index, num_experts, group=group, sequence=sequence,
                                 num_sequences=num_sequences)


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer on one process.

    MoELayer(d_model, d_ff, num_experts, k=2, capacity_factor=1.0, dropless=False, router="softmax",
             shared_experts=0, activation="gelu", balance="aux", bias_update_rate=1e-3,
             node_of_expert=None, max_nodes=None, experts_impl="loop")

    forward(x: (T, d_model), sequence=None, num_sequences=None) -> (y: (T, d_model), stats) where the
    T tokens are one routing group (capacity ``ceil(k·cf·T/E)``, or none if ``dropless``), ``sequence``
    (T,) their sequences for the sequence-wise balance loss, and ``stats`` holds

        aux_loss           the balance loss to back-propagate (module docstring; scalar tensor)
        z_loss             ST-MoE router z-loss (scalar tensor)
        tokens_per_expert  (E,) long: assignments per expert BEFORE dropping
        kept_per_expert    (E,) long: assignments that got a slot = min(count_e, C)
        dropped            int: assignments dropped (k·T - kept)
        capacity           int, or None when dropless
        routing            the dict of :func:`top_k_gating` (probs, expert_index, weight, kept, slot)

    The routing decision is also recorded as a ``route`` trace event (``where="layer"``).  In training
    mode the assignments per expert are added to ``load`` (for :meth:`update_bias`).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, k: int = 2, capacity_factor: float = 1.0,
                 dropless: bool = False, jitter: float = 0.0, random_second_expert: bool = False,
                 router: str = "softmax", shared_experts: int = 0, activation: str = "gelu", balance: str = "aux",
                 bias_update_rate: float = 1e-3, node_of_expert=None, max_nodes: int | None = None,
                 experts_impl: str = "loop"):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be between 1 and num_experts={num_experts}, got {k}")
        if router not in ROUTERS or balance not in BALANCES or shared_experts < 0:
            raise ValueError(f"router must be one of {ROUTERS}, balance one of {BALANCES} and shared_experts >= 0; "
                             f"got {router!r}, {balance!r}, {shared_experts!r}")
        if max_nodes is not None and (node_of_expert is None or len(node_of_expert) != num_experts or max_nodes < 1):
            raise ValueError("max_nodes needs node_of_expert, one node per expert, and max_nodes >= 1")
        if max_nodes is not None:
            check_node_limit(node_of_expert, max_nodes, k)
        self.d_model, self.d_ff, self.num_experts = d_model, d_ff, num_experts
        self.k, self.capacity_factor, self.dropless = k, capacity_factor, dropless
        self.jitter, self.random_second_expert = jitter, random_second_expert
        self.router_kind, self.balance, self.bias_update_rate = router, balance, bias_update_rate
        self.shared_experts, self.activation, self.experts_impl = shared_experts, activation, experts_impl
        self.max_nodes = max_nodes
        self.node_of_expert = None if node_of_expert is None else torch.as_tensor(node_of_expert, dtype=torch.long)
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(make_expert(d_model, d_ff, activation) for _ in range(num_experts))
        if shared_experts:
            self.shared = make_expert(d_model, shared_experts * d_ff, activation)
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=balance.startswith("loss_free"))
        self.register_buffer("load", torch.zeros(num_experts), persistent=False)

    def capacity(self, num_tokens: int) -> int | None:
        return None if self.dropless else expert_capacity(num_tokens, self.num_experts, self.k, self.capacity_factor)

    def gating(self) -> dict:
        """The keyword arguments of :func:`top_k_routing` this layer routes with."""
        return dict(router=self.router_kind, bias=self.expert_bias if self.balance.startswith("loss_free") else None,
                    node_of_expert=self.node_of_expert, max_nodes=self.max_nodes)

    def update_bias(self, group=None) -> None:
        """Loss-free balancing's step (:func:`loss_free_bias_update`, γ = ``bias_update_rate``) from the
        loads counted since the last call, summed over ``group`` (the ranks that route tokens); resets
        ``load``.  Nothing for the other balances."""
        if self.balance.startswith("loss_free"):
            loss_free_bias_update(self.expert_bias, self.load, self.bias_update_rate, group=group)
        self.load.zero_()

    def count_load(self, expert_index: torch.Tensor) -> None:
        """Add this forward's assignments to ``load`` — while training with gradients (not in an evaluation)."""
        if self.training and torch.is_grad_enabled():
            self.load += torch.bincount(expert_index.flatten(), minlength=self.num_experts).to(self.load.dtype)

    def forward(self, x: torch.Tensor, sequence: torch.Tensor | None = None,
                num_sequences: int | None = None) -> tuple[torch.Tensor, dict]:
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"MoELayer expects tokens of shape (T, {self.d_model}), got {tuple(x.shape)}")
        T, E = x.shape[0], self.num_experts
        capacity = self.capacity(T)
        logits, routing = route(x, self.router, k=self.k, capacity=capacity, num_experts=E, jitter=self.jitter,
                                random_second_expert=self.random_second_expert, training=self.training,
                                gating=self.gating())
        emit_route(routing, num_experts=E, capacity=capacity, k=self.k, where="layer")
        idx, w, kept, slot = routing["expert_index"], routing["weight"], routing["kept"], routing["slot"]
        self.count_load(idx)

        # Kept assignments sorted by (expert, slot): each expert's buffer, in order, back to back.
        t, j = torch.nonzero(kept, as_tuple=True)
        e = idx[t, j]
        order = (e * (self.k * T) + slot[t, j]).argsort()
        t, j, e = t[order], j[order], e[order]
        kept_per_expert = torch.bincount(e, minlength=E)                          # = min(count_e, C)
        out = run_experts(list(self.experts), x[t], kept_per_expert.tolist(), self.experts_impl)
        y = torch.zeros_like(x).index_add_(0, t, w[t, j].unsqueeze(-1).to(x.dtype) * out)
        if self.shared_experts:
            y = y + self.shared(x)

        stats = {
            "aux_loss": balance_loss(self.balance, routing["probs"], idx, E, sequence=sequence,
                                     num_sequences=num_sequences),
            "z_loss": router_z_loss(logits),
            "tokens_per_expert": torch.bincount(idx.flatten(), minlength=E),
            "kept_per_expert": kept_per_expert,
            "dropped": int((~kept).sum()),
            "capacity": capacity,
            "routing": routing,
        }
        return y, stats
