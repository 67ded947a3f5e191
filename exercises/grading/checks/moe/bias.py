"""Checks for exercise 5b.5 loss_free_bias_update: DeepSeek-V3's bias step, its loads counted over every rank
that routes tokens.

Each rank is given its own counts only; the truth is the reference's step on the loads summed over the rank's
group (``ctx.oracle``, one process).  The inputs are drawn so that the classic mistakes give another bias on some
rank: this rank's counts alone, the whole world's counts where ``group`` is part of it, the sign reversed,
``γ·(mean − load)`` for ``γ·sign(mean − load)``, a tie (a load equal to the mean) moved, and the biases averaged
after local steps instead of the loads summed before one.
"""
from __future__ import annotations

import torch

from ...core import exercise, salted_seed
from ...feedback import Mismatch
from .common import REF, ROUTING_MIRRORS, H

LOSS_FREE = exercise("5b.5", "Loss-free balancing: the bias step, counted over every routing rank", "moe",
                     ["loss_free_bias_update"], mirrors=ROUTING_MIRRORS, shortcuts=("moe_bias",))

# |got − expected| allowed per dtype, as (atol, rtol): the learner may round γ·sign in another order (one ulp)
BIAS_TOL = {torch.float64: (1e-15, 1e-12), torch.float32: (1e-7, 1e-6), torch.bfloat16: (1e-4, 2.0 ** -7)}


