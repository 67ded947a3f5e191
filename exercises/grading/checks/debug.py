"""Checks for lecture 6 (when the split goes wrong): reading a hang report (6.1), the first divergence
(6.2), fixing the given run's silent bug (6.3).

Ground truth comes from the reference in the grader's process (``reference.debug.oracles``): real
hangs on real ranks with the kind and ranks they were planted with; recorded runs with a planted bug
(or none) and the reference's first divergence; one process's loss and gradients of the padded
batch.  Every input is drawn from ``ctx.seed``: the autograder's fresh inputs plant the hangs on other
ranks and the bugs in other layers, ranks and models.  Detectors name the usual mistakes: the waiting
ranks named instead of the one at fault, a later record than the first, every rank named where one
differs, rounding taken for a bug, the given step's mean of means.
"""
from __future__ import annotations

import random

import torch

from ..core import CheckFailed, CheckTimedOut, exercise
from ..feedback import Mismatch

H = "exercises.grading.harness.debug"
ORACLES = "reference.debug.oracles"

__all__ = ["DIAGNOSE", "FIRST", "ACCUMULATE", "HINTS"]

# Switched off while each is graded ("mirrors"): the grader's own truths (every function of
# reference.debug.oracles: the hang reports with their truth, the recorded runs with their answers, one
# process's gradients); for 6.2 also what maps or walks a run's differences (the lecture's map, the
# bisection animation's search); for 6.3 every other function of reference.debug.accumulate (the given step
# and its recorder, the data and model makers: the grader makes each rank's inputs in its own process).
# The format of the runs (reference.debug.records) and the hang programs are what the exercises are about.
TRUTHS = "reference.debug.oracles:*"
DIAGNOSE = exercise("6.1", "Read a hang report: the kind of hang and the ranks at fault", "debug", ["diagnose_hang"],
                    mirrors=(TRUTHS,))
FIRST = exercise("6.2", "first_divergence: where a parallel run first parts from one process", "debug",
                 ["first_divergence"], mirrors=(TRUTHS, "reference.debug.lecture:_map",
                                                "reference.widgets.bisection:bisection_frames"))
ACCUMULATE = exercise("6.3", "Fix the given run: gradient accumulation over padded documents", "debug",
                      ["accumulate_gradients"], comm=("all_reduce",),
                      mirrors=(TRUTHS, "reference.debug.accumulate:*"))


# ----------------------------------------------------------------------------------------------
# 6.1 — reading a hang report


def hang_cases(seed: int, big: bool = False) -> tuple:
    """One case of each kind (name, world size, ranks at fault, options), drawn from ``seed``: the faulty
    ranks, and the step of the run at which it hangs (``at``: 0-9 steps go well first); ``big``: four ranks
    where a case allows it (hidden checks), the pipeline 4 stages with 1 micro-batch (with 2, stages 2 and 3 wait on
    each other and none finishes: the report shows a cycle, p2p's signature)."""
    rng = random.Random(seed)
    W = 4 if big else 3
    p, m = (4, 1) if big else (3, 1)
    at = lambda: {"at": rng.randrange(10)}      # noqa: E731
    return (("order", W, (rng.randrange(W),), at()),
            ("skip", W, (rng.randrange(W),), at()),
            ("p2p", rng.choice((2, 3)), (), at()),
            ("pipeline", p, tuple(r for r in range(p) if p - 1 - r > m), {"num_microbatches": m, **at()}),
            ("group", W, (rng.randrange(1, W - 1),), at()),    # not the last rank: see hangs._group
            ("shape", W, (rng.randrange(W),), {"detail": True, **at()}))


def _written(ctx, harness: str, *args) -> None:
    """Call the learner's function once on a trivial input before the truths are computed (real hangs, real
    runs: seconds): a stub says "not implemented" at once.  Whatever else it returns or raises is judged by
    the check itself, on its real inputs."""
    try:
        ctx.local(harness, *args)
    except CheckTimedOut:
        raise
    except CheckFailed as e:
        if str(e).startswith("not implemented yet"):
            raise


