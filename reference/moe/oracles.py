"""The grader's single-process truths for lecture 5b (``exercises/grading/checks/moe/`` calls these
through ``ctx.oracle``): toy experts, dispatch and combine on one process, the load-balancing loss
with its gradient, and the local gradients of an expert × data parallel step with their sync.
"""
from __future__ import annotations

import torch

from .layer import MoELayer
from .parallel import combine, dispatch
from .routing import load_balancing_loss

__all__ = ["toy_experts", "dispatch_combine_single", "aux_loss_and_grad", "ep_dp_local_grads"]


def toy_experts(buffer: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Known expert functions for checking dispatch/combine without weights.

    buffer: (E_local, N, d), local expert i is global expert ``first_expert + i``; expert e maps
    x ↦ (e+1)·tanh(x) + x/2, elementwise (so a zero padding row stays zero, and a token sent to
    the wrong expert comes back visibly wrong).
    """
    scale = torch.arange(first_expert + 1, first_expert + 1 + buffer.shape[0], dtype=buffer.dtype,
                         device=buffer.device).view(-1, 1, 1)
    return scale * torch.tanh(buffer) + 0.5 * buffer


def dispatch_combine_single(x: torch.Tensor, routing: dict, num_experts: int, capacity: int,
                            grad_out: torch.Tensor) -> dict:
    """One process: y = combine(toy_experts(dispatch(x))) and its gradients w.r.t. x and the weights.

    Also returns ``per_assignment`` (T, k, d): expert e_tj's output for token t, 0 where dropped, so
    a checker can form Σ_j w_tj^p · out_tj for other powers p (weights forgotten or applied twice).
    """
    x = x.detach().clone().requires_grad_(True)
    routing = dict(routing)
    routing["weight"] = routing["weight"].detach().clone().requires_grad_(True)
    y = combine(toy_experts(dispatch(x, routing, num_experts, capacity), 0), routing, num_experts, capacity)
    y.backward(grad_out)
    idx, kept = routing["expert_index"], routing["kept"]
    scale = (idx + 1).to(x.dtype).unsqueeze(-1)                                          # (T, k, 1)
    xd = x.detach().unsqueeze(1)
    per_assignment = (scale * torch.tanh(xd) + 0.5 * xd) * kept.unsqueeze(-1)
    return {"out": y.detach(), "grad_x": x.grad, "grad_weight": routing["weight"].grad,
            "per_assignment": per_assignment}


def aux_loss_and_grad(probs: torch.Tensor, expert_index: torch.Tensor, num_experts: int) -> dict:
    """The load-balancing loss of one batch and its gradient w.r.t. ``probs`` (single process)."""
    p = probs.detach().clone().requires_grad_(True)
    loss = load_balancing_loss(p, expert_index, num_experts)
    loss.backward()
    return {"loss": loss.detach(), "grad": p.grad}


def ep_dp_local_grads(world_size: int, ep: int, seed: int, *, num_experts: int = 8, tokens: int = 6,
                      c_aux: float = 0.5, c_z: float = 0.05) -> dict:
    """What each rank holds before and after gradient sync in EP × DP training, simulated in one process.

    Rank r is rank r % ep of expert-parallel group r // ep and holds experts of block q = r % ep.
    It back-propagates ℓ_r = <g_r, y_r> + c_aux·aux + c_z·z_r with y_r = layer(x_r), as the
    expert-parallel layer does: aux is the whole batch's balance loss, its gradient through this
    rank's tokens only, scaled by N (:func:`reference.moe.parallel.mean_share`).
    Before sync: router gradient ∂ℓ_r/∂W_r; expert gradients Σ_{s in r's EP group} ∂ℓ_s/∂θ_q (the
    all-to-all brought the group's tokens to the expert).  After sync (the truth): the gradients of
    the mean (1/N) Σ_s <g_s, y_s> + c_aux·aux + c_z·(1/N) Σ_s z_s.  Returns {"dense", "experts",
    "want_dense", "want_experts"}, lists per rank (lists of tensors).
    """
    torch.manual_seed(seed)
    d, E, W = 4, num_experts, world_size
    layer = MoELayer(d, 6, E, k=2, capacity_factor=1.0).double()
    xs = [torch.randn(tokens, d, dtype=torch.float64) for _ in range(W)]
    gs = [torch.randn(tokens, d, dtype=torch.float64) for _ in range(W)]
    params = [layer.router.weight] + [p for ex in layer.experts for p in ex.parameters()]
    per_expert = len(list(layer.experts[0].parameters()))
    outs = [layer(x) for x in xs]
    probs = [st["routing"]["probs"] for _, st in outs]
    idx = torch.cat([st["routing"]["expert_index"] for _, st in outs])

    def grads_of(s: int) -> list[torch.Tensor]:
        y, st = outs[s]
        aux = load_balancing_loss(torch.cat([p if m == s else p.detach() for m, p in enumerate(probs)]), idx, E)
        loss = (gs[s] * y).sum() + c_aux * W * aux + c_z * st["z_loss"]
        gr = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(gr, params)]

    each = [grads_of(s) for s in range(W)]
    E_local = E // ep

    def block(grads: list[torch.Tensor], q: int) -> list[torch.Tensor]:
        return grads[1 + q * E_local * per_expert: 1 + (q + 1) * E_local * per_expert]

    dense = [[each[r][0]] for r in range(W)]
    experts, want_experts = [], []
    total = [sum(g[i] for g in each) for i in range(len(params))]
    for r in range(W):
        q, grp = r % ep, r // ep
        mine = [sum(gs_) for gs_ in zip(*(block(each[s], q) for s in range(grp * ep, (grp + 1) * ep)))]
        experts.append(mine)
        want_experts.append([g / W for g in block(total, q)])
    return {"dense": dense, "experts": experts, "want_dense": [total[0] / W], "want_experts": want_experts}
