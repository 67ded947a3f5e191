"""Checks for exercise 5a.5 ring_attention_backward: K/V travel the ring again, dK/dV come home.

The truth is single-process autograd of full attention in float64 (:func:`grad_truth`).  The
learner's ring gets the forward's out and lse from that truth (so 5a.5 does not depend on 5a.3)
and returns this rank's (dq, dk, dv).  When a gradient is wrong, the usual mistakes are computed
here too, block by block with the FlashAttention-2 formulas written out in float64
(:func:`block_grads`), and the one the learner's numbers match is named.
"""
from __future__ import annotations

import math
import random
from typing import Any

import torch

from ...core import CheckFailed, exercise
from ...feedback import Mismatch, compare
from .common import ME, RANKS_TIMEOUT, _randn, attention, layout_positions
from .ring import _peers, block_keep, judge_inputs_kept, kv_rules, ring_direction, ring_sent, same_as_another

RING_BWD = exercise("5a.5", "Ring attention backward", "sequence", ["ring_attention_backward"], comm=("p2p",),
                   ring=True, mirrors=("reference.sequence.blockwise:blockwise_attention",))

LAYOUTS = ("contiguous", "zigzag", "striped")

# ----------------------------------------------------------------------------------------------
# Inputs and truth


def bwd_inputs(B: int, H: int, S: int, D: int, seed: int, *, H_kv: int | None = None, q_scale: float = 1.0,
               dtype=torch.float64) -> tuple[torch.Tensor, ...]:
    """(q, k, v, dout) over the whole sequence; q × ``q_scale`` makes the scores ~ ±q_scale."""
    hk = H if H_kv is None else H_kv
    return (_randn((B, H, S, D), seed, q_scale, dtype), _randn((B, hk, S, D), seed + 1, 1.0, dtype),
            _randn((B, hk, S, D), seed + 2, 1.0, dtype), _randn((B, H, S, D), seed + 3, 1.0, dtype))


def grad_truth(q, k, v, dout, causal: bool) -> dict[str, torch.Tensor]:
    """float64 out, lse, dq, dk, dv of full attention (global order) by autograd, one process."""
    S, G = q.shape[-2], q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    keep = torch.ones(S, S, dtype=torch.bool).tril() if causal else None
    out, lse = attention(qd, kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1), keep)
    out.backward(dout.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}


def shard_backward_inputs(inputs, truth: dict, W: int, layout: str) -> list[tuple[torch.Tensor, ...]]:
    """Per rank (dout, q, k, v, out, lse) in ``layout`` order; out in the inputs' dtype, lse in float32
    (float64 for float64 inputs), as the forward returns them."""
    q, k, v, dout = inputs
    S, dtype = q.shape[-2], q.dtype
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    shards = []
    for r in range(W):
        pos = layout_positions(S, r, W, layout)
        shards.append((dout[..., pos, :].contiguous(), q[..., pos, :].contiguous(), k[..., pos, :].contiguous(),
                       v[..., pos, :].contiguous(), truth["out"][..., pos, :].to(dtype).contiguous(),
                       truth["lse"][..., pos].to(lse_dtype).contiguous()))
    return shards


# ----------------------------------------------------------------------------------------------
# The usual mistakes, computed block by block


