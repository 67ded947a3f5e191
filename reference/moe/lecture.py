"""The lecture 5b notebook's runs (recorded for the student release, see ``reference.notebook.recorded``):
gating and capacity examples, the balance loss, collapse, expert parallelism against one process,
dispatch bytes, routing traces, balance under expert × data parallelism, FLOPs per token, and the
tiny GPT (:mod:`reference.gpt`) trained dense, top-1 and top-2.  Their rank functions are in
:mod:`.workers`, the grader's truths in :mod:`.oracles`.
"""
from __future__ import annotations

import re

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


# ---------------------------------------------------------------------------------- top-1 vs top-2, trained

SETTINGS = {"dense": {}, "top-1": {"top_k": 1}, "top-2": {"top_k": 2}}


def _block_costs(model, x: torch.Tensor) -> dict:
    """One forward of ``model`` on ``x`` (B, S) under FlopCounterMode, with the MoE layers' routing
    counted by a hook: FLOPs per token of each block's feed-forward work (its experts' matmuls, or
    its dense MLP's) and of the routers, the whole model's, and the assignments the routers
    dispatched (dropless: k per token)."""
    from torch.utils.flop_counter import FlopCounterMode
    dispatched = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: dispatched.append(int(out[1]["tokens_per_expert"].sum())))
             for m in model.modules() if isinstance(m, MoELayer)]
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    flops = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    tokens = x.numel()
    ffn = [sum(f for name, f in flops.items() if re.fullmatch(rf"TinyGPT\.blocks\.{i}\.mlp\.(fc[12]|moe\.experts\.\d+)",
                                                             name)) / tokens for i in range(len(model.blocks))]
    router = sum(f for name, f in flops.items() if name.endswith(".moe.router"))
    return {"tokens": tokens, "ffn_flops_per_token": ffn, "router_flops_per_token": router / tokens,
            "model_flops_per_token": flops["Global"] / tokens, "dispatched": sum(dispatched),
            "moe_layers": len(dispatched), "params": sum(p.numel() for p in model.parameters())}


def topk_summary(result: dict) -> dict:
    """Per setting of a :func:`topk_quality` result: the final held-out loss per seed, its mean and
    sample standard deviation over seeds, and the costs of the MoE block(s) per token: "ffn_flops"
    (the experts' FLOPs, or the dense MLP's in the same blocks), "dispatched" (assignments the
    routers made per token and MoE layer: k, dropless), "model_flops" and "params"."""
    import statistics
    cfg = result["config"]
    moe_blocks = [i for i in range(cfg["layers"]) if i % cfg["moe_every"] == cfg["moe_every"] - 1]
    out = {}
    for name, run in result["runs"].items():
        final = [curve[-1][1] for curve in run["heldout"]]
        c = result["cost"][name]
        out[name] = {"heldout": final, "mean": statistics.fmean(final),
                     "std": statistics.stdev(final) if len(final) > 1 else 0.0,
                     "ffn_flops": sum(c["ffn_flops_per_token"][i] for i in moe_blocks) / len(moe_blocks),
                     "dispatched": c["dispatched"] / (c["tokens"] * c["moe_layers"]) if c["moe_layers"] else 0.0,
                     "model_flops": c["model_flops_per_token"], "params": c["params"]}
    return out


def topk_story(result: dict) -> list[str]:
    """How a :func:`topk_quality` result contradicts the notebook's text (empty if it does not): top-2
    dispatches exactly twice top-1's tokens; it ends below top-1 in every seed, by less on average
    than the seed-to-seed spread; top-1 and dense are within that spread of each other."""
    s, broken = topk_summary(result), []
    one, two, dense = s["top-1"], s["top-2"], s["dense"]
    if two["dispatched"] != 2 * one["dispatched"] or two["ffn_flops"] != 2 * one["ffn_flops"]:
        broken.append("top-2 did not dispatch and compute exactly twice top-1's tokens")
    if not all(b < a for a, b in zip(one["heldout"], two["heldout"])):
        broken.append("top-2 did not end below top-1 in every seed")
    if one["mean"] - two["mean"] >= max(one["std"], two["std"]):
        broken.append("top-2's mean gain is larger than the seed spread")
    if abs(one["mean"] - dense["mean"]) >= max(one["std"], dense["std"]):
        broken.append("top-1 and dense differ by more than the seed spread")
    return broken


