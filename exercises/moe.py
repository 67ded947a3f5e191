"""Lecture 5b exercises — the expert axis.  Reference: ``reference/moe/``.

    5b.1  top_k_gating          route T tokens to their top-k experts, with capacity
    5b.2  load_balancing_loss   Switch's auxiliary loss, group-wide under expert parallelism
    5b.3  dispatch, combine     move tokens to the ranks holding their experts and back (all-to-all)
    5b.4  sync_moe_gradients    gradient averaging when expert parallelism meets data parallelism

Given (already written for you): :func:`expert_capacity` and :func:`router_dtype` below, and the
traced collectives in ``reference.comm`` (``comm.all_reduce``, ``comm.all_to_all_single``, ...;
plain ``torch.distributed`` works too).  Check your work with ``check("5b.1")`` in the notebook or
``python -m exercises.grade 5b.1`` in a terminal.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F  # noqa: F401  (one_hot, softmax: you will want them)

from reference import comm  # noqa: F401  (traced all_reduce / all_to_all_single)
from reference.moe.routing import expert_capacity, router_dtype  # noqa: F401  (given)

__all__ = ["expert_capacity", "router_dtype", "top_k_gating", "load_balancing_loss", "dispatch", "combine",
           "sync_moe_gradients"]


# ----------------------------------------------------------------------------------------------
# 5b.1 — the router


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
    raise NotImplementedError(
        'Exercise 5b.1 (top_k_gating): Softmax over ALL experts first (in router_dtype), then top-k. Slots: '
        'first choices of every token come before any second choice; an assignment whose slot reaches the '
        'capacity is dropped. More help: hint("5b.1").')


# ----------------------------------------------------------------------------------------------
# 5b.2 — the load-balancing loss


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
    raise NotImplementedError(
        'Exercise 5b.2 (load_balancing_loss): E · Σ_i f_i · P_i with f from the counts of all k choices (a '
        'constant) and P the mean probability (carries the gradient). With a group, every rank must return '
        'the loss of the WHOLE batch. More help: hint("5b.2").')


# ----------------------------------------------------------------------------------------------
# 5b.3 — dispatch and combine through all-to-all


def dispatch(x: torch.Tensor, routing: dict, num_experts: int, capacity: int, group=None) -> torch.Tensor:
    """Send each kept assignment to the rank holding its expert; padded to ``capacity`` per expert.

    x: (T, d) this rank's tokens; routing: from :func:`top_k_gating`.  Returns (E_local, W·C, d):
    for each of this rank's experts, C slots from each source rank in rank order (zeros where no
    token was assigned).

    Graded on: the dispatched buffer on 1–4 ranks, and combine(experts(dispatch(x))) with its gradients w.r.t. x and
    the combine weights equal to one process's.
    """
    raise NotImplementedError(
        'Exercise 5b.3 (dispatch): dispatch: put each kept assignment in a zero buffer of E·C rows at row e·C'
        ' + slot; rows of the experts on rank w form block w; one all-to-all delivers them. combine undoes it'
        ' and mixes with the combine weights. More help: hint("5b.3").')


def combine(expert_out: torch.Tensor, routing: dict, num_experts: int, capacity: int, group=None) -> torch.Tensor:
    """Return the experts' outputs to the tokens' home ranks and mix them with the combine weights.

    expert_out: (E_local, W·C, d) laid out as :func:`dispatch` returns.  Returns (T, d):
    ``y_t = Σ_j w_tj · out[e_tj, slot_tj]`` over kept assignments; dropped ones contribute 0.

    Graded on: combine(experts(dispatch(x))) and its gradients w.r.t. x and the combine weights on 1–4 ranks, equal
    to one process's.
    """
    raise NotImplementedError(
        'Exercise 5b.3 (combine): dispatch: put each kept assignment in a zero buffer of E·C rows at row e·C '
        '+ slot; rows of the experts on rank w form block w; one all-to-all delivers them. combine undoes it '
        'and mixes with the combine weights. More help: hint("5b.3").')


# ----------------------------------------------------------------------------------------------
# 5b.4 — expert parallelism × data parallelism


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
    raise NotImplementedError(
        "Exercise 5b.4 (sync_moe_gradients): The objective is the mean of the ranks' losses. Dense parameters"
        ' are replicated on every rank of dp_group; each expert on the ranks of expert_dp_group. What did the'
        ' all-to-all already sum into an expert\'s gradient? More help: hint("5b.4").')