def block_grads(q, k, v, dout, out, lse, keep, *, local_lse: bool = False, local_d: bool = False):
    """One (query block, key block) share of (dq, dk, dv) in float64, FlashAttention-2 written out.

    q, dout, out: (B, H, nq, D), lse (B, H, nq): the rows' FINAL values; k, v (B, H_kv, nk, D);
    keep (nq, nk).  ``local_lse``: P from the block's own lse instead; ``local_d``: D from the
    block's own attention output instead of the final one (two classic mistakes)."""
    q, k, v, dout, out, lse = (t.double() for t in (q, k, v, dout, out, lse))
    B, H, nq, D = q.shape
    Hkv, nk, G = k.shape[1], k.shape[2], H // k.shape[1]
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scale = 1 / math.sqrt(D)
    s = (q @ ke.transpose(-1, -2) * scale).masked_fill(~keep, -math.inf)
    own_lse = torch.logsumexp(s, -1)
    finite = lambda t: torch.where(torch.isneginf(t), torch.zeros_like(t), t)  # noqa: E731
    if local_d:
        out = torch.exp(s - finite(own_lse)[..., None]) @ ve
    p = torch.exp(s - finite(own_lse if local_lse else lse)[..., None])
    d = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ ve.transpose(-1, -2) - d)
    per_kv = lambda t: t.reshape(B, Hkv, G, nk, D).sum(2)  # noqa: E731
    return ds @ ke * scale, per_kv(ds.transpose(-1, -2) @ q * scale), per_kv(p.transpose(-1, -2) @ dout)


def _blocks(inputs, truth, W: int, layout: str, causal: bool, rule: str = "truth", **kw):
    """shares[r][j] = (dq, dk, dv): rank r's queries against rank j's K/V, under mask ``rule``."""
    q, k, v, dout = inputs
    S = q.shape[-2]
    pos = [layout_positions(S, r, W, layout) for r in range(W)]
    shares = []
    for r in range(W):
        row = []
        for j in range(W):
            keep = (block_keep(rule, layout, S, W, r, j) if causal
                    else torch.ones(len(pos[r]), len(pos[j]), dtype=torch.bool))
            row.append(block_grads(q[..., pos[r], :], k[..., pos[j], :], v[..., pos[j], :], dout[..., pos[r], :],
                                   truth["out"][..., pos[r], :], truth["lse"][..., pos[r]], keep, **kw))
        shares.append(row)
    return shares


def _assemble(shares, W: int, how: str = "home") -> list[tuple[torch.Tensor, ...]]:
    """Per rank (dq, dk, dv) from the block shares: ``home`` (each K/V block's shares summed on its
    owner — right), ``kept`` (each rank sums the shares it computed), ``own_only``, ``own_twice``."""
    res = []
    for r in range(W):
        dq = sum(shares[r][j][0] for j in range(W))
        if how == "kept":
            dk, dv = (sum(shares[r][j][i] for j in range(W)) for i in (1, 2))
        elif how == "own_only":
            dk, dv = shares[r][r][1], shares[r][r][2]
        else:
            dk, dv = (sum(shares[i][r][x] for i in range(W)) for x in (1, 2))
            if how == "own_twice":
                dk, dv = dk + shares[r][r][1], dv + shares[r][r][2]
        res.append((dq, dk, dv))
    return res


