"""Checks for exercise 5a.1 merge_attention: fold two partial attention results into one."""
from __future__ import annotations

from typing import Any

import torch

from ...core import CheckFailed, exercise
from ...feedback import Mismatch, compare
from .common import H, _randn, attention

MERGE = exercise("5a.1", "Merge two partial attention results (online softmax)", "sequence", ["merge_attention"],
                 mirrors=("reference.sequence.blockwise:*",))


NO_MAX = ("no running max: with large logits e^{lse} overflows to inf — the textbook merge log(e^{lse_a} + "
          "e^{lse_b}) gives lse = inf, and then weights e^{lse_a − lse} = 0 (an out of zeros) or inf/inf = NaN. "
          "The merge needs the running max: with m = max(lse_a, lse_b) use e^{lse_a − m} and e^{lse_b − m} (one of "
          "them is 1, neither overflows).")


def merge_no_max(m: Mismatch) -> str | None:
    """The textbook merge without the running max, in either of its two forms: as a ratio of
    exponentials (NaN) or through lse = log(e^{lse_a} + e^{lse_b}) (inf, and an out of zeros)."""
    naive, ratio = m.extra.get(f"naive_{m.what}"), m.extra.get("naive")
    if not isinstance(m.got, torch.Tensor) or not isinstance(ratio, torch.Tensor) or bool(torch.isfinite(ratio).all()):
        return None                           # no overflow on these inputs: the max is not what went wrong
    if m.has_nonfinite:
        return NO_MAX
    if isinstance(naive, torch.Tensor) and naive.shape == m.got.shape \
            and torch.allclose(m.got.double(), naive, atol=1e-9, equal_nan=True):
        return NO_MAX
    return None


def merge_masked_side(m: Mismatch) -> str | None:
    if m.has_nonfinite and "masked" in m.case:
        return ("NaN where one side saw no key (lse = −inf): that side's weight must be exactly 0. "
                "With m = max(lse_a, lse_b) (finite here), e^{−inf − m} = 0 does it; lse_b − lse_a = inf does not.")
    return None


