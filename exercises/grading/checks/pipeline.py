"""Checks for lecture 4b (the pipeline axis): the 1F1B order (4.4), one stage's forward and
backward step (4.5), the bubble formula (4.6).

Ground truth comes from the reference through ``ctx.oracle``: the orders of
``reference.pipeline.schedules``, one process's gradients (gradient accumulation over the same
micro-batches, ``reference.pipeline.oracles.single_process_truth``), and the bubble measured on each
schedule's slot timeline (``reference.pipeline.lecture.slot_bubble``).  Multi-rank checks run the
reference executor, whose ``forward_step``/``backward_step`` (or whose 1F1B order) are the
learner's while it is graded; a bad order deadlocks for real and the runtime names the ranks.
"""
from __future__ import annotations

import random

import torch

from ..core import CheckFailed, exercise, salted_seed
from ..feedback import Mismatch

H = "exercises.grading.harness"
ME = "exercises.grading.harness.pipeline"
SCHED = "reference.pipeline.schedules"
RANKS_TIMEOUT = 10.0

# What the learner writes: the order itself, one stage's step through the given Link, the formula.
# torch.distributed.pipelining (whose schedules hold the 1F1B table) is switched off; so are the
# given functions that compute an answer by another road: the zero-bubble B (4.5's backward with
# the graph kept), the planner's bubble and the schedules' own rules and slot measurement (4.6).
# Mirrors: the other schedules' orders and the simulator (4.4, 4.6), the zero-bubble backward and the
# trace readers (4.5); the executor that runs a schedule (schedule, validate_actions, run_pipeline) stays.
_OTHER_ORDERS = tuple(f"reference.pipeline.schedules:{f}" for f in ("gpipe", "interleaved_one_f_one_b", "zb_h1",
                                                                     "simulate", "measured_bubble", "peak_stash",
                                                                     "render", "_slot_cost"))
ORDER = exercise("4.4", "The 1F1B order of one stage", "pipeline", ["one_f_one_b"], comm=("p2p",),
                 shortcuts=("pipelining",), mirrors=_OTHER_ORDERS)
STEP = exercise("4.5", "One stage, one micro-batch: forward_step and backward_step", "pipeline",
                ["forward_step", "backward_step"], comm=("p2p",), shortcuts=("pipelining",),
                mirrors=tuple(f"reference.pipeline.executor:{f}" for f in (
                    "backward_input_step", "backward_weight_step", "_layer_outputs", "actions_from_trace",
                    "peak_stashed_from_trace", "wall_clock_bubble")))
BUBBLE = exercise("4.6", "The bubble fraction, by formula", "pipeline", ["bubble_fraction"], shortcuts=("pipelining",),
                  mirrors=("reference.planner.counts:bubble_fraction", "reference.pipeline.schedules:*",
                           "reference.pipeline.lecture:slot_bubble"))


# ----------------------------------------------------------------------------------------------
# Harnesses (run in the runner or on its ranks)


# ----------------------------------------------------------------------------------------------
# 4.4 — the 1F1B order


def _as_actions(got) -> list[tuple] | None:
    try:
        return [(str(a[0]), int(a[1])) for a in got]
    except Exception:
        return None


def _warmup(order: list[tuple]) -> int:
    n = 0
    for kind, _ in order:
        if kind != "F":
            break
        n += 1
    return n


def _order_case(ctx, p: int, m: int) -> None:
    from reference.pipeline.schedules import Action, peak_stash, simulate
    got_all = []
    for s in range(p):
        got = ctx.local(f"{H}:call", "one_f_one_b", (p, m, s))
        want = [tuple(a)[:2] for a in ctx.oracle(f"{SCHED}:one_f_one_b", p, m, s)]
        mine = _as_actions(got) if isinstance(got, (list, tuple)) else None
        if mine is None:
            raise CheckFailed(f"one_f_one_b({p}, {m}, stage={s}) must return a list of Action(kind, microbatch); "
                              f"got {type(got).__name__}.")
        got_all.append(mine)
        if mine == want:
            continue
        words = f"p={p}, m={m}, stage {s}"
        hint = ""
        w_got, w_want = _warmup(mine), _warmup(want)
        if sorted(mine) != sorted(want):
            hint = " Each micro-batch needs exactly one F and one B on every stage."
        elif w_got != w_want:
            hint = (f" It runs {w_got} forward{'s' if w_got != 1 else ''} before its first backward; 1F1B warms up "
                    f"with min(m, p − s − 1) = {min(m, p - s - 1)} forwards and then starts its first F-B pair" + (
                                        ": more keeps more activations stashed (memory grows towards GPipe's m)."
                                        if w_got > w_want else ": fewer makes it wait for a gradient that cannot "
                                        "come back yet (the later stages have not seen enough micro-batches)."))
        raise CheckFailed(f"[{words}] got {_short(mine)}; expected {_short(want)}.{hint}")
    # the whole order: runs without deadlock, and stage s holds at most p − s micro-batches
    plan = [[Action(k, i) for k, i in stage] for stage in got_all]
    try:
        simulate(plan)
    except ValueError as e:
        raise CheckFailed(f"p={p}, m={m}: {e}") from None
    peaks = peak_stash(plan)
    bad = [s for s in range(p) if peaks[s] > p - s]
    if bad:
        raise CheckFailed(f"p={p}, m={m}: stage {bad[0]} holds {peaks[bad[0]]} micro-batches at once; 1F1B keeps at "
                          f"most p − s = {p - bad[0]}.")