MISTAKES = {
    "kept": ("each rank kept the dK/dV shares it computed: rank r's dk is what its own queries contribute to "
             "EVERY block it visited. A share belongs to the owner of the K/V block: add it to an accumulator "
             "that travels round the ring with the block and comes home to its owner."),
    "own_only": ("your dk/dv hold only this rank's own share of its own block (step 0): the shares the other "
                 "ranks computed for it never arrived. They travel round the ring, accumulated, and come home."),
    "own_twice": ("this rank's own share of its block is counted twice: kept from step 0 AND already in the "
                  "accumulator that came home (or added once more at the end)."),
    "local_d": ("D = rowsum(dO ∘ O) needs the row's FINAL output O (over all keys: the out passed in), not one "
                "block's own attention output; with a block's O, dq and dk are off while dv is right."),
    "local_lse": ("P = exp(S − lse) needs the row's FINAL lse over all keys (the lse passed in), not one block's "
                  "own: with a block's lse each block's probabilities sum to 1 on their own, so every block's "
                  "share is too large."),
    "local_both": ("your gradients are what a block's OWN (out, lse) give: P and D need the row's FINAL lse and "
                   "output over all keys — the out and lse passed in, never a block's recomputed ones."),
    "causal_every_block": ("your gradients are what EVERY block with the causal mask gives (causal=True at every "
                           "step): only the diagonal block (your own K/V, step 0) is causal; the given block_plan "
                           "says which rows each block uses and whether it is causal, as in the forward."),
    "no_mask": "your gradients are those of non-causal attention: causal=True was ignored in the backward.",
    "diag_unmasked": ("each rank's own block (step 0, the diagonal) was not masked: it needs the causal mask "
                      "(causal=True) there, as in the forward."),
    "diag_skipped": ("each rank's own block (step 0, the diagonal) was skipped: compute it with the causal mask; "
                     "only blocks entirely in the future are skipped."),
    "contiguous_rules": ("your blocks follow the contiguous layout's causal rule (earlier rank: all keys, same: "
                         "causal, later: none) on {layout} shards. Plan each block by the layout's own rule, as "
                         "in the forward (block_plan is given)."),
    "reversed": ("your gradients are those of each rank attending to the blocks of LATER ranks: at step s rank r "
                 "holds the K/V of rank (r − s) mod W. Did K/V go the wrong way round the ring?"),
    "striped_inclusive": ("striped: a block from a later rank j > r is STRICTLY causal (q[1:] against k[:-1] with "
                          "causal=True); yours includes the diagonal."),
}


def alternatives(inputs, truth, W: int, layout: str, causal: bool) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    """Per mistake, per rank (dq, dk, dv) a ring with that mistake returns."""
    alts = {}
    base = _blocks(inputs, truth, W, layout, causal)
    for how in ("kept", "own_only", "own_twice"):
        alts[how] = _assemble(base, W, how)
    if W > 1:
        for name, kw in (("local_d", {"local_d": True}), ("local_lse", {"local_lse": True}),
                         ("local_both", {"local_d": True, "local_lse": True})):
            alts[name] = _assemble(_blocks(inputs, truth, W, layout, causal, **kw), W)
    if causal:
        for rule in ("causal_every_block", "no_mask", "diag_unmasked", "diag_skipped", "contiguous_rules", "reversed",
                     "striped_inclusive"):
            if not same_as_another(rule, layout):
                alts[rule] = _assemble(_blocks(inputs, truth, W, layout, causal, rule), W)
    return alts


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol))


def named_mistake(m: Mismatch) -> str | None:
    got, alts, tol = m.got, m.extra.get("alternatives", {}), m.extra.get("tol", (1e-7, 1e-6))
    if not isinstance(got, torch.Tensor) or not bool(torch.isfinite(got).all()):
        return None
    best, best_err = None, float("inf")          # of the mistakes it matches, the closest
    for name, alt in alts.items():
        if _close(got, alt, *tol) and not _close(alt, m.expected, *tol):
            err = float((got.double() - alt.double()).abs().max())
            if err < best_err:
                best, best_err = name, err
    if best is not None:
        return MISTAKES[best].format(layout=m.extra.get("layout"))
    owner = m.extra.get("owners", {})
    for j, want in owner.items():
        if j != m.rank and _close(got, want, *tol):
            W, r = m.world_size, m.rank
            return (f"rank {r} returned the complete {m.what} of rank {j}'s K/V: the accumulators gathered every "
                    f"share but stopped {(j - r) % W} hop(s) short of home. The accumulator of a block must end "
                    "on the rank that owns it.")
    return None


def two_directions(m: Mismatch) -> str | None:
    r, W, got = m.rank, m.world_size, m.extra.get("recv_peers")
    if got and W and W > 2 and got == {(r - 1) % W, (r + 1) % W}:
        return (f"rank {r} received from both neighbours, {(r - 1) % W} and {(r + 1) % W}: K/V and the dK/dV "
                "accumulators must travel the same way round the ring (each rank sends only to r+1 and receives "
                "only from r−1), so that the accumulator a rank receives is the one of the block it holds.")
    return None


