"""Checks for exercise 5b.2 load_balancing_loss: Switch's auxiliary loss, group-wide under expert parallelism."""
from __future__ import annotations

import torch

from ...core import exercise, salted_seed
from ...feedback import Mismatch
from .common import ROUTING_MIRRORS, ORACLES, REF, H

AUX = exercise("5b.2", "The load-balancing loss, group-wide", "moe", ["load_balancing_loss"],
               mirrors=ROUTING_MIRRORS)


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
        return (f"your loss is exactly 1/E = 1/{E} of the true one: the Switch loss is E · Σ_i f_i·P_i (the ×E is "
                "missing).")
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
    res = ctx.ranks(W, f"{H}:aux_per_rank", E, per_rank=per_rank)
    want = ctx.oracle(f"{ORACLES}:aux_loss_and_grad", probs, idx, E)
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
    res = ctx.ranks(1, f"{H}:aux_per_rank", E, per_rank=[(uniform, idx)])
    ctx.compare(res.values[0]["loss"], torch.tensor(1.0, dtype=torch.float64), "load-balancing loss",
                atol=1e-12, rtol=0, case="uniform probabilities, k=2", detectors=AUX_DETECT, extra={"k": 2, "E": E})
    eps = 1e-9
    collapsed = torch.full((T, E), eps / (E - 1), dtype=torch.float64)
    collapsed[:, 0] = 1 - eps
    res = ctx.ranks(1, f"{H}:aux_per_rank", E, per_rank=[(collapsed, torch.zeros(T, 1, dtype=torch.long))])
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


# Hints in tiers: the stub's error shows tier 1; ``hint("5b.2")`` shows the next one each call.
HINTS = {
    "5b.2": [
        "E · Σ_i f_i · P_i with f from the counts of all k choices (a constant) and P the mean probability (carries "
        "the gradient). With a group, every rank must return the loss of the WHOLE batch.",
        "The loss is a product of two batch means, so a mean of per-rank losses is wrong: all-reduce the counts, "
        "the probability sums (detached) and T, in one tensor, before forming f and P.",
        "Keep the gradient local: prob_sum + (global_prob_sum - prob_sum).detach() has the global value and reaches "
        "only this rank's tokens. f = counts / (k·T), P = prob_sum / T, loss = E · (f · P).sum().",
    ],
}
