"""Checks for exercise 5a.3 ring_attention_forward: Q stays, K/V travel the ring."""
from __future__ import annotations

from typing import Any

import torch

from ...core import CheckFailed, exercise
from ...feedback import Mismatch, compare
from ...referee import SEND, rules
from .common import ME, RANKS_TIMEOUT, _randn, attention, layout_positions

RING = exercise("5a.3", "Ring attention forward", "sequence", ["ring_attention_forward"], comm=("p2p",), ring=True,
                mirrors=("reference.sequence.blockwise:blockwise_attention",))


def kv_rules(shard: tuple, W: int, hops: int = 1, accumulators: bool = False) -> dict:
    """The referee's rules for a ring attention call on ``W`` ranks, ``shard`` = one rank's (q, k, v, …):
    one message carries at most one rank's K/V block (K and V, or dK and dV, alone or stacked);
    ``hops``·(W−1) hops of K/V (+ as many of dK/dV ``accumulators``), two messages each."""
    q, k, v = shard[-3:] if len(shard) == 3 else shard[1:4]
    block = k.numel() + v.numel()
    kinds = 2 if accumulators else 1
    what = "K/V, then the dK/dV accumulators," if accumulators else "K/V"
    return rules(max_elems=block, max_sends=2 * kinds * (W - 1), max_total=kinds * (W - 1) * block,
                 block=f"one rank's K/V block ({k.numel()} + {v.numel()} elements)",
                 why=f"In the ring {what} move one hop per step, W−1 hops: a rank never sends its Q, and never "
                     "more than one block at a time.")


def judge_inputs_kept(values: list, shards: list, names: tuple[str, ...]) -> None:
    """The learner's ring left every input tensor as it was sent."""
    for r, (res, sent) in enumerate(zip(values, shards)):
        after = res.get("inputs") if isinstance(res, dict) else None
        if after is None:
            continue
        for name, a, b in zip(names, after, sent):
            if not (isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)):
                raise CheckFailed(f"your ring changed its input {name} on rank {r}: the inputs must be left as they "
                                  "were (receive into buffers of your own; never into the caller's k and v).")


# Wrong causal rules a learner's ring may follow, as block masks: (rank r's queries, rank j's keys)
# → boolean (n, n) over local indices.  ``truth`` is causality on global positions.


def block_keep(rule: str, layout: str, S: int, W: int, r: int, j: int) -> torch.Tensor:
    qp = torch.tensor(layout_positions(S, r, W, layout))
    kp = torch.tensor(layout_positions(S, j, W, layout))
    truth = kp[None, :] <= qp[:, None]
    n = qp.numel()
    local_causal = torch.ones(n, n, dtype=torch.bool).tril()
    if rule == "truth":
        return truth
    if rule == "causal_every_block":
        return local_causal
    if rule == "no_mask":
        return torch.ones(n, n, dtype=torch.bool)
    if rule == "diag_unmasked":
        return torch.ones(n, n, dtype=torch.bool) if j == r else truth
    if rule == "diag_skipped":
        return torch.zeros(n, n, dtype=torch.bool) if j == r else truth
    if rule == "contiguous_rules":
        return (torch.ones(n, n, dtype=torch.bool) if j < r else local_causal if j == r
                else torch.zeros(n, n, dtype=torch.bool))
    if rule == "reversed":
        return (torch.ones(n, n, dtype=torch.bool) if j > r else local_causal if j == r
                else torch.zeros(n, n, dtype=torch.bool))
    if rule == "striped_inclusive":
        return local_causal if layout == "striped" else truth
    raise ValueError(rule)


