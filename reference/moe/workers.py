"""Rank functions that check the expert-parallel layer against the single-process one.

Used by ``tests/test_moe_*.py`` (and handy in a notebook): each runs on every rank of a world,
builds the same seeded :class:`MoELayer` everywhere, computes the single-process ground truth for
the whole batch on each rank (cheap at test sizes), runs the expert-parallel layer on this
rank's share, and returns both as plain tensors for the caller to compare.
"""
from __future__ import annotations

import torch

from .. import comm
from .grad_sync import sync_moe_gradients
from .layer import MoELayer
from .parallel import ExpertParallelMoE, all_to_all
from .routing import load_balancing_loss


def _grads(module) -> list[torch.Tensor]:
    """Gradients of a module's parameters, zeros for parameters that got none (an unused expert)."""
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def _skew_router(layer: MoELayer, hot_experts: list[int]) -> None:
    """Make every token prefer ``hot_experts`` (feature 0 of the inputs is set to a large value)."""
    with torch.no_grad():
        layer.router.weight[:, 0] = -3.0
        for i, e in enumerate(hot_experts):
            layer.router.weight[e, 0] = 3.0 + 0.5 * i


def make_case(cfg: dict, world_size: int):
    """The seeded layer, per-rank inputs and upstream gradients for one test case."""
    torch.manual_seed(cfg.get("seed", 0))
    E, d, d_ff = cfg["num_experts"], cfg.get("d_model", 6), cfg.get("d_ff", 10)
    layer = MoELayer(d, d_ff, E, k=cfg["k"], capacity_factor=cfg.get("capacity_factor", 1.0),
                     dropless=cfg.get("dropless", False)).double()
    T = cfg.get("tokens", 16)
    sizes = [T + (r * cfg.get("uneven", 0)) for r in range(world_size)]
    xs = [cfg.get("scale", 1.0) * torch.randn(n, d, dtype=torch.float64) for n in sizes]
    gs = [torch.randn(n, d, dtype=torch.float64) for n in sizes]
    if cfg.get("hot_experts"):
        _skew_router(layer, cfg["hot_experts"])
        for x in xs:
            x[:, 0] = 4.0
    return layer, xs, gs


def single_process_truth(layer: MoELayer, xs, gs, c_aux: float, c_z: float, aux_batches=None) -> dict:
    """Ground truth, one process: rank r's tokens are one routing group of ``layer``, and the
    objective is the mean over the ranks of their task and z-losses plus the balance loss:

        J = (1/N) Σ_r <g_r, y_r>  +  c_aux · aux  +  c_z · (1/N) Σ_r z_r

    aux_batches: lists of ranks whose tokens one balance loss covers (default: all of them, the
    whole batch); aux is the mean of those losses (per routing group: [[0], [1], ...])."""
    layer.zero_grad()
    N = len(xs)
    xs = [x.clone().requires_grad_() for x in xs]
    ys, stats = zip(*(layer(x) for x in xs))
    batches = aux_batches or [list(range(N))]
    auxes = [load_balancing_loss(torch.cat([stats[m]["routing"]["probs"] for m in b]),
                                 torch.cat([stats[m]["routing"]["expert_index"] for m in b]), layer.num_experts)
             for b in batches]
    aux = sum(auxes) / len(auxes)
    J = sum((g * y).sum() for g, y in zip(gs, ys)) / N + c_aux * aux + c_z * sum(s["z_loss"] for s in stats) / N
    J.backward()
    return {"y": [y.detach() for y in ys], "x_grad": [x.grad for x in xs], "aux": aux.detach(),
            "auxes": [a.detach() for a in auxes],
            "z": [s["z_loss"].detach() for s in stats], "router_grad": layer.router.weight.grad.clone(),
            "expert_grads": [_grads(ex) for ex in layer.experts],
            "tokens_per_expert": [s["tokens_per_expert"] for s in stats],
            "kept_per_expert": [s["kept_per_expert"] for s in stats],
            "dropped": [s["dropped"] for s in stats], "capacity": [s["capacity"] for s in stats]}


