"""Checks for lecture 0 (ring all-reduce, ring all-gather).

The ring is the exercise, so it is enforced while these are graded (``ring=True``): a rank may send
only to rank r+1 and receive only from rank r−1, and the referee (:mod:`..referee`, in the runner)
refuses a message of more than one chunk, or more messages or elements than the ring sends
(:func:`ring_rules`).  Every value check runs under those rules: gathering every rank's tensor
(directly or relayed round the ring) is refused before it can produce a value.
"""
from __future__ import annotations

import torch

from reference.collectives import chunk_bounds

from ..core import CheckFailed, exercise, salted_seed
from ..feedback import Mismatch
from ..referee import SEND, rules

H = "exercises.grading.harness"

ALL_REDUCE = exercise("0.1", "Ring all-reduce from send/recv", "collectives",
                      ["ring_reduce_scatter", "ring_all_reduce"], comm=("p2p",), ring=True)
ALL_GATHER = exercise("0.2", "Ring all-gather from send/recv", "collectives", ["ring_all_gather"], comm=("p2p",),
                      ring=True)


def ring_rules(numel: int, W: int, passes: int) -> dict:
    """The referee's rules for one ring collective of ``numel`` elements on ``W`` ranks: every message
    one chunk (at most ⌈numel/W⌉ elements), ``passes``·(W−1) of them per rank (a reduce-scatter or an
    all-gather is one pass, an all-reduce two)."""
    chunk = -(-numel // W)
    name = {1: "one pass round the ring", 2: "a reduce-scatter then an all-gather"}[passes]
    return rules(max_elems=chunk, max_sends=passes * (W - 1), max_total=passes * (W - 1) * chunk,
                 block=f"one chunk ({chunk} elements: {numel} cut {W} ways)",
                 why=f"The ring's pattern is {name}: N−1 steps each, one chunk to the next rank per step "
                     f"({passes}·(N−1) = {passes * (W - 1)} messages on {W} ranks). Gathering the tensors — "
                     "directly or relayed round the ring — sends more, and is not what this exercise builds.")


def judge_input_kept(values: list, sent: list, what: str) -> list:
    """Each rank's value, after checking that its input tensor came back as it was sent."""
    out = []
    for r, (v, x) in enumerate(zip(values, sent)):
        if not isinstance(v, dict) or "inputs" not in v:
            raise CheckFailed(f"rank {r}: the grader got no answer from {what}.")
        after = v["inputs"][0]
        if not (isinstance(after, torch.Tensor) and after.shape == x.shape and torch.equal(after, x)):
            raise CheckFailed(f"{what} changed its input tensor on rank {r}: the input must be left as it was "
                              "(work on a copy, and return a new tensor) — the caller still needs it.")
        if v.get("aliases"):
            raise CheckFailed(f"{what} returned its input tensor itself on rank {r}: return a new tensor (a copy, "
                              "with one rank), so that the caller's input and the result are not one tensor.")
        out.append(v["value"])
    return out


def _inputs(world_size: int, shape, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(salted_seed(seed))
    return [torch.randn(shape, generator=g, dtype=torch.float64) * scale for _ in range(world_size)]


def only_own_chunk_summed(m: Mismatch) -> str | None:
    """Each rank's result matches the true sum on one chunk only: the all-gather half is missing."""
    xs, n = m.extra.get("inputs"), m.world_size
    if not xs or not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape:
        return None
    g, e = m.got.flatten(), m.expected.flatten()
    ok = [torch.allclose(g[a:b], e[a:b]) for a, b in chunk_bounds(g.numel(), n)]
    if sum(ok) == 1:
        return ("only one chunk holds the full sum: the reduce-scatter works, but the all-gather pass that "
                "hands the finished chunks round the ring is missing or wrong.")
    return None


def wrong_chunk_returned(m: Mismatch) -> str | None:
    """ring_reduce_scatter returned another chunk of the sum than (r+1) mod N (e.g. chunk r)."""
    total, r, n = m.extra.get("total"), m.rank, m.world_size
    if not isinstance(m.got, torch.Tensor) or total is None or r is None or not n:
        return None
    bounds = chunk_bounds(total.numel(), n)
    for c, (a, b) in enumerate(bounds):
        if c != (r + 1) % n and m.got.shape == (b - a,) and torch.allclose(m.got.double(), total[a:b].double()):
            return (f"rank {r} returned chunk {c} of the sum, which is complete, but the ring leaves rank r "
                    f"the full sum of chunk (r+1) mod N = {(r + 1) % n}: after N−1 steps the chunk a rank has just "
                    "finished adding is the one it received last. Check which chunk you return (and that you "
                    f"send chunk (r − s) mod N at step s)." if c == r else
                    f"rank {r} returned chunk {c} of the sum; the ring leaves rank r chunk (r+1) mod N = "
                    f"{(r + 1) % n}.")
    return None


def sum_of_two(m: Mismatch) -> str | None:
    xs, r = m.extra.get("inputs"), m.rank
    if not xs or m.world_size is None or m.world_size < 3 or not isinstance(m.got, torch.Tensor):
        return None
    n = m.world_size
    for other in ((r - 1) % n, (r + 1) % n):
        if torch.allclose(m.got, xs[r] + xs[other]):
            return f"rank {r} returned its own tensor plus rank {other}'s: one step instead of N-1 steps."
    return None


def _backwards(res, n: int) -> bool:
    return n >= 3 and all({e["peer"] for e in res.events("send", rank=r)} == {(r - 1) % n} for r in range(n))


def _compare_naming_direction(ctx, res, n: int, compare) -> None:
    """Run the value comparisons; if they fail and the trace shows a backwards ring, say so first
    (the trace only names the mistake here — the verdict is the values')."""
    try:
        compare()
    except CheckFailed as e:
        if _backwards(res, n):
            raise CheckFailed(BACKWARDS + "\n" + str(e)) from None
        raise


def _ring_direction(ctx, res, n: int) -> None:
    """Fail with the misconception by name if every rank sends to its previous rank (n >= 3)."""
    ctx.expect(not _backwards(res, n), BACKWARDS)


BACKWARDS = ("every rank sends to the previous rank: the ring runs the other way round. In this "
              "course data flows forward: rank r sends to r+1 and receives from r-1 (comm.ring_peers() gives "
              "(next, prev)); the chunk indices in the hints assume that direction.")


def _all_reduce_case(ctx, n: int, shape, seed: int, scale: float = 1.0, case: str = ""):
    xs = _inputs(n, shape, seed, scale)
    numel = xs[0].numel()
    res = ctx.ranks(n, f"{H}:call_per_rank", "ring_all_reduce", None, True, per_rank=[(x,) for x in xs],
                    rules=ring_rules(numel, n, 2))
    values = judge_input_kept(res.values, xs, "ring_all_reduce")
    want = torch.stack(xs).sum(0)

    def compare():
        for r in range(n):
            ctx.compare(values[r], want, "sum", rank=r, world_size=n, atol=1e-9 * scale, rtol=1e-9, case=case,
                        detectors=[only_own_chunk_summed, sum_of_two], extra={"inputs": xs, "input": xs[r]})
    _compare_naming_direction(ctx, res, n, compare)
    return res


@ALL_REDUCE.check("reduce-scatter leaves rank r the full sum of chunk (r+1) mod N (N = 3)")
def _(ctx):
    n = 3
    xs = _inputs(n, (10,), seed=6)
    res = ctx.ranks(n, f"{H}:call_per_rank", "ring_reduce_scatter", None, True, per_rank=[(x,) for x in xs],
                    rules=ring_rules(10, n, 1))
    values = judge_input_kept(res.values, xs, "ring_reduce_scatter")
    total = torch.stack(xs).sum(0)
    bounds = chunk_bounds(10, n)
    for r in range(n):
        a, b = bounds[(r + 1) % n]
        ctx.compare(values[r], total[a:b], f"chunk {(r + 1) % n} of the sum", rank=r, world_size=n,
                    atol=1e-12, rtol=1e-12, detectors=[wrong_chunk_returned], extra={"total": total})


@ALL_REDUCE.check("sums on 2 ranks")
def _(ctx):
    _all_reduce_case(ctx, 2, (6,), seed=1)


@ALL_REDUCE.check("sums on 3 ranks, 10 elements (not divisible by 3), 2-D shape kept", points=2)
def _(ctx):
    _all_reduce_case(ctx, 3, (2, 5), seed=2, case="numel 10, N=3")


@ALL_REDUCE.check("sums on 4 ranks, large values, input left unchanged")
def _(ctx):
    _all_reduce_case(ctx, 4, (3, 4), seed=3, scale=1e6, case="large values")


@ALL_REDUCE.check("a single rank returns a copy of its input", requires_value=True)
def _(ctx):
    _all_reduce_case(ctx, 1, (5,), seed=4)


@ALL_REDUCE.check("sums 64 elements on 4 ranks")
def _(ctx):
    _all_reduce_case(ctx, 4, (64,), seed=5)


def judge_sent(comm: list, W: int, want: int, words: str) -> None:
    """Every rank sent exactly ``want`` elements, to the next rank only (the referee's log)."""
    for r in range(W):
        sends = [(peer, n) for op, peer, n, ok in comm[r] if op == SEND and ok]
        total = sum(n for _, n in sends)
        if total != want:
            raise CheckFailed(f"rank {r} sent {total} elements in {len(sends)} message(s); {words} sends {want}.")
        if {peer for peer, _ in sends} - {(r + 1) % W}:
            raise CheckFailed(f"rank {r} sent to ranks {sorted({p for p, _ in sends})}; in a ring each rank sends "
                              f"only to the next one ({(r + 1) % W}).")


@ALL_REDUCE.check("sends exactly 2·(N-1)/N · n per rank, to the next rank only (counted by the grader; the "
                  "value checks enforce the ring's limits)", points=0)
def _(ctx):
    n, numel = 4, 64
    res = _all_reduce_case(ctx, n, (numel,), seed=5)
    _ring_direction(ctx, res, n)
    judge_sent(res.comm, n, 2 * (n - 1) * (numel // n), f"a ring all-reduce of {numel} values on {n} ranks "
               "(2·(N-1)/N·n)")


def _gather_case(ctx, n: int, numel: int, seed: int):
    full = _inputs(1, (numel,), seed)[0]
    bounds = chunk_bounds(numel, n)
    args = []
    for r in range(n):
        a, b = bounds[(r + 1) % n]
        args.append((full[a:b].clone(), numel))
    res = ctx.ranks(n, f"{H}:call_per_rank", "ring_all_gather", None, True, per_rank=args,
                    rules=ring_rules(numel, n, 1))
    values = judge_input_kept(res.values, [a[0] for a in args], "ring_all_gather")
    _compare_naming_direction(ctx, res, n, lambda: [
        ctx.compare(values[r], full, "gathered tensor", rank=r, world_size=n, atol=0, rtol=0) for r in range(n)])
    return res


@ALL_GATHER.check("gathers on 2 ranks")
def _(ctx):
    _gather_case(ctx, 2, 8, seed=11)


@ALL_GATHER.check("gathers on 3 ranks, 10 elements (uneven chunks)", points=2)
def _(ctx):
    _gather_case(ctx, 3, 10, seed=12)


@ALL_GATHER.check("gathers on 4 ranks")
def _(ctx):
    _gather_case(ctx, 4, 32, seed=13)


@ALL_GATHER.check("sends (N-1)/N · n per rank, to the next rank only (counted by the grader; the value checks "
                  "enforce the ring's limits)", points=0)
def _(ctx):
    n, numel = 4, 32
    res = _gather_case(ctx, n, numel, seed=13)
    _ring_direction(ctx, res, n)
    judge_sent(res.comm, n, (n - 1) * (numel // n), f"a ring all-gather of {numel} values on {n} ranks ((N-1)/N·n)")


# Hints in tiers: the stub's error shows tier 1; ``hint("0.1")`` shows the next one each call.
HINTS = {
    "0.1": [
        "A ring all-reduce is a reduce-scatter (N-1 steps: send a chunk right, add the one from the left) followed "
        "by an all-gather (N-1 steps: pass finished chunks round). Post each step's send and receive together.",
        "Cut tensor.flatten() into N chunks with torch.tensor_split and clone them (you add into them). At step s "
        "rank r sends chunk (r - s) % N to the next rank and adds what arrives from the previous one into chunk "
        "(r - s - 1) % N. comm.exchange([(chunk, nxt)], [(buffer, prv)]).wait() posts both at once.",
        "After N-1 steps rank r holds the complete sum of chunk (r + 1) % N: return it from ring_reduce_scatter. "
        "ring_all_reduce = your reduce-scatter, then your all-gather (exercise 0.2), reshaped to the input's shape; "
        "with one rank return a copy, and never modify the input.",
    ],
    "0.2": [
        "An all-gather on a ring: each rank starts with one finished chunk and, for N-1 steps, passes the chunk it "
        "got last to the next rank while receiving a new one from the previous rank.",
        "Make N empty chunk buffers of the sizes reference.collectives.chunk_bounds(numel, N) gives; yours goes at "
        "index (r + 1) % N (where the reduce-scatter left it).",
        "At step s send chunk (r + 1 - s) % N to the next rank and receive chunk (r - s) % N from the previous one "
        "(comm.exchange(...).wait()); finally torch.cat the N chunks.",
    ],
}
