"""Checks for exercise 5b.3 dispatch / combine: tokens to the ranks holding their experts and back (all-to-all)."""
from __future__ import annotations

import torch

from ...core import exercise, salted_seed
from ...feedback import Mismatch
from .common import ORACLES, REF, H

DISPATCH = exercise("5b.3", "Dispatch and combine through all-to-all", "moe", ["dispatch", "combine"],
                    comm=("all_to_all",), mirrors=("reference.moe.parallel:*", "reference.moe.assignments:*"))


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
    res = ctx.ranks(W, f"{H}:dispatch_combine_per_rank", E, C, backward,
                    per_rank=[(x, routing, grads[r]) for r, (x, routing) in enumerate(per_rank)])
    bufs = _expected_buffers(ctx, per_rank, E, C)
    case = f"{case}, C={C}"
    for r, v in enumerate(res.values):
        ctx.compare(v["buffer"], bufs[r], "dispatched buffer (E_local, W·C, d)", rank=r, world_size=W, atol=0,
                    rtol=0, case=case, detectors=[sent_to_wrong_rank], extra={"per_rank": per_rank, "E": E})
    for r, v in enumerate(res.values):
        x, routing = per_rank[r]
        want = ctx.oracle(f"{ORACLES}:dispatch_combine_single", x, routing, E, C, grads[r])
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


@DISPATCH.check("an all-to-all moves E·C rows per rank each way (padded, GShard style) (trace; feedback only, no "
                "points)", points=0)
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


# Hints in tiers: the stub's error shows tier 1; ``hint("5b.3")`` shows the next one each call.
HINTS = {
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
}