_NO_HANG = {"kind": "timeout", "message": "", "world_size": 2,
            "ranks": {r: {"state": "finished", "blocked_in": "", "error": ""} for r in range(2)}}
_NO_RUN = {"records": [], "world_size": 1}


def _reports(ctx, big: bool = False, kinds: tuple = ()) -> dict:
    _written(ctx, f"{H}:diagnose_call", _NO_HANG)
    cases = hang_cases(ctx.seed(61 if not big else 62), big)
    cases = tuple((n, w, f if n != "p2p" else tuple(range(w)), o) for n, w, f, o in cases if not kinds or n in kinds)
    return {c[0]: r for c, r in zip(cases, ctx.oracle(f"{ORACLES}:hang_reports", cases))}


_SIGNS = {
    "order": "every rank is blocked and they wait in collectives of different kinds at the same step",
    "skip": "some ranks FINISHED while the others wait in a collective: a rank ran out of collectives early",
    "p2p": "every rank is blocked in a send or a receive and none finished: a cycle",
    "pipeline": "ranks wait in sends/receives while a rank (the last stage) finished: not a cycle",
    "group": 'every stuck rank is "running" with no communication the trace knows: process-group creation',
    "shape": "an error names tensor shapes (TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprints)",
}
_RANK_HINTS = {
    "order": "the ranks at fault are the odd ones out: the ranks whose collective differs from what most ranks wait in",
    "skip": "the ranks still waiting are the victims; the one at fault FINISHED early, one collective short",
    "p2p": "in a cycle every rank sent first: every rank of it is at fault",
    "pipeline": "a stage blocked sending a gradient back (to a lower rank) waits for a stage that ran ahead; at fault "
                "are the stages still passing activations forward (sending to a higher rank)",
    "group": "the report cannot tell which rank skipped new_group: name every stuck rank",
    "shape": "read TensorShape in each rank's error: at fault is the rank whose shape differs from the others'",
}


def _diagnose_case(ctx, kind: str, report: dict) -> None:
    truth = report["truth"]
    shown = {k: v for k, v in report.items() if k in ("kind", "message", "world_size", "ranks")}
    got = ctx.local(f"{H}:diagnose_call", shown)
    if not isinstance(got, dict) or "kind" not in got or "ranks" not in got:
        raise CheckFailed(f"diagnose_hang must return {{'kind': …, 'ranks': […]}}; got {type(got).__name__}.")
    states = ", ".join(f"{r}: {v['state']}" + (f" in {v['blocked_in']}" if v["blocked_in"] else "")
                       for r, v in sorted(report["ranks"].items()))
    if got["kind"] != truth["kind"]:
        raise CheckFailed(f"a {report['world_size']}-rank report ({states}): you said {got['kind']!r}, it is "
                          f"{truth['kind']!r} — {_SIGNS[truth['kind']]}.")
    try:
        ranks = sorted(int(r) for r in got["ranks"])
    except (TypeError, ValueError):
        raise CheckFailed(f"'ranks' must be a list of rank numbers; got {got['ranks']!r}.") from None
    if ranks != truth["ranks"]:
        raise CheckFailed(f"the kind is right ({kind}); the ranks at fault are {truth['ranks']}, you named {ranks} "
                          f"({states}): {_RANK_HINTS[kind]}.")


def _kind_check(kinds: tuple, points: float = 1.0):
    words = "; ".join(f"{k}: {_SIGNS[k].split(':')[0]}" for k in kinds)

    @DIAGNOSE.check(f"{words} — the kind and the ranks at fault", points=points, timeout=90)
    def _(ctx):
        reports = _reports(ctx)
        for kind in kinds:
            _diagnose_case(ctx, kind, reports[kind])


# "group" leaves the same report wherever it is planted (every rank "running"): it is graded beside "order"
for _kinds, _points in ((("order", "group"), 2), (("skip",), 1), (("p2p",), 1), (("pipeline",), 1), (("shape",), 1)):
    _kind_check(_kinds, _points)