RULE_WORDS = {
    "causal_every_block": ("your output is what you get when EVERY block gets the causal mask (causal=True at every "
                           "step): only a block whose keys sit where its queries sit is causal — on the diagonal "
                           "(your own K/V, step 0). The given block_plan(r, j, W, layout, causal, n) says, for the "
                           "block of rank j, which rows of Q and K to compute and whether with the causal mask "
                           "(contiguous: earlier ranks full, later ranks skipped)."),
    "no_mask": "your output is non-causal attention: causal=True was ignored.",
    "diag_unmasked": ("your output is what you get when each rank's own K/V block (step 0, the diagonal) is "
                      "not masked: that block needs the causal mask (attention_block(..., causal=True)): "
                      "local query i sees local keys t ≤ i."),
    "diag_skipped": ("your output is what you get when each rank's own K/V block (step 0, the diagonal) is "
                     "skipped: compute it with the causal mask; only blocks entirely in the future are skipped."),
    "contiguous_rules": ("your output follows the contiguous layout's rule (earlier rank: all keys, same rank: "
                         "causal, later rank: none) on {layout} shards. The causal diagonal sits elsewhere for "
                         "this layout: zigzag rank r holds chunks r and 2W−1−r, so a block from rank j < r is "
                         "seen by both query chunks (keys of chunk j only) and a block from j > r only by the "
                         "second query chunk (all its keys); striped: a block from j > r is strictly causal."),
    "reversed": ("your output is what you get when each rank attends to the blocks of LATER ranks: at step s "
                 "rank r holds the K/V of rank (r − s) mod W (earlier ranks first), and those are the visible "
                 "ones. Did K/V go the wrong way round the ring, or is j = (r + s) mod W?"),
    "striped_inclusive": ("with the striped layout a block from a later rank j > r is STRICTLY causal: token "
                          "a·W + r sees a·W + j only when j ≤ r, so shift the mask by one (q[1:] against "
                          "k[:-1] with causal=True) — yours includes the diagonal."),
}


def same_as_another(rule: str, layout: str) -> bool:
    """Whether ``rule`` gives, on ``layout``, the masks of a rule with more precise words: the contiguous
    rule on contiguous shards is the truth; on striped shards the causal mask on every block is exactly
    the mask including the diagonal on later ranks (striped_inclusive, which says how to fix it)."""
    return (rule, layout) in {("contiguous_rules", "contiguous"), ("causal_every_block", "striped")}


def ring_truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, W: int,
               rule: str = "truth") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank (out, lse) of global attention under ``rule``'s mask, rows in ``layout`` order."""
    S = q.shape[-2]
    pos = [layout_positions(S, r, W, layout) for r in range(W)]
    keep = torch.zeros(S, S, dtype=torch.bool)
    for r in range(W):
        for j in range(W):
            blk = block_keep(rule, layout, S, W, r, j) if causal else torch.ones(len(pos[r]), len(pos[j]),
                                                                                  dtype=torch.bool)
            keep[torch.tensor(pos[r])[:, None], torch.tensor(pos[j])[None, :]] = blk
    out, lse = attention(q, k, v, keep)
    return [(out[..., pos[r], :], lse[..., pos[r]]) for r in range(W)]


def ring_inputs(B: int, Hh: int, S: int, D: int, seed: int, scale: float = 1.0, dtype=torch.float64):
    return (_randn((B, Hh, S, D), seed, scale, dtype), _randn((B, Hh, S, D), seed + 1, scale, dtype),
            _randn((B, Hh, S, D), seed + 2, 1.0, dtype))


def shard_inputs(qkv, W: int, layout: str) -> list[tuple[torch.Tensor, ...]]:
    S = qkv[0].shape[-2]
    return [tuple(t[..., layout_positions(S, r, W, layout), :].contiguous() for t in qkv) for r in range(W)]


def _peers(trace: list[dict], op: str, rank: int) -> set[int]:
    return {e["peer"] for e in trace if e["op"] == op and e["rank"] == rank and e.get("peer") is not None}


def ring_direction(m: Mismatch) -> str | None:
    r, W, got = m.rank, m.world_size, m.extra.get("recv_peers")
    if got and W and W > 2 and got == {(r + 1) % W}:
        return (f"K/V came from rank {(r + 1) % W} = r+1: the ring runs the other way. Send to r+1 and "
                "receive from r−1 (comm.ring_peers gives (next, prev)), so at step s rank r holds the K/V of "
                "rank (r − s) mod W.")
    return None


def ring_wrong_rule(m: Mismatch) -> str | None:
    """The wrong causal rule the learner's output follows: of the rules it matches, the closest one (with
    large logits two masks can give nearly the same output; the nearest is the one the ring used)."""
    if not isinstance(m.got, torch.Tensor):
        return None
    best, best_err = None, float("inf")
    got = m.got.double()
    for rule, alt in m.extra.get("alternatives", {}).items():
        if alt.shape == got.shape and torch.allclose(got, alt, atol=1e-7, rtol=1e-6, equal_nan=True) \
                and not torch.allclose(alt, m.expected.double(), atol=1e-7, rtol=1e-6, equal_nan=True):
            err = float(torch.nan_to_num((got - alt).abs(), nan=0.0).max())
            if err < best_err:
                best, best_err = rule, err
    return RULE_WORDS[best].format(layout=m.extra.get("layout")) if best else None