def ep_vs_single(cfg: dict) -> dict:
    """Expert-parallel forward + backward on this rank, the gradients averaged as training does
    with EP alone (router: mean over ranks; experts: divided by W), and the single-process truth.

    Each rank back-propagates its own <g_r, y_r> + c_aux·aux + c_z·z_r, so its input gradient is
    W × the truth's (its share of a mean over W ranks)."""
    W, r = comm.world_size(), comm.rank()
    c_aux, c_z = cfg.get("c_aux", 0.3), cfg.get("c_z", 0.05)
    layer, xs, gs = make_case(cfg, W)
    truth = single_process_truth(layer, xs, gs, c_aux, c_z)

    ep = ExpertParallelMoE.from_layer(layer)
    x = xs[r].clone().requires_grad_()
    y, st = ep(x)
    ((gs[r] * y).sum() + c_aux * st["aux_loss"] + c_z * st["z_loss"]).backward()
    router_grad = ep.router.weight.grad.clone()
    comm.all_reduce(router_grad, what="dense_grads")        # sync_moe_gradients with DP = EP = W
    E_local = len(ep.experts)
    return {
        "rank": r, "world_size": W, "first_expert": r * E_local,
        "y": y.detach(), "x_grad": x.grad / W, "aux": st["aux_loss"].detach(), "z": st["z_loss"].detach(),
        "router_grad": router_grad / W,
        "expert_grads": [[g / W for g in _grads(ex)] for ex in ep.experts],
        "kept": st["routing"]["kept"], "dispatched": st["dispatched"], "dropped": st["dropped"], "capacity": st["capacity"],
        "tokens_per_expert": st["tokens_per_expert"], "kept_per_expert": st["kept_per_expert"],
        "truth": {key: (val[r] if key in ("y", "x_grad", "z", "tokens_per_expert", "kept_per_expert",
                                          "dropped", "capacity") else val)
                  for key, val in truth.items()},
    }


def all_to_all_adjoint(rows_per_dest: list[list[int]], d: int, seed: int = 0) -> dict:
    """<A x, g> on this rank and <x, Aᵀ g>, where A is :func:`all_to_all` with the given splits
    (``rows_per_dest[s][t]`` rows go from rank s to rank t) and Aᵀ is what autograd computes."""
    W, r = comm.world_size(), comm.rank()
    send = rows_per_dest[r]
    recv = [rows_per_dest[s][r] for s in range(W)]
    gen = torch.Generator().manual_seed(seed + r)
    x = torch.randn(sum(send), d, dtype=torch.float64, generator=gen).requires_grad_()
    g = torch.randn(sum(recv), d, dtype=torch.float64, generator=gen)
    Ax = all_to_all(x, send, recv, what="adjoint_test")
    (Ax * g).sum().backward()
    return {"Ax_dot_g": float((Ax.detach() * g).sum()), "x_dot_ATg": float((x.detach() * x.grad).sum()),
            "Ax": Ax.detach(), "x": x.detach(), "grad_shape": tuple(x.grad.shape)}