def _loads(W: int, E: int, seed: int, ties: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-rank counts (W, E) whose sum over the ranks has mean m exactly and ``ties`` experts at m (``ties=0``:
    one count more, so the mean m + 1/E is no count's and not an integer)."""
    g = torch.Generator().manual_seed(salted_seed(seed))
    m = int(torch.randint(4 * W, 12 * W, (1,), generator=g))
    pairs = (E - ties) // 2
    d = torch.randint(1, m, (pairs,), generator=g)
    total = torch.cat([m + d, m - d, torch.full((E - 2 * pairs,), m)])[torch.randperm(E, generator=g)]
    if ties == 0:
        total[0] += 1
    cuts = [torch.sort(torch.randint(0, int(t) + 1, (W - 1,), generator=g)).values for t in total]
    per = torch.stack([torch.diff(torch.cat([torch.tensor([0]), c, t.view(1)])) for c, t in zip(cuts, total)], 1)
    return list(per), total


def _signs(load: torch.Tensor) -> torch.Tensor:
    load = load.double()
    return torch.sign(load.mean() - load)


def _draw(groups: list[list[int]], W: int, E: int, seed: int, ties: int) -> list[torch.Tensor]:
    """Each rank's counts: every group's drawn by :func:`_loads` (its sum with ``ties`` experts at the mean) and
    split over its ranks, redrawn (deterministically) until the mistakes show: each rank's own counts, the
    world's and the averaged local steps all step some expert another way than its group's loads."""
    for attempt in range(100):
        per_rank: list = [None] * W
        for i, g in enumerate(groups):
            for r, c in zip(g, _loads(len(g), E, seed + 7919 * attempt + 101 * i, ties)[0]):
                per_rank[r] = c
        group_signs = {r: _signs(sum(per_rank[q] for q in g)) for g in groups for r in g}
        own = all(len(g) == 1 or not torch.equal(_signs(per_rank[r]), group_signs[r]) for g in groups for r in g)
        world = len(groups) == 1 or all(not torch.equal(_signs(sum(per_rank)), group_signs[r]) for r in range(W))
        averaged = all(len(g) == 1 or not torch.equal(sum(_signs(per_rank[q]) for q in g) / len(g), group_signs[g[0]])
                       for g in groups)
        if ties == E or (own and world and averaged):
            return per_rank
    raise RuntimeError(f"no counts for {groups} (E={E}) tell the mistakes apart")       # never, for these sizes


def _bias(E: int, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(salted_seed(seed))
    return (torch.randn(E, generator=g, dtype=torch.float64) * 0.05).to(dtype)


def _step(bias: torch.Tensor, load: torch.Tensor, rate: float, how: str = "sign") -> torch.Tensor:
    """A (wrong) step written out here for the detectors, in float64: sign, reversed, proportional."""
    load = load.double()
    diff = load.mean() - load
    delta = {"sign": torch.sign(diff), "reversed": -torch.sign(diff), "proportional": diff}[how]
    return bias.double() + rate * delta


def _close(got, want, dtype) -> bool:
    atol, rtol = BIAS_TOL.get(dtype, BIAS_TOL[torch.float32])
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        bool(((got.double() - want.double()).abs() <= atol + rtol * want.double().abs()).all())


def counted_wrong_ranks(m: Mismatch) -> str | None:
    x = m.extra
    if not isinstance(m.got, torch.Tensor) or m.rank is None:
        return None
    if x.get("W", 1) > 1 and _close(m.got, x["local"][m.rank], x["dtype"]):
        return ("your bias followed this rank's own counts only. Every rank of group must step on the SAME "
                "loads — all-reduce (sum) the counts over group first — or the replicas' biases drift apart and "
                "the same token goes to different experts on different replicas.")
    if x.get("world") is not None and _close(m.got, x["world"][m.rank], x["dtype"]):
        return ("your bias followed the counts of EVERY rank in the world, but group is only some of them "
                f"({x['groups']}: e.g. two pipeline stages, each routing its own layer's tokens). All-reduce over "
                "group=group, not the default world group.")
    if x.get("averaged") is not None and _close(m.got, x["averaged"][m.rank], x["dtype"]):
        return ("your bias is the average of the ranks' biases after each stepped on its own counts. The sign is "
                "not linear: sum the counts over group first, then take one sign per expert.")
    return None


def sign_mistakes(m: Mismatch) -> str | None:
    x = m.extra
    if not isinstance(m.got, torch.Tensor) or m.rank is None:
        return None
    bias, load, rate, dtype = x["bias"], x["load"], x["rate"], x["dtype"]
    if _close(m.got, _step(bias, load, rate, "reversed").to(dtype), dtype):
        return ("your step has the wrong sign: an OVERLOADED expert (load above the mean) must get a LOWER bias "
                "so fewer tokens pick it — b_e += γ·sign(mean − load_e), not sign(load_e − mean).")
    if _close(m.got, _step(bias, load, rate, "proportional").to(dtype), dtype):
        return ("your step is γ·(mean − load_e): its size grows with the imbalance. DeepSeek-V3's step is "
                "γ·sign(mean − load_e): exactly ±γ (or 0) for every expert, whatever the counts.")
    want, ties = m.expected.double(), x["ties"]
    off = (m.got.double() - want).abs() > BIAS_TOL[dtype][0] + BIAS_TOL[dtype][1] * want.abs()
    if bool(off.any()) and bool(ties[off].all()) and \
            torch.allclose((m.got.double() - want)[off].abs(), torch.full((int(off.sum()),), rate, dtype=torch.float64),
                           rtol=1e-2, atol=0):
        return ("only the experts whose load equals the mean moved (by γ): a load exactly at the mean must leave "
                "its bias alone — sign(0) = 0 (torch.sign), not a comparison that picks a side.")
    return None


BIAS_DETECT = [counted_wrong_ranks, sign_mistakes]


def _case(ctx, W: int, E: int, seed: int, case: str, *, dtype=torch.float32, rate: float = 1e-2,
          groups: list | None = "world", counts_dtype=torch.int64, ties: int = 2):
    """Run the learner's step on W ranks (each its own counts) and judge every rank's bias."""
    groups = [list(range(W))] if groups == "world" else groups
    per_rank = _draw(groups if groups is not None else [[r] for r in range(W)], W, E, seed, ties)
    bias0 = _bias(E, seed + 1, dtype)
    group_of = {r: (next(g for g in groups if r in g) if groups is not None else [r]) for r in range(W)}
    summed = {r: sum(per_rank[q] for q in group_of[r]) for r in range(W)}
    want = {r: ctx.oracle(f"{REF}:loss_free_bias_update", bias0.clone(), summed[r].clone(), rate) for r in range(W)}
    local = [ctx.oracle(f"{REF}:loss_free_bias_update", bias0.clone(), per_rank[r].clone(), rate) for r in range(W)]
    world = None
    if groups is not None and len(groups) > 1:
        everyone = sum(per_rank)
        world = [ctx.oracle(f"{REF}:loss_free_bias_update", bias0.clone(), everyone.clone(), rate)] * W
    averaged = [sum(_step(bias0, per_rank[q], rate) for q in group_of[r]) / len(group_of[r]) for r in range(W)]
    inputs = [(bias0.clone(), per_rank[r].to(counts_dtype)) for r in range(W)]
    res = ctx.ranks(W, f"{H}:bias_update_per_rank", rate, groups, per_rank=inputs)
    for r, v in enumerate(res.values):
        load = summed[r].double()
        extra = {"W": len(group_of[r]), "local": local, "world": world, "averaged": averaged, "groups": groups,
                 "bias": bias0, "load": load, "rate": rate, "dtype": dtype, "ties": load == load.mean()}
        got = v["returned"]
        ctx.expect(got is not None or not _close(v["bias"], want[r], dtype),
                   f"rank {r} [{case}]: your bias was updated in place but your function returned None: return "
                   "bias (the caller may chain it).")
        atol, rtol = BIAS_TOL[dtype]
        ctx.compare(got, want[r], "bias after the update", rank=r, world_size=W, atol=atol, rtol=rtol, case=case,
                    detectors=BIAS_DETECT, extra=extra)
        ctx.expect(got.dtype == dtype, f"rank {r} [{case}]: your bias came back as {got.dtype}; the bias was "
                   f"{dtype} and must stay so (update it in place: bias.add_(...), which keeps its dtype).")
        if not _close(v["bias"], want[r], dtype):
            state = "unchanged" if _close(v["bias"], bias0, dtype) else "changed, but not to the bias you returned"
            ctx.expect(False, f"rank {r} [{case}]: the bias tensor you were given is {state}. Update it IN PLACE "
                       "(bias.add_(...) under torch.no_grad()) and return it: the layer keeps its bias in a buffer, "
                       "and only an in-place update reaches it.")
        ctx.expect(v["same"], f"rank {r} [{case}]: you updated the bias in place but returned another tensor: "
                   "return bias itself.")
        ctx.compare(v["counts"], inputs[r][1], "tokens_per_expert after your call", rank=r, world_size=W, atol=0,
                    rtol=0, case=case)
        ctx.expect(v["counts"].dtype == counts_dtype, f"rank {r} [{case}]: you changed tokens_per_expert's dtype.")
    return res


@LOSS_FREE.check("one rank: each expert's bias moves by γ towards the mean load, a load equal to the mean stays; "
                 "in place", points=2)
def _(ctx):
    _case(ctx, 1, 8, seed=51, case="W=1, E=8, float32 bias, int64 counts, group=None", groups=None)


@LOSS_FREE.check("float64 and bfloat16 biases keep their dtype; float32 counts whose mean is not an integer")
def _(ctx):
    _case(ctx, 1, 6, seed=52, case="W=1, E=6, float64 bias, float32 counts, group=None", groups=None,
          dtype=torch.float64, counts_dtype=torch.float32, ties=0)
    _case(ctx, 1, 8, seed=53, case="W=1, E=8, bfloat16 bias, int64 counts, group=None", groups=None,
          dtype=torch.bfloat16)


@LOSS_FREE.check("2 ranks, one routing group: the loads summed over the group, one bias on both ranks", points=2)
def _(ctx):
    _case(ctx, 2, 8, seed=54, case="W=2, group = {0, 1}, E=8")


@LOSS_FREE.check("3 ranks with uneven counts: every rank steps on the group's loads")
def _(ctx):
    _case(ctx, 3, 6, seed=55, case="W=3, group = {0, 1, 2}, E=6, float64 bias", dtype=torch.float64)


@LOSS_FREE.check("4 ranks as two routing groups {0, 1} and {2, 3} (two pipeline stages): each counts its own group "
                 "— not the world, not itself", points=2)
def _(ctx):
    _case(ctx, 4, 8, seed=56, case="W=4, groups {0, 1} and {2, 3}, E=8", groups=[[0, 1], [2, 3]])


# Hints in tiers: the stub's error shows tier 1; ``hint("5b.5")`` shows the next one each call.
HINTS = {
    "5b.5": [
        "Every rank of group must step its bias on the same loads: the counts of ALL the ranks that route tokens, "
        "summed. Then each expert's bias moves by γ towards the mean load.",
        "Sum a float64 COPY of tokens_per_expert over group with one all-reduce (none when group is None; never "
        "the caller's tensor, never the default world group). sign(mean load − load_e) gives the direction: +γ "
        "below the mean, −γ above it, 0 exactly at it.",
        "The loads: a detached float64 clone of the counts, summed in place over group by comm.all_reduce. The "
        "step: torch.sign of (the loads' mean minus each load) times rate, cast to the bias's dtype and added to "
        "the bias in place (add_, under torch.no_grad()); return the bias. Not γ·(mean − load): the step is the "
        "same size for every expert.",
    ],
}
