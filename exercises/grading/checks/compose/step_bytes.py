"""Checks for exercise 5c.3 step_bytes: a planner's estimate of the bytes one rank sends per step.

The truth is the reference's formula for the tiny GPT (``reference.compose.train.expected_bytes``, via
``ctx.oracle``),
which ``tests/compose/test_train.py`` holds equal, byte for byte, to the trace of real runs on
every rank of every grid it trains.  Each case is one rank of a real grid with the numbers that
rank has (its tokens, its stage's layers, its parameter count from the formula), so the learner's
arithmetic is compared with what that rank sends.  Detectors name the usual slips per axis.
"""
from __future__ import annotations

import random

from ...core import CheckFailed, exercise, salted_seed

H = "exercises.grading.harness"
REF = "reference.compose.cases"
REF_ESTIMATE = "reference.compose.estimate"

__all__ = ["BYTES", "HINTS"]

# The given planner and the grader's own case builder would answer by another road: switched off
# while 5c.3 is graded (the per-collective building blocks, comm.ring_bytes and the planner's
# allreduce_bytes, stay: they are lecture 0's arithmetic, not this exercise's).
BYTES = exercise("5c.3", "A planner's estimate: bytes per axis, checked against a real run", "compose", ["step_bytes"],
                 mirrors=("reference.planner.plan:plan", "reference.planner.plan:search",
                          "reference.compose.cases:bytes_case"))

AXES = ("dp_cp", "cp", "pp")


def _rank_case(ctx, sizes: dict, rank: int, *, m: int = 1, **model) -> tuple[dict, dict]:
    """(the arguments of step_bytes for this rank, the bytes it sends by the validated formula)."""
    args, want = ctx.oracle(f"{REF}:bytes_case", dict(sizes), rank, num_microbatches=m, **model)
    return args, want


def _world(sizes: dict) -> int:
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    return n