def _short(order: list[tuple], n: int = 12) -> str:
    text = " ".join(f"{k}{i}" for k, i in order[:n])
    return text + (" …" if len(order) > n else "")


@ORDER.check("p = 3 to 24, m from p+1 to 6p: every stage's order (warm-up, steady one-forward-one-backward, "
             "cool-down)", points=2)
def _(ctx):
    rng = random.Random(salted_seed(41))      # 1,485 (p, m) pairs, 24,475 stages' orders: too many to tabulate
    p = rng.randint(3, 24)
    _order_case(ctx, p, rng.randint(p + 1, 6 * p))


@ORDER.check("m = p (no steady state left over) and a single stage (no warm-up at all)")
def _(ctx):
    rng = random.Random(salted_seed(42))
    p = rng.randint(2, 6)
    _order_case(ctx, p, p)
    _order_case(ctx, 1, rng.randint(2, 7))


@ORDER.check("odd sizes: 3, 5 and 7 stages with more micro-batches than stages", points=2)
def _(ctx):
    rng = random.Random(salted_seed(44))
    for p in (3, 5, 7):
        _order_case(ctx, p, p + rng.randrange(1, 6))


@ORDER.check("your order on 3 real ranks: no deadlock, every gradient equals one process's (m = 3 to 6)",
             timeout=RANKS_TIMEOUT + 30)
def _(ctx):
    """Graded on the order alone: the grader runs it with the reference's own forward and backward
    steps (so 4.4 does not wait for 4.5).  The order is plain data the learner's function returned."""
    p, m, seed = 3, random.Random(salted_seed(43)).randint(3, 6), salted_seed(430)
    orders = []
    for s in range(p):
        got = _as_actions(ctx.local(f"{H}:call", "one_f_one_b", (p, m, s)))
        if got is None:
            raise CheckFailed(f"one_f_one_b({p}, {m}, stage={s}) must return a list of Action(kind, microbatch).")
        orders.append(got)
    out = ctx.oracle("reference.pipeline.oracles:run_order", orders, m, seed=seed)
    if "error" in out:
        raise CheckFailed(f"[1F1B, p={p}, m={m}] your order did not run on real ranks: {out['error']}")
    truth = ctx.oracle("reference.pipeline.oracles:single_process_truth", m, num_stages=p, seed=seed)
    ctx.compare(torch.tensor(float(out["loss"]), dtype=torch.float64), torch.tensor(truth["loss"], dtype=torch.float64),
                "loss", atol=1e-12, rtol=1e-12, case=f"1F1B, p={p}, m={m}")
    for name, want in truth["grads"].items():
        ctx.compare(out["grads"].get(name), want, f"gradient of {name}", atol=1e-12, rtol=1e-10,
                    case=f"1F1B, p={p}, m={m}")


# ----------------------------------------------------------------------------------------------
# 4.5 — forward_step / backward_step


def _m_times(m: int):
    def detect(mm: Mismatch) -> str | None:
        if not isinstance(mm.got, torch.Tensor) or mm.got.shape != mm.expected.shape:
            return None
        e = mm.expected.double()
        if torch.allclose(mm.got.double(), m * e, rtol=1e-9, atol=1e-12):
            return (f"exactly m = {m} times the true value: each micro-batch's loss must be divided by m "
                    "(num_microbatches) so that the sum over micro-batches is the mean over the whole batch.")
        if torch.allclose(mm.got.double(), e / m, rtol=1e-9, atol=1e-12):
            return f"exactly 1/m = 1/{m} of the true value: the loss is divided by m twice."
        return None
    return detect


