"""Lecture 5b, part 1 — the router: top-k gating, capacity, and the two router losses.

A mixture-of-experts layer replaces one feed-forward block by E experts and a router, a linear map
``W_r`` (d_model × E, no bias).  Token t gets router logits ``h_t = x_t · W_r`` and probabilities

    p_t = softmax(h_t)          over ALL E experts, in float32 (or the input's dtype if wider)

and is sent to its k most probable experts.  Its output is the weighted sum of what they return:

    y_t = Σ_{j<k, kept}  w_tj · FFN_{e_tj}(x_t)

Every choice below is pinned down, with where it comes from and where public code differs.

Softmax order — softmax over all experts, THEN top-k (Switch arXiv:2101.03961 §2.1, GShard
    arXiv:2006.16668 Alg. 1).  Top-k first and a softmax over the k survivors (Mixtral-style code)
    gives the same top-2 weights, but for k = 1 it always gives weight 1.0, so the router receives
    no gradient through the weight.

Sigmoid router (``router="sigmoid"``, DeepSeek-V3 arXiv:2412.19437 eq. 13-15): each expert's score
    is its own ``s_{t,e} = sigmoid(h_{t,e})`` (no competition between experts), the top k are
    chosen and their weights are the scores normalised over the chosen k, ``w_j = s_j / Σ_k s``.
    (For k = 1 that would always be 1 — no router gradient — so top-1 keeps the raw score, as
    softmax's top-1 keeps the raw probability.)  ``probs`` is then ``s / Σ_e s``, the scores
    normalised over all experts, the "P" the balance losses use (DeepSeek-V3 eq. 19).

Loss-free balancing (DeepSeek-V3 §2.1.2; Wang et al. arXiv:2408.15664): a bias ``b_e`` per expert is
    ADDED to the scores for CHOOSING the top k only — never to the combine weights — and nudged
    after each step towards the mean load (:func:`loss_free_bias_update`).

Node-limited routing (DeepSeek-V3 §2.1.2, "at most M nodes"): each token first picks the M nodes
    whose experts score highest (a node's score: the sum of its ⌈k/M⌉ best scores), then its top k
    among those nodes' experts only (:func:`node_limited_mask`): a token's all-to-all reaches at
    most M nodes whatever k is.

Combine weights — top-1 (Switch): ``w = p_{t,e}``, the raw probability.  Top-2 (GShard): the two
    probabilities renormalised, ``w_j = p_j / (p_1 + p_2)``, BEFORE any capacity dropping: a dropped
    second choice does not hand its weight to the first.  (DeepSpeed's and fairscale's
    ``top2gating`` take the denominator from the capacity-masked gates, i.e. renormalise AFTER
    dropping: a token that lost its second expert gives its first one weight 1; fairseq has a
    ``normalize_gate_prob_before_dropping`` switch.)  For k > 2 we renormalise the same way.

Capacity — each expert has a buffer of ``C = ceil(k · capacity_factor · T / E)`` slots per routing
    group of T tokens, at least 1 (Switch §2.2 writes (T/E)·cf for k = 1; GShard sizes top-2
    buffers 2T/E).  DeepSpeed uses the same ceil with a ``min_capacity`` floor (default 4); other
    code floors instead of ceiling.  Slots are filled by every token's FIRST choice, in token order,
    before any SECOND choice (GShard Alg. 1 offsets the second choice's position by the count of
    first choices).  V-MoE's "batch prioritized routing" (arXiv:2106.05974) instead orders by
    router probability; not used here.

Dropping — an assignment beyond capacity is dropped: it contributes exactly 0 to ``y_t``.  A token
    dropped by all its experts outputs 0 from the layer and is carried by the residual around it
    (Switch §2.2).  Code that adds the residual inside the MoE layer shows such a token as "x".

Layout of the routing decision, T tokens, k choices (what the lecture's widget draws)::

                   choice 0      choice 1          slot: position in the expert's buffer,
    token 0    ->  e=3 w=.61     e=0 w=.39               first choices fill slots first
    token 1    ->  e=3 w=.55     e=2 w=.45         kept: slot < C
    ...                                            dropped: slot = -1, contributes 0
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import comm

__all__ = ["expert_capacity", "top_k_gating", "load_balancing_loss", "router_z_loss",
           "router_dtype", "gshard_random_routing", "ROUTERS", "top_k_routing", "node_limited_mask",
           "sequence_balance_loss", "loss_free_bias_update", "sequence_ids"]

ROUTERS = ("softmax", "sigmoid")


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or the input's dtype if wider (float64): the router's softmax never runs in 16 bits."""
    return torch.promote_types(dtype, torch.float32)


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert per routing group: ``C = ceil(k · capacity_factor · T / E)``, at least 1.

    With ``capacity_factor = 1`` the buffers hold exactly the k·T assignments if routing is
    perfectly balanced; above 1 they leave head-room for imbalance (Switch uses 1.0-1.25 in
    training, GShard 2T/E for top-2).
    """
    if num_tokens < 0 or num_experts < 1 or k < 1 or capacity_factor <= 0:
        raise ValueError(f"expert_capacity needs T >= 0, E >= 1, k >= 1, capacity_factor > 0; got "
                         f"T={num_tokens}, E={num_experts}, k={k}, capacity_factor={capacity_factor}")
    return max(1, math.ceil(k * capacity_factor * num_tokens / num_experts))


def top_k_gating(logits: torch.Tensor, k: int, capacity: int | None) -> dict[str, torch.Tensor]:
    """Route T tokens to their top-k experts with capacity ``capacity`` (None: dropless).

    logits: (T, E) router logits.  Returns a dict of tensors:

        probs         (T, E) float32+  softmax over all experts
        expert_index  (T, k) long      experts chosen, most probable first
        weight        (T, k) float32+  combine weights: k = 1 raw probability (Switch); k >= 2
                                       renormalised over the k chosen, before dropping (GShard)
        kept          (T, k) bool      the assignment got a slot
        slot          (T, k) long      position in its expert's buffer, -1 if dropped

    Slot order: all first choices in token order, then all second choices, ...  The assignment
    (t, j) to expert e takes slot = number of assignments to e that come before it in the order
    (j=0, t=0), (j=0, t=1), ..., (j=0, t=T-1), (j=1, t=0), ...; it is kept if slot < capacity.

    Graded on: probs, expert_index, weight, kept and slot for top-1 and top-2, with and without dropping, dropless,
    float32 and bfloat16 logits.
    """
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"k must be between 1 and the number of experts ({E}), got {k}")
    probs = torch.softmax(logits.to(router_dtype(logits.dtype)), dim=-1)         # (T, E)
    top_p, expert_index = probs.topk(k, dim=-1)                                  # (T, k)
    weight = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)

    # Priority order: entry j·T + t is choice j of token t.  Its position = how many earlier entries
    # chose the same expert: a stable sort by expert keeps the priority order within each expert,
    # so position = rank in the sorted order - where its expert's run starts.  O(k·T log k·T), not
    # O(k·T·E) like a cumsum over one-hot rows (the same integers; E = 64 made that 5 % of a step).
    chosen = expert_index.t().reshape(k * T)                                     # (k·T,)
    by_expert = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=E)
    start = counts.cumsum(0) - counts                                            # (E,)
    position = torch.empty_like(chosen)
    position[by_expert] = torch.arange(k * T, device=chosen.device) - start[chosen[by_expert]]
    position = position.view(k, T).t()                                           # (T, k)

    kept = torch.ones_like(position, dtype=torch.bool) if capacity is None else position < capacity
    slot = torch.where(kept, position, torch.full_like(position, -1))
    return {"probs": probs, "expert_index": expert_index, "weight": weight, "kept": kept, "slot": slot}


def top_k_routing(logits: torch.Tensor, k: int, capacity: int | None, *, router: str = "softmax",
                 bias: torch.Tensor | None = None, node_of_expert: torch.Tensor | None = None,
                 max_nodes: int | None = None) -> dict[str, torch.Tensor]:
    """:func:`top_k_gating` with the frontier options: the same dict, the same slots.

    logits: (T, E) router logits.  router: "softmax" (Switch/GShard) or "sigmoid" (DeepSeek-V3).
    bias: (E,) added to the scores for choosing the top k only (loss-free balancing).  node_of_expert
    (E,) and max_nodes M: each token chooses among the experts of its M best nodes only
    (:func:`node_limited_mask`).  Returns a dict of tensors:

        probs         (T, E) float32+  softmax over all experts (sigmoid: the scores normalised over all)
        expert_index  (T, k) long      experts chosen, best first
        weight        (T, k) float32+  combine weights: k = 1 the raw probability / score; k >= 2
                                       renormalised over the k chosen, before dropping (GShard, DeepSeek-V3)
        kept          (T, k) bool      the assignment got a slot
        slot          (T, k) long      position in its expert's buffer, -1 if dropped

    Slots as :func:`top_k_gating` assigns them.  With the defaults it IS :func:`top_k_gating`.
    """
    if router == "softmax" and bias is None and max_nodes is None:
        return top_k_gating(logits, k, capacity)
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"k must be between 1 and the number of experts ({E}), got {k}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    h = logits.to(router_dtype(logits.dtype))
    if router == "softmax":
        scores = probs = torch.softmax(h, dim=-1)                                 # (T, E)
    else:
        scores = torch.sigmoid(h)                                                 # (T, E), each in (0, 1)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    choice = scores if bias is None else scores + bias.to(scores.dtype)           # bias: for choosing only
    if max_nodes is not None:
        if node_of_expert is None:
            raise ValueError("max_nodes needs node_of_expert (the node each expert lives on)")
        choice = choice.masked_fill(~node_limited_mask(choice.detach(), node_of_expert, max_nodes, k), float("-inf"))
    expert_index = choice.detach().topk(k, dim=-1).indices                        # (T, k)
    top = scores.gather(1, expert_index)
    weight = top if k == 1 else top / top.sum(dim=-1, keepdim=True)

    # The slots are top_k_gating's, in its order: give it logits that rank the k chosen experts first
    # (k, k-1, ..., 1; every other expert far below), so that its top k are exactly expert_index.
    ranking = torch.full((T, E), -1e4, dtype=torch.float32, device=logits.device)
    ranking.scatter_(1, expert_index, torch.arange(k, 0, -1, dtype=torch.float32, device=logits.device).expand(T, k))
    gated = top_k_gating(ranking, k, capacity)
    return {"probs": probs, "expert_index": expert_index, "weight": weight, "kept": gated["kept"],
            "slot": gated["slot"]}


def node_limited_mask(scores: torch.Tensor, node_of_expert: torch.Tensor, max_nodes: int, k: int) -> torch.Tensor:
    """(T, E) bool: the experts on each token's ``max_nodes`` best nodes (DeepSeek-V3's node-limited routing).

    scores: (T, E) the scores the top k is chosen from (bias included); node_of_expert: (E,) long, the
    node each expert lives on.  A node's score for a token is the sum of its ⌈k/M⌉ best experts'
    scores (fewer if it holds fewer); ties go to the lower node.  ValueError if M nodes cannot hold
    k experts.
    """
    check_node_limit(node_of_expert, max_nodes, k)
    nodes = torch.unique(node_of_expert)
    if max_nodes >= len(nodes):
        return torch.ones_like(scores, dtype=torch.bool)
    per_node = [(node_of_expert == n).nonzero().flatten() for n in nodes.tolist()]
    g = -(-k // max_nodes)
    node_score = torch.stack([scores[:, p].topk(min(g, len(p)), dim=-1).values.sum(-1) for p in per_node], 1)
    best = node_score.topk(max_nodes, dim=-1).indices                                         # (T, M)
    chosen_nodes = torch.zeros_like(node_score, dtype=torch.bool).scatter_(1, best, True)     # (T, N)
    column = torch.searchsorted(nodes, node_of_expert)                                         # (E,) node column
    return chosen_nodes[:, column]


def check_node_limit(node_of_expert, max_nodes: int, k: int) -> None:
    """ValueError unless any ``max_nodes`` nodes of ``node_of_expert`` hold at least k experts (checked when a
    layer is built: every rank raises the same, before any message)."""
    counts = sorted(torch.bincount(torch.as_tensor(node_of_expert)).tolist())
    counts = [c for c in counts if c]
    if max_nodes < 1 or sum(counts[:max_nodes]) < k:
        raise ValueError(f"max_nodes={max_nodes}: the {max_nodes} smallest nodes hold fewer than k={k} experts "
                         f"(experts per node: {counts})")


def sequence_ids(batch: int, seq_len: int, *, sequence_first: bool = False, first: int = 0) -> torch.Tensor:
    """The sequence of each token of a flattened (batch, seq_len) — or (seq_len, batch) if ``sequence_first``
    — block of tokens, numbered from ``first`` (for :func:`load_balancing_loss`'s sequence-wise loss)."""
    b = torch.arange(first, first + batch)
    return b.repeat(seq_len) if sequence_first else b.repeat_interleave(seq_len)


def gshard_random_routing(routing: dict[str, torch.Tensor], num_experts: int, capacity: int | None, *,
                          generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """GShard's random second expert (arXiv:2006.16668 §2.2), off by default in the course.

    A token's second choice is used only with probability ``min(1, 2 · w_2)`` (w_2 <= 1/2 after
    renormalisation; fairseq's ``second_expert_policy="random"`` does the same): a token whose router
    is nearly sure of its first expert rarely pays for a
    second.  Unused second choices take no slot; the weights are NOT renormalised again.  Slots are
    then re-assigned in the usual order.  Returns a new routing dict (top-2 only).
    """
    idx, w = routing["expert_index"], routing["weight"]
    if idx.shape[1] != 2:
        raise ValueError("random second-expert routing is defined for top-2 gating")
    T, k = idx.shape
    u = torch.rand(T, generator=generator, dtype=w.dtype, device=w.device)
    active = torch.stack([torch.ones(T, dtype=torch.bool, device=idx.device), u < 2 * w[:, 1].detach()], 1)
    order = (F.one_hot(idx, num_experts) * active.unsqueeze(-1)).transpose(0, 1).reshape(k * T, num_experts)
    position = ((order.cumsum(dim=0) - 1) * order).sum(dim=-1).view(k, T).t()
    kept = active if capacity is None else active & (position < capacity)
    slot = torch.where(kept, position, torch.full_like(position, -1))
    return {**routing, "kept": kept, "slot": slot}


def load_balancing_loss(probs: torch.Tensor, expert_index: torch.Tensor, num_experts: int, *,
                        group=None) -> torch.Tensor:
    """Switch's auxiliary load-balancing loss ``E · Σ_i f_i · P_i`` (arXiv:2101.03961 eq. 4-6).

    probs: (T, E) router probabilities; expert_index: (T, k) choices, BEFORE capacity dropping.

        f_i = (assignments to expert i) / (k · T)     fraction of the k·T assignments
        P_i = (1/T) Σ_t p_{t,i}                       mean router probability

    Uniform probabilities give f_i = P_i = 1/E, so the loss is exactly 1.0 whatever the choices;
    a collapsed top-1 router (every token to one expert with probability → 1) gives → E.  Only P carries
    gradient (f is a count), pushing probability away from over-loaded experts.

    Where code differs: Switch routes top-1, so f counts the one choice.  GShard-style top-2 code
    (DeepSpeed, fairscale: ``mean(me · ce) · E²``) counts FIRST choices only — the same value as
    here when k = 1.  HF's Mixtral loss counts all k choices but does not divide by k, so its
    uniform value is k.  A top-k router's collapse value is E/k here (f_i <= 1/k).  Multiply by
    the coefficient α yourself (Switch: 0.01).

    group: the process group the routing group's tokens are spread over (expert parallelism), or
    None for no communication (all tokens are here).  Counts, probability sums and T are
    all-reduced, so EVERY rank returns the loss of the concatenated batch.

    Gradient across ranks.  Each rank then back-propagates its own copy of this global value.  The
    all-reduced probability sum is built as ``local + (global - local).detach()``: its value is the
    group's, its gradient reaches only this rank's own tokens, ∂L/∂p_{t,i} = E·f_i / T_group for
    t on this rank.  Summed over the ranks, the router's gradients count the loss exactly once; a
    differentiable all-reduce (backward = all-reduce) would count it W times.  Training AVERAGES
    gradients over the ranks (:func:`reference.moe.sync_moe_gradients`), which would weaken the
    loss to α/W: the expert-parallel layer therefore scales this gradient by W
    (:func:`reference.moe.parallel.mean_share`; lecture 5b, "the balance loss under data parallelism").

    Graded on: the loss on 1–4 ranks with uneven token counts (every rank the whole batch's), uniform and collapsed
    routers, and the gradient reaching each rank's own tokens only; each rank is given its own tokens only.
    """
    T, k = expert_index.shape
    counts = torch.bincount(expert_index.flatten(), minlength=num_experts).to(probs.dtype)   # (E,)
    prob_sum = probs.sum(dim=0)                                                       # (E,)
    tokens = torch.tensor([float(T)], dtype=probs.dtype, device=probs.device)
    if group is not None and comm.world_size(group) > 1:
        packed = torch.cat([counts, prob_sum.detach(), tokens])
        comm.all_reduce(packed, group=group, what="aux_loss")
        counts, group_prob_sum, tokens = packed[:num_experts], packed[num_experts:-1], packed[-1:]
        prob_sum = prob_sum + (group_prob_sum - prob_sum.detach())   # value global, gradient local
    f = counts / (k * tokens)
    P = prob_sum / tokens
    return num_experts * (f * P).sum()


def sequence_balance_loss(probs: torch.Tensor, expert_index: torch.Tensor, num_experts: int, *,
                        group=None, sequence: torch.Tensor | None = None,
                        num_sequences: int | None = None) -> torch.Tensor:
    """:func:`load_balancing_loss` per sequence (DeepSeek-V3's L_Bal, arXiv:2412.19437 eq. 17-20), averaged.

    ``sequence`` (T,) long gives each token's sequence (0 … num_sequences − 1, :func:`sequence_ids`;
    None: all one sequence, then it IS :func:`load_balancing_loss`).  f and P are taken over each
    sequence's tokens alone and the loss is the MEAN over the sequences of E · Σ_i f_si · P_si: it
    balances every sequence, not just the batch (a batch whose sequences each favour one expert is
    balanced as a whole, not sequence by sequence).  ``group``: as :func:`load_balancing_loss` — each
    rank puts its tokens' statistics at their sequences' global numbers, so ranks may hold parts
    of the same sequences (context parallelism); the value is the group's, the gradient local.
    DeepSeek-V3 weighs it by α = 0.0001, as a guard beside loss-free balancing.
    """
    T, k = expert_index.shape
    if sequence is None:
        return load_balancing_loss(probs, expert_index, num_experts, group=group)
    if num_sequences is None:
        num_sequences = int(sequence.max()) + 1 if T else 1
    S, E = num_sequences, num_experts
    cell = (sequence.unsqueeze(1) * E + expert_index).flatten()                          # (T·k,) sequence × expert
    counts = torch.bincount(cell, minlength=S * E).to(probs.dtype).view(S, E)          # (S, E)
    prob_sum = probs.new_zeros(S, E).index_add(0, sequence, probs)                      # (S, E)
    tokens = torch.bincount(sequence, minlength=S).to(probs.dtype)                      # (S,)
    if group is not None and comm.world_size(group) > 1:
        packed = torch.cat([counts.flatten(), prob_sum.detach().flatten(), tokens])
        comm.all_reduce(packed, group=group, what="aux_loss")
        counts, group_prob_sum = packed[:S * E].view(S, E), packed[S * E:2 * S * E].view(S, E)
        tokens = packed[2 * S * E:]
        prob_sum = prob_sum + (group_prob_sum - prob_sum.detach())   # value global, gradient local
    tokens = tokens.clamp(min=1).unsqueeze(1)                                           # (S, 1)
    f = counts / (k * tokens)
    P = prob_sum / tokens
    return (num_experts * (f * P).sum(dim=1)).mean()


def loss_free_bias_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float, *,
                          group=None) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free bias update (arXiv:2412.19437 §2.1.2), in place; returns ``bias``.

        load_e = tokens routed to expert e this step, summed over EVERY rank that routes tokens
        b_e  ←  b_e + γ · sign(mean_e load − load_e)

    bias: (E,) the per-expert bias added to the scores for choosing the top k; tokens_per_expert: (E,)
    this rank's assignments per expert since the last update (all its micro-batches); rate: γ
    (DeepSeek-V3: 0.001).  ``group``: the ranks that route tokens — on a composed grid every data ×
    context rank (not just the expert-parallel group, whose ranks see only part of the batch: each
    replica would then step its bias on a different count and the replicas would drift apart).
    One all-reduce of E numbers; every rank ends with the same bias.  An overloaded expert's bias
    drops by γ, an underloaded one's rises by γ, a balanced one's (load = mean) stays.
    """
    load = tokens_per_expert.detach().to(torch.float64).clone()
    if group is not None and comm.world_size(group) > 1:
        comm.all_reduce(load, group=group, what="expert_load")
    with torch.no_grad():
        bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
    return bias


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``(1/T) Σ_t (log Σ_i exp h_{t,i})²`` (Zoph et al., arXiv:2202.08906 eq. 5).

    logits: (T, E).  Penalises large logits, which make the router's softmax (and bf16 training)
    unstable.  Computed in float32 or wider; ST-MoE weighs it by 1e-3.
    """
    return torch.logsumexp(logits.to(router_dtype(logits.dtype)), dim=-1).pow(2).mean()
