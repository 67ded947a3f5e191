"""Checks for lecture 5b (the expert axis): gating, the load-balancing loss, dispatch/combine,
and gradient synchronisation under expert × data parallelism.

Ground truth always comes from the reference through ``ctx.oracle`` (single process, float64);
the multi-rank truth is the single-process answer for each rank's tokens, which is what the
expert-parallel layer is defined to compute.  Detectors look at properties of the learner's
answer (which slots a second choice took, whether the weights of a half-dropped token sum to 1,
which experts' tokens arrived on a rank) rather than re-implementing the exercise here.
"""
from __future__ import annotations

import torch

from ..core import CheckFailed, exercise, salted_seed
from ..feedback import Mismatch

H = "exercises.grading.checks.moe"
REF = "reference.moe"
DEMOS = "reference.moe.demos"

GATING = exercise("5b.1", "Top-1 and top-2 gating with capacity", "moe", ["top_k_gating"])
AUX = exercise("5b.2", "The load-balancing loss, group-wide", "moe", ["load_balancing_loss"])
DISPATCH = exercise("5b.3", "Dispatch and combine through all-to-all", "moe", ["dispatch", "combine"], comm=("all_to_all",))
GRADSYNC = exercise("5b.4", "Expert gradients under expert × data parallelism", "moe", ["sync_moe_gradients"])

KEYS = ("probs", "expert_index", "weight", "kept", "slot")


# ----------------------------------------------------------------------------------------------
# Harnesses: run in the runner (or on its ranks), call learner code, return plain values.


