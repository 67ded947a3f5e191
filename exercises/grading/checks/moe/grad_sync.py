"""Checks for exercise 5b.4 sync_moe_gradients: gradient averaging when expert parallelism meets data parallelism."""
from __future__ import annotations

import torch

from ...core import exercise
from ...feedback import Mismatch
from .common import ORACLES, H

GRADSYNC = exercise("5b.4", "Expert gradients under expert × data parallelism", "moe", ["sync_moe_gradients"])


def off_by_ep_size(m: Mismatch) -> str | None:
    ep = m.extra.get("ep")
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or not ep or ep == 1:
        return None
    g, e = m.got.double().flatten(), m.expected.double().flatten()
    for c, words in ((ep, f"exactly EP = {ep}× the true one"), (1 / ep, f"exactly 1/EP = 1/{ep} of the true one")):
        if torch.allclose(g, c * e, rtol=1e-9, atol=1e-12):
            holders = m.world_size // ep
            return (f"your {m.what} is {words}: did you divide by the expert-data-parallel size "
                    f"({holders} {'rank holds' if holders == 1 else 'ranks hold'} each expert) instead of the "
                    f"data-parallel size ({m.world_size})? The all-to-all already summed the EP group's tokens into "
                    "each expert's gradient; sum over expert_dp_group, then divide by the FULL data-parallel size.")
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
    data = ctx.oracle(f"{ORACLES}:ep_dp_local_grads", W, ep, seed)
    res = ctx.ranks(W, f"{H}:grad_sync_per_rank", ep, per_rank=list(zip(data["dense"], data["experts"])))
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
    _grad_sync_case(ctx, 4, 2, seed=ctx.seed(41), case="W=4, EP=2")


@GRADSYNC.check("4 ranks, EP = 4 (each expert on one rank): expert gradients still divided by 4", points=2)
def _(ctx):
    _grad_sync_case(ctx, 4, 4, seed=ctx.seed(42), case="W=4, EP=4")


@GRADSYNC.check("4 ranks, EP = 1 (plain data parallelism): every gradient averaged over the 4 ranks")
def _(ctx):
    _grad_sync_case(ctx, 4, 1, seed=ctx.seed(43), case="W=4, EP=1")


# Hints in tiers: the stub's error shows tier 1; ``hint("5b.4")`` shows the next one each call.
HINTS = {
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
