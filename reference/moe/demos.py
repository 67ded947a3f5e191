"""Worker functions for the lecture 5b notebook, and the grader's single-process oracles.

Everything here is importable by spawned ranks (notebook cells cannot hold worker functions).
Sections are appended by the lecture's authors; each function says who calls it.
"""
from __future__ import annotations

import torch

from ..recorded import live_world, recordable
from .layer import MoELayer
from .parallel import combine, dispatch
from .routing import load_balancing_loss, router_z_loss, top_k_gating


# ----------------------------------------------------------------------------------------------
# Oracles for the grader (exercises/grading/checks/moe/ calls these through ctx.oracle)


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


# ----------------------------------------------------------------------------------------------
# The notebook's demos, recordable: in the student release they replay what the reference did
# until the learner's exercises pass (reference.recorded).  Each returns plain data.

_NB = dict(ignore=("worlds",))


@recordable("05b.gating_examples", needs=("5b.1",), **_NB)
def gating_examples(tokens: int = 5, num_experts: int = 4, seed: int = 0) -> dict:
    """Top-1 and top-2 routing of a few random tokens (float64 logits × 1.5)."""
    torch.manual_seed(seed)
    logits = torch.randn(tokens, num_experts, dtype=torch.float64) * 1.5
    return {k: top_k_gating(logits, k, capacity=None) for k in (1, 2)}


@recordable("05b.capacity_example", needs=("5b.1",), **_NB)
def capacity_example(tokens: int = 16, num_experts: int = 4, k: int = 2, capacity_factor: float = 0.5) -> dict:
    """One single-process layer with a small capacity: counts before and after dropping."""
    torch.manual_seed(1)
    layer = MoELayer(8, 16, num_experts=num_experts, k=k, capacity_factor=capacity_factor).double()
    y, st = layer(torch.randn(tokens, 8, dtype=torch.float64))
    lost = ~st["routing"]["kept"].any(1)
    return {"C": st["capacity"], "counts": st["tokens_per_expert"], "kept": st["kept_per_expert"],
            "dropped": st["dropped"], "lost_tokens": lost.nonzero().flatten().tolist(),
            "lost_outputs_zero": bool((y[lost] == 0).all())}


@recordable("05b.aux_examples", needs=("5b.2",), **_NB)
def aux_examples(num_experts: int = 8, tokens: int = 32) -> dict:
    """The balance loss at uniform probabilities and at collapse; the z-loss of one token."""
    E, T = num_experts, tokens
    uniform = torch.full((T, E), 1 / E, dtype=torch.float64)
    choices = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:2] for t in range(T)])
    eps = 1e-6
    collapsed = torch.full((T, E), eps / (E - 1), dtype=torch.float64)
    collapsed[:, 0] = 1 - eps
    return {"uniform": float(load_balancing_loss(uniform, choices, E)), "eps": eps,
            "collapsed": float(load_balancing_loss(collapsed, torch.zeros(T, 1, dtype=torch.long), E)),
            "z": float(router_z_loss(torch.tensor([[2.0, 0.0, -1.0]], dtype=torch.float64)))}


@recordable("05b.whose_batch", needs=("5b.1", "5b.2"), **_NB)
def balance_loss_whose_batch(groups: int = 4, tokens: int = 64, num_experts: int = 4, k: int = 1) -> dict:
    """The balance loss per routing group (GShard/Switch: averaged) and over the whole batch
    (Megatron's global aux loss), from the SAME routing decisions.

    Routing group g's tokens lean towards expert g mod E (think: each group is one domain — code,
    maths, prose — that one expert could specialise in); over the whole batch the experts are
    evenly used.  Returns the per-group losses, their mean and the global loss.
    """
    torch.manual_seed(0)
    layer = MoELayer(8, 16, num_experts, k=k, dropless=True).double()
    per_group, probs, choices, loads = [], [], [], []
    for g in range(groups):
        x = torch.randn(tokens, 8, dtype=torch.float64)
        with torch.no_grad():
            bias = torch.zeros(num_experts, dtype=torch.float64)
            bias[g % num_experts] = 1.5
            logits = layer.router(x) + bias              # the group's domain
            r = top_k_gating(logits, k, None)
        per_group.append(float(load_balancing_loss(r["probs"], r["expert_index"], num_experts)))
        probs.append(r["probs"])
        choices.append(r["expert_index"])
        loads.append((torch.bincount(r["expert_index"].flatten(), minlength=num_experts).double()
                      / (k * tokens)).tolist())
    whole = float(load_balancing_loss(torch.cat(probs), torch.cat(choices), num_experts))
    return {"per_group": per_group, "mean_per_group": sum(per_group) / groups, "global": whole, "loads": loads}