def scaled_twice(m: Mismatch) -> str | None:
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or m.what == "dv":
        return None
    scale = m.extra.get("scale")
    e, g = m.expected.double(), m.got.double()
    for c in (scale, 1 / scale) if scale else ():
        if torch.allclose(g, c * e, rtol=1e-5, atol=1e-8 * max(1.0, float(e.abs().max()))):
            return (f"your {m.what} is exactly {c:.4g}× the true one: the softmax scale 1/√D was applied twice (or "
                    "undone). The block backward already includes it in dq and dk: scale neither q nor the results.")
    return None


def judge_ring_backward(values: list[Any], trace: list[dict], inputs, causal: bool, layout: str, W: int, *,
                        truth: dict | None = None, atol: float = 1e-9, rtol: float = 1e-7, words: str = "") -> None:
    """Compare each rank's (dq, dk, dv) with float64 autograd of full attention; name the usual mistake."""
    words = words or f"W={W}, {layout}, {'causal' if causal else 'non-causal'}"
    truth = truth if truth is not None else grad_truth(*inputs, causal)
    S = inputs[0].shape[-2]
    pos = [layout_positions(S, r, W, layout) for r in range(W)]
    want = [tuple(truth[x][..., pos[r], :] for x in ("dq", "dk", "dv")) for r in range(W)]
    alts = None
    for r in range(W):
        res = values[r]
        if "bad_return" in res:
            raise CheckFailed(f"ring_attention_backward must return (dq, dk, dv); rank {r} returned "
                              f"{res['bad_return']} [{words}].")
        for i, what in enumerate(("dq", "dk", "dv")):
            got = res[what]
            if what != "dq" and isinstance(got, torch.Tensor) and got.dim() == 4 \
                    and got.shape[1] == inputs[0].shape[1] != inputs[1].shape[1]:
                raise CheckFailed(f"{what} on rank {r} has the {got.shape[1]} query heads; K/V have "
                                  f"{inputs[1].shape[1]} [{words}]: return one gradient per K/V head (the given "
                                  "block backward sums over the query heads that share a K/V head).")
            if compare(got, want[r][i], what, atol=atol, rtol=rtol) is None:
                continue
            if alts is None:
                alts = alternatives(inputs, truth, W, layout, causal)
            extra = {"alternatives": {name: alt[r][i] for name, alt in alts.items()},
                     "owners": {j: want[j][i] for j in range(W)} if what != "dq" else {},
                     "layout": layout, "scale": 1 / math.sqrt(inputs[0].shape[-1]),
                     "recv_peers": _peers(trace, "recv", r), "tol": (max(atol * 10, 1e-7), max(rtol * 10, 1e-6))}
            msg = compare(got, want[r][i], what, rank=r, world_size=W, atol=atol, rtol=rtol, case=words,
                          detectors=[ring_direction, two_directions, named_mistake, scaled_twice], extra=extra)
            if what != "dq" and compare(res["dq"], want[r][0], "dq", atol=atol, rtol=rtol) is None:
                msg += ("\n    (dq is right, so the blocks themselves are likely right: look at where the dK/dV "
                        "shares end up — each block's must reach the rank that owns the block.)")
            raise CheckFailed(msg)


# ----------------------------------------------------------------------------------------------
# Checks


def _run(ctx, W: int, inputs, causal: bool, layout: str, **kw):
    truth = grad_truth(*inputs, causal)
    shards = shard_backward_inputs(inputs, truth, W, layout)
    res = ctx.ranks(W, f"{ME}:ring_backward_harness", causal, layout, per_rank=shards,
                    rules=kv_rules(shards[0], W, accumulators=True))
    judge_ring_backward(res.values, res.trace, inputs, causal, layout, W, truth=truth, **kw)
    judge_inputs_kept(res.values, shards, ("dout", "q", "k", "v", "out", "lse"))
    return res