def _explain(axis: str, got, want: int, case: dict) -> str:
    s, c, T, d = case["sizes"], case["coords"], case["tokens"], case["d_model"]
    b, L, P, m = case.get("bytes_per_element", 8), case["layers"], case["dense_params"], case["num_microbatches"]
    N = s["dp"] * s["cp"]
    slips = []
    if axis == "dp_cp":
        slips = [(2 * (s["dp"] - 1) * b * P // max(s["dp"], 1), "you used N = dp; the context-parallel ranks hold "
                  f"the same parameters and average too: N = dp·cp = {N}"),
                 (b * P, "that is the payload (the gradients' bytes), not what a ring all-reduce sends: a "
                  "reduce-scatter then an all-gather, each sending (N−1)/N of it"),
                 ((N - 1) * b * P // N, "that is one half of a ring all-reduce (a reduce-scatter); the "
                  "all-gather sends as much again"),
                 (2 * b * P, "2× the payload is the limit for large N; the ring sends 2(N−1)/N of it")]
    elif axis == "cp":
        hop = (s["cp"] - 1) * T * (d // s["tp"]) * b * L
        slips = [(2 * hop, "that is the forward only (K and V per hop); the backward passes K and V again and "
                  "the dK, dV accumulators: 6 blocks per hop in all"),
                 (4 * hop, "the backward passes K, V again AND dK, dV: 2 + 4 = 6 blocks per hop"),
                 (6 * (s["cp"] - 1) * T * d * b * L, "each tensor-parallel rank holds only its heads: d/tp "
                  "features of K and V")]
    elif axis == "pp":
        slips = [(2 * T * d * b, "the first stage sends no gradient back and the last no activation forward"),
                 (m * T * d * b * ((c["pp"] < s["pp"] - 1) + (c["pp"] > 0)), "each micro-batch carries T/m "
                  "tokens: the total is the same whatever m")]
    for value, words in slips:
        if got == value != want:
            return words
    return ""


def _check(ctx, cases: list[tuple[dict, dict]], label: str) -> None:
    for args, want in cases:
        kw = {k: v for k, v in args.items() if k not in ("sizes", "coords")}
        got = ctx.local(f"{H}:call", "step_bytes", (args["sizes"], args["coords"]), kw)
        words = (f"[{label}: sizes {args['sizes']}, coords {args['coords']}, tokens={args['tokens']}, "
                 f"layers={args['layers']}, dense_params={args['dense_params']}]")
        if not isinstance(got, dict):
            raise CheckFailed(f"{words} step_bytes must return a dict of axis → bytes, got {type(got).__name__}.")
        extra = sorted(set(got) - set(want))
        if extra and any(got[a] for a in extra):
            raise CheckFailed(f"{words} no bytes move on {extra} here (that axis has size 1, or dp·cp = 1); leave it "
                              f"out. Expected keys {sorted(want)}.")
        for axis, value in want.items():
            if axis not in got:
                raise CheckFailed(f"{words} missing the {axis!r} entry: this rank sends {value} bytes on it.")
            if got[axis] != value:
                why = _explain(axis, got[axis], value, args)
                raise CheckFailed(f"{words} {axis}: got {got[axis]} bytes, this rank sends {value}." +
                                  (f"\n{why}." if why else ""))


TINY = dict(layers=4, d_model=16, heads=2, seq_len=16, batch=4)


def _tiny(rng: random.Random, **over) -> dict:
    """A tiny GPT drawn from the check's seed: 2–6 layers, width 8–32, 8–24 tokens."""
    return dict(TINY, layers=rng.randint(2, 6), d_model=rng.choice([8, 16, 24, 32]), seq_len=rng.choice([8, 16, 24]),
                **over)


@BYTES.check("dp × cp = 2 × 2: the gradient all-reduce and ring attention, every rank", points=2)
def _(ctx):
    cfg = _tiny(random.Random(salted_seed(59)))
    _check(ctx, [_rank_case(ctx, {"dp": 2, "cp": 2}, r, **cfg) for r in range(4)], "dp=2, cp=2")


@BYTES.check("dp × tp × pp = 2 × 2 × 2 with 4 micro-batches: the pipeline's messages on first and last stage",
             points=2)
def _(ctx):
    cfg = _tiny(random.Random(salted_seed(60)), batch=8)
    _check(ctx, [_rank_case(ctx, {"dp": 2, "tp": 2, "pp": 2}, r, m=4, **cfg) for r in (0, 5)], "dp=2, tp=2, pp=2, m=4")


@BYTES.check("odd grids (3 stages, cp 3, dp 3, tp 2), middle stages included", points=2)
def _(ctx):
    rng = random.Random(salted_seed(53))
    cases = []
    for sizes in ({"cp": 3, "dp": 2}, {"pp": 3, "dp": 3}, {"tp": 2, "cp": 3, "pp": 3}):
        cfg = dict(_tiny(rng), layers=rng.choice([5, 6, 7]), seq_len=rng.choice([12, 24]), batch=6)
        W = _world(sizes)
        cases += [_rank_case(ctx, sizes, r, m=rng.choice([1, 3]) if sizes.get("pp") else 1, **cfg)
                  for r in sorted(rng.sample(range(W), min(W, 4)))]
    _check(ctx, cases, "odd grids")


@BYTES.check("any numbers: random grids, token counts, widths, parameter counts and element sizes", points=1)
def _(ctx):
    """Not a model the planner describes: only the arithmetic of the three mechanisms answers it."""
    from reference.mesh import RankGrid
    rng = random.Random(salted_seed(54))
    cases = []
    for _ in range(6):
        sizes = {a: rng.choice([1, 2, 3, 4]) for a in ("tp", "cp", "dp", "pp")}
        n = _world(sizes)
        coords = RankGrid(n, rank=rng.randrange(n), **sizes).coords()
        args = dict(sizes=sizes, coords={a: coords[a] for a in sizes}, tokens=rng.randrange(1, 5000),
                    d_model=sizes["tp"] * rng.randrange(1, 300), layers=rng.randrange(1, 9),
                    dense_params=rng.randrange(1, 10**7), num_microbatches=rng.choice([1, 2, 4]),
                    bytes_per_element=rng.choice([2, 4, 8]))
        kw = {k: v for k, v in args.items() if k not in ("sizes", "coords")}
        cases.append((args, ctx.oracle(f"{REF_ESTIMATE}:step_bytes", args["sizes"], args["coords"], **kw)))
    _check(ctx, cases, "random numbers")


HINTS = {
    "5c.3": [
        "One axis at a time — which collective or message does it use, how often per step, and how many bytes "
        "does THIS rank send in it? Leave out the axes that move nothing.",
        "dp_cp: one ring all-reduce of the gradients (dense_params × b bytes) over N = dp·cp ranks sends 2(N−1)/N "
        "of it. pp: every token's activation crosses each boundary once forward and its gradient once back.",
        "cp: per layer, cp−1 hops forward each carrying K and V (T × d/tp values each); the backward carries K, V "
        "and dK, dV: 6·(cp−1)·T·(d/tp)·b·layers. pp: T·d·b for each neighbour the stage has (0, 1 or 2 "
        "directions), whatever m. Use integer arithmetic (// at the end).",
    ],
}