def _step_case(ctx, p: int, schedule: str, m: int, kw: dict, words: str):
    res = ctx.ranks(p, f"{ME}:pipeline_step", schedule, m, kw, timeout=RANKS_TIMEOUT)
    v = kw.get("virtual_stages", 1)
    model_kw = {k: kw[k] for k in ("layers", "width", "seed") if k in kw}
    truth = ctx.oracle("reference.pipeline.oracles:single_process_truth", m, num_stages=p, virtual_stages=v, **model_kw)
    per_mb = ctx.oracle("reference.pipeline.oracles:microbatch_grads", m, num_stages=p, virtual_stages=v, **model_kw)
    losses = [x["loss"] for x in res.values if isinstance(x, dict) and x.get("loss") is not None]
    ctx.expect(len(losses) == 1, f"[{words}] exactly one rank (the last stage's) should return the loss; "
               f"{len(losses)} did.")
    ctx.compare(torch.tensor(float(losses[0]), dtype=torch.float64), torch.tensor(truth["loss"], dtype=torch.float64),
                "loss", atol=1e-12, rtol=1e-12, case=words, detectors=[_m_times(m)])
    got = {}
    for x in res.values:
        got.update(x["grads"])
    for name, want in truth["grads"].items():
        g = got.get(name)
        if g is None:
            raise CheckFailed(f"[{words}] parameter {name} has no gradient after the step: backward_step must "
                              "backpropagate every micro-batch it is given, from the gradient the next stage sent.")
        ctx.compare(g, want, f"gradient of {name}", atol=1e-12, rtol=1e-10, case=words,
                    detectors=[_m_times(m), _one_microbatch_only(m)],
                    extra={"per_microbatch": [mb[name] for mb in per_mb]})
    return res


def _one_microbatch_only(m: int):
    def detect(mm: Mismatch) -> str | None:
        if not isinstance(mm.got, torch.Tensor) or m < 2:
            return None
        for i, g in enumerate(mm.extra.get("per_microbatch", [])):
            for scale in (1, m):
                if g.shape == mm.got.shape and torch.allclose(mm.got.double(), scale * g.double(), rtol=1e-9,
                                                               atol=1e-12):
                    return (f"this is micro-batch {i}'s share alone{' (times m)' if scale > 1 else ''}, not the sum "
                            "over all m: gradients must accumulate over micro-batches (never zero .grad or replace "
                            "it between micro-batches).")
        return None
    return detect


@STEP.check("2 stages, GPipe, m = 2: the loss and every gradient equal one process's (float64)", points=2,
            timeout=RANKS_TIMEOUT)
def _(ctx):
    _step_case(ctx, 2, "gpipe", 2, {"seed": salted_seed(450)}, "GPipe, p=2, m=2")


@STEP.check("3 stages, 1F1B, m = 3 to 7", points=2, timeout=RANKS_TIMEOUT)
def _(ctx):
    m = random.Random(salted_seed(45)).randint(3, 7)
    _step_case(ctx, 3, "1f1b", m, {"seed": salted_seed(451)}, f"1F1B, p=3, m={m}")


@STEP.check("4 stages, an uneven layer split (1 to 3 blocks each), 1F1B, m = 4", timeout=RANKS_TIMEOUT)
def _(ctx):
    rng = random.Random(salted_seed(46))
    sizes = [rng.randint(1, 3) for _ in range(4)]
    _step_case(ctx, 4, "1f1b", 4, {"layers": sum(sizes), "sizes": sizes, "seed": salted_seed(452)},
               f"1F1B, p=4, blocks {sizes}, m=4")


@STEP.check("interleaved 1F1B: 2 ranks × 2 chunks, m = 4", timeout=RANKS_TIMEOUT)
def _(ctx):
    _step_case(ctx, 2, "interleaved_1f1b", 4, {"virtual_stages": 2, "seed": salted_seed(453)},
               "interleaved, p=2, v=2, m=4")


def _expected_link_calls(plan: list, p: int, v: int) -> dict[int, list[tuple[str, int]]]:
    """What each virtual stage must send and receive, action by action: F(i) receives micro-batch i's
    activation (not the first stage) and sends its output (not the last); B(i) receives the output's
    gradient (not the last) and sends the input's gradient (not the first)."""
    K = p * v
    want: dict[int, list[tuple[str, int]]] = {}
    for rank, actions in enumerate(plan):
        for a in actions:
            k, i = a.chunk * p + rank, a.microbatch
            calls = want.setdefault(k, [])
            if a.kind == "F":
                calls += ([("recv_activation", i)] if k > 0 else []) + ([("send_activation", i)] if k < K - 1 else [])
            else:
                calls += ([("recv_gradient", i)] if k < K - 1 else []) + ([("send_gradient", i)] if k > 0 else [])
    return want