@RING_BWD.check("one rank (W=1): the gradients of full attention, causal and not", timeout=RANKS_TIMEOUT,
                requires_value=True)
def _(ctx):
    for causal in (False, True):
        _run(ctx, 1, bwd_inputs(2, 2, 8, 8, seed=501), causal, "contiguous")


@RING_BWD.check("W=2 contiguous, non-causal and causal, float64", timeout=RANKS_TIMEOUT)
def _(ctx):
    for causal in (False, True):
        _run(ctx, 2, bwd_inputs(2, 3, 12, 8, seed=502), causal, "contiguous")


@RING_BWD.check("W=3 and W=4 contiguous, causal and not: every block's dK/dV reach its owner", points=2,
                timeout=RANKS_TIMEOUT)
def _(ctx):
    for W in (3, 4):
        for causal in (True, False):
            _run(ctx, W, bwd_inputs(1, 2, 4 * W, 8, seed=503 + W), causal, "contiguous")


@RING_BWD.check("zigzag causal on W=2, 3, 4 (and non-causal on W=3)", points=2, timeout=RANKS_TIMEOUT)
def _(ctx):
    for W in (2, 3, 4):
        _run(ctx, W, bwd_inputs(1, 2, 4 * W, 8, seed=510 + W), True, "zigzag")
    _run(ctx, 3, bwd_inputs(1, 2, 12, 8, seed=514), False, "zigzag")


@RING_BWD.check("striped causal on W=3 and W=4", timeout=RANKS_TIMEOUT)
def _(ctx):
    for W in (3, 4):
        _run(ctx, W, bwd_inputs(1, 2, 3 * W, 8, seed=520 + W), True, "striped")


@RING_BWD.check("odd local lengths (n = 5, 7): contiguous and striped, causal", timeout=RANKS_TIMEOUT)
def _(ctx):
    _run(ctx, 3, bwd_inputs(1, 2, 15, 8, seed=525), True, "contiguous", words="W=3, contiguous, causal, n=5")
    _run(ctx, 2, bwd_inputs(2, 1, 14, 4, seed=526), True, "striped", words="W=2, striped, causal, n=7")


@RING_BWD.check("large logits (scores ~ ±50, where a naive exp overflows): float64 and float32",
                timeout=RANKS_TIMEOUT)
def _(ctx):
    _run(ctx, 4, bwd_inputs(1, 2, 16, 16, seed=530, q_scale=50.0), True, "zigzag",
         words="W=4, zigzag, causal, scores ~ ±50")
    _run(ctx, 4, bwd_inputs(1, 2, 16, 16, seed=531, q_scale=50.0, dtype=torch.float32), True, "contiguous",
         atol=1e-3, rtol=1e-4, words="W=4, contiguous, causal, float32, scores ~ ±50")


def fresh_case(rng: random.Random) -> dict[str, Any]:
    """A shape drawn from ``rng``: W, layout, local length (odd where the layout allows), heads, causal.
    W is 3 or 4: W ≤ 2 has checks of its own, and on two ranks any exchange of K/V is the ring."""
    W, layout = rng.choice((3, 4)), rng.choice(LAYOUTS)
    n = rng.randint(2, 6)
    if layout == "zigzag" and n % 2:
        n += 1
    return {"W": W, "layout": layout, "S": n * W, "B": rng.randint(1, 2), "H": rng.randint(1, 3),
            "D": rng.choice((4, 8, 16)), "causal": rng.random() < 0.7}


