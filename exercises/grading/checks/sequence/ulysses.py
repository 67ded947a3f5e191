"""Checks for exercise 5a.4 seq_to_heads / heads_to_seq: the Ulysses all-to-all."""
from __future__ import annotations

import random

import torch

from ...core import CheckFailed, exercise, salted_seed
from ...feedback import Mismatch, compare
from .common import ME, RANKS_TIMEOUT
from .shard import _short

ULYSSES = exercise("5a.4", "The Ulysses all-to-all", "sequence", ["seq_to_heads", "heads_to_seq"],
                   comm=("all_to_all",), mirrors=("reference.sequence.ulysses:*",))


def heads_tokens_tensor(B: int, Hh: int, S: int, D: int) -> torch.Tensor:
    """x[b, h, s, d] = 100000·b + 1000·h + s + d/100: every entry says which head and token it is."""
    b = torch.arange(B, dtype=torch.float64).view(B, 1, 1, 1) * 100000
    h = torch.arange(Hh, dtype=torch.float64).view(1, Hh, 1, 1) * 1000
    s = torch.arange(S, dtype=torch.float64).view(1, 1, S, 1)
    d = torch.arange(D, dtype=torch.float64).view(1, 1, 1, D) / 100
    return (b + h + s + d).contiguous()


def ulysses_layout(m: Mismatch) -> str | None:
    if not isinstance(m.got, torch.Tensor) or m.got.dim() != 4 or not torch.isfinite(m.got).all():
        return None
    heads = sorted({int(x) for x in (m.got[0, :, 0, 0].double() // 1000).tolist()})
    toks = [int(round(x)) % 1000 for x in m.got[0, 0, :, 0].double().tolist()]
    want_h = sorted({int(x) for x in (m.expected[0, :, 0, 0] // 1000).tolist()})
    want_t = [int(round(x)) % 1000 for x in m.expected[0, 0, :, 0].tolist()]
    parts = []
    if heads != want_h:
        interleaved = m.rank is not None and m.world_size and \
            heads == list(range(m.rank, m.rank + len(heads) * m.world_size, m.world_size))
        parts.append(f"it holds heads {_short(heads)} instead of {_short(want_h)}"
                     + (" (interleaved, head h on rank h mod W: rank r gets the consecutive block "
                        "r·H/W … (r+1)·H/W − 1)" if interleaved else ""))
    if toks != want_t:
        parts.append(f"its tokens are in the order {_short(toks)} instead of {_short(want_t)} "
                     "(the piece from rank w belongs at sequence positions w·n … (w+1)·n − 1)")
    return ("; ".join(parts) + ".") if parts else None


def judge_ulysses(values: list[dict], X: torch.Tensor, W: int) -> None:
    B, Hh, S, D = X.shape
    n, h = S // W, Hh // W
    for r in range(W):
        res = values[r]
        want_heads = X[:, r * h:(r + 1) * h].contiguous()
        want_seq = X[:, :, r * n:(r + 1) * n].contiguous()
        for what, want in (("seq_to_heads", want_heads), ("heads_to_seq", want_seq), ("round_trip", want_seq)):
            label = {"round_trip": "heads_to_seq(seq_to_heads(x))"}.get(what, f"{what} output")
            msg = compare(res[what], want, label, rank=r, world_size=W, atol=0, rtol=0,
                          case=f"B={B}, H={Hh}, S={S}", detectors=[ulysses_layout])
            if msg:
                raise CheckFailed(msg)


def _ulysses_check(ctx, W: int, B: int, Hh: int, S: int, D: int) -> None:
    X = heads_tokens_tensor(B, Hh, S, D)
    n, h = S // W, Hh // W
    seq_shards = [X[:, :, r * n:(r + 1) * n].contiguous() for r in range(W)]
    head_shards = [X[:, r * h:(r + 1) * h].contiguous() for r in range(W)]
    res = ctx.ranks(W, f"{ME}:ulysses_harness", per_rank=list(zip(seq_shards, head_shards)))
    judge_ulysses(res.values, X, W)
    for r, v in enumerate(res.values):
        a, b = v["inputs"]
        ctx.expect(torch.equal(a, seq_shards[r]) and torch.equal(b, head_shards[r]),
                   f"seq_to_heads or heads_to_seq changed its input on rank {r}: leave the input as it was "
                   "(the all-to-all writes into a buffer of your own).")


@ULYSSES.check("W=2: rank r gets head block r of all S tokens, and back (bitwise)", timeout=RANKS_TIMEOUT)
def _(ctx):
    rng = random.Random(salted_seed(541))
    _ulysses_check(ctx, 2, rng.randint(1, 2), 2 * rng.randint(1, 3), 2 * rng.randint(2, 5), rng.randint(1, 4))


@ULYSSES.check("W=4, batch 2, 8 heads: exact slices, bitwise round trip", points=2, timeout=RANKS_TIMEOUT)
def _(ctx):
    rng = random.Random(salted_seed(542))
    _ulysses_check(ctx, 4, 2, 8, 4 * rng.randint(1, 4), rng.randint(2, 4))


def judge_ulysses_error(values: list[dict], W: int, Hh: int) -> None:
    quiet = [r for r in range(W) if values[r]["raised"] is None]
    other = [r for r in range(W) if values[r]["raised"] not in (None, "ValueError")]
    if other:
        r = other[0]
        raise CheckFailed(f"with {Hh} heads on {W} ranks rank {r} raised {values[r]['raised']} "
                          f"({values[r]['message']}); raise ValueError (a bad input, named as such).")
    if quiet:
        raise CheckFailed(f"with {Hh} heads on {W} ranks, ranks {quiet} raised nothing: {Hh} heads cannot be "
                          f"split over {W} ranks. Raise ValueError on every rank before any communication.")


@ULYSSES.check("heads not divisible by W (5 to 10 heads on 4 ranks): ValueError on every rank, no hang",
               timeout=RANKS_TIMEOUT, requires_value=True)
def _(ctx):
    W, Hh = 4, random.Random(salted_seed(543)).choice([5, 6, 7, 9, 10])
    X = heads_tokens_tensor(1, Hh, 8, 2)
    shards = [X[:, :, 2 * r:2 * r + 2].contiguous() for r in range(W)]
    try:
        res = ctx.ranks(W, f"{ME}:ulysses_error_harness", per_rank=shards, timeout=8.0)
    except CheckFailed as e:
        if str(e).startswith("deadlock"):
            raise CheckFailed(str(e) + f"\n    With {Hh} heads on {W} ranks some ranks went on to the all-to-all "
                              "and waited for ranks that never came: check H % W on every rank and raise "
                              "ValueError before any communication.") from None
        raise
    judge_ulysses_error(res.values, W, Hh)


# Hints in tiers: the stub's error shows tier 1; ``hint("5a.4")`` shows the next one each call.
HINTS = {
    "5a.4": [
        "Before: every rank has all H heads of its n = L/W tokens. After: every rank has H/W heads of all L tokens. "
        "One all-to-all does it: slice w of what a rank sends goes to rank w. heads_to_seq is the mirror image.",
        "Check x.shape[1] % W first and raise ValueError on every rank, before any message. Cut the heads into W "
        "groups and make the group the first axis of a contiguous send buffer for comm.all_to_all_single.",
        "The send buffer: split the H heads into W groups of H/W and bring the group axis to the front (a "
        "reshape to (B, W, H/W, n, D) and a transpose of its first two axes, made contiguous); after "
        "all_to_all_single slice w of the output is sequence chunk w of your head group: put the chunks in rank "
        "order along the sequence axis. heads_to_seq is the mirror image: split the sequence into W chunks, chunk "
        "axis first, one all_to_all_single, then the slice from rank w is head group w.",
    ],
}
