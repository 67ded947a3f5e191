"""Lecture 5c — a planner's estimate for one rank: the bytes each axis sends in one training step.

The planner (:mod:`reference.planner`) does this for models of hundreds of billions of
parameters; here it is done for one rank of the tiny GPT, and checked against what a real run
sends (exercise 5c.3; the trace of the run is read by :func:`reference.compose.train.measured_bytes`).

Three axes, three mechanisms (b bytes per element, every message counted once, by its sender)::

    dp_cp   the gradient all-reduce: a ring all-reduce of n bytes sends 2(N−1)/N · n from every
            rank (a reduce-scatter, then an all-gather), over N = dp·cp ranks — the context ranks
            hold the same parameters and saw other tokens, so they average too
    cp      ring attention: in every layer, each of the cp − 1 hops of the forward passes a K and a
            V block (T tokens × the rank's d/tp features each); the backward passes K and V again
            and the dK, dV accumulators: 6·(cp − 1) blocks of T·d/tp per layer
    pp      a stage boundary: every micro-batch's activation goes forward, its gradient back; in
            total T·d per direction whatever the number of micro-batches (the first stage sends no
            gradient back, the last no activation forward)

Tensor parallelism's bytes (the f/g all-reduces, the vocabulary-parallel embedding, head and
loss) are in :func:`reference.compose.train.expected_bytes`.
"""
from __future__ import annotations

__all__ = ["step_bytes"]


def step_bytes(sizes: dict[str, int], coords: dict[str, int], *, tokens: int, d_model: int, layers: int,
               dense_params: int, num_microbatches: int = 1, bytes_per_element: int = 8) -> dict[str, int]:
    """Bytes one rank sends in one training step, per axis, by formula (exercise 5c.3).

    sizes: the grid, ``{"tp": …, "cp": …, "dp": …, "pp": …}`` (missing axes are 1); coords: this
    rank's coordinates on it (``{"tp": 0, "cp": 1, "dp": 0, "pp": 1}``); tokens: T, the tokens this
    rank holds in the step (its B/dp sequences × S/cp positions); d_model: the model width d;
    layers: the transformer blocks on this rank's pipeline stage; dense_params: the parameters
    this rank holds (its tensor shards; the model is dense); num_microbatches: the pipeline's m;
    bytes_per_element: b (8 for float64).

    Returns ``{"dp_cp": …, "cp": …, "pp": …}`` in bytes (ints), with an entry only for the axes
    that move data (dp·cp > 1, cp > 1, pp > 1): the gradient all-reduce over the dp·cp ranks
    (a ring all-reduce), ring attention's K/V traffic forward and backward, and the pipeline's
    activations and gradients.  What every rank SENDS is counted, as ``measured_bytes`` does.

    Graded on: the bytes per axis of ranks of real grids (dp × cp, dp × tp × pp, odd grids) and of random numbers.
    """
    s = {a: sizes.get(a, 1) for a in ("tp", "cp", "dp", "pp")}
    b, T, d = bytes_per_element, tokens, d_model
    out = {}
    n = s["dp"] * s["cp"]
    if n > 1:
        out["dp_cp"] = 2 * (n - 1) * b * dense_params // n
    if s["cp"] > 1:
        out["cp"] = 6 * (s["cp"] - 1) * T * (d // s["tp"]) * b * layers
    if s["pp"] > 1:
        first, last = coords["pp"] == 0, coords["pp"] == s["pp"] - 1
        out["pp"] = T * d * b * ((not last) + (not first))
    return out