# ----------------------------------------------------------------------------------------------
# 6.2 — the first divergence


PLANT_GRIDS = {   # plant: (run arguments, where its bug may go: {key: choices})
    "dp_sum": (dict(sizes={"dp": 2}), {}),
    "zero_stale": (dict(sizes={"dp": 2}, steps=3, options={"zero": 1}), {"rank": (0, 1)}),
    "tp_no_f": (dict(sizes={"tp": 2}), {"layer": (0, 1)}),
    "tp_dropout_same": (dict(sizes={"tp": 2}, family="blocks"), {"layer": (0, 1), "rank": (1,)}),
    "tp_dropout_differ": (dict(sizes={"tp": 2}, family="blocks"), {"layer": (0, 1), "rank": (1,)}),
    "pp_no_accumulate": (dict(sizes={"pp": 2}, options={"num_microbatches": 2}), {}),
    "cp_causal_block": (dict(sizes={"cp": 2}), {"layer": (0, 1)}),
    "moe_aux_ep": (dict(sizes={"dp": 2}, options={"num_experts": 4, "top_k": 2, "moe_every": 2}),
                   {"layer": (1,)}),
    "clip_group": (dict(sizes={"pp": 2}, options={"num_microbatches": 2, "clip_grad_norm": 0.05}), {}),
}
CORRECT = (dict(sizes={"tp": 2}, options={"num_experts": 4, "top_k": 2, "moe_every": 2}),
           dict(sizes={"cp": 2}))


def divergence_inputs(seed: int) -> tuple:
    """Every case of 6.2's visible checks: each plant at a place drawn from ``seed``, and two correct composed
    runs — all of one model (and data) seed drawn from ``seed``, so that runs of one configuration share one
    one-process run (recorded once, shipped once)."""
    rng = random.Random(seed)
    model_seed = rng.randrange(1000)
    cases = []
    for plant, (run, where) in PLANT_GRIDS.items():
        cases.append(dict(run, plant=plant, where={k: rng.choice(v) for k, v in where.items()}, seed=model_seed))
    for run in CORRECT:
        cases.append(dict(run, plant=None, where={}, seed=model_seed))
    return tuple(_full(c) for c in cases)


def _full(c: dict) -> dict:
    return dict(plant=c.get("plant"), sizes=c["sizes"], where=c.get("where", {}), seed=c.get("seed", 0),
                steps=c.get("steps", 2), family=c.get("family", "gpt"), options=c.get("options", {}))


def _cases(ctx) -> dict:
    _written(ctx, f"{H}:divergence_call", _NO_RUN, _NO_RUN, {})
    inputs = divergence_inputs(ctx.seed(63))
    table = ctx.oracle(f"{ORACLES}:divergence_table", inputs)
    return {(c["plant"] or f"correct {i}"): dict(case, single=table["singles"][case["single"]])
            for i, (c, case) in enumerate(zip(inputs, table["cases"]))}


def _field(got, name: str):
    return got.get(name) if isinstance(got, dict) else getattr(got, name, None)


def _describe(d) -> str:
    return (f"step {d['step']}, {d['phase']}: {d['module'] or '(model)'} {d['tensor']} on ranks {d['ranks']}"
            if d else "no divergence")