def _fresh_run(ctx, c: dict, seed: int, *, H_kv: int | None = None, dtype=torch.float64, q_scale: float = 1.0,
               **kw):
    words = (f"W={c['W']}, {c['layout']}, {'causal' if c['causal'] else 'non-causal'}, S={c['S']}, "
             f"B={c['B']}, H={c['H']}" + (f", H_kv={H_kv}" if H_kv else "") + f", D={c['D']}, {dtype}"
             + (f", scores ~ ±{q_scale:g}" if q_scale != 1 else ""))
    inputs = bwd_inputs(c["B"], c["H"], c["S"], c["D"], seed, H_kv=H_kv, q_scale=q_scale, dtype=dtype)
    _run(ctx, c["W"], inputs, c["causal"], c["layout"], words=words, **kw)


@RING_BWD.check("shapes drawn from the seed (W, layout, length, heads): new ones for every autograder run",
                timeout=RANKS_TIMEOUT)
def _(ctx):
    rng = random.Random(ctx.seed(540))
    for i in range(2):
        _fresh_run(ctx, fresh_case(rng), 541 + 4 * i)


# ----------------------------------------------------------------------------------------------
# How: the messages (counted by the grader: points), and the blocks computed (feedback only)


def judge_backward_messages(comm: list, W: int, n: int, Hkv: int, D: int) -> None:
    """From the referee's log (kept in the runner): rank r sends only to r+1, K/V W−1 hops and the
    dK/dV accumulators W−1 hops, (W−1)·2·n·H·D elements of each."""
    kv = (W - 1) * 2 * n * Hkv * D
    for r in range(W):
        sent = ring_sent(comm, r, W, "K/V and the dK/dV accumulators")
        if sent == kv:
            raise CheckFailed(f"rank {r} sent {sent} elements: K and V, W−1 times, and nothing else. The dK/dV "
                              f"shares of the blocks it visited belong to their owners: they travel too "
                              f"((W−1)·2·n·H·D = {kv} elements more).")
        if sent != 2 * kv:
            too_many = sent == kv + kv * W // (W - 1)
            hint = " — one hop too many: after W−1 hops each accumulator is home." if too_many else ""
            raise CheckFailed(f"rank {r} sent {sent} elements; the ring backward sends K/V W−1 times and the dK/dV "
                              f"accumulators W−1 times: {kv} + {kv} = {2 * kv} (n={n}, H_kv={Hkv}, D={D}){hint}.")


@RING_BWD.check("K/V and the dK/dV accumulators travel forward: rank r sends (W−1)·2·n·H·D elements of each to r+1"
                " (counted by the grader)", timeout=RANKS_TIMEOUT)
