"""Checks for exercise 5b.1 top_k_gating: route T tokens to their top-k experts, with capacity."""
from __future__ import annotations

import torch

from ...core import exercise, salted_seed
from ...feedback import Mismatch
from .common import ROUTING_MIRRORS, KEYS, REF, H

GATING = exercise("5b.1", "Top-1 and top-2 gating with capacity", "moe", ["top_k_gating"],
                  mirrors=ROUTING_MIRRORS)


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
                    "before any second choice: count the assignments in the order (j=0, t=0..T-1), then "
                    "(j=1, t=0..T-1) — choice-major, not token-major.")
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


# Hints in tiers: the stub's error shows tier 1; ``hint("5b.1")`` shows the next one each call.
HINTS = {
    "5b.1": [
        "Softmax over ALL experts first (in router_dtype), then top-k. Slots: first choices of every token come "
        "before any second choice; an assignment whose slot reaches the capacity is dropped.",
        "k = 1: the weight is the raw probability; k >= 2: divide the k probabilities by their sum, before any "
        "dropping. one_hot(expert_index, E) is (T, k, E): put it in priority order, choice-major.",
        "Lay the one-hot choices out choice-major — every token's first choice, then every second choice — as "
        "k·T rows of E columns. A running count down each expert's column, minus one, on the rows that chose it, "
        "is the number of assignments to that expert before this one: the slot. An assignment is kept while its "
        "slot is below the capacity (all are, with capacity None); a dropped one gets slot −1.",
    ],
}
