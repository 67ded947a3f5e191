"""Checks for lecture 0 (ring all-reduce, ring all-gather)."""
from __future__ import annotations

import torch

from reference.collectives import chunk_bounds

from ..core import CheckFailed, exercise, salted_seed
from ..feedback import Mismatch

H = "exercises.grading.harness"

ALL_REDUCE = exercise("0.1", "Ring all-reduce from send/recv", "collectives",
                      ["ring_reduce_scatter", "ring_all_reduce"], comm=("p2p",))
ALL_GATHER = exercise("0.2", "Ring all-gather from send/recv", "collectives", ["ring_all_gather"], comm=("p2p",))


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


def _all_reduce_case(ctx, n: int, shape, seed: int, scale: float = 1.0, case: str = "") -> None:
    xs = _inputs(n, shape, seed, scale)
    res = ctx.ranks(n, f"{H}:call_per_rank", "ring_all_reduce", [(x,) for x in xs])
    want = torch.stack(xs).sum(0)

    def compare():
        for r in range(n):
            ctx.compare(res.values[r], want, "sum", rank=r, world_size=n, atol=1e-9 * scale, rtol=1e-9, case=case,
                        detectors=[only_own_chunk_summed, sum_of_two], extra={"inputs": xs, "input": xs[r]})
    _compare_naming_direction(ctx, res, n, compare)
    return res


@ALL_REDUCE.check("reduce-scatter leaves rank r the full sum of chunk (r+1) mod N (N = 3)")
def _(ctx):
    n = 3
    xs = _inputs(n, (10,), seed=6)
    res = ctx.ranks(n, f"{H}:call_per_rank", "ring_reduce_scatter", [(x,) for x in xs])
    total = torch.stack(xs).sum(0)
    bounds = chunk_bounds(10, n)
    for r in range(n):
        a, b = bounds[(r + 1) % n]
        ctx.compare(res.values[r], total[a:b], f"chunk {(r + 1) % n} of the sum", rank=r, world_size=n,
                    atol=1e-12, rtol=1e-12)


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


@ALL_REDUCE.check("sends exactly 2·(N-1)/N · n bytes per rank, to the next rank only (trace; feedback only, no points)",
                  points=0)
def _(ctx):
    n, numel = 4, 64
    res = _all_reduce_case(ctx, n, (numel,), seed=5)
    _ring_direction(ctx, res, n)
    want = 2 * (n - 1) * (numel // n) * 8
    sent = {r: 0 for r in range(n)}
    peers: dict[int, set] = {r: set() for r in range(n)}
    for e in res.events("send"):
        sent[e["rank"]] += e["nbytes"]
        peers[e["rank"]].add(e["peer"])
    ctx.expect(any(sent.values()), "no sends were recorded: use reference.comm (or torch.distributed) "
               "point-to-point messages, not a library all_reduce.")
    for r in range(n):
        ctx.expect(sent[r] == want, f"rank {r} sent {sent[r]} bytes; a ring all-reduce of {numel} float64 values "
                   f"on {n} ranks sends 2·(N-1)/N·n = {want} bytes per rank.")
        ctx.expect(peers[r] == {(r + 1) % n}, f"rank {r} sent to ranks {sorted(peers[r])}; in a ring each rank "
                   f"sends only to the next one ({(r + 1) % n}).")


def _gather_case(ctx, n: int, numel: int, seed: int):
    full = _inputs(1, (numel,), seed)[0]
    bounds = chunk_bounds(numel, n)
    args = []
    for r in range(n):
        a, b = bounds[(r + 1) % n]
        args.append((full[a:b].clone(), numel))
    res = ctx.ranks(n, f"{H}:call_per_rank", "ring_all_gather", args)
    _compare_naming_direction(ctx, res, n, lambda: [
        ctx.compare(res.values[r], full, "gathered tensor", rank=r, world_size=n, atol=0, rtol=0) for r in range(n)])
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


@ALL_GATHER.check("sends (N-1)/N · n bytes per rank, to the next rank only (trace; feedback only, no points)", points=0)
def _(ctx):
    n, numel = 4, 32
    res = _gather_case(ctx, n, numel, seed=13)
    _ring_direction(ctx, res, n)
    want = (n - 1) * (numel // n) * 8
    for r in range(n):
        sent = sum(e["nbytes"] for e in res.events("send", rank=r))
        peers = {e["peer"] for e in res.events("send", rank=r)}
        ctx.expect(sent == want, f"rank {r} sent {sent} bytes; a ring all-gather sends (N-1)/N·n = {want}.")
        ctx.expect(peers == {(r + 1) % n}, f"rank {r} sent to ranks {sorted(peers)}: the ring runs the other way "
                   f"round — each rank sends to the next one ({(r + 1) % n}) and receives from the previous one.")


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
