"""Worker functions for the lecture 5b notebook, and the grader's single-process oracles.

Everything here is importable by spawned ranks (notebook cells cannot hold worker functions).
Sections are appended by the lecture's authors; each function says who calls it.
"""
from __future__ import annotations

import torch

from .layer import MoELayer
from .parallel import combine, dispatch
from .routing import load_balancing_loss


# ----------------------------------------------------------------------------------------------
# Oracles for the grader (exercises/grading/checks/moe.py calls these through ctx.oracle)


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


# ----------------------------------------------------------------------------------------------
# Lecture 5b notebook: the routing widget's runs, bytes per all-to-all, the collapse experiment


def routing_run(num_experts: int, k: int, capacity_factor: float, tokens: int = 8, d_model: int = 16,
                seed: int = 0, dropless: bool = False) -> dict:
    """Rank worker: one expert-parallel forward of a seeded layer on this rank's ``tokens`` tokens.

    Every rank builds the same layer (same seed) and keeps its experts; rank r's tokens come from
    seed + 1 + r.  The trace (route, dispatch/combine all-to-alls, expert compute) is what the
    routing widget replays.  Returns this rank's counts.
    """
    from .. import comm
    from .parallel import ExpertParallelMoE
    torch.manual_seed(seed)
    layer = MoELayer(d_model, 2 * d_model, num_experts, k=k, capacity_factor=capacity_factor, dropless=dropless)
    with torch.no_grad():
        layer.router.weight.mul_(3.0)          # a confident router: uneven loads, visible drops
    ep = ExpertParallelMoE.from_layer(layer)
    g = torch.Generator().manual_seed(seed + 1 + comm.rank())
    x = torch.randn(tokens, d_model, generator=g)
    with torch.no_grad():
        y, stats = ep(x)
    return {"dropped": stats["dropped"], "dispatched": stats["dispatched"], "capacity": stats["capacity"],
            "tokens_per_expert": stats["tokens_per_expert"], "y_zero_rows": int((y == 0).all(1).sum())}


def record_routing_traces(worlds: dict, ks=(1, 2), capacity_factors=(0.5, 1.0, 2.0), num_experts=(4, 8),
                          tokens: int = 8, d_model: int = 16, seed: int = 0) -> dict:
    """Parent side: run :func:`routing_run` for every (k, cf, E, W) in live ``worlds`` {W: World}.

    Returns {(k, cf, E, W): trace} for :func:`reference.widgets.routing.routing_player`.
    """
    traces = {}
    for W, world in worlds.items():
        for E in num_experts:
            for k in ks:
                for cf in capacity_factors:
                    res = world.run(routing_run, E, k, cf, tokens, d_model, seed)
                    traces[(k, cf, E, W)] = res.trace
    return traces


def train_toy_moe(aux_coef: float, *, steps: int = 300, num_experts: int = 4, d_model: int = 16,
                  tokens: int = 128, mean_norm: float = 1.0, lr: float = 1e-2, seed: int = 0) -> dict:
    """Train a one-layer top-1 MoE (dropless) to fit a linear map, with ``aux_coef`` × the balance loss.

    The data have learnable structure: y = x·A with x = μ + N(0, I), a shared mean direction μ
    (|μ| = ``mean_norm``) as hidden states of a real model have.  The router starts balanced:
    small random weights made orthogonal to μ, so at step 0 each expert gets about 1/E of the
    tokens.  Without the balance loss the router learns a component along μ for whichever
    expert improved first — raising that expert's logit for EVERY token — and the rich get
    richer.  Returns per step the fraction of tokens each expert received (``load``, steps × E),
    the task loss and the aux loss.
    """
    torch.manual_seed(seed)
    d, E = d_model, num_experts
    layer = MoELayer(d, 2 * d, E, k=1, dropless=True)
    A = torch.randn(d, d) / d ** 0.5
    mu = torch.randn(d)
    mu = mean_norm * mu / mu.norm()
    with torch.no_grad():   # balanced start: E orthogonal rows of equal norm, all orthogonal to μ
        G = torch.randn(d, E)
        G -= torch.outer(mu, mu @ G) / mu.dot(mu)
        layer.router.weight.copy_(1e-2 * torch.linalg.qr(G).Q.T)
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    load, task, aux = [], [], []
    for _ in range(steps):
        x = mu + torch.randn(tokens, d)
        y, stats = layer(x)
        mse = (y - x @ A).pow(2).mean()
        opt.zero_grad()
        (mse + aux_coef * stats["aux_loss"]).backward()
        opt.step()
        load.append((stats["tokens_per_expert"].double() / tokens).tolist())
        task.append(float(mse.detach()))
        aux.append(float(stats["aux_loss"].detach()))
    return {"load": load, "task_loss": task, "aux_loss": aux}


def flops_per_token(num_experts: int, *, k: int = 2, d_model: int = 64, d_ff: int = 256, tokens: int = 256,
                    seed: int = 0) -> dict:
    """Count one forward's FLOPs of a dropless top-k :class:`MoELayer` with torch's FlopCounterMode.

    Returns parameters, FLOPs per token (matmuls, as the counter reports them: 2·m·n·k each) and
    the dense FFN's FLOPs per token for comparison (2 matmuls d_model × d_ff).
    """
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(seed)
    layer = MoELayer(d_model, d_ff, num_experts, k=k, dropless=True)
    x = torch.randn(tokens, d_model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x)
    return {"experts": num_experts, "params": sum(p.numel() for p in layer.parameters()),
            "flops_per_token": counter.get_total_flops() / tokens,
            "dense_ffn_flops_per_token": 2 * 2 * d_model * d_ff,
            "dense_ffn_params": 2 * d_model * d_ff + d_model + d_ff}
