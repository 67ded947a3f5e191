"""Lecture 5b's harness: rank functions that call the learner's 5b.1–5b.4 and return plain values.
Each rank gets its own tokens, routing and gradients only (``mine``)."""
from __future__ import annotations

import torch

from . import function as _fn


def gating_call(module: str, logits, k, capacity):
    out = _fn(module, "top_k_gating")(logits, k, capacity)
    return dict(out) if isinstance(out, dict) else out


def aux_per_rank(module: str, mine: tuple, num_experts: int):
    """On each rank: the learner's loss over the world group, and its gradient w.r.t. this rank's
    probs (``mine = (probs, expert_index)``)."""
    import torch.distributed as dist
    probs, idx = mine
    probs = probs.clone().requires_grad_(True)
    loss = _fn(module, "load_balancing_loss")(probs, idx, num_experts, group=dist.group.WORLD)
    grad = None
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
        grad = probs.grad
    return {"loss": loss.detach() if isinstance(loss, torch.Tensor) else loss, "grad": grad}


def dispatch_combine_per_rank(module: str, mine: tuple, num_experts: int, capacity: int, backward: bool):
    """On each rank: buffer = dispatch(x); y = combine(toy_experts(buffer)); backprop the output
    gradient (``mine = (x, routing, grad_out)``)."""
    import torch.distributed as dist

    from reference.moe.oracles import toy_experts
    r, W = dist.get_rank(), dist.get_world_size()
    x, routing, grad_out = mine
    x = x.clone().requires_grad_(backward)
    routing = dict(routing)
    routing["weight"] = routing["weight"].clone().requires_grad_(backward)
    buf = _fn(module, "dispatch")(x, routing, num_experts, capacity)
    if not isinstance(buf, torch.Tensor) or buf.dim() != 3:
        return {"buffer": buf, "out": None, "grad_x": None, "grad_weight": None}
    y = _fn(module, "combine")(toy_experts(buf, r * (num_experts // W)), routing, num_experts, capacity)
    out = {"buffer": buf.detach(), "out": y.detach() if isinstance(y, torch.Tensor) else y,
           "grad_x": None, "grad_weight": None, "has_graph": bool(getattr(y, "requires_grad", False))}
    if backward and out["has_graph"]:
        y.backward(grad_out)
        out["grad_x"], out["grad_weight"] = x.grad, routing["weight"].grad
    return out


def grad_sync_per_rank(module: str, mine: tuple, ep: int):
    """On each rank: parameters whose ``.grad`` hold this rank's local gradients (``mine = (dense,
    experts)``); the learner syncs them.

    Groups (as in reference.moe.grad_sync): dp_group = the world; expert_dp_group of rank r =
    {r mod EP, r mod EP + EP, ...} (the ranks holding the same experts).
    """
    import torch.distributed as dist

    from reference import comm
    r, W = dist.get_rank(), dist.get_world_size()
    groups = [comm.new_group([q + ep * i for i in range(W // ep)]) for q in range(ep)]
    dp_group = comm.new_group(list(range(W)))

    def params(grads):
        ps = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
            ps.append(p)
        return ps
    dense, experts = params(mine[0]), params(mine[1])
    _fn(module, "sync_moe_gradients")(dense, experts, dp_group=dp_group, expert_dp_group=groups[r % ep])
    return {"dense": [p.grad for p in dense], "experts": [p.grad for p in experts]}