@recordable("05b.topk_quality", needs=("5b.1", "5b.2"), story=topk_story, **_NB)
def topk_quality(steps: int = 150, seeds: tuple = (0, 1, 2), num_experts: int = 4, batch_size: int = 16,
                 lr: float = 1e-2, eval_every: int = 25, d_model: int = 32, heads: int = 4, layers: int = 2,
                 d_ff: int = 64, seq_len: int = 16, moe_every: int = 2) -> dict:
    """The tiny GPT (reference.gpt, float64, one process, one thread) trained dense, top-1 and top-2
    (``num_experts`` dropless experts in every ``moe_every``-th block; top-1 and top-2 from the same
    initial weights for a seed), once per seed, with :func:`reference.gpt.train_single`.

    Returns {"config", "runs": {setting: {"losses": per seed train_single's curve (task + 0.01·aux),
    "heldout": per seed [(step, held-out cross-entropy)] every ``eval_every`` steps and at the end}},
    "cost": {setting: :func:`_block_costs` on the held-out batch}}.  Held out: 128 windows of
    ``corpus(seed=1)`` — new sentences of the same grammar, never trained on.
    """
    import torch.nn.functional as F

    from ..gpt import GPTConfig, TinyGPT, corpus, encode, get_batch, train_single
    size = dict(d_model=d_model, heads=heads, layers=layers, d_ff=d_ff, seq_len=seq_len)
    _, alphabet = encode(corpus())
    index = {c: i for i, c in enumerate(alphabet)}
    held = torch.tensor([index[c] for c in corpus(seed=1)])
    hx, hy = get_batch(held, 0, 128, seq_len, seed=1)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    runs, cost = {}, {}
    try:
        for name, extra in SETTINGS.items():
            config = dict(size, num_experts=num_experts, moe_every=moe_every, **extra) if extra else size
            runs[name] = {"losses": [], "heldout": []}
            for seed in seeds:
                torch.manual_seed(seed)
                model = TinyGPT(GPTConfig(vocab=len(alphabet), **config)).double()
                curve = []

                def evaluate(step, _loss, model=model, curve=curve):
                    if (step + 1) % eval_every == 0 or step + 1 == steps:
                        with torch.no_grad():
                            logits = model(hx)
                        curve.append((step + 1, F.cross_entropy(logits.flatten(0, 1), hy.flatten()).item()))
                runs[name]["losses"].append(train_single(steps, batch_size=batch_size, lr=lr, seed=seed,
                                                         model=model, on_step=evaluate))
                runs[name]["heldout"].append(curve)
            cost[name] = _block_costs(model, hx)
    finally:
        torch.set_num_threads(old)
    return {"config": dict(size, steps=steps, seeds=tuple(seeds), num_experts=num_experts, batch_size=batch_size,
                           lr=lr, moe_every=moe_every, heldout_tokens=hx.numel()),
            "runs": runs, "cost": cost}


# ---------------------------------------------------------------------------------- balancing over training

BALANCE_SETTINGS = {                  # name: GPTConfig fields — no balancing, Switch's loss, DeepSeek-V3's bias
    "none": {"balance": "aux", "aux_loss_coef": 0.0},
    "aux": {"balance": "aux", "aux_loss_coef": 0.01},
    "loss_free": {"balance": "loss_free", "aux_loss_coef": 0.0, "bias_update_rate": 0.01},
}


def balance_over_training(steps: int = 150, settings: dict | None = None, *, num_experts: int = 8, top_k: int = 2,
                          router: str = "softmax", seed: int = 0, batch_size: int = 16, lr: float = 1e-2,
                          d_model: int = 32, heads: int = 4, layers: int = 2, d_ff: int = 64, seq_len: int = 16,
                          moe_every: int = 1) -> dict:
    """The tiny GPT (reference.gpt, float64, one process, one thread) trained once per balance setting
    (``settings``: name → GPTConfig fields, default :data:`BALANCE_SETTINGS`), from the same initial
    weights: per step the expert loads of every MoE layer, their max/mean (mean over the layers: 1.0 is
    perfectly balanced, E/k all on k experts), the loss, and each layer's loss-free bias after the step.

    Returns {"config", "runs": {name: {"loss": [steps], "max_over_mean": [steps], "loads": [steps][layers][E],
    "bias": [steps][layers][E]}}}.  The loads are the assignments each layer's router made in that step
    (k per token), counted by a hook on its output, so they are the counts the loss-free bias step used.
    """
    from ..gpt import GPTConfig, TinyGPT, corpus, encode, train_single
    from .layer import MoELayer
    settings = BALANCE_SETTINGS if settings is None else settings
    size = dict(d_model=d_model, heads=heads, layers=layers, d_ff=d_ff, seq_len=seq_len, num_experts=num_experts,
                top_k=top_k, moe_every=moe_every, router=router)
    _, alphabet = encode(corpus())
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {}
    try:
        for name, fields in settings.items():
            torch.manual_seed(seed)
            model = TinyGPT(GPTConfig(vocab=len(alphabet), **size, **fields)).double()
            moe = [m for m in model.modules() if isinstance(m, MoELayer)]
            step_loads, loads, biases = [], [], []
            hooks = [m.register_forward_hook(
                lambda _m, _i, out: step_loads.append(out[1]["tokens_per_expert"].double())) for m in moe]

            def after(_step, _loss, moe=moe, step_loads=step_loads, loads=loads, biases=biases):
                loads.append([t.tolist() for t in step_loads])
                biases.append([m.expert_bias.tolist() for m in moe])
                step_loads.clear()
            try:
                loss = train_single(steps, batch_size=batch_size, lr=lr, seed=seed, model=model, on_step=after)
            finally:
                for h in hooks:
                    h.remove()
            ratio = [sum(max(layer) / (sum(layer) / len(layer)) for layer in step) / len(step) for step in loads]
            runs[name] = {"loss": loss, "max_over_mean": ratio, "loads": loads, "bias": biases}
    finally:
        torch.set_num_threads(old)
    return {"config": dict(size, steps=steps, seed=seed, batch_size=batch_size, lr=lr, settings=settings),
            "runs": runs}