def _(ctx):
    W, S, Hh, D = 4, 16, 2, 8
    res = _run(ctx, W, bwd_inputs(1, Hh, S, D, seed=550), False, "contiguous")
    judge_backward_messages(res.comm, W, S // W, Hh, D)


@RING_BWD.check("memory: a rank holds its own K/V, the block in flight and its accumulators, never every rank's "
                "(W=12; the grader caps each rank's memory)", timeout=60)
def _(ctx):
    from .ring import MEMORY_SHAPE, MEMORY_W, memory_case, out_of_memory
    seeds, u, (dout, q, k, v), block = memory_case(ctx, 560, causal=True, count=4)
    W, n = MEMORY_W, MEMORY_SHAPE[2]
    truth = grad_truth(q, k, v, dout, True)
    rows = [slice(r * n, (r + 1) * n) for r in range(W)]
    mine = [(s, truth["out"][..., rows[r], :].contiguous(), truth["lse"][..., rows[r]].contiguous(), u)
            for r, s in enumerate(seeds)]
    try:
        res = ctx.ranks(W, f"{ME}:ring_backward_memory_harness", True, MEMORY_SHAPE, per_rank=mine,
                        rules=kv_rules((q[..., :n, :],) * 3, W, accumulators=True),
                        memory_cap=BACKWARD_CAP_BLOCKS * block)
    except CheckFailed as e:
        words = out_of_memory(str(e), BACKWARD_CAP_BLOCKS, "K/V, dK/dV accumulators")
        raise CheckFailed(str(e) + (f"\n    Likely mistake: {words}" if words else "")) from None
    for r, got in enumerate(res.values):
        ctx.expect("bad_return" not in got, f"ring_attention_backward must return (dq, dk, dv); rank {r} returned "
                   f"{got.get('bad_return')}.")
        for name in ("dq", "dk", "dv"):
            ctx.compare(got[f"{name}_u"], truth[name][..., r * n:(r + 1) * n, :] @ u,
                        f"{name} (projected on a probe vector)", rank=r, world_size=W, atol=1e-8, rtol=1e-7,
                        case="W=12, contiguous, causal, head dim 1024")


# the ring backward needs 25-28 blocks more during the call (measured, W = 12, freed blocks given back:
# the reference and a learner's); one that keeps every rank's K/V and computes every share at once, 65-72
BACKWARD_CAP_BLOCKS = 44


def judge_backward_skipping(values: list[Any], W: int, n: int, trace: list[dict] = ()) -> None:
    """Contiguous causal: rank r computes the backward of r+1 blocks (none of later ranks) — counted
    from the block-backward calls of the learner's module, or else from its trace's compute events."""
    for r in range(W):
        count = len(values[r].get("calls") or []) or sum(
            1 for e in trace if e["op"] == "compute" and e["rank"] == r and e.get("meta", {}).get("what") == "attn_bwd")
        if not count:
            raise CheckFailed("could not see your block computations: compute each block's share with "
                              "attention_block_backward (or its _explicit twin) so the grader can count them.")
        if count > r + 1:
            raise CheckFailed(f"rank {r} made {count} block-backward calls; with contiguous causal sharding it "
                              f"needs {r + 1} (the blocks of ranks 0..{r}): the K/V of later ranks are entirely in "
                              "the future of its queries, so their shares are zero. Skip fully masked blocks — but "
                              "keep passing K/V and the accumulators on.")


@RING_BWD.check("fully masked blocks are skipped in the backward too (contiguous causal, W=4)"
                " (trace; feedback only, no points)", points=0, timeout=RANKS_TIMEOUT)
def _(ctx):
    W, S = 4, 16
    res = _run(ctx, W, bwd_inputs(1, 2, S, 8, seed=560), True, "contiguous")
    judge_backward_skipping(res.values, W, S // W, res.trace)


# Hints in tiers: the stub's error shows tier 1; ``hint("5a.5")`` shows the next one each call.
HINTS = {
    "5a.5": [
        "Q, dO, O and lse stay on their rank; K/V go round the ring again, as in your forward. A rank's share of "
        "dK/dV for a block belongs to the block's OWNER, not to the rank that computed it: how does it get home?",
        "The given attention_block_backward(dout, q, k, v, out, lse, causal=) returns one block's share of (dq, dk, "
        "dv) when it gets the rows' FINAL out and lse (never a block's own), and the given block_plan(r, j, W, "
        "layout, causal, n) says which rows of Q and K a block uses (empty: skip it). dQ is just the sum of its "
        "shares. Keep your share of your own block (step 0) aside; from step 1 on, an accumulator of dK/dV (zeros, "
        "float32 or wider) travels one step behind K/V: each rank adds its share and sends it on to r+1.",
        "The most explicit (a sketch, not the code). For s = 0..W−1 with j = (r − s) mod W: post the next K/V hop "
        "(not on the last step); for each piece of block_plan call the block backward on the piece's rows, add its "
        "dq into those rows of dQ and remember (the piece's K rows, dk, dv). Step 0: that is your own share. Step "
        "1: start zero accumulators; step ≥ 2: wait for the accumulator rank r−1 sent at the previous step (swap "
        "buffers as for K/V). Add your share into its K rows and post it to r+1 — W−1 accumulator hops, steps 1.."
        "W−1. After the loop, wait for the last hop: it brings your own block's accumulator home; add your step-0 "
        "share and return everything in the inputs' dtypes.",
    ],
}