@STEP.check("every message through the stage's Link, in the schedule's order (recorded by the grader's own Link)",
            timeout=RANKS_TIMEOUT)
def _(ctx):
    from reference.pipeline.schedules import schedule
    m = random.Random(salted_seed(47)).randint(3, 6)
    res = _step_case(ctx, 3, "1f1b", m, {"seed": salted_seed(454)}, f"1F1B, p=3, m={m}")
    got: dict[int, list] = {}
    for x in res.values:
        got.update({int(k): [(str(c), int(i)) for c, i in v] for k, v in x["links"].items()})
    for k, calls in sorted(_expected_link_calls(schedule("1f1b", 3, m), 3, 1).items()):
        mine = got.get(k, [])
        if mine != calls:
            first = next((j for j, (a, b) in enumerate(zip(mine, calls)) if a != b), min(len(mine), len(calls)))
            shown = lambda xs: ", ".join(f"{c}({i})" for c, i in xs[max(0, first - 1):first + 3]) or "nothing"  # noqa: E731
            raise CheckFailed(f"stage {k}: its Link saw {len(mine)} calls, the schedule needs {len(calls)}; from call "
                              f"{first} on it saw {shown(mine)} where {shown(calls)} was due. Receive and send every "
                              "activation and gradient through `link` (no other way between stages), once each, "
                              "in the step that needs it.")


@STEP.check("activations freed as soon as each backward is done (trace; feedback only, no points)", points=0,
            timeout=RANKS_TIMEOUT)
def _(ctx):
    m = 4
    res = ctx.ranks(2, f"{ME}:pipeline_step", "gpipe", m, {}, timeout=RANKS_TIMEOUT)
    for r in range(2):      # the executor records, after each action, how many micro-batches it holds
        held = [e["meta"].get("stashed") for e in res.events("compute", rank=r) if "stashed" in e["meta"]]
        ctx.expect(held and held[-1] == 0, f"rank {r} still holds {held[-1] if held else '?'} micro-batches after "
                   "the step: backward_step must take its micro-batch OUT of the stash (stash.pop), or every "
                   "activation stays alive until the step ends.")
        ctx.expect(max(held) <= m, f"rank {r} held {max(held)} micro-batches at once with m = {m}.")


# ----------------------------------------------------------------------------------------------
# 4.6 — the bubble


def _bubble_case(ctx, name: str, p: int, m: int, v: int = 1, truth: str = "measured") -> None:
    """``truth``: "measured" on the schedule's slot timeline, or (for sizes no simulator finishes)
    the reference's formula, which the tests hold equal to the measurement."""
    got = ctx.local(f"{H}:call", "bubble_fraction", (name, p, m), {"virtual_stages": v}, timeout=5)
    want = (ctx.oracle("reference.pipeline.lecture:slot_bubble", name, p, m, v) if truth == "measured" else
            ctx.oracle("reference.pipeline.schedules:bubble_fraction", name, p, m, virtual_stages=v))
    words = f"{name}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        raise CheckFailed(f"bubble_fraction({words}) must return a number, got {type(got).__name__}.")
    if abs(got - want) <= 1e-12:
        return
    hint = ""
    ideal = {"interleaved_1f1b": v * m, "zb_h1": 3 * m}.get(name, m)     # the slots of work alone
    if any(abs(got - (p - 1) / w) < 1e-12 for w in (m, ideal)):
        hint = (" That is Megatron-LM's convention (the bubble relative to the ideal time, the slots of work "
                "alone); this exercise asks for the fraction of the step: what is the step's whole length in slots?")
    elif abs(got - (p - 1) / p) < 1e-12:
        hint = " (p−1)/p is the naive pipeline without micro-batches; m micro-batches shrink it."
    elif v > 1 and abs(got - (p - 1) / (m + p - 1)) < 1e-12:
        hint = (" that is 1F1B's bubble: with v chunks per rank each block is 1/v of the work, so the fill takes 1/v "
                "as long.")
    elif name == "zb_h1" and abs(got - (p - 1) / (m + p - 1)) < 1e-12:
        hint = (" that is 1F1B's bubble: ZB-H1 splits the backward into B and W (three slots per micro-batch) and "
                "fills the cool-down with W's.")
    raise CheckFailed(f"bubble_fraction({words}) = {got:.6g}; measured on the schedule's slot timeline it is "
                      f"{want:.6g}.{hint}")


