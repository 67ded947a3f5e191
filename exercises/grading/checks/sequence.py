"""Checks for lecture 5a (sequence parallelism): merge, sharding layouts, the ring forward, Ulysses.

Ground truth is computed here, in float64, from scratch: full attention with an explicit mask over
global token positions, and token positions of each layout written out independently of the
learner's (and the reference's) code.  Inputs encode their own positions where it helps feedback:
a shard that comes back with the wrong tokens is described by the tokens it holds.

Each check is "make inputs → run learner code → judge"; the judging functions (``judge_*``) are
plain functions of the values that came back, so tests can feed them results of deliberately
wrong implementations.
"""
from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from ..core import CheckFailed, exercise, salted_seed
from ..feedback import Mismatch, compare

H = "exercises.grading.harness"
ME = "exercises.grading.checks.sequence"
RANKS_TIMEOUT = 12.0   # seconds: every multi-rank run here takes well under one; a deadlock is reported after this

MERGE = exercise("5a.1", "Merge two partial attention results (online softmax)", "sequence", ["merge_attention"])
SHARD = exercise("5a.2", "Shard a sequence: contiguous, zigzag, striped", "sequence",
                 ["shard_sequence", "unshard_sequence"])
RING = exercise("5a.3", "Ring attention forward", "sequence", ["ring_attention_forward"], comm=("p2p",))
ULYSSES = exercise("5a.4", "The Ulysses all-to-all", "sequence", ["seq_to_heads", "heads_to_seq"],
                   comm=("all_to_all",))


# ----------------------------------------------------------------------------------------------
# Ground truth, written out independently