def _fn(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def gating_call(module: str, logits, k, capacity):
    out = _fn(module, "top_k_gating")(logits, k, capacity)
    return dict(out) if isinstance(out, dict) else out


def aux_per_rank(module: str, per_rank, num_experts: int):
    """On each rank: the learner's loss over the world group, and its gradient w.r.t. this rank's probs."""
    import torch.distributed as dist
    r = dist.get_rank()
    probs, idx = per_rank[r]
    probs = probs.clone().requires_grad_(True)
    loss = _fn(module, "load_balancing_loss")(probs, idx, num_experts, group=dist.group.WORLD)
    grad = None
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
        grad = probs.grad
    return {"loss": loss.detach() if isinstance(loss, torch.Tensor) else loss, "grad": grad}


def dispatch_combine_per_rank(module: str, per_rank, num_experts: int, capacity: int, grad_outs, backward: bool):
    """On each rank: buffer = dispatch(x); y = combine(toy_experts(buffer)); backprop ``grad_outs[r]``."""
    import torch.distributed as dist
    from reference.moe.demos import toy_experts
    r, W = dist.get_rank(), dist.get_world_size()
    x, routing = per_rank[r]
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
        y.backward(grad_outs[r])
        out["grad_x"], out["grad_weight"] = x.grad, routing["weight"].grad
    return out


def grad_sync_per_rank(module: str, dense_grads, expert_grads, ep: int):
    """On each rank: parameters whose ``.grad`` hold this rank's local gradients; the learner syncs them.

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
    dense, experts = params(dense_grads[r]), params(expert_grads[r])
    _fn(module, "sync_moe_gradients")(dense, experts, dp_group=dp_group, expert_dp_group=groups[r % ep])
    return {"dense": [p.grad for p in dense], "experts": [p.grad for p in experts]}


# ----------------------------------------------------------------------------------------------
# 5b.1 — top-k gating


def _logits(T: int, E: int, seed: int, scale: float = 2.0, dtype=torch.float64, hot: dict | None = None):
    g = torch.Generator().manual_seed(salted_seed(seed))
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * scale
    for e, bias in (hot or {}).items():
        logits[:, e] += bias
    return logits.to(dtype)


def _second_before_first_logits(seed: int = 7) -> torch.Tensor:
    """T = 8, E = 4: expert 0 is the SECOND choice of tokens 0-3 and the FIRST choice of tokens 4-7.

    With C = 4 the first choices of tokens 4-7 fill expert 0 and the second choices of tokens 0-3
    are dropped; filling slots in token order across both choices drops the wrong ones.
    """
    g = torch.Generator().manual_seed(salted_seed(seed))
    logits = torch.randn(8, 4, generator=g, dtype=torch.float64) * 0.3
    for t in range(8):
        first, second = (1 + t % 3, 0) if t < 4 else (0, 1 + t % 3)
        logits[t, first] += 3.0
        logits[t, second] += 2.0
    return logits


def softmax_over_top_k(m: Mismatch) -> str | None:
    k = m.extra.get("k")
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape:
        return None
    if m.what.endswith('["probs"]') and bool(((m.got.abs() > 0).sum(-1) <= k).all()):
        return ("your probs are non-zero only at the chosen experts: take the softmax over ALL E experts "
                "first, then the top-k (Switch §2.1, GShard Alg. 1).")
    if m.what.endswith('["weight"]') and k == 1 and bool((m.got == 1).all()):
        return ("every top-1 weight is 1.0: that is a softmax over the single chosen logit. Switch's weight "
                "is the raw probability p_{t,e} of the softmax over all experts (it is what gives the router "
                "a gradient).")
    return None


def wrong_router_dtype(m: Mismatch) -> str | None:
    if isinstance(m.got, torch.Tensor) and m.got.is_floating_point() and m.got.dtype != m.expected.dtype:
        return (f"your {m.what} is {m.got.dtype}, expected {m.expected.dtype}: compute the softmax in "
                "router_dtype(logits.dtype) — float32, or float64 when the logits are float64.")
    return None


def renormalised_after_dropping(m: Mismatch) -> str | None:
    want = m.extra.get("want")
    if want is None or not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape:
        return None
    kept = want["kept"]
    if kept.shape[1] < 2:
        return None
    partial = kept.any(1) & ~kept.all(1)
    got = m.got.double()
    if bool(partial.any()):
        s = (got * kept)[partial].sum(1)
        if torch.allclose(s, torch.ones_like(s), atol=1e-6) and not torch.allclose(got, m.expected.double()):
            return ("for tokens that lost a choice to capacity, your kept weights sum to 1: you renormalised "
                    "AFTER dropping. GShard renormalises the top-k probabilities BEFORE dropping; a dropped "
                    "choice's weight is simply not used (the token keeps w_1 < 1).")
    if torch.allclose(got, m.expected.double() * kept, atol=1e-9):
        return ("your weights of dropped choices are 0: keep every choice's weight (renormalised before "
                "dropping) and let `kept` / slot = -1 mark the dropped ones.")
    return None


def _slots_by_choice(got_slot: torch.Tensor, idx: torch.Tensor, e: int):
    first = got_slot[:, 0][(idx[:, 0] == e) & (got_slot[:, 0] >= 0)]
    later = got_slot[:, 1:][(idx[:, 1:] == e) & (got_slot[:, 1:] >= 0)]
    return first, later


def second_choice_took_slots(m: Mismatch) -> str | None:
    got, want = m.extra.get("got"), m.extra.get("want")
    if not got or want is None or want["expert_index"].shape[1] < 2:
        return None
    idx = want["expert_index"]
    slot, kept = got.get("slot"), got.get("kept")
    if not isinstance(slot, torch.Tensor) or slot.shape != idx.shape:
        return None
    if isinstance(kept, torch.Tensor) and kept.shape == idx.shape:
        slot = torch.where(kept.bool(), slot.long(), torch.full_like(slot.long(), -1))
    for e in range(int(idx.max()) + 1):
        first, later = _slots_by_choice(slot.long(), idx, e)
        dropped_first = bool(((idx[:, 0] == e) & (slot[:, 0] < 0)).any())
        if (len(first) and len(later) and int(later.min()) < int(first.max())) or (dropped_first and len(later)):
            return (f"on expert {e}, a second choice holds a buffer slot ahead of a first choice: slots were "
                    "handed out in token order across both choices. GShard fills EVERY token's first choice "
                    "before any second choice: count in the order (j=0, t=0..T-1), then (j=1, t=0..T-1) — "
                    "e.g. one_hot(expert_index).transpose(0, 1).reshape(k*T, E) before the cumsum.")
    return None


def capacity_off_by_one(m: Mismatch) -> str | None:
    got, want, C = m.extra.get("got"), m.extra.get("want"), m.extra.get("capacity")
    if not got or want is None or C is None:
        return None
    idx, kept, slot = want["expert_index"], got.get("kept"), got.get("slot")
    if not isinstance(kept, torch.Tensor) or kept.shape != idx.shape:
        return None
    kept = kept.bool()
    E = want["probs"].shape[1]
    n_kept = torch.bincount(idx[kept], minlength=E)
    demand = torch.bincount(idx.flatten(), minlength=E)
    if int(n_kept.max()) == C + 1:
        return (f"an expert kept {C + 1} assignments with capacity {C}: keep slot < capacity "
                "(slots are numbered from 0), not slot <= capacity.")
    if bool((demand >= C).any()) and torch.equal(n_kept, demand.clamp(max=C - 1)):
        return (f"every full expert kept {C - 1} assignments, one fewer than its capacity {C}: slots start at 0 "
                "(cumsum − 1) and an assignment is kept while slot < capacity.")
    if isinstance(slot, torch.Tensor) and slot.shape == idx.shape and bool(kept.any()):
        s = slot.long()[kept]
        if int(s.min()) >= 1 and int(want["slot"][want["kept"]].min()) == 0:
            return "your slots start at 1: the first assignment to an expert takes slot 0 (cumsum − 1)."
    if isinstance(slot, torch.Tensor) and slot.shape == idx.shape and bool((~kept).any()) \
            and bool((slot.long()[~kept] != -1).any()):
        return "dropped assignments must have slot = -1 (they have no place in any buffer)."
    return None


DETECT = {
    "probs": [softmax_over_top_k, wrong_router_dtype],
    "expert_index": [],
    "weight": [softmax_over_top_k, renormalised_after_dropping, wrong_router_dtype],
    "kept": [second_choice_took_slots, capacity_off_by_one],
    "slot": [second_choice_took_slots, capacity_off_by_one],
}


def _gating_case(ctx, logits: torch.Tensor, k: int, capacity: int | None, case: str) -> dict:
    got = ctx.local(f"{H}:gating_call", logits, k, capacity)
    want = ctx.oracle(f"{REF}:top_k_gating", logits, k, capacity)
    ctx.expect(isinstance(got, dict), f"top_k_gating must return a dict, got {type(got).__name__} [{case}].")
    missing = [key for key in KEYS if key not in got]
    ctx.expect(not missing, f"top_k_gating's dict lacks {', '.join(missing)} [{case}]; it needs {', '.join(KEYS)}.")
    exact = logits.dtype == torch.float64
    extra = {"got": got, "want": want, "k": k, "capacity": capacity}
    for key in KEYS:
        tol = (1e-12 if exact else 1e-6) if key in ("probs", "weight") else 0.0
        ctx.compare(got[key], want[key], f'routing["{key}"]', atol=tol, rtol=tol, case=case,
                    detectors=DETECT[key], extra=extra)
    for key in ("probs", "weight"):
        ctx.expect(got[key].dtype == want[key].dtype,
                   f'routing["{key}"] is {got[key].dtype}, expected {want[key].dtype} [{case}]: the router works in '
                   "float32, or in the logits' dtype if that is wider (router_dtype).")
    ctx.expect(got["kept"].dtype == torch.bool, f'routing["kept"] must be a bool tensor, got {got["kept"].dtype}.')
    return got


@GATING.check("top-1 (Switch), capacity never reached: the weight is the raw probability")
def _(ctx):
    logits = _logits(10, 4, seed=1)
    _gating_case(ctx, logits, 1, 10, "T=10, E=4, k=1, C=10")


@GATING.check("top-1 with a capacity that drops tokens: first come, first served", points=2)
def _(ctx):
    logits = _logits(12, 4, seed=2, hot={0: 1.5})
    _gating_case(ctx, logits, 1, 3, "T=12, E=4, k=1, C=3, expert 0 popular")


@GATING.check("top-2 (GShard), capacity never reached: weights renormalised over the two choices")
def _(ctx):
    logits = _logits(10, 6, seed=3)
    _gating_case(ctx, logits, 2, 10, "T=10, E=6, k=2, C=10")


@GATING.check("top-2 with dropping: every first choice gets a slot before any second choice; "
              "weights renormalised before dropping", points=3)
def _(ctx):
    _gating_case(ctx, _second_before_first_logits(), 2, 4, "T=8, E=4, k=2, C=4")
    logits = _logits(16, 4, seed=4, hot={1: 1.0, 2: 0.5})
    _gating_case(ctx, logits, 2, 6, "T=16, E=4, k=2, C=6")


@GATING.check("dropless (capacity None): every assignment kept, slots count up per expert")
def _(ctx):
    logits = _logits(16, 8, seed=5, hot={3: 2.0})
    _gating_case(ctx, logits, 2, None, "T=16, E=8, k=2, dropless")


@GATING.check("float32 logits stay float32 (large logits, no overflow); 16-bit logits route in float32")
def _(ctx):
    logits = _logits(12, 8, seed=6, scale=40.0, dtype=torch.float32)
    _gating_case(ctx, logits, 2, 3, "float32, |logits| ~ 40, k=2, C=3")
    g = torch.Generator().manual_seed(salted_seed(8))
    distinct = torch.stack([torch.randperm(8, generator=g) for _ in range(12)]).to(torch.float64) * 0.75
    _gating_case(ctx, distinct.to(torch.bfloat16), 1, 2, "bfloat16 logits, k=1, C=2")


# ----------------------------------------------------------------------------------------------
# 5b.2 — the load-balancing loss


def _aux_inputs(sizes, E: int, k: int, seed: int, scale: float = 1.5):
    g = torch.Generator().manual_seed(salted_seed(seed))
    out = []
    for T in sizes:
        probs = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64) * scale, dim=-1)
        out.append((probs, probs.topk(k, dim=-1).indices))
    return out


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    if not isinstance(got, torch.Tensor) or got.numel() != 1 or float(want) == 0:
        return None
    return float(got) / float(want)


def aux_scale_mistakes(m: Mismatch) -> str | None:
    c, k, E = _ratio(m.got, m.expected), m.extra.get("k"), m.extra.get("E")
    if c is None or not m.what.startswith("load-balancing loss"):
        return None
    if k and k > 1 and abs(c - k) < 1e-9:
        return (f"your loss is exactly k = {k}× the true one: f_i counts all k choices of every token, so "
                "divide the counts by k·T (otherwise uniform routing gives k, not 1).")
    if E and abs(c - 1 / E) < 1e-9:
        return f"your loss is exactly 1/E = 1/{E} of the true one: the Switch loss is E · Σ_i f_i·P_i (the ×E is missing)."
    if E and abs(c - E) < 1e-9:
        return f"your loss is exactly E = {E}× too large: multiply Σ_i f_i·P_i by E once."
    return None


def first_choice_only(m: Mismatch) -> str | None:
    alt = m.extra.get("first_choice_only")
    if isinstance(alt, torch.Tensor) and isinstance(m.got, torch.Tensor) and m.got.numel() == 1 \
            and abs(float(m.got) - float(alt)) < 1e-9 * max(1.0, abs(float(alt))):
        return ("your loss counts only the FIRST choice of each token (GShard's variant). Here f_i counts all "
                "k choices before dropping, divided by k·T.")
    return None


def local_batch_loss(m: Mismatch) -> str | None:
    local, values = m.extra.get("local"), m.extra.get("values")
    r = m.rank
    if not isinstance(m.got, torch.Tensor) or m.got.numel() != 1 or local is None or r is None:
        return None
    g = float(m.got)
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b))  # noqa: E731
    if close(g, float(local[r])):
        return (f"rank {r} returned the loss of its own {m.extra['sizes'][r]} tokens: the counts f_i and the "
                "mean probabilities P_i must be all-reduced over the group so every rank gets the loss of the "
                "whole batch.")
    if close(g, float(torch.stack(list(local)).mean())):
        return ("your loss is the mean of the ranks' local losses. E·Σ f_i·P_i is a product of two batch means, "
                "not linear in the batch: all-reduce the counts, probability sums and token counts, then form it.")
    sizes = m.extra.get("sizes")
    if sizes:
        ratio = g / float(m.expected)
        if abs(ratio - (sum(sizes) / sizes[r]) ** 2) < 1e-9 * ratio:
            return ("you all-reduced the counts and probability sums but divided by this rank's own token "
                    "count: all-reduce T as well.")
    if values and len({round(float(v), 12) for v in values if isinstance(v, torch.Tensor)}) > 1:
        return ("your loss differs from rank to rank; the true one is the same on every rank. Something "
                "(counts, probability sums, or T) was taken from the local batch only.")
    return None


AUX_DETECT = [aux_scale_mistakes, first_choice_only, local_batch_loss]


def _aux_case(ctx, sizes, E: int, k: int, seed: int, case: str, grads: bool = False):
    per_rank = _aux_inputs(sizes, E, k, seed)
    W = len(sizes)
    probs = torch.cat([p for p, _ in per_rank])
    idx = torch.cat([i for _, i in per_rank])
    res = ctx.ranks(W, f"{H}:aux_per_rank", per_rank, E)
    want = ctx.oracle(f"{DEMOS}:aux_loss_and_grad", probs, idx, E)
    local = [ctx.oracle(f"{REF}:load_balancing_loss", p, i, E) for p, i in per_rank]
    extra = {"k": k, "E": E, "local": local, "values": [v.get("loss") for v in res.values], "sizes": list(sizes),
             "first_choice_only": ctx.oracle(f"{REF}:load_balancing_loss", probs, idx[:, :1], E) if k > 1 else None}
    for r, v in enumerate(res.values):
        ctx.compare(v["loss"], want["loss"], "load-balancing loss", rank=r, world_size=W, atol=1e-12, rtol=1e-12,
                    case=case, detectors=AUX_DETECT, extra=extra)
    if grads:
        bounds = torch.tensor([0] + list(sizes)).cumsum(0).tolist()
        for r, v in enumerate(res.values):
            ctx.expect(v["grad"] is not None, f"rank {r}: your loss carries no gradient to probs [{case}]. P_i (the "
                       "mean probability) must stay differentiable: only the counts f_i are constants.")
            ctx.compare(v["grad"], want["grad"][bounds[r]:bounds[r + 1]], "gradient w.r.t. this rank's probs",
                        rank=r, world_size=W, atol=1e-12, rtol=1e-10, case=case, detectors=[grad_counted_w_times])
    return res


def grad_counted_w_times(m: Mismatch) -> str | None:
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or not m.world_size:
        return None
    c = float(m.got.flatten()[0] / m.expected.flatten()[0]) if float(m.expected.flatten()[0]) else None
    if c is not None and abs(c - m.world_size) < 1e-9 * m.world_size and \
            torch.allclose(m.got.double(), c * m.expected.double(), rtol=1e-9, atol=0):
        return (f"your gradient is {m.world_size}× the true one: a differentiable all-reduce sends every rank's "
                "gradient to every rank, so the loss is counted W times. Keep the gradient local: "
                "prob_sum + (global_prob_sum − prob_sum).detach().")
    return None


@AUX.check("one rank, top-1 and top-2: E·Σ f_i·P_i with f over all k choices divided by k", points=2)
def _(ctx):
    _aux_case(ctx, [16], 8, 1, seed=21, case="W=1, T=16, E=8, k=1")
    _aux_case(ctx, [16], 8, 2, seed=22, case="W=1, T=16, E=8, k=2")


@AUX.check("uniform router probabilities give exactly 1.0; a collapsed router gives E")
def _(ctx):
    E, T = 8, 12
    g = torch.Generator().manual_seed(salted_seed(23))
    uniform = torch.full((T, E), 1.0 / E, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    res = ctx.ranks(1, f"{H}:aux_per_rank", [(uniform, idx)], E)
    ctx.compare(res.values[0]["loss"], torch.tensor(1.0, dtype=torch.float64), "load-balancing loss",
                atol=1e-12, rtol=0, case="uniform probabilities, k=2", detectors=AUX_DETECT, extra={"k": 2, "E": E})
    eps = 1e-9
    collapsed = torch.full((T, E), eps / (E - 1), dtype=torch.float64)
    collapsed[:, 0] = 1 - eps
    res = ctx.ranks(1, f"{H}:aux_per_rank", [(collapsed, torch.zeros(T, 1, dtype=torch.long))], E)
    want = ctx.oracle(f"{REF}:load_balancing_loss", collapsed, torch.zeros(T, 1, dtype=torch.long), E)
    ctx.compare(res.values[0]["loss"], want, "load-balancing loss", atol=1e-12, rtol=0,
                case="every token on expert 0 with probability 1 − 1e-9, k=1", detectors=AUX_DETECT,
                extra={"k": 1, "E": E})


@AUX.check("2 ranks: every rank returns the loss of the whole batch", points=2)
def _(ctx):
    _aux_case(ctx, [10, 10], 8, 2, seed=24, case="W=2, 10 tokens per rank, E=8, k=2")


@AUX.check("3 ranks with 5, 8 and 11 tokens: counts, probability sums and T all-reduced", points=2)
def _(ctx):
    _aux_case(ctx, [5, 8, 11], 6, 1, seed=25, case="W=3, T = 5, 8, 11, E=6, k=1")


@AUX.check("4 ranks, top-2: the value is global, the gradient reaches only each rank's own tokens", points=2)
def _(ctx):
    _aux_case(ctx, [6, 6, 6, 6], 8, 2, seed=26, case="W=4, 6 tokens per rank, E=8, k=2", grads=True)


# ----------------------------------------------------------------------------------------------
# 5b.3 — dispatch and combine


def _dispatch_inputs(ctx, W: int, T: int, E: int, k: int, cf: float, seed: int, d: int = 3, hot=None):
    from reference.moe.routing import expert_capacity  # given to learners; not an exercise
    C = expert_capacity(T, E, k, cf)
    g = torch.Generator().manual_seed(salted_seed(seed))
    per_rank, grads = [], []
    for r in range(W):
        x = torch.randn(T, d, generator=g, dtype=torch.float64)
        logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 1.5
        for e, b in (hot or {}).items():
            logits[:, e] += b
        per_rank.append((x, ctx.oracle(f"{REF}:top_k_gating", logits, k, C)))
        grads.append(torch.randn(T, d, generator=g, dtype=torch.float64))
    return per_rank, grads, C


def _expected_buffers(ctx, per_rank, E: int, C: int):
    """Rank r's dispatched buffer: for each source s, rows of s's single-process (E, C, d) buffer for r's experts."""
    W = len(per_rank)
    E_local = E // W
    singles = [ctx.oracle(f"{REF}:dispatch", x, routing, E, C) for x, routing in per_rank]    # (E, C, d) each
    return [torch.cat([s[r * E_local:(r + 1) * E_local] for s in singles], dim=1) for r in range(W)]


def sent_to_wrong_rank(m: Mismatch) -> str | None:
    """Identify each non-zero row of the learner's buffer with a token; test where its expert lives."""
    got, per_rank, E, r = m.got, m.extra.get("per_rank"), m.extra.get("E"), m.rank
    if not isinstance(got, torch.Tensor) or got.dim() != 3 or per_rank is None or r is None:
        return None
    W = len(per_rank)
    E_local = E // W
    hypotheses = {"blocks": lambda i: r * E_local + i, "mod": lambda i: i * W + r}
    fits = {h: 0 for h in hypotheses}
    rows = 0
    for i in range(min(got.shape[0], E_local)):
        for row in got[i]:
            if not bool(row.any()):
                continue
            for x, routing in per_rank:
                hit = torch.nonzero((x == row).all(1), as_tuple=True)[0]
                if len(hit):
                    t = int(hit[0])
                    chosen = {int(e) for e, kp in zip(routing["expert_index"][t], routing["kept"][t]) if kp}
                    rows += 1
                    for h, f in hypotheses.items():
                        fits[h] += f(i) in chosen
                    break
    if not rows:
        return None
    mine = list(range(r * E_local, (r + 1) * E_local))
    if fits["mod"] == rows and fits["blocks"] < rows:
        return (f"rank {r} received the tokens of experts {[i * W + r for i in range(E_local)]} (e mod W = {r}): "
                f"experts live in contiguous blocks, expert e on rank e // (E/W) = e // {E_local}; rank {r} holds "
                f"{mine}.")
    if fits["blocks"] < rows:
        return (f"some tokens in rank {r}'s buffer were not assigned to the experts it holds, {mine} "
                f"(expert e lives on rank e // (E/W) = e // {E_local}): tokens were sent to the wrong rank.")
    return ("the right tokens arrived but in the wrong rows: rank r's buffer is (E_local, W·C, d) with rows "
            "s·C … s·C+C−1 of each local expert from source rank s, at their slot.")


def combine_weights_wrong(m: Mismatch) -> str | None:
    parts, routing = m.extra.get("per_assignment"), m.extra.get("routing")
    if not isinstance(m.got, torch.Tensor) or parts is None or routing is None or m.got.shape != m.expected.shape:
        return None
    w = routing["weight"].unsqueeze(-1)
    for power, words in ((0, "not applied: multiply each expert's output by its combine weight w_tj"),
                         (2, "applied twice (w² · out): multiply by w_tj once, in combine only")):
        alt = (parts * w ** power).sum(1)
        if torch.allclose(m.got, alt, atol=1e-9, rtol=1e-9):
            return f"your combine weights are {words}."
    dropped = ~routing["kept"].any(1)
    if bool(dropped.any()) and bool(m.got[dropped].abs().max() > 0) and not bool(m.expected[dropped].abs().max() > 0):
        return ("a token dropped by all its experts must output exactly 0 from the layer (the residual connection "
                "carries it): skip assignments with kept = False / slot = −1 (slot −1 indexes the LAST row).")
    return None


def _dispatch_case(ctx, W: int, T: int, E: int, k: int, cf: float, seed: int, case: str, *, backward: bool = True,
                   hot=None):
    per_rank, grads, C = _dispatch_inputs(ctx, W, T, E, k, cf, seed, hot=hot)
    res = ctx.ranks(W, f"{H}:dispatch_combine_per_rank", per_rank, E, C, grads, backward)
    bufs = _expected_buffers(ctx, per_rank, E, C)
    case = f"{case}, C={C}"
    for r, v in enumerate(res.values):
        ctx.compare(v["buffer"], bufs[r], "dispatched buffer (E_local, W·C, d)", rank=r, world_size=W, atol=0,
                    rtol=0, case=case, detectors=[sent_to_wrong_rank], extra={"per_rank": per_rank, "E": E})
    for r, v in enumerate(res.values):
        x, routing = per_rank[r]
        want = ctx.oracle(f"{DEMOS}:dispatch_combine_single", x, routing, E, C, grads[r])
        ctx.compare(v["out"], want["out"], "combine(experts(dispatch(x)))", rank=r, world_size=W, atol=1e-12,
                    rtol=1e-12, case=case, detectors=[combine_weights_wrong],
                    extra={"per_assignment": want["per_assignment"], "routing": routing})
        dropped = ~routing["kept"].any(1)
        if bool(dropped.any()):
            ctx.expect(bool((v["out"][dropped] == 0).all()), f"rank {r}: tokens dropped by all their experts must "
                       f"output exactly 0 [{case}].")
        if backward:
            ctx.expect(v.get("has_graph", False), f"rank {r}: combine's output carries no gradient [{case}]: "
                       "dispatch and combine must be differentiable (index_add / indexing, and an all-to-all whose "
                       "backward is the all-to-all with the splits swapped).")
            ctx.compare(v["grad_x"], want["grad_x"], "gradient w.r.t. x", rank=r, world_size=W, atol=1e-12,
                        rtol=1e-12, case=case)
            ctx.compare(v["grad_weight"], want["grad_weight"], 'gradient w.r.t. routing["weight"]', rank=r,
                        world_size=W, atol=1e-12, rtol=1e-12, case=case)
    return res, C


@DISPATCH.check("one rank: the (E, C, d) buffer at each token's slot, weighted sum back")
def _(ctx):
    _dispatch_case(ctx, 1, 8, 4, 2, 1.0, seed=31, case="W=1, T=8, E=4, k=2")


@DISPATCH.check("2 ranks, top-1, 8 experts, capacity that drops: dropped tokens give exactly 0", points=2)
def _(ctx):
    _dispatch_case(ctx, 2, 12, 8, 1, 1.0, seed=32, case="W=2, T=12, E=8, k=1, expert 5 popular", hot={5: 2.0})


@DISPATCH.check("2 ranks, top-2: outputs and gradients (x and combine weights) equal one process", points=2)
def _(ctx):
    _dispatch_case(ctx, 2, 8, 4, 2, 1.5, seed=33, case="W=2, T=8, E=4, k=2")


@DISPATCH.check("4 ranks, top-2, 8 experts, skewed router: outputs and gradients equal one process", points=2)
def _(ctx):
    _dispatch_case(ctx, 4, 8, 8, 2, 1.0, seed=34, case="W=4, T=8, E=8, k=2, experts 0-1 popular",
                   hot={0: 1.5, 1: 1.0})


@DISPATCH.check("an all-to-all moves E·C rows per rank each way (padded, GShard style) (trace; feedback only, no points)", points=0)
def _(ctx):
    W, T, E, k, d = 4, 8, 8, 2, 3
    res, C = _dispatch_case(ctx, W, T, E, k, 1.0, seed=35, case="W=4, forward only", backward=False)
    want = 2 * E * C * d * 8
    for r in range(W):
        a2a = sum(e["nbytes"] for e in res.events("all_to_all", rank=r))
        other = sorted({e["op"] for e in res.events(rank=r)} - {"all_to_all", "compute", "route"})
        ctx.expect(a2a == want, f"rank {r} handed {a2a} bytes to all-to-alls in one forward (dispatch + combine); "
                   f"padded expert parallelism hands in its whole (E·C, d) buffer each way: "
                   f"2 · E·C·d · 8 bytes = 2·{E}·{C}·{d}·8 = {want}. "
                   + (f"It also used {', '.join(other)}." if other else ""))


# ----------------------------------------------------------------------------------------------
# 5b.4 — gradient synchronisation under EP × DP


def off_by_ep_size(m: Mismatch) -> str | None:
    ep = m.extra.get("ep")
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or not ep or ep == 1:
        return None
    g, e = m.got.double().flatten(), m.expected.double().flatten()
    for c, words in ((ep, f"exactly EP = {ep}× the true one"), (1 / ep, f"exactly 1/EP = 1/{ep} of the true one")):
        if torch.allclose(g, c * e, rtol=1e-9, atol=1e-12):
            return (f"your {m.what} is {words}: did you divide by the expert-data-parallel size "
                    f"({m.world_size // ep} ranks hold each expert) instead of the data-parallel size "
                    f"({m.world_size})? The all-to-all already summed the EP group's tokens into each expert's "
                    "gradient; sum over expert_dp_group, then divide by the FULL data-parallel size.")
    return None


def mixed_experts(m: Mismatch) -> str | None:
    locals_ = m.extra.get("local_expert_grads")
    i = m.extra.get("param")
    if not isinstance(m.got, torch.Tensor) or locals_ is None or i is None:
        return None
    mean_all = torch.stack([lg[i] for lg in locals_]).mean(0)
    if m.got.shape == mean_all.shape and torch.allclose(m.got.double(), mean_all.double(), rtol=1e-9, atol=1e-12):
        return ("you averaged the expert gradients over the whole data-parallel group: that mixes DIFFERENT "
                "experts (each rank of an EP group holds its own). Reduce expert gradients over expert_dp_group.")
    return None


def dense_not_averaged(m: Mismatch) -> str | None:
    N = m.world_size
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or not N or N == 1:
        return None
    g, e = m.got.double().flatten(), m.expected.double().flatten()
    if torch.allclose(g, N * e, rtol=1e-9, atol=1e-12):
        return (f"your {m.what} is exactly N = {N}× the true one: you summed it over dp_group but did not "
                "divide by N. The objective is the MEAN of the ranks' losses. (The balance loss keeps its full "
                "strength anyway: the expert-parallel layer already scales its gradient by the group size.)")
    return None


def _grad_sync_case(ctx, W: int, ep: int, seed: int, case: str):
    data = ctx.oracle(f"{DEMOS}:ep_dp_local_grads", W, ep, seed)
    res = ctx.ranks(W, f"{H}:grad_sync_per_rank", data["dense"], data["experts"], ep)
    for r, v in enumerate(res.values):
        for i, (g, want) in enumerate(zip(v["dense"], data["want_dense"])):
            ctx.compare(g, want, f"dense (router) gradient {i}", rank=r, world_size=W, atol=1e-12, rtol=1e-10,
                        case=case, detectors=[dense_not_averaged])
        for i, (g, want) in enumerate(zip(v["experts"], data["want_experts"][r])):
            ctx.compare(g, want, f"expert gradient {i}", rank=r, world_size=W, atol=1e-12, rtol=1e-10, case=case,
                        detectors=[off_by_ep_size, mixed_experts],
                        extra={"ep": ep, "local_expert_grads": data["experts"], "param": i})


@GRADSYNC.check("4 ranks, EP = 2 (expert-dp groups {0,2}, {1,3}): synced gradients = gradient of the mean loss",
                points=3)
def _(ctx):
    _grad_sync_case(ctx, 4, 2, seed=41, case="W=4, EP=2")


@GRADSYNC.check("4 ranks, EP = 4 (each expert on one rank): expert gradients still divided by 4", points=2)
def _(ctx):
    _grad_sync_case(ctx, 4, 4, seed=42, case="W=4, EP=4")


@GRADSYNC.check("4 ranks, EP = 1 (plain data parallelism): every gradient averaged over the 4 ranks")
def _(ctx):
    _grad_sync_case(ctx, 4, 1, seed=43, case="W=4, EP=1")


# Hints in tiers: the stub's error shows tier 1; ``hint("5b.2")`` shows the next one each call.
HINTS = {
    "5b.1": [
        "Softmax over ALL experts first (in router_dtype), then top-k. Slots: first choices of every token come "
        "before any second choice; an assignment whose slot reaches the capacity is dropped.",
        "k = 1: the weight is the raw probability; k >= 2: divide the k probabilities by their sum, before any "
        "dropping. one_hot(expert_index, E) is (T, k, E): put it in priority order, choice-major.",
        "order = one_hot(expert_index, E).transpose(0, 1).reshape(k*T, E); a cumsum down that order minus one, "
        "times the one-hot, counts the assignments to the same expert before each one: that is the slot. "
        "kept = slot < capacity (all kept if capacity is None); slot = -1 where dropped.",
    ],
    "5b.2": [
        "E · Σ_i f_i · P_i with f from the counts of all k choices (a constant) and P the mean probability (carries "
        "the gradient). With a group, every rank must return the loss of the WHOLE batch.",
        "The loss is a product of two batch means, so a mean of per-rank losses is wrong: all-reduce the counts, "
        "the probability sums (detached) and T, in one tensor, before forming f and P.",
        "Keep the gradient local: prob_sum + (global_prob_sum - prob_sum).detach() has the global value and reaches "
        "only this rank's tokens. f = counts / (k·T), P = prob_sum / T, loss = E · (f · P).sum().",
    ],
    "5b.3": [
        "dispatch: put each kept assignment in a zero buffer of E·C rows at row e·C + slot; rows of the experts on "
        "rank w form block w; one all-to-all delivers them. combine undoes it and mixes with the combine weights.",
        "Expert e lives on rank e // E_local. The all-to-all must be differentiable (its backward is the all-to-all "
        "of the gradient with the splits swapped): reference.comm has one. What arrives is (W, E_local, C, d) in "
        "source order: reorder to (E_local, W·C, d).",
        "combine: (E_local, W·C, d) → (W, E_local, C, d) → (W·E_local·C, d) rows, all-to-all them back; row e·C + "
        "slot now holds the output for your assignment (t, j). y = zeros(T, d).index_add(0, t, w_tj · rows) over "
        "KEPT assignments only (a slot of -1 would index the last row).",
    ],
    "5b.4": [
        "The objective is the mean of the ranks' losses. Dense parameters are replicated on every rank of "
        "dp_group; each expert on the ranks of expert_dp_group. What did the all-to-all already sum into an "
        "expert's gradient?",
        "Dense: all-reduce over dp_group and divide by its size N. Experts: all-reduce over expert_dp_group — the "
        "all-to-all already summed the whole EP group's tokens into each expert's gradient.",
        "Divide the expert gradients by N as well, NOT by the size of expert_dp_group (that is EP times too "
        "large). Skip parameters whose grad is None; work in place.",
    ],
}