def divergence_verdict(got, want: dict | None, single: dict) -> str | None:
    """None if ``got`` (the learner's answer, a Divergence or its dict) names the record, ranks and size of
    ``want`` (the reference's), else what is wrong."""
    if want is None:
        if got is None:
            return None
        return (f"these runs agree to atol + rtol·|single| everywhere (float64 rounding is not a bug); you reported "
                f"{_describe({k: _field(got, k) for k in ('step', 'phase', 'module', 'tensor', 'ranks')})}.")
    if got is None:
        return f"the runs part at {_describe(want)}; you found no divergence."
    mine = {k: _field(got, k) for k in ("step", "phase", "module", "tensor", "ranks", "max_abs")}
    key = ("step", "phase", "module", "tensor")
    if tuple(mine[k] for k in key) != tuple(want[k] for k in key):
        order = [tuple(r[:4]) for r in single["records"]]
        w, g = tuple(want[k] for k in key), tuple(mine[k] for k in key)
        if g in order and order.index(g) > order.index(w):
            why = (" — a LATER record than the first" if g[0] == w[0] else
                   f" — a later step: step {w[0]} already differs (bisect for the FIRST differing step)")
        elif g in order:
            why = " — an EARLIER record, which agrees (check your comparison: |block − single| ≤ atol + rtol·|single|)"
        else:
            why = " — not a record of the one-process run (use the record's own step, phase, module and tensor)"
        return f"the runs first part at {_describe(want)}; you named {_describe(mine)}{why}."
    try:
        ranks = sorted(int(r) for r in mine["ranks"])
    except (TypeError, ValueError):
        return f"'ranks' must be a list of rank numbers; got {mine['ranks']!r}."
    if ranks != list(want["ranks"]):
        extra = (" Compare each rank's pieces on their own: only some ranks' pieces differ."
                 if set(want["ranks"]) < set(ranks) else "")
        return f"at {_describe(want)} the differing ranks are {want['ranks']}; you named {ranks}.{extra}"
    size = mine["max_abs"]
    if not isinstance(size, (int, float)) or not (size == want["max_abs"] or
                                                  abs(size - want["max_abs"]) <= 1e-6 * abs(want["max_abs"])):
        return (f"the record and ranks are right; the largest |difference| is {want['max_abs']:.6g}, you said "
                f"{size!r} (the largest |block − single| over the differing pieces).")
    return None


def _divergence_check(ctx, case: dict, words: str) -> None:
    got = ctx.local(f"{H}:divergence_call", case["parallel"], case["single"], {})
    msg = divergence_verdict(got, case["answer"], case["single"])
    if msg is not None:
        raise CheckFailed(f"[{words}] {msg}")


_PLANT_WORDS = {
    "dp_sum": ("dp 2: gradients summed, not averaged", 1),
    "zero_stale": ("dp 2, ZeRO-1: one shard stepped with a stale gradient (3 steps)", 1),
    "tp_no_f": ("tp 2: a column-parallel layer without its backward all-reduce", 1),
    "tp_dropout_same": ("tp 2 with dropout: one rank draws the wrong heads' masks", 1),
    "tp_dropout_differ": ("tp 2 with dropout: one rank's hidden-dropout mask differs", 1),
    "pp_no_accumulate": ("pp 2, 2 micro-batches: gradients not accumulated", 1),
    "cp_causal_block": ("cp 2: ring attention's causal mask one block off", 1),
    "moe_aux_ep": ("dp 2 (ep 1): the balance loss ÷ ep instead of ÷ dp", 1),
    "clip_group": ("pp 2: clipping's norm over the wrong group", 1),
}


def _plant_check(plant: str):
    words, points = _PLANT_WORDS[plant]

    @FIRST.check(f"{words}: the first record, the ranks and the size", points=points, timeout=120)
    def _(ctx):
        _divergence_check(ctx, _cases(ctx)[plant], words)


for _plant in PLANT_GRIDS:
    _plant_check(_plant)


@FIRST.check("correct runs (tp 2 with MoE layers; cp 2): no divergence — float64 rounding is not a bug",
             requires_value=True, timeout=120)
def _(ctx):
    cases = _cases(ctx)
    for i, c in enumerate(CORRECT):
        _divergence_check(ctx, cases[f"correct {len(PLANT_GRIDS) + i}"], f"correct run on {c['sizes']}")


# ----------------------------------------------------------------------------------------------
# 6.3 — the given run, fixed