def layout_positions(seq_len: int, rank: int, world_size: int, layout: str) -> list[int]:
    """Global token positions rank ``rank`` holds, in local order (from the layouts' definitions)."""
    W, S = world_size, seq_len
    if layout == "contiguous":
        c = S // W
        return list(range(rank * c, (rank + 1) * c))
    if layout == "zigzag":
        h = S // (2 * W)
        return list(range(rank * h, (rank + 1) * h)) + list(range((2 * W - 1 - rank) * h, (2 * W - rank) * h))
    if layout == "striped":
        return list(range(rank, S, W))
    raise ValueError(layout)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None):
    """float64 attention with an explicit boolean mask ``keep`` (Sq, Sk); rows with no key: out 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return p @ v, lse


def _randn(shape, seed: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(salted_seed(seed))
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ----------------------------------------------------------------------------------------------
# 5a.1 merge_attention


def merge_no_max(m: Mismatch) -> str | None:
    naive = m.extra.get("naive")
    if m.has_nonfinite and isinstance(naive, torch.Tensor) and not bool(torch.isfinite(naive).all()):
        return ("NaN/inf with large logits: e^{lse} overflows. The merge needs the running max — with "
                "m = max(lse_a, lse_b) use e^{lse_a − m} and e^{lse_b − m} (one of them is 1).")
    return None


def merge_masked_side(m: Mismatch) -> str | None:
    if m.has_nonfinite and "masked" in m.case:
        return ("NaN where one side saw no key (lse = −inf): that side's weight must be exactly 0. "
                "With m = max(lse_a, lse_b) (finite here), e^{−inf − m} = 0 does it; lse_b − lse_a = inf does not.")
    return None


def merge_equal_weights(m: Mismatch) -> str | None:
    a, b = m.extra.get("out_a"), m.extra.get("out_b")
    if m.what == "out" and isinstance(a, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == a.shape and torch.allclose(m.got.double(), (a.double() + b.double()) / 2, atol=1e-9):
        return ("your out is the plain average of out_a and out_b: weight each side by its share of the "
                "softmax mass, e^{lse_a − lse} and e^{lse_b − lse}.")
    return None


def merge_swapped(m: Mismatch) -> str | None:
    sw = m.extra.get("swapped")
    if m.what == "out" and isinstance(sw, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == sw.shape and torch.allclose(m.got.double(), sw, atol=1e-9):
        return "the weights are swapped: out_a gets the weight of side b and out_b that of side a."
    return None


def merge_lse_max(m: Mismatch) -> str | None:
    la, lb = m.extra.get("lse_a"), m.extra.get("lse_b")
    if m.what == "lse" and isinstance(la, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == la.shape and torch.equal(m.got.double(), torch.maximum(la, lb).double()):
        return "your lse is max(lse_a, lse_b); the merged lse is log(e^{lse_a} + e^{lse_b}) = m + log(w_a + w_b)."
    if m.what == "lse" and isinstance(la, torch.Tensor) and isinstance(m.got, torch.Tensor) \
            and m.got.shape == la.shape and torch.allclose(m.got.double(), la.double()):
        return "your lse is lse_a unchanged: the merged lse must include side b's mass too."
    return None


MERGE_DETECTORS = [merge_no_max, merge_masked_side, merge_equal_weights, merge_swapped, merge_lse_max]


def merge_case(B: int, Hh: int, Sq: int, Sa: int, Sb: int, D: int, seed: int, scale: float = 1.0,
               masked: str = "") -> dict[str, Any]:
    """Inputs (two key blocks' results) and the truth (attention over both blocks), in float64.

    masked: "" | "b" (side b sees no key: lse_b = −inf) | "rows" (some rows see no key of side a).
    """
    q = _randn((B, Hh, Sq, D), seed, scale)
    k = _randn((B, Hh, Sa + Sb, D), seed + 1, scale)
    v = _randn((B, Hh, Sa + Sb, D), seed + 2)
    keep = torch.ones(Sq, Sa + Sb, dtype=torch.bool)
    if masked == "b":
        keep[:, Sa:] = False
    elif masked == "rows":
        keep[: Sq // 2, :Sa] = False
    out_a, lse_a = attention(q, k[..., :Sa, :], v[..., :Sa, :], keep[:, :Sa])
    out_b, lse_b = attention(q, k[..., Sa:, :], v[..., Sa:, :], keep[:, Sa:])
    out, lse = attention(q, k, v, keep)
    with torch.no_grad():
        den = torch.exp(lse_a) + torch.exp(lse_b)
        naive = (torch.exp(lse_a).unsqueeze(-1) * out_a + torch.exp(lse_b).unsqueeze(-1) * out_b) / den.unsqueeze(-1)
        wa, wb = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
        swapped = wb * out_a + wa * out_b
    return {"args": (out_a, lse_a, out_b, lse_b), "out": out, "lse": lse,
            "extra": {"naive": naive, "swapped": swapped, "out_a": out_a, "out_b": out_b,
                      "lse_a": lse_a, "lse_b": lse_b}}


def judge_merge(got: Any, case: dict[str, Any], words: str) -> None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailed(f"merge_attention must return a tuple (out, lse); got {type(got).__name__} [{words}].")
    for i, what in enumerate(("out", "lse")):
        msg = compare(got[i], case[what], what, atol=1e-9, rtol=1e-9, case=words, detectors=MERGE_DETECTORS,
                      extra=case["extra"])
        if msg:
            raise CheckFailed(msg)


def _merge_check(ctx, case: dict[str, Any], words: str) -> None:
    got = ctx.local(f"{H}:call", "merge_attention", case["args"])
    judge_merge(got, case, words)


@MERGE.check("matches attention over both blocks in float64 (batch 2, 3 heads, blocks of 5 and 7 keys)", points=2)
def _(ctx):
    _merge_check(ctx, merge_case(2, 3, 6, 5, 7, 8, seed=101), "N(0,1) inputs")


@MERGE.check("large logits (q, k scaled ×4 and ×30) stay finite and exact", points=2)
def _(ctx):
    _merge_check(ctx, merge_case(1, 2, 8, 6, 6, 16, seed=102, scale=4.0), "large logits ×4")
    _merge_check(ctx, merge_case(1, 2, 8, 6, 6, 16, seed=103, scale=30.0), "large logits ×30")


@MERGE.check("a side that saw no key (lse = −inf) gets weight 0, on either side and for some rows only")
def _(ctx):
    case = merge_case(1, 2, 4, 4, 3, 8, seed=104, masked="b")
    _merge_check(ctx, case, "side b fully masked")
    a, la, b, lb = case["args"]
    _merge_check(ctx, {**case, "args": (b, lb, a, la), "extra": {**case["extra"], "naive": None, "swapped": None,
                                                                  "out_a": b, "out_b": a, "lse_a": lb, "lse_b": la}},
                 "side a fully masked")
    _merge_check(ctx, merge_case(2, 1, 6, 4, 4, 8, seed=105, masked="rows"), "some rows masked on side a")


# ----------------------------------------------------------------------------------------------
# 5a.2 shard_sequence / unshard_sequence


def tokens_tensor(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A float64 tensor whose entries along ``dim`` at index 0 elsewhere are the token positions,
    and every entry is distinct: x[..., s, ...] = s + 1000·(flat index of the other coordinates)."""
    dim = dim % len(shape)
    n = shape[dim]
    others = [s for i, s in enumerate(shape) if i != dim]
    rest = torch.arange(math.prod(others), dtype=torch.float64).reshape(others) * 1000
    x = rest.unsqueeze(dim) + torch.arange(n, dtype=torch.float64).reshape([n if i == dim else 1
                                                                             for i in range(len(shape))])
    return x.contiguous()


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


def shard_harness(module: str, cases: list[tuple]) -> list[Any]:
    """Runs in the runner: shard_sequence for each (x, rank, W, layout, dim); exceptions come back as
    ``{"raised": type name, "message": ...}`` (NotImplementedError propagates)."""
    mod = importlib.import_module(module)
    out = []
    for x, r, W, layout, dim in cases:
        try:
            y = mod.shard_sequence(x, r, W, layout, dim)
            out.append({"value": y, "contiguous": bool(y.is_contiguous()) if isinstance(y, torch.Tensor) else None,
                        "input_intact": bool(torch.equal(x, tokens_tensor(tuple(x.shape), dim)))})
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            out.append({"raised": type(e).__name__, "message": str(e)[:300]})
    return out


def unshard_harness(module: str, cases: list[tuple]) -> list[Any]:
    mod = importlib.import_module(module)
    return [mod.unshard_sequence(list(shards), layout, dim) for shards, layout, dim in cases]


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


@SHARD.check("contiguous and striped shards on 1-4 ranks (B, H, S, D), dim=-2")
def _(ctx):
    _shard_check(ctx, _shard_cases(("contiguous", "striped"), (1, 2, 3, 4), lambda W, _: 4 * W,
                                   lambda S: (2, 3, S, 4), -2))


@SHARD.check("zigzag: rank r holds chunk r, then chunk 2W−1−r of 2W, on 1-4 ranks", points=2)
def _(ctx):
    _shard_check(ctx, _shard_cases(("zigzag",), (1, 2, 3, 4), lambda W, _: 6 * W, lambda S: (2, 2, S, 3), -2))


@SHARD.check("another sequence axis: (B, S, H, D) with dim=1, every layout")
def _(ctx):
    _shard_check(ctx, _shard_cases(("contiguous", "zigzag", "striped"), (3,), lambda W, _: 12,
                                   lambda S: (2, S, 2, 3), 1))


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
    for layout in ("contiguous", "zigzag", "striped"):
        for W, dim in ((1, -2), (2, -2), (3, 1), (4, -2)):
            S = 4 * W
            shape = (2, 2, S, 3) if dim == -2 else (2, S, 2, 3)
            full = tokens_tensor(shape, dim)
            shards = [full.index_select(dim, torch.tensor(layout_positions(S, r, W, layout))) for r in range(W)]
            cases.append((shards, layout, dim))
            fulls.append(full)
    judge_unshard(ctx.local(f"{ME}:unshard_harness", cases), cases, fulls)


@SHARD.check("a length the layout cannot split raises ValueError", requires_value=True)
def _(ctx):
    bad = [(tokens_tensor((1, 1, 10, 2), -2), 0, 3, "contiguous", -2),
           (tokens_tensor((1, 1, 12, 2), -2), 1, 4, "zigzag", -2),
           (tokens_tensor((1, 1, 10, 2), -2), 2, 4, "striped", -2)]
    for res, (x, r, W, layout, dim) in zip(ctx.local(f"{ME}:shard_harness", bad), bad):
        S = x.shape[dim]
        n = 2 * W if layout == "zigzag" else W
        ctx.expect(res.get("raised") == "ValueError",
                   f"shard_sequence({layout}, W={W}) of a sequence of {S} tokens should raise ValueError "
                   f"({S} is not a multiple of {n} chunks); it "
                   + (f"raised {res['raised']}." if "raised" in res else "returned a shard. Uneven shards "
                      "would make the ranks' messages different sizes and the ring hang."))


# ----------------------------------------------------------------------------------------------
# 5a.3 ring_attention_forward

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
    if rule == "no_mask":
        return torch.ones(n, n, dtype=torch.bool)
    if rule == "diag_unmasked":
        return torch.ones(n, n, dtype=torch.bool) if j == r else truth
    if rule == "diag_skipped":
        return torch.zeros(n, n, dtype=torch.bool) if j == r else truth
    if rule == "contiguous_rules":
        return torch.ones(n, n, dtype=torch.bool) if j < r else local_causal if j == r else torch.zeros(n, n, dtype=torch.bool)
    if rule == "reversed":
        return torch.ones(n, n, dtype=torch.bool) if j > r else local_causal if j == r else torch.zeros(n, n, dtype=torch.bool)
    if rule == "striped_inclusive":
        return local_causal if layout == "striped" else truth
    raise ValueError(rule)


RULE_WORDS = {
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


class _Counter:
    """Counts the attention-kernel calls a rank makes (grader-side instrumentation in the rank)."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.depth = 0

    def wrap(self, fn):
        def counted(q, k, v, *args, **kwargs):
            if self.depth == 0:
                self.calls.append([int(q.shape[-2]), int(k.shape[-2]), int(bool(kwargs.get("causal", False)))])
            self.depth += 1
            try:
                return fn(q, k, v, *args, **kwargs)
            finally:
                self.depth -= 1
        return counted


def ring_harness(module: str, shards: list[tuple], causal: bool, layout: str) -> dict[str, Any]:
    """On each rank: the learner's ring_attention_forward on its shard; also the kernel calls it made."""
    import torch.distributed as dist
    from reference.sequence import blockwise

    r = dist.get_rank()
    mod = importlib.import_module(module)
    q, k, v = shards[r]
    counter = _Counter()
    patched = []
    for owner in {id(mod): mod, id(blockwise): blockwise}.values():
        for name in ("attention_block", "attention_block_explicit"):
            if hasattr(owner, name):
                patched.append((owner, name, getattr(owner, name)))
                setattr(owner, name, counter.wrap(getattr(owner, name)))
    try:
        res = mod.ring_attention_forward(q, k, v, causal=causal, layout=layout)
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        return {"bad_return": type(res).__name__}
    return {"out": res[0], "lse": res[1], "calls": counter.calls}


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
    if not isinstance(m.got, torch.Tensor):
        return None
    for rule, alt in m.extra.get("alternatives", {}).items():
        if alt.shape == m.got.shape and torch.allclose(m.got.double(), alt, atol=1e-7, rtol=1e-6, equal_nan=True) \
                and not torch.allclose(alt, m.expected.double(), atol=1e-7, rtol=1e-6, equal_nan=True):
            return RULE_WORDS[rule].format(layout=m.extra.get("layout"))
    return None


def judge_ring(values: list[Any], trace: list[dict], qkv, causal: bool, layout: str, W: int, *,
               atol: float = 1e-9, rtol: float = 1e-7, words: str = "") -> None:
    """Compare each rank's (out, lse) with float64 full attention; name a wrong causal rule or direction."""
    words = words or f"W={W}, {layout}, {'causal' if causal else 'non-causal'}"
    truth = ring_truth(*qkv, causal, layout, W)
    rules = [x for x in RULE_WORDS if causal and not (x == "contiguous_rules" and layout == "contiguous")]
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
    res = ctx.ranks(W, f"{ME}:ring_harness", shard_inputs(qkv, W, layout), causal, layout)
    judge_ring(res.values, res.trace, qkv, causal, layout, W, **kw)
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


def judge_ring_messages(trace: list[dict], W: int, n: int, Hkv: int, D: int, itemsize: int) -> None:
    want = (W - 1) * 2 * n * Hkv * D * itemsize
    sent = {r: 0 for r in range(W)}
    for e in trace:
        if e["op"] == "send":
            sent[e["rank"]] += e["nbytes"]
    if not any(sent.values()):
        raise CheckFailed("no point-to-point messages were recorded: pass K/V round the ring with sends and "
                          "receives (comm.exchange or torch.distributed), not a collective such as all_gather.")
    for r in range(W):
        nxt, prv = (r + 1) % W, (r - 1) % W
        to, frm = _peers(trace, "send", r), _peers(trace, "recv", r)
        if frm == {nxt} and to == {prv}:
            raise CheckFailed(f"rank {r} received K/V from rank {nxt} (r+1) and sent to rank {prv} (r−1): the ring "
                              "runs the other way. Send to r+1 and receive from r−1, so that at step s rank r holds "
                              "the K/V of rank (r − s) mod W (comm.ring_peers gives (next, prev)).")
        if to != {nxt} or frm != {prv}:
            raise CheckFailed(f"rank {r} sent to ranks {sorted(to)} and received from {sorted(frm)}; in the ring it "
                              f"sends only to rank {nxt} and receives only from rank {prv}.")
        if sent[r] != want:
            hint = (" — one hop too many: after W−1 hops every rank has seen every block, so the last step "
                    "sends nothing." if sent[r] == want * W // (W - 1) else "")
            raise CheckFailed(f"rank {r} sent {sent[r]} bytes; the ring forward sends K and V W−1 times: "
                              f"(W−1)·2·n·H·D·itemsize = {W - 1}·2·{n}·{Hkv}·{D}·{itemsize} = {want}{hint}.")


@RING.check("K/V travel forward: rank r sends (W−1)·2·n·H·D·b bytes to r+1 only, receives from r−1 only"
            " (trace; feedback only, no points)", points=0, timeout=RANKS_TIMEOUT)
def _(ctx):
    W, S, Hh, D = 4, 16, 2, 8
    res = _ring_run(ctx, W, ring_inputs(1, Hh, S, D, seed=340), False, "contiguous")
    judge_ring_messages(res.trace, W, S // W, Hh, D, 8)


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


# ----------------------------------------------------------------------------------------------
# 5a.4 seq_to_heads / heads_to_seq


def heads_tokens_tensor(B: int, Hh: int, S: int, D: int) -> torch.Tensor:
    """x[b, h, s, d] = 100000·b + 1000·h + s + d/100: every entry says which head and token it is."""
    b = torch.arange(B, dtype=torch.float64).view(B, 1, 1, 1) * 100000
    h = torch.arange(Hh, dtype=torch.float64).view(1, Hh, 1, 1) * 1000
    s = torch.arange(S, dtype=torch.float64).view(1, 1, S, 1)
    d = torch.arange(D, dtype=torch.float64).view(1, 1, 1, D) / 100
    return (b + h + s + d).contiguous()


def ulysses_harness(module: str, seq_shards: list[torch.Tensor], head_shards: list[torch.Tensor]) -> dict:
    import torch.distributed as dist
    mod = importlib.import_module(module)
    r = dist.get_rank()
    a = mod.seq_to_heads(seq_shards[r])
    b = mod.heads_to_seq(head_shards[r])
    back = mod.heads_to_seq(a) if isinstance(a, torch.Tensor) else None
    return {"seq_to_heads": a, "heads_to_seq": b, "round_trip": back}


def ulysses_error_harness(module: str, shards: list[torch.Tensor]) -> dict:
    import torch.distributed as dist
    mod = importlib.import_module(module)
    try:
        mod.seq_to_heads(shards[dist.get_rank()])
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    return {"raised": None}


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
    res = ctx.ranks(W, f"{ME}:ulysses_harness", seq_shards, head_shards)
    judge_ulysses(res.values, X, W)


@ULYSSES.check("W=2: rank r gets head block r of all S tokens, and back (bitwise)", timeout=RANKS_TIMEOUT)
def _(ctx):
    _ulysses_check(ctx, 2, 1, 4, 6, 3)


@ULYSSES.check("W=4, batch 2, 8 heads: exact slices, bitwise round trip", points=2, timeout=RANKS_TIMEOUT)
def _(ctx):
    _ulysses_check(ctx, 4, 2, 8, 8, 3)


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


@ULYSSES.check("heads not divisible by W (6 heads on 4 ranks): ValueError on every rank, no hang", timeout=RANKS_TIMEOUT,
               requires_value=True)
def _(ctx):
    W, Hh = 4, 6
    X = heads_tokens_tensor(1, Hh, 8, 2)
    shards = [X[:, :, 2 * r:2 * r + 2].contiguous() for r in range(W)]
    try:
        res = ctx.ranks(W, f"{ME}:ulysses_error_harness", shards, timeout=8.0)
    except CheckFailed as e:
        if str(e).startswith("deadlock"):
            raise CheckFailed(str(e) + f"\n    With {Hh} heads on {W} ranks some ranks went on to the all-to-all "
                              "and waited for ranks that never came: check H % W on every rank and raise "
                              "ValueError before any communication.") from None
        raise
    judge_ulysses_error(res.values, W, Hh)


# Hints in tiers: the stub's error shows tier 1; ``hint("5a.3")`` shows the next one each call.
HINTS = {
    "5a.1": [
        "Each side's weight is its share of the softmax mass, e^{lse_a} / (e^{lse_a} + e^{lse_b}). Think about what "
        "e^{lse} does when the logits are large, and what a fully masked side (lse = -inf) must contribute.",
        "Never compute e^{lse} itself: subtract the larger of the two log-sum-exps first, so every exponent is <= 0. "
        "lse has no head_dim axis: unsqueeze(-1) the weights before multiplying out_a and out_b.",
        "lse = m + log(e^{lse_a - m} + e^{lse_b - m}); out = e^{lse_a - lse}·out_a + e^{lse_b - lse}·out_b. Where "
        "both sides are -inf, m is -inf too: replace it by 0 before subtracting, so the weights come out 0, not NaN.",
    ],
    "5a.2": [
        "Draw the three layouts for L = 8, W = 2 (the pictures are in reference/sequence/layouts.py's docstring): "
        "which global token positions does each rank hold, in which order? unshard_sequence is the inverse.",
        "contiguous: W equal chunks, rank r takes chunk r. zigzag: 2W chunks, rank r takes chunk r and chunk "
        "2W-1-r. striped: token i lives on rank i mod W. Check that the length divides and raise ValueError.",
        "shard: x.chunk(W, dim)[r]; torch.cat([c[r], c[2W-1-r]], dim) with c = x.chunk(2W, dim); x.movedim(dim, 0)"
        "[r::W].movedim(0, dim). unshard: concatenate; split each zigzag shard in halves and put chunk r and "
        "2W-1-r back in place; striped: torch.stack(shards, dim+1).flatten(dim, dim+1) with a non-negative dim.",
    ],
    "5a.3": [
        "At step s rank r holds the K/V block of rank (r - s) mod W; K/V move one rank forward per step, queries "
        "never move. Post the next hop before computing the current block, and merge each block into a running "
        "(out, lse) with your 5a.1.",
        "comm.ring_peers(group) gives (next, previous). Each step: comm.exchange([(k_cur, nxt), (v_cur, nxt)], "
        "[(k_buf, prv), (v_buf, prv)], group=group, step=s, what='kv') (not on the last step), compute, then "
        ".wait() and swap buffers. Never a blocking send then recv: on a ring every rank would wait for the next.",
        "Causal: a block is full, causal (diagonal included), strictly causal or skipped, depending on the global "
        "positions of your queries and of rank j's keys (layouts.positions). Contiguous: j < r full, j == r causal, "
        "j > r skip; zigzag and striped: sketch the score matrix. Skip fully masked blocks without a kernel call; "
        "accumulate in float32 or wider and return (out in q's dtype, lse).",
    ],
    "5a.4": [
        "Before: every rank has all H heads of its n = L/W tokens. After: every rank has H/W heads of all L tokens. "
        "One all-to-all does it: slice w of what a rank sends goes to rank w. heads_to_seq is the mirror image.",
        "Check x.shape[1] % W first and raise ValueError on every rank, before any message. Cut the heads into W "
        "groups and make the group the first axis of a contiguous send buffer for comm.all_to_all_single.",
        "send = x.reshape(B, W, H//W, n, D).transpose(0, 1).contiguous(); after all_to_all_single slice w of the "
        "output is sequence chunk w of your head group: put the chunks in rank order along the sequence axis. "
        "heads_to_seq: x.reshape(B, h, W, S//W, D).permute(2, 0, 1, 3, 4).contiguous(), one all_to_all_single, "
        "then the slice from rank w is head group w.",
    ],
}