def judge_ring(values: list[Any], trace: list[dict], qkv, causal: bool, layout: str, W: int, *,
               atol: float = 1e-9, rtol: float = 1e-7, words: str = "") -> None:
    """Compare each rank's (out, lse) with float64 full attention; name a wrong causal rule or direction."""
    words = words or f"W={W}, {layout}, {'causal' if causal else 'non-causal'}"
    truth = ring_truth(*qkv, causal, layout, W)
    rules = [x for x in RULE_WORDS if causal and not same_as_another(x, layout)]
    alts = {rule: ring_truth(*qkv, causal, layout, W, rule) for rule in rules}
    for r in range(W):
        res = values[r]
        if "bad_return" in res:
            raise CheckFailed(f"ring_attention_forward must return (out, lse); rank {r} returned "
                              f"{res['bad_return']} [{words}].")
        for i, what in enumerate(("out", "lse")):
            extra = {"alternatives": {rule: alt[r][i].double() for rule, alt in alts.items()},
                     "recv_peers": _peers(trace, "recv", r), "layout": layout}
            msg = compare(res[what], truth[r][i], what, rank=r, world_size=W, atol=atol, rtol=rtol, case=words,
                          detectors=[ring_direction, ring_wrong_rule], extra=extra)
            if msg:
                if what == "lse" and compare(res["out"], truth[r][0], "out", atol=atol, rtol=rtol) is None:
                    msg += ("\n    (out is right but lse is not: return the merged lse of all blocks — the "
                            "backward pass and any further merge need it.)")
                raise CheckFailed(msg)


def _ring_run(ctx, W: int, qkv, causal: bool, layout: str, **kw):
    shards = shard_inputs(qkv, W, layout)
    res = ctx.ranks(W, f"{ME}:ring_harness", causal, layout, per_rank=shards, rules=kv_rules(shards[0], W))
    judge_ring(res.values, res.trace, qkv, causal, layout, W, **kw)
    judge_inputs_kept(res.values, shards, ("q", "k", "v"))
    return res


@RING.check("one rank (W=1) gives full attention, causal and not", timeout=RANKS_TIMEOUT, requires_value=True)
def _(ctx):
    for causal in (False, True):
        _ring_run(ctx, 1, ring_inputs(2, 2, 8, 8, seed=301), causal, "contiguous")


@RING.check("W=2 contiguous, non-causal and causal, float64", timeout=RANKS_TIMEOUT)
def _(ctx):
    for causal in (False, True):
        _ring_run(ctx, 2, ring_inputs(2, 3, 12, 8, seed=302), causal, "contiguous")


@RING.check("W=3 and W=4 contiguous, causal and not (K/V must arrive from rank r−1)", points=2, timeout=RANKS_TIMEOUT)
def _(ctx):
    for W in (3, 4):
        for causal in (True, False):
            _ring_run(ctx, W, ring_inputs(1, 2, 4 * W, 8, seed=303 + W), causal, "contiguous")


@RING.check("zigzag causal on W=2, 3, 4 (and non-causal on W=3)", points=2, timeout=RANKS_TIMEOUT)
def _(ctx):
    for W in (2, 3, 4):
        _ring_run(ctx, W, ring_inputs(1, 2, 4 * W, 8, seed=310 + W), True, "zigzag")
    _ring_run(ctx, 3, ring_inputs(1, 2, 12, 8, seed=314), False, "zigzag")


@RING.check("striped causal on W=3 and W=4", timeout=RANKS_TIMEOUT)
def _(ctx):
    for W in (3, 4):
        _ring_run(ctx, W, ring_inputs(1, 2, 3 * W, 8, seed=320 + W), True, "striped")


@RING.check("large logits stay finite and accurate (×30 in float64; ×4 in float32)", timeout=RANKS_TIMEOUT)
def _(ctx):
    _ring_run(ctx, 4, ring_inputs(1, 2, 16, 16, seed=330, scale=30.0), True, "zigzag",
              words="W=4, zigzag, causal, large logits ×30")
    _ring_run(ctx, 4, ring_inputs(1, 2, 16, 16, seed=331, scale=4.0, dtype=torch.float32), True, "contiguous",
              atol=2e-4, rtol=1e-4, words="W=4, contiguous, causal, float32, large logits ×4")