def ep_dp_grad_sync(cfg: dict, divide_by: str = "dp") -> dict:
    """One training step of EP × DP on N ranks, against the single-process truth.

    EP groups of ``cfg["ep_size"]`` consecutive ranks ({0,1}, {2,3} for N = 4, EP = 2);
    expert-data-parallel groups {q, q+EP, ...}; the data-parallel group is the world.  Every rank
    back-propagates its task loss <g_r, y_r>/T + c_aux·aux + c_z·z_r and syncs with
    :func:`sync_moe_gradients`.  The truth: one process, gradients of

        mean task loss + c_aux · aux + c_z · z-loss        over the whole batch of N·T tokens

    cfg["aux"]: whose batch aux covers — "global" (the whole batch, aux_group = the world), "ep"
    (each EP group's, averaged) or "local" (each rank's routing group, averaged).
    cfg["naive_aux"]: back-propagate the bare :func:`load_balancing_loss` (no |G| gradient scale):
    the bug class of lecture 5b, the router gets α/|G| of the balance gradient.
    divide_by="expert_dp" reproduces the other classic bug (expert grads divided by the expert-dp size).
    """
    import torch.distributed as dist
    N, r = comm.world_size(), comm.rank()
    ep_size = cfg.get("ep_size", 2)
    if N % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide the {N} ranks")
    ep_groups = [comm.new_group(list(range(i, i + ep_size))) for i in range(0, N, ep_size)]
    edp_groups = [comm.new_group(list(range(i, N, ep_size))) for i in range(ep_size)]
    ep_group, edp_group = ep_groups[r // ep_size], edp_groups[r % ep_size]
    c_task, c_aux, c_z = cfg.get("c_task", 1.0), cfg.get("c_aux", 0.3), cfg.get("c_z", 0.05)
    layer, xs, gs = make_case(cfg, N)
    T = xs[r].shape[0]
    if any(x.shape[0] != T for x in xs):
        raise ValueError("the EP × DP step compares with a whole-batch mean: give every rank the same T")
    kind = cfg.get("aux", "global")
    batches = {"global": [list(range(N))], "local": [[m] for m in range(N)],
               "ep": [list(range(i, i + ep_size)) for i in range(0, N, ep_size)]}[kind]
    truth = single_process_truth(layer, xs, [c_task * g / T for g in gs], c_aux, c_z, aux_batches=batches)

    aux_group = {"global": dist.group.WORLD, "ep": "ep", "local": "local"}[kind]
    ep = ExpertParallelMoE.from_layer(layer, group=ep_group, aux_group=aux_group)
    y, st = ep(xs[r])
    aux = st["aux_loss"]
    if cfg.get("naive_aux"):
        grp = {"global": None, "ep": ep_group, "local": "local"}[kind]
        aux = load_balancing_loss(st["routing"]["probs"], st["routing"]["expert_index"], layer.num_experts,
                                  group=None if grp == "local" else (grp or dist.group.WORLD))
    (c_task * (gs[r] * y).sum() / T + c_aux * aux + c_z * st["z_loss"]).backward()
    dense = list(ep.router.parameters())
    experts = [p for ex in ep.experts for p in ex.parameters()]
    if divide_by == "dp":
        sync_moe_gradients(dense, experts, dp_group=None, expert_dp_group=edp_group)
    else:  # the bug: average the expert grads over the expert-data-parallel group only
        sync_moe_gradients(dense, [], dp_group=None, expert_dp_group=edp_group)
        for p in experts:
            comm.all_reduce(p.grad, group=edp_group)
            p.grad /= comm.world_size(edp_group)
    first = comm.rank(ep_group) * len(ep.experts)
    return {"router_grad": ep.router.weight.grad, "truth_router": truth["router_grad"],
            "expert_grads": [_grads(ex) for ex in ep.experts],
            "truth_experts": truth["expert_grads"][first:first + len(ep.experts)],
            "aux": float(st["aux_loss"]), "truth_aux": float(truth["aux"]), "y": y.detach(),
            "truth_y": truth["y"][r]}


def ep_bad_input(kinds: list[str]) -> list[str]:
    """Feed the expert-parallel layer something wrong on ONE rank (or an uneven expert split).
    Returns, per kind, the name of the exception THIS rank raised ("" if none): every rank must
    raise ValueError, none may hang."""
    W, r = comm.world_size(), comm.rank()
    raised = []
    for kind in kinds:
        torch.manual_seed(0)
        T = 8
        x = torch.randn(T, 4, dtype=torch.float64)
        if kind == "wrong_width" and r == W - 1:
            x = torch.randn(T, 5, dtype=torch.float64)
        elif kind == "unequal_tokens" and r == W - 1:
            x = torch.randn(T + 1, 4, dtype=torch.float64)
        try:
            layer = MoELayer(4, 8, 3 if kind == "uneven_experts" else 4, k=1).double()
            ExpertParallelMoE.from_layer(layer)(x)
            raised.append("")
        except Exception as e:  # noqa: BLE001 - the caller checks the type
            raised.append(type(e).__name__)
    return raised
