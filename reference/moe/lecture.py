"""The lecture 5b notebook's runs (recorded for the student release, see ``reference.notebook.recorded``):
gating and capacity examples, the balance loss, collapse, expert parallelism against one process,
dispatch bytes, routing traces, balance under expert × data parallelism, FLOPs per token.  Their
rank functions are in :mod:`.workers`, the grader's truths in :mod:`.oracles`.
"""
from __future__ import annotations

import torch

from ..notebook.recorded import live_world, recordable
from .layer import MoELayer
from .routing import load_balancing_loss, router_z_loss, top_k_gating
from .workers import flops_per_token, record_routing_traces, routing_run, train_toy_moe

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
