"""Checks for exercise 5a.2 shard_sequence / unshard_sequence: contiguous, zigzag and striped layouts."""
from __future__ import annotations

import random
from typing import Any

import torch

from ...core import CheckFailed, exercise, salted_seed
from ...feedback import Mismatch, compare
from ...harness.sequence import tokens_tensor
from .common import ME, layout_positions

SHARD = exercise("5a.2", "Shard a sequence: contiguous, zigzag, striped", "sequence",
                 ["shard_sequence", "unshard_sequence"], mirrors=("reference.sequence.layouts:*",))


def token_ids(t: Any, dim: int) -> list[int] | None:
    """The token positions a tensor made from :func:`tokens_tensor` holds along ``dim``."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    dim = dim % t.dim()
    line = t.movedim(dim, -1).reshape(-1, t.shape[dim])[0]
    if not torch.isfinite(line).all():
        return None
    return [int(x) for x in torch.round(line).tolist()]


def _zigzag_variant(S: int, r: int, W: int, first: int, second: int) -> list[int]:
    h = S // (2 * W)
    out = []
    for c in (first, second):
        if not 0 <= c < 2 * W:
            return []
        out += list(range(c * h, (c + 1) * h))
    return out


def shard_mistake(m: Mismatch) -> str | None:
    """Name the layout rule the learner's shard follows, from the tokens it holds."""
    S, r, W, layout, dim = (m.extra.get(k) for k in ("S", "rank", "W", "layout", "dim"))
    if S is None:
        return None
    got = token_ids(m.got, dim)
    if got is None:
        return None
    want = layout_positions(S, r, W, layout)
    if got == want:
        return None
    known = [
        ("the zigzag's second chunk is r + W; it is 2W − 1 − r (the mirror image), so that an early and a "
         "late chunk pair up", _zigzag_variant(S, r, W, r, r + W)),
        ("the zigzag's two chunks are in the wrong order: rank r holds chunk r first, then chunk 2W − 1 − r",
         _zigzag_variant(S, r, W, 2 * W - 1 - r, r)),
        ("this is the contiguous layout (chunk r of W)", layout_positions(S, r, W, "contiguous")),
        ("this is the striped layout (token i on rank i mod W)", layout_positions(S, r, W, "striped")),
        ("this is the zigzag layout (chunks r and 2W − 1 − r of 2W)", layout_positions(S, r, W, "zigzag")),
    ]
    for words, toks in known:     # got != want, so a match here is a mistake
        if toks and got == toks:
            return f"rank {r}'s shard holds tokens {_short(got)}: {words}. Expected {_short(want)}."
    return f"rank {r}'s shard holds tokens {_short(got)}; for the {layout} layout it should hold {_short(want)}."


def unshard_mistake(m: Mismatch) -> str | None:
    dim = m.extra.get("dim")
    got = token_ids(m.got, dim) if dim is not None else None
    if got is None:
        return None
    return f"your result holds the tokens in the order {_short(got)}; the full sequence is 0, 1, 2, … in order."


def _short(xs: list[int], n: int = 12) -> str:
    return "[" + ", ".join(map(str, xs[:n])) + (", …]" if len(xs) > n else "]")


def judge_shards(results: list[Any], cases: list[tuple]) -> None:
    for res, (x, r, W, layout, dim) in zip(results, cases):
        S = x.shape[dim]
        words = f"{layout}, W={W}, S={S}, rank {r}, dim={dim}"
        if "raised" in res:
            raise CheckFailed(f"shard_sequence raised {res['raised']} [{words}]: {res['message']}")
        want = x.index_select(dim, torch.tensor(layout_positions(S, r, W, layout)))
        msg = compare(res["value"], want, "shard", atol=0, rtol=0, case=words, detectors=[shard_mistake],
                      extra={"S": S, "rank": r, "W": W, "layout": layout, "dim": dim})
        if msg:
            raise CheckFailed(msg)
        if not res["contiguous"]:
            raise CheckFailed(f"the shard is a strided view [{words}]: return a new contiguous tensor "
                              "(.contiguous()) — it will be sent over the network.")
        if not res["input_intact"]:
            raise CheckFailed(f"shard_sequence modified its input x [{words}].")


def _shard_cases(layouts, sizes, S_of, shape_of, dim: int) -> list[tuple]:
    cases = []
    for layout in layouts:
        for W in sizes:
            S = S_of(W, layout)
            x = tokens_tensor(shape_of(S), dim)
            cases += [(x, r, W, layout, dim) for r in range(W)]
    return cases


def _shard_check(ctx, cases: list[tuple]) -> None:
    judge_shards(ctx.local(f"{ME}:shard_harness", cases), cases)


def _sizes(seed: int) -> tuple[random.Random, int, int, int]:
    """A random generator from the check's seed, and (B, H, D) drawn from it."""
    rng = random.Random(salted_seed(seed))
    return rng, rng.randint(1, 3), rng.randint(1, 3), rng.randint(2, 4)