def ring_sent(comm: list, r: int, W: int, what: str) -> int:
    """Elements rank ``r`` sent in the call, by the referee's log (kept in the runner, out of the
    learner's reach), after checking it sent something, to rank r+1 only."""
    sends = [(peer, k) for op, peer, k, ok in comm[r] if op == SEND and ok]
    if not sends:
        raise CheckFailed(f"rank {r} sent no point-to-point message: pass {what} round the ring with sends and "
                          "receives (comm.exchange or torch.distributed), not a collective such as all_gather.")
    peers = {peer for peer, _ in sends}
    if W > 2 and peers == {(r - 1) % W}:
        raise CheckFailed(f"rank {r} sent {what} to rank {(r - 1) % W} (r−1): the ring runs the other way. Send to "
                          "r+1 and receive from r−1, so that at step s rank r holds the K/V of rank (r − s) mod W "
                          "(comm.ring_peers gives (next, prev)).")
    if peers != {(r + 1) % W}:
        raise CheckFailed(f"rank {r} sent to ranks {sorted(peers)}; in the ring it sends only to rank {(r + 1) % W} "
                          f"— {what} alike.")
    return sum(k for _, k in sends)


def judge_ring_messages(comm: list, W: int, n: int, Hkv: int, D: int) -> None:
    """Every rank sent K and V W−1 times — (W−1)·2·n·H·D elements — to rank r+1 only."""
    want = (W - 1) * 2 * n * Hkv * D
    for r in range(W):
        sent = ring_sent(comm, r, W, "K/V")
        if sent != want:
            hint = (" — one hop too many: after W−1 hops every rank has seen every block, so the last step "
                    "sends nothing." if sent == want * W // (W - 1) else "")
            raise CheckFailed(f"rank {r} sent {sent} elements; the ring forward sends K and V W−1 times: "
                              f"(W−1)·2·n·H·D = {W - 1}·2·{n}·{Hkv}·{D} = {want}{hint}.")


@RING.check("K/V travel forward: rank r sends (W−1)·2·n·H·D elements to r+1 only (counted by the grader)",
            timeout=RANKS_TIMEOUT)
def _(ctx):
    W, S, Hh, D = 4, 16, 2, 8
    res = _ring_run(ctx, W, ring_inputs(1, Hh, S, D, seed=340), False, "contiguous")
    judge_ring_messages(res.comm, W, S // W, Hh, D)


# ----------------------------------------------------------------------------------------------
# Memory: what the ring is for.  Its messages are those of relaying every block round the ring and
# keeping them all, so only the memory a rank holds tells the two apart: W = 12 ranks, a cap on what
# each may map during the call (set by the runner, out of the rank's reach) that the ring fits with
# room to spare and a rank holding every K/V block does not.  The harness first makes malloc give freed
# blocks back (rank_program.return_freed_memory), so what a rank maps is what it holds: measured, the
# reference and a learner's ring need 13-16 blocks, a ring that keeps every block 31-36.  (With the
# allocator keeping freed blocks, a learner's honest backward once mapped past its cap on a busy CI run.)

MEMORY_W, MEMORY_SHAPE, MEMORY_CAP_BLOCKS = 12, (1, 4, 32, 1024), 25


def memory_case(ctx, seed: int, causal: bool, count: int = 3):
    """(per-rank seeds, probe vector, the full inputs rebuilt here from the seeds, a block's bytes)."""
    from ...harness.sequence import _shard_from_seed
    W, shape = MEMORY_W, MEMORY_SHAPE
    seeds = [ctx.seed(1000 * seed + 1 + r) for r in range(W)]
    u = _randn((shape[-1],), seed)
    shards = [_shard_from_seed(s, shape, count) for s in seeds]
    full = [torch.cat([sh[i] for sh in shards], dim=-2) for i in range(count)]
    return seeds, u, full, shape[0] * shape[1] * shape[2] * shape[3] * 8


def out_of_memory(err: str, cap_blocks: int, what: str) -> str | None:
    """The words for a rank that ran out of its memory cap in the memory check."""
    if "can't allocate memory" in err or "MemoryError" in err or "Cannot allocate memory" in err:
        return (f"a rank ran out of memory: here each rank may hold about {cap_blocks} K/V blocks of working memory "
                f"at once, and the ring needs far fewer — its own {what} and the block in flight. A rank that keeps "
                "every rank's K/V (relayed round the ring, or gathered) needs 2W blocks and does not fit: compute "
                "each block as it arrives, merge it into the running result, and pass it on.")
    return None


@RING.check("memory: a rank holds its own K/V and the block in flight, never every rank's (W=12; the grader caps "
            "each rank's memory)", timeout=60)
def _(ctx):
    from ...core import CheckFailed as Failed
    seeds, u, (q, k, v), block = memory_case(ctx, 360, causal=True)
    W = MEMORY_W
    try:
        res = ctx.ranks(W, f"{ME}:ring_memory_harness", True, MEMORY_SHAPE, per_rank=[(s, u) for s in seeds],
                        rules=kv_rules((q[..., :MEMORY_SHAPE[2], :],) * 3, W),
                        memory_cap=MEMORY_CAP_BLOCKS * block)
    except Failed as e:
        words = out_of_memory(str(e), MEMORY_CAP_BLOCKS, "K/V")
        raise Failed(str(e) + (f"\n    Likely mistake: {words}" if words else "")) from None
    truth = ring_truth(q, k, v, True, "contiguous", W)
    for r, got in enumerate(res.values):
        ctx.expect("bad_return" not in got, f"ring_attention_forward must return (out, lse); rank {r} returned "
                   f"{got.get('bad_return')}.")
        ctx.compare(got["out_u"], truth[r][0] @ u, "out (projected on a probe vector)", rank=r, world_size=W,
                    atol=1e-8, rtol=1e-7, case="W=12, contiguous, causal, head dim 1024")
        ctx.compare(got["lse"], truth[r][1], "lse", rank=r, world_size=W, atol=1e-9, rtol=1e-7,
                    case="W=12, contiguous, causal, head dim 1024")


def judge_skipping(values: list[Any], trace: list[dict], W: int, n: int) -> None:
    """Contiguous causal: rank r computes r+1 blocks (none from later ranks): c²·r + c(c+1)/2 pairs."""
    for r in range(W):
        calls = values[r].get("calls") or []
        if calls:
            count, how = len(calls), "attention-kernel calls"
        else:
            count = sum(1 for e in trace if e["op"] == "compute" and e["rank"] == r)
            how = "compute events"
            if count == 0:
                raise CheckFailed("could not see your block computations: compute each block with "
                                  "attention_block (or attention_block_explicit) so the grader can count them.")
        if count > r + 1:
            raise CheckFailed(f"rank {r} made {count} {how}; with contiguous causal sharding it needs {r + 1} "
                              f"(the blocks of ranks 0..{r}): the K/V of later ranks are entirely in the "
                              "future of its queries. Skip fully masked blocks instead of computing and "
                              f"discarding them — rank {r} should compute {n * n * r + n * (n + 1) // 2} "
                              f"pairs = c²·r + c(c+1)/2 (c = {n}).")


@RING.check("fully masked blocks are skipped, not computed and thrown away (contiguous causal, W=4)"
            " (trace; feedback only, no points)", points=0, timeout=RANKS_TIMEOUT)
def _(ctx):
    W, S = 4, 16
    res = _ring_run(ctx, W, ring_inputs(1, 2, S, 8, seed=350), True, "contiguous")
    judge_skipping(res.values, res.trace, W, S // W)


# Hints in tiers: the stub's error shows tier 1; ``hint("5a.3")`` shows the next one each call.
HINTS = {
    "5a.3": [
        "At step s rank r holds the K/V block of rank (r - s) mod W; K/V move one rank forward per step, queries "
        "never move. Post the next hop before computing the current block, and merge each block into a running "
        "(out, lse) with your 5a.1. With causal=True, the given block_plan says what part of each block to compute.",
        "comm.ring_peers(group) gives (next, previous). Each step: comm.exchange([(k_cur, nxt), (v_cur, nxt)], "
        "[(k_buf, prv), (v_buf, prv)], group=group, step=s, what='kv') (not on the last step), compute, then "
        ".wait() and swap buffers. Never a blocking send then recv: on a ring every rank would wait for the next.",
        "Causal: a block is full, causal (diagonal included), strictly causal or skipped, depending on the global "
        "positions of your queries and of rank j's keys. The given block_plan(r, j, W, layout, causal, n) works it "
        "out for every layout: for each piece it returns, call the kernel on rows piece.q of Q and piece.k of the "
        "held K/V with causal=piece.causal, and merge into rows piece.q; an empty plan means skip the block (no "
        "kernel call). Accumulate in float32 or wider and return (out in q's dtype, lse).",
    ],
}