@recordable("05b.collapse", needs=("5b.1", "5b.2"), **_NB)
def collapse_runs(steps: int = 300, alphas: tuple = (0.0, 0.1)) -> dict:
    """:func:`train_toy_moe` once per balance-loss coefficient α, from the same balanced start."""
    return {alpha: train_toy_moe(alpha, steps=steps) for alpha in alphas}


@recordable("05b.ep_equals_single", needs=("5b.1", "5b.2", "5b.3"), **_NB)
def ep_equals_single(worlds: dict | None = None) -> list[dict]:
    """Three configurations on 4 ranks: the largest differences from the single-process layer."""
    from .workers import ep_vs_single
    rows = []
    with live_world(4, worlds) as w:
        for cfg in ({"num_experts": 8, "k": 2, "capacity_factor": 1.0, "tokens": 16},
                    {"num_experts": 8, "k": 1, "capacity_factor": 0.5, "tokens": 16},
                    {"num_experts": 8, "k": 2, "dropless": True, "tokens": 16, "hot_experts": [2, 5]}):
            vals = w.run(ep_vs_single, cfg).values
            err = lambda key: max(float((v[key] - v["truth"][key]).abs().max()) for v in vals)  # noqa: E731
            rows.append({"cfg": cfg, "y": err("y"), "x_grad": err("x_grad"), "router_grad": err("router_grad"),
                         "dropped": sum(v["dropped"] for v in vals)})
    return rows


@recordable("05b.dispatch_bytes", needs=("5b.1", "5b.3"), **_NB)
def dispatch_bytes(W: int = 4, E: int = 8, T: int = 64, d: int = 64, cf: float = 1.0,
                   worlds: dict | None = None) -> list[dict]:
    """Bytes leaving rank 0 in the dispatch all-to-all: top-1, top-2 (padded) and top-2 dropless."""
    from ..widgets.routing import bytes_per_phase
    rows = []
    with live_world(W, worlds) as w:
        for k, dropless in ((1, False), (2, False), (2, True)):
            res = w.run(routing_run, E, k, cf, T, d, 0, dropless)
            sent = bytes_per_phase(res.trace)["dispatch"][0]
            rows.append({"k": k, "dropless": dropless, "C": res.values[0]["capacity"], "bytes": sent["off_rank"],
                         "tokens_off_rank": sent["tokens_off_rank"]})
    return rows


@recordable("05b.routing_traces", needs=("5b.1", "5b.3"), **_NB)
def routing_traces(worlds: dict | None = None) -> dict:
    """Traces for the routing widget: every (k, cf, E, W) for k 1, 2; cf 0.5, 1, 2; E 4, 8; W 2, 4."""
    with live_world(2, worlds) as w2, live_world(4, worlds) as w4:
        return record_routing_traces({2: w2, 4: w4})


@recordable("05b.balance_strength", needs=("5b.1", "5b.2", "5b.3", "5b.4"), **_NB)
def balance_strength_under_ep_dp(worlds: dict | None = None) -> dict:
    """The router's balance-loss gradient after one EP = 2 × DP = 2 step, over the single-process
    truth: back-propagating the bare loss (the bug) vs the layer's aux (scaled by the group size)."""
    from .workers import ep_dp_grad_sync
    cfg = dict(num_experts=8, k=2, capacity_factor=1.0, tokens=8, d_model=4, d_ff=6, scale=3.0,
               ep_size=2, aux="global", c_task=0.0, c_z=0.0, c_aux=0.5)
    out = {}
    with live_world(4, worlds) as w:
        for name, naive in (("bare load_balancing_loss", True), ("the layer's aux_loss", False)):
            v = w.run(ep_dp_grad_sync, dict(cfg, naive_aux=naive)).values[0]
            out[name] = float((v["router_grad"] * v["truth_router"]).sum() / v["truth_router"].pow(2).sum())
    return out


@recordable("05b.flops", needs=("5b.1", "5b.2"), **_NB)
def flops_table(experts: tuple = (4, 8, 16, 32, 64), k: int = 2) -> list[dict]:
    """:func:`flops_per_token` for each number of experts."""
    return [flops_per_token(E, k=k) for E in experts]
