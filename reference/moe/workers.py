"""Rank functions of lecture 5b: the expert-parallel layer against the single-process one, and the
rank side of the notebook's runs (:mod:`.lecture`: routing, a toy MoE trained, FLOPs per token).

The full course's checks (``tests/test_moe_*.py``, handy in a notebook too) each run on every rank of a world,
builds the same seeded :class:`MoELayer` everywhere, computes the single-process ground truth for
the whole batch on each rank (cheap at test sizes), runs the expert-parallel layer on this
rank's share, and returns both as plain tensors for the caller to compare.
"""
from __future__ import annotations

import torch

from .. import comm
from .grad_sync import sync_moe_gradients
from .layer import MoELayer, balance_loss
from .parallel import ExpertParallelMoE
from .placement import expert_nodes
from .routing import load_balancing_loss, top_k_routing


def _grads(module) -> list[torch.Tensor]:
    """Gradients of a module's parameters, zeros for parameters that got none (an unused expert)."""
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def _skew_router(layer: MoELayer, hot_experts: list[int]) -> None:
    """Make every token prefer ``hot_experts`` (feature 0 of the inputs is set to a large value)."""
    with torch.no_grad():
        layer.router.weight[:, 0] = -3.0
        for i, e in enumerate(hot_experts):
            layer.router.weight[e, 0] = 3.0 + 0.5 * i


LAYER_OPTIONS = ("router", "shared_experts", "activation", "balance", "experts_impl")


def make_case(cfg: dict, world_size: int):
    """The seeded layer, per-rank inputs and upstream gradients for one test case.

    Frontier options in ``cfg``: :class:`MoELayer`'s ``LAYER_OPTIONS``; ``bias_scale`` (a random loss-free
    bias of that size, so that it changes the routing); ``max_nodes`` with ``devices_per_node`` (the
    experts' nodes as an expert-parallel group over the whole world places them); ``dtype``."""
    torch.manual_seed(cfg.get("seed", 0))
    E, d, d_ff = cfg["num_experts"], cfg.get("d_model", 6), cfg.get("d_ff", 10)
    extra = {key: cfg[key] for key in LAYER_OPTIONS if key in cfg}
    if cfg.get("max_nodes"):
        extra.update(max_nodes=cfg["max_nodes"],
                     node_of_expert=expert_nodes(E, list(range(world_size)), cfg["devices_per_node"]))
    layer = MoELayer(d, d_ff, E, k=cfg["k"], capacity_factor=cfg.get("capacity_factor", 1.0),
                     dropless=cfg.get("dropless", False), **extra).to(cfg.get("dtype", torch.float64))
    if cfg.get("bias_scale"):
        with torch.no_grad():
            layer.expert_bias.copy_(cfg["bias_scale"] * torch.randn(E, dtype=layer.expert_bias.dtype))
    T = cfg.get("tokens", 16)
    sizes = [T + (r * cfg.get("uneven", 0)) for r in range(world_size)]
    dtype = cfg.get("dtype", torch.float64)
    xs = [cfg.get("scale", 1.0) * torch.randn(n, d, dtype=dtype) for n in sizes]
    gs = [torch.randn(n, d, dtype=dtype) for n in sizes]
    if cfg.get("hot_experts"):
        _skew_router(layer, cfg["hot_experts"])
        for x in xs:
            x[:, 0] = 4.0
    return layer, xs, gs