def _given_step(m: Mismatch) -> str | None:
    for how, words in (("given", "this is the GIVEN step's gradient: each micro-batch's own mean, ÷ m, averaged over "
                        "the ranks — a micro-batch of 3 real tokens weighs as much as one of 30. Sum the per-token "
                        "losses and divide by the real tokens of the WHOLE batch (all-reduce the count first)"),
                       ("rank_mean", "each rank divides by its OWN real tokens and the ranks are then averaged: "
                        "the micro-batches are fixed, the ranks are not. Divide by the real tokens of every rank "
                        "together")):
        want = m.extra.get(how, {}).get(m.extra.get("name"))
        if isinstance(m.got, torch.Tensor) and want is not None and m.got.shape == want.shape and \
                torch.allclose(m.got.double(), want.double(), rtol=1e-9, atol=1e-12):
            return words + "."
    return None


def _scaled(m: Mismatch) -> str | None:
    W = m.world_size or 1
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or W == 1:
        return None
    g, e = m.got.double(), m.expected.double()
    if torch.allclose(g * W, e, rtol=1e-9, atol=1e-12):
        return (f"your gradient is exactly 1/{W} of one process's: each share is already ÷ the GLOBAL token count, "
                "so the all-reduce's SUM is the answer — do not divide by the world size again.")
    if torch.allclose(g, e * W, rtol=1e-9, atol=1e-12):
        return f"your gradient is exactly {W}× one process's: divide by the real tokens of all ranks together."
    return None


def _nan_from_an_empty_microbatch(m: Mismatch) -> str | None:
    if m.has_nonfinite and "empty" in m.case:
        return ("NaN: a micro-batch with no real token divides 0 by 0 in a mean. Divide the summed loss by the real "
                "tokens of the WHOLE batch (at least 1), never by a micro-batch's own count.")
    return None


def _accumulation_inputs(W: int, m: int, batch: int, seq_len: int, seed: int, data_seed: int, min_len: int,
                         empty: tuple) -> tuple:
    """(per_rank, state, config) of a 6.3 run: each rank's own micro-batches of the padded batch, and the tiny
    GPT's weights and configuration (the same on every rank), made here in the grader."""
    from dataclasses import asdict

    from reference.debug.accumulate import _model, microbatches, padded_batch
    x, y = padded_batch(batch, seq_len, seed=data_seed, min_len=min_len, empty=empty)
    model = _model(seed, seq_len=seq_len)
    return [microbatches(x, y, r, W, m) for r in range(W)], model.state_dict(), asdict(model.cfg)


def _accumulate_case(ctx, W: int, m: int, *, batch: int, data_seed: int, min_len: int = 0, empty: tuple = (),
                     words: str) -> None:
    seq_len, seed = 8, ctx.seed(65)
    truth = ctx.oracle(f"{ORACLES}:accumulation_truth", batch, seq_len, seed=seed, data_seed=data_seed, min_len=min_len,
                       empty=empty)
    wrong = ctx.oracle(f"{ORACLES}:accumulation_wrong", batch, seq_len, W, m, seed=seed, data_seed=data_seed,
                       min_len=min_len, empty=empty)
    per_rank, state, config = _accumulation_inputs(W, m, batch, seq_len, seed, data_seed, min_len, empty)
    res = ctx.ranks(W, f"{H}:accumulate_per_rank", state, config, per_rank=per_rank)
    for r, v in enumerate(res.values):
        loss = v.get("loss") if isinstance(v, dict) else None
        if isinstance(loss, float) and loss != loss:
            raise CheckFailed(f"[{words}] rank {r} returned the loss NaN: a micro-batch with no real token divides 0 "
                              "by 0 in a mean (F.cross_entropy's default). Sum the per-token losses and divide by "
                              "the real tokens of the WHOLE batch (at least 1).")
        for name, want in truth["grads"].items():
            got = v["grads"].get(name) if isinstance(v, dict) else None
            got = torch.zeros_like(want) if got is None and not want.any() else got
            ctx.compare(got, want, f"gradient of {name}", rank=r, world_size=W, atol=1e-12, rtol=1e-9, case=words,
                        detectors=[_nan_from_an_empty_microbatch, _given_step, _scaled], extra={"name": name, **wrong})
        if not isinstance(loss, float) or abs(loss - truth["loss"]) > 1e-9 * max(1.0, abs(truth["loss"])):
            raise CheckFailed(f"[{words}] rank {r} returned the loss {loss!r}; one process's mean over the "
                              f"{truth['real_tokens']} real tokens is {truth['loss']:.12g}.")