def merge_equal_weights(m: Mismatch) -> str | None:
    a, b = m.extra.get("out_a"), m.extra.get("out_b")
    if m.what == "out" and isinstance(a, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == a.shape and torch.allclose(m.got.double(), (a.double() + b.double()) / 2, atol=1e-9):
        return ("your out is the plain average of out_a and out_b: weight each side by its share of the "
                "softmax mass, e^{lse_a − lse} and e^{lse_b − lse}.")
    return None


def merge_swapped(m: Mismatch) -> str | None:
    sw = m.extra.get("swapped")
    if m.what == "out" and isinstance(sw, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == sw.shape and torch.allclose(m.got.double(), sw, atol=1e-9):
        return "the weights are swapped: out_a gets the weight of side b and out_b that of side a."
    return None


def merge_lse_max(m: Mismatch) -> str | None:
    la, lb = m.extra.get("lse_a"), m.extra.get("lse_b")
    if m.what == "lse" and isinstance(la, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == la.shape and torch.equal(m.got.double(), torch.maximum(la, lb).double()):
        return "your lse is max(lse_a, lse_b); the merged lse is log(e^{lse_a} + e^{lse_b}) = m + log(w_a + w_b)."
    if m.what == "lse" and isinstance(la, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == la.shape and torch.allclose(m.got.double(), la.double()):
        return "your lse is lse_a unchanged: the merged lse must include side b's mass too."
    return None


MERGE_DETECTORS = [merge_no_max, merge_masked_side, merge_equal_weights, merge_swapped, merge_lse_max]


def merge_case(B: int, Hh: int, Sq: int, Sa: int, Sb: int, D: int, seed: int, scale: float = 1.0,
               masked: str = "") -> dict[str, Any]:
    """Inputs (two key blocks' results) and the truth (attention over both blocks), in float64.

    masked: "" | "b" (side b sees no key: lse_b = −inf) | "rows" (some rows see no key of side a).
    """
    q = _randn((B, Hh, Sq, D), seed, scale)
    k = _randn((B, Hh, Sa + Sb, D), seed + 1, scale)
    v = _randn((B, Hh, Sa + Sb, D), seed + 2)
    keep = torch.ones(Sq, Sa + Sb, dtype=torch.bool)
    if masked == "b":
        keep[:, Sa:] = False
    elif masked == "rows":
        keep[: Sq // 2, :Sa] = False
    out_a, lse_a = attention(q, k[..., :Sa, :], v[..., :Sa, :], keep[:, :Sa])
    out_b, lse_b = attention(q, k[..., Sa:, :], v[..., Sa:, :], keep[:, Sa:])
    out, lse = attention(q, k, v, keep)
    with torch.no_grad():
        den = torch.exp(lse_a) + torch.exp(lse_b)
        naive = (torch.exp(lse_a).unsqueeze(-1) * out_a + torch.exp(lse_b).unsqueeze(-1) * out_b) / den.unsqueeze(-1)
        naive_lse = torch.log(den)                                  # the textbook merge, no running max
        naive_out = (torch.exp(lse_a - naive_lse).unsqueeze(-1) * out_a
                     + torch.exp(lse_b - naive_lse).unsqueeze(-1) * out_b)
        wa, wb = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
        swapped = wb * out_a + wa * out_b
    return {"args": (out_a, lse_a, out_b, lse_b), "out": out, "lse": lse,
            "extra": {"naive": naive, "naive_out": naive_out, "naive_lse": naive_lse, "swapped": swapped,
                      "out_a": out_a, "out_b": out_b, "lse_a": lse_a, "lse_b": lse_b}}


def judge_merge(got: Any, case: dict[str, Any], words: str) -> None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailed(f"merge_attention must return a tuple (out, lse); got {type(got).__name__} [{words}].")
    for i, what in enumerate(("out", "lse")):
        msg = compare(got[i], case[what], what, atol=1e-9, rtol=1e-9, case=words, detectors=MERGE_DETECTORS,
                      extra=case["extra"])
        if msg:
            raise CheckFailed(msg)


def _merge_check(ctx, case: dict[str, Any], words: str) -> None:
    got = ctx.local(f"{H}:call", "merge_attention", case["args"], None, True)
    for name, before, after in zip(("out_a", "lse_a", "out_b", "lse_b"), case["args"], got["inputs"]):
        if not (isinstance(after, torch.Tensor) and after.shape == before.shape and torch.equal(after, before)):
            raise CheckFailed(f"merge_attention changed its input {name} [{words}]: return new tensors and leave the "
                              "inputs as they were (a ring merges into a running result it still needs).")
    judge_merge(got["value"], case, words)


@MERGE.check("matches attention over both blocks in float64 (batch 2, 3 heads, blocks of 5 and 7 keys)", points=2)
def _(ctx):
    _merge_check(ctx, merge_case(2, 3, 6, 5, 7, 8, seed=101), "N(0,1) inputs")


@MERGE.check("large logits (q, k scaled ×4 and ×30) stay finite and exact", points=2)
def _(ctx):
    _merge_check(ctx, merge_case(1, 2, 8, 6, 6, 16, seed=102, scale=4.0), "large logits ×4")
    _merge_check(ctx, merge_case(1, 2, 8, 6, 6, 16, seed=103, scale=30.0), "large logits ×30")


@MERGE.check("a side that saw no key (lse = −inf) gets weight 0, on either side and for some rows only")
def _(ctx):
    case = merge_case(1, 2, 4, 4, 3, 8, seed=104, masked="b")
    _merge_check(ctx, case, "side b fully masked")
    a, la, b, lb = case["args"]
    _merge_check(ctx, {**case, "args": (b, lb, a, la), "extra": {**case["extra"], "naive": None, "swapped": None,
                                                                  "out_a": b, "out_b": a, "lse_a": lb, "lse_b": la}},
                 "side a fully masked")
    _merge_check(ctx, merge_case(2, 1, 6, 4, 4, 8, seed=105, masked="rows"), "some rows masked on side a")


# Hints in tiers: the stub's error shows tier 1; ``hint("5a.1")`` shows the next one each call.
HINTS = {
    "5a.1": [
        "Each side's weight is its share of the softmax mass, e^{lse_a} / (e^{lse_a} + e^{lse_b}). Think about what "
        "e^{lse} does when the logits are large, and what a fully masked side (lse = -inf) must contribute.",
        "Never compute e^{lse} itself: subtract the larger of the two log-sum-exps first, so every exponent is <= 0. "
        "lse has no head_dim axis: unsqueeze(-1) the weights before multiplying out_a and out_b.",
        "lse = m + log(e^{lse_a - m} + e^{lse_b - m}); out = e^{lse_a - lse}·out_a + e^{lse_b - lse}·out_b. Where "
        "both sides are -inf, m is -inf too: replace it by 0 before subtracting, so the weights come out 0, not NaN.",
    ],
}