def sequences_of(cfg: dict, sizes: list[int]) -> list[tuple[torch.Tensor, int] | None]:
    """Per rank: (its tokens' global sequence ids, number of sequences), ``cfg["seqs_per_rank"]`` s equal
    sequences of each rank's tokens numbered r·s …; None without it."""
    s = cfg.get("seqs_per_rank")
    if not s:
        return [None] * len(sizes)
    return [(r * s + torch.arange(s).repeat_interleave(n // s), len(sizes) * s) for r, n in enumerate(sizes)]


def single_process_truth(layer: MoELayer, xs, gs, c_aux: float, c_z: float, aux_batches=None,
                         seqs=None) -> dict:
    """Ground truth, one process: rank r's tokens are one routing group of ``layer``, and the
    objective is the mean over the ranks of their task and z-losses plus the balance loss:

        J = (1/N) Σ_r <g_r, y_r>  +  c_aux · aux  +  c_z · (1/N) Σ_r z_r

    aux_batches: lists of ranks whose tokens one balance loss covers (default: all of them, the
    whole batch); aux is the mean of those losses (per routing group: [[0], [1], ...]).  The balance
    loss is the layer's own (``layer.balance``: Switch's, sequence-wise over ``seqs`` (per rank, as
    :func:`sequences_of`), or none)."""
    layer.zero_grad()
    N = len(xs)
    xs = [x.clone().requires_grad_() for x in xs]
    ys, stats = zip(*(layer(x) for x in xs))
    batches = aux_batches or [list(range(N))]
    seqs = seqs or [None] * N

    def seq(b):
        if seqs[b[0]] is None:
            return {}
        return dict(sequence=torch.cat([seqs[m][0] for m in b]), num_sequences=seqs[b[0]][1])
    auxes = [balance_loss(layer.balance, torch.cat([stats[m]["routing"]["probs"] for m in b]),
                          torch.cat([stats[m]["routing"]["expert_index"] for m in b]), layer.num_experts, **seq(b))
             for b in batches]
    aux = sum(auxes) / len(auxes)
    J = sum((g * y).sum() for g, y in zip(gs, ys)) / N + c_aux * aux + c_z * sum(s["z_loss"] for s in stats) / N
    J.backward()
    return {"y": [y.detach() for y in ys], "x_grad": [x.grad for x in xs], "aux": aux.detach(),
            "auxes": [a.detach() for a in auxes],
            "z": [s["z_loss"].detach() for s in stats], "router_grad": layer.router.weight.grad.clone(),
            "expert_grads": [_grads(ex) for ex in layer.experts],
            "shared_grads": _grads(layer.shared) if layer.shared_experts else [],
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
    seqs = sequences_of(cfg, [len(x) for x in xs])
    truth = single_process_truth(layer, xs, gs, c_aux, c_z, seqs=seqs)

    options = {key: cfg[key] for key in ("overlap", "max_nodes", "devices_per_node") if cfg.get(key)}
    ep = ExpertParallelMoE.from_layer(layer, **options)
    x = xs[r].clone().requires_grad_()
    y, st = ep(x, *(seqs[r] or ()))
    ((gs[r] * y).sum() + c_aux * st["aux_loss"] + c_z * st["z_loss"]).backward()
    router_grad = ep.router.weight.grad.clone()
    comm.all_reduce(router_grad, what="dense_grads")        # sync_moe_gradients with DP = EP = W
    shared_grads = []
    if layer.shared_experts:                                # a replica, like the router
        for g in _grads(ep.shared):
            comm.all_reduce(g, what="dense_grads")
            shared_grads.append(g / W)
    E_local = len(ep.experts)
    spans = 0
    if cfg.get("max_nodes"):                                # the same logits without the node limit
        with torch.no_grad():
            free = top_k_routing(ep.router(x), layer.k, None, router=layer.router_kind)["expert_index"]
        node = torch.tensor(expert_nodes(layer.num_experts, list(range(W)), cfg["devices_per_node"]))[free]
        spans = int((node != node[:, :1]).any(1).sum())
    return {
        "rank": r, "world_size": W, "first_expert": r * E_local,
        "expert_index": st["routing"]["expert_index"], "unlimited_spans_nodes": spans,
        "y": y.detach(), "x_grad": x.grad / W, "aux": st["aux_loss"].detach(), "z": st["z_loss"].detach(),
        "router_grad": router_grad / W,
        "expert_grads": [[g / W for g in _grads(ex)] for ex in ep.experts], "shared_grads": shared_grads,
        "kept": st["routing"]["kept"], "dispatched": st["dispatched"], "dropped": st["dropped"],
        "capacity": st["capacity"],
        "tokens_per_expert": st["tokens_per_expert"], "kept_per_expert": st["kept_per_expert"],
        "truth": {key: (val[r] if key in ("y", "x_grad", "z", "tokens_per_expert", "kept_per_expert",
                                          "dropped", "capacity") else val)
                  for key, val in truth.items()},
    }




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
            "aux": float(st["aux_loss"].detach()), "truth_aux": float(truth["aux"]), "y": y.detach(),
            "truth_y": truth["y"][r]}


# ----------------------------------------------------------------------------------------------
# Rank functions of the notebook's runs (reference.moe.lecture)


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