@ACCUMULATE.check("2 ranks × 2 micro-batches of padded documents: loss and gradients = one process", points=3,
                  timeout=90)
def _(ctx):
    _accumulate_case(ctx, 2, 2, batch=8, data_seed=ctx.seed(66), words="W=2, m=2")


@ACCUMULATE.check("1 rank, 4 micro-batches (accumulation alone): = one process", timeout=90)
def _(ctx):
    _accumulate_case(ctx, 1, 4, batch=8, data_seed=ctx.seed(67), words="W=1, m=4")


@ACCUMULATE.check("3 ranks, 1 micro-batch each (data parallelism alone): = one process", timeout=90)
def _(ctx):
    _accumulate_case(ctx, 3, 1, batch=6, data_seed=ctx.seed(68), words="W=3, m=1")


@ACCUMULATE.check("2 ranks × 4 micro-batches, some with no real token at all: no NaN, = one process", timeout=90)
def _(ctx):
    _accumulate_case(ctx, 2, 4, batch=8, data_seed=ctx.seed(69), empty=(1, 6), words="W=2, m=4, empty micro-batches")


# Hints in tiers: the stub's error shows tier 1; ``hint("6.x")`` shows the next one each call.
HINTS = {
    "6.1": [
        'Look at each rank\'s state first: who is blocked, who is "running" with no communication, who FINISHED, '
        "who raised. Each kind of hang leaves its own pattern (the table in reference/debug/diagnose.py's "
        "docstring is in the lecture).",
        "Order the tests: an error naming TensorShape → shape; every stuck rank 'running' → group; all blocked in "
        "send/recv → p2p if nobody finished, pipeline if someone did; someone finished → skip; else collectives of "
        "different kinds → order.",
        "Ranks at fault: shape — parse 'Rank (\\d+) is running collective: …TensorShape=[…]' and take the odd "
        "shape out; order — the ranks whose op (the first word of blocked_in) is the rarer one; skip — the "
        "finished ranks; p2p — every blocked rank; pipeline — the blocked ranks sending to a HIGHER rank or "
        "receiving from a LOWER one; group — every stuck rank.",
    ],
    "6.2": [
        "Compare one record first: for each (rank, offsets, block) of the parallel record, cut the same slice out "
        "of the one-process tensor (record.whole()) and test it with torch.isclose. Then search the steps by "
        "bisection.",
        "whole[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))] is the slice; "
        "~torch.isclose(block, want, rtol=rtol, atol=atol, equal_nan=True) marks the elements that differ. A "
        "step differs if any of its records does: binary search for the first such step (lo, hi = 0, len(steps)).",
        "In the first differing step, walk single_run.records of that step in order and return, for the first "
        "record with a difference, Divergence(step, phase, module, tensor, sorted ranks, max |block − want| over "
        "the differing elements (NaN → inf), that ÷ max |whole|, and the whole tensor's index of that maximum "
        "(offsets + the local index)). No differing step: None.",
    ],
    "6.3": [
        "Start from a copy of the given step's body (accumulate_gradients_given in reference/debug/accumulate.py; "
        "calling it is switched off while 6.3 is graded): it runs, and it is silently wrong whenever micro-batches "
        "hold different numbers of real tokens. Find where with first_divergence, then fix it.",
        "One process divides the summed loss by ALL the real tokens of the batch. The given step divides each "
        "micro-batch by its own count (then ÷ m, ÷ W): a mean of means. Count the real tokens first: y != IGNORE, "
        "summed over your micro-batches, all-reduced over the group.",
        "count = all-reduce Σ (y != IGNORE).sum(); for each micro-batch: F.cross_entropy(…, ignore_index=IGNORE, "
        "reduction='sum') / max(count, 1), backward. Then all-reduce (SUM, no ÷ W) every .grad, and all-reduce "
        "the loss the same way.",
    ],
}