@SHARD.check("contiguous and striped shards on 1-4 ranks (B, H, S, D), dim=-2")
def _(ctx):
    rng, B, Hh, D = _sizes(521)
    k = rng.randint(2, 5)
    _shard_check(ctx, _shard_cases(("contiguous", "striped"), (1, 2, 3, 4), lambda W, _: k * W,
                                   lambda S: (B, Hh, S, D), -2))


@SHARD.check("zigzag: rank r holds chunk r, then chunk 2W−1−r of 2W, on 1-4 ranks", points=2)
def _(ctx):
    rng, B, Hh, D = _sizes(522)
    k = rng.randint(1, 4)
    _shard_check(ctx, _shard_cases(("zigzag",), (1, 2, 3, 4), lambda W, _: 2 * k * W, lambda S: (B, Hh, S, D), -2))


@SHARD.check("another sequence axis: (B, S, H, D) with dim=1, every layout")
def _(ctx):
    rng, B, Hh, D = _sizes(523)
    W = rng.randint(2, 4)
    S = 2 * W * rng.randint(1, 3)
    _shard_check(ctx, _shard_cases(("contiguous", "zigzag", "striped"), (W,), lambda W, _: S,
                                   lambda S: (B, S, Hh, D), 1))


def judge_unshard(results: list[Any], cases: list[tuple], fulls: list[torch.Tensor]) -> None:
    for got, (shards, layout, dim), full in zip(results, cases, fulls):
        words = f"{layout}, W={len(shards)}, S={full.shape[dim]}, dim={dim}"
        msg = compare(got, full, "unsharded tensor", atol=0, rtol=0, case=words, detectors=[unshard_mistake],
                      extra={"dim": dim})
        if msg:
            raise CheckFailed(msg)


@SHARD.check("unshard_sequence puts every layout back together bitwise, 1-4 ranks", points=2)
def _(ctx):
    cases, fulls = [], []
    rng, B, Hh, D = _sizes(524)
    for layout in ("contiguous", "zigzag", "striped"):
        for W, dim in ((1, -2), (2, -2), (3, 1), (4, -2)):
            S = 2 * W * rng.randint(1, 3)
            shape = (B, Hh, S, D) if dim == -2 else (B, S, Hh, D)
            full = tokens_tensor(shape, dim)
            shards = [full.index_select(dim, torch.tensor(layout_positions(S, r, W, layout))) for r in range(W)]
            cases.append((shards, layout, dim))
            fulls.append(full)
    judge_unshard(ctx.local(f"{ME}:unshard_harness", cases), cases, fulls)


@SHARD.check("a length the layout cannot split raises ValueError", requires_value=True)
def _(ctx):
    rng = random.Random(salted_seed(525))
    bad = [(tokens_tensor((1, 1, 3 * rng.randint(2, 5) + rng.choice([1, 2]), 2), -2), 0, 3, "contiguous", -2),
           (tokens_tensor((1, 1, 8 * rng.randint(1, 3) + rng.choice([2, 4, 6]), 2), -2), 1, 4, "zigzag", -2),
           (tokens_tensor((1, 1, 4 * rng.randint(2, 5) + rng.choice([1, 2, 3]), 2), -2), 2, 4, "striped", -2)]
    for res, (x, r, W, layout, dim) in zip(ctx.local(f"{ME}:shard_harness", bad), bad):
        S = x.shape[dim]
        n = 2 * W if layout == "zigzag" else W
        ctx.expect(res.get("raised") == "ValueError",
                   f"shard_sequence({layout}, W={W}) of a sequence of {S} tokens should raise ValueError "
                   f"({S} is not a multiple of {n} chunks); it "
                   + (f"raised {res['raised']}." if "raised" in res else "returned a shard. Uneven shards "
                      "would make the ranks' messages different sizes and the ring hang."))


# Hints in tiers: the stub's error shows tier 1; ``hint("5a.2")`` shows the next one each call.
HINTS = {
    "5a.2": [
        "Draw the three layouts for L = 8, W = 2 (the pictures are in reference/sequence/layouts.py's docstring): "
        "which global token positions does each rank hold, in which order? unshard_sequence is the inverse.",
        "contiguous: W equal chunks, rank r takes chunk r. zigzag: 2W chunks, rank r takes chunk r and chunk "
        "2W-1-r. striped: token i lives on rank i mod W. Check that the length divides and raise ValueError.",
        "shard: x.chunk(W, dim)[r]; torch.cat([c[r], c[2W-1-r]], dim) with c = x.chunk(2W, dim); x.movedim(dim, 0)"
        "[r::W].movedim(0, dim). unshard: concatenate; split each zigzag shard in halves and put chunk r and "
        "2W-1-r back in place; striped: torch.stack(shards, dim+1).flatten(dim, dim+1) with a non-negative dim.",
    ],
}