@BUBBLE.check("GPipe and 1F1B on 2–64 stages and 1–512 micro-batches: the measured slot bubble", points=2)
def _(ctx):
    rng = random.Random(salted_seed(61))
    for name in ("gpipe", "gpipe", "1f1b", "1f1b"):
        p = rng.randint(2, 8)
        _bubble_case(ctx, name, p, rng.randint(1 if name == "gpipe" else p, 4 * p))
    _bubble_case(ctx, "gpipe", rng.randint(32, 64), rng.randint(256, 512))


@BUBBLE.check("interleaved 1F1B with 2 and 3 chunks per rank")
def _(ctx):
    rng = random.Random(salted_seed(62))
    for v in (2, 3, rng.choice([2, 3])):
        p = rng.randint(2, 4)
        _bubble_case(ctx, "interleaved_1f1b", p, p * rng.randint(1, 3), v)


@BUBBLE.check("ZB-H1: the backward split in two fills the cool-down")
def _(ctx):
    rng = random.Random(salted_seed(63))
    for _ in range(3):
        p = rng.randint(2, 6)
        _bubble_case(ctx, "zb_h1", p, rng.randint(p, 2 * p))


@BUBBLE.check("a formula, not a simulation: thousands of stages and millions of micro-batches, every schedule")
def _(ctx):
    rng = random.Random(salted_seed(64))
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        p = rng.randint(1000, 5000)
        v = rng.randint(2, 8) if name == "interleaved_1f1b" else 1
        _bubble_case(ctx, name, p, p * rng.randint(1000, 20000), v, truth="formula")


@BUBBLE.check("what schedule() refuses raises ValueError: an unknown name, 1F1B with m < p", requires_value=True)
def _(ctx):
    rng = random.Random(salted_seed(65))
    p = rng.randint(3, 8)
    for args, kw in (((rng.choice(["pipedream", "1F1B", "dualpipe"]), p, 2 * p), {}), (("1f1b", p, p - 1), {}),
                     (("interleaved_1f1b", p, p + 1), {"virtual_stages": 2}),
                     (("gpipe", p, 2 * p), {"virtual_stages": 2})):
        err = ctx.local(f"{H}:raises", "bubble_fraction", args, kw)
        if err != "ValueError":
            raise CheckFailed(f"bubble_fraction{args}{', ' + str(kw) if kw else ''} should raise ValueError, "
                              f"{'returned a number' if err is None else 'raised ' + err}.")


HINTS = {
    "4.4": [
        "Stage s must have sent some forwards down the pipe before the first backward can come back up: how many "
        "micro-batches are in flight below it when the last stage starts its first backward? After that, alternate.",
        "Warm-up: w = min(m, p − s − 1) forwards (the last stage: none). Then m − w pairs: the forward of the next "
        "micro-batch, then the backward of the oldest one in flight. Then the w backwards left.",
        "A sketch: the warm-up forwards, the steady pairs, the cool-down backwards — every micro-batch once as F "
        "and once as B, its F first. Draw your order for every stage with render() (the cell under exercise 4.4 "
        "does): the last stage alternates from the start, the first stage fills the pipe.",
    ],
    "4.5": [
        "The first stage reads inputs, the others link.recv_activation(microbatch); run the module; the last stage "
        "computes the loss, the others link.send_activation(...). Keep in stash what the backward of this "
        "micro-batch will need.",
        "Forward: make the received activation a leaf that requires grad (x.requires_grad_()) so backward gives "
        "its gradient; the last stage's loss is loss_fn(y, target) / num_microbatches (the mean over the batch); "
        "stash[microbatch] = (x, y or loss); send y.detach().",
        "A sketch of the backward: pop this micro-batch's stash (popping frees it); the gradient of the output "
        "comes from the next stage (the last stage starts from its loss); backpropagate it through the stashed "
        "output, and every stage but the first sends its input's gradient back.",
    ],
    "4.6": [
        "Count in slots. While the first micro-batch travels down and the last one comes back, how many slots does "
        "each stage wait, and how many does it work in total?",
        "GPipe and 1F1B: each stage works 2m slots (F and B) and waits 2(p − 1) — the fill and the drain. The idle "
        "fraction is idle / (idle + work). Interleaving cuts every block into v smaller ones; ZB-H1 works 3m slots.",
        "A sketch: gpipe, 1f1b: (p−1)/(m+p−1); interleaved: (p−1)/(v·m+p−1); zb_h1: (p−1)/(3m+p−1). Validate "
        "first, with the rules the docstring lists (an unknown name, 1F1B with m < p, …: ValueError).",
    ],
}
