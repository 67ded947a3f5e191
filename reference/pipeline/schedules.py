"""Pipeline schedules as pure data: which micro-batch each stage runs, in which order.

A pipeline of ``p`` stages (one per rank) trains on a batch cut into ``m`` micro-batches.  A
*schedule* is, for every stage, the ordered list of what it computes::

    schedule("1f1b", 4, 8)[1]  ->  [F0, F1, F2, B0, F3, B1, F4, B2, ..., B7]

Each entry is an :class:`Action` ``(kind, microbatch, chunk)``: ``kind`` "F" (forward), "B"
(backward; for zero-bubble schedules only the *input*-gradient half) or "W" (zero-bubble only:
the *weight*-gradient half); ``microbatch`` counts from 0; ``chunk`` is which of this rank's model
chunks it runs (always 0 unless the schedule is interleaved).

Virtual stages.  With ``v`` chunks per rank (interleaved schedules) the model is cut into
``p·v`` pieces, the *virtual stages* 0 … p·v−1 in model order, dealt out round-robin: rank r holds
chunks 0 … v−1, and **chunk c on rank r is virtual stage c·p + r**.  For p = 2, v = 2::

    virtual stage:   0        1        2        3
    rank (chunk):    0 (c0)   1 (c0)   0 (c1)   1 (c1)

so an activation visits rank 0, 1, 0, 1 and its gradient 1, 0, 1, 0.  Same convention as
Megatron-LM and ``torch.distributed.pipelining`` (its ``stage_index``).  The V-shaped schedules of
lecture 4b's last section (ZB-V, DualPipeV) fold two chunks per rank instead, ``placement="v"``:
chunk 0 of rank r is stage r, chunk 1 is stage 2p−1−r, so a micro-batch runs down the ranks and back
up (:func:`virtual_stage`; :func:`simulate` and :func:`render` take either placement).

The four schedules (slot diagrams drawn by :func:`render` with one slot per F, B or W)::

    GPipe, p=4, m=4: all forwards, then all backwards (fill, then drain)
      stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
      stage 1 | .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
      stage 2 | .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
      stage 3 | .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .

    1F1B (PipeDream-Flush), p=4, m=8: warm up with p−s−1 forwards, then alternate
      stage 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
      stage 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
      stage 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
      stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

Both idle (p−1)·(F+B) per stage: a bubble of (p−1)/(m+p−1) of the time.  1F1B does not shrink
the bubble; it caps memory: stage s holds at most p−s micro-batches' activations, GPipe holds m.
Interleaving (v chunks per rank, each 1/v of the work) shrinks the bubble to (p−1)/(v·m+p−1); the
zero-bubble ZB-H1 schedule runs the weight gradients W late, in what was the bubble, and keeps
1F1B's peak memory (its W for micro-batch j runs right after the B of micro-batch j+s).

Papers: GPipe, arXiv:1811.06965 · PipeDream, arXiv:1806.03377 · PipeDream-Flush (1F1B) in
"Memory-Efficient Pipeline-Parallel DNN Training", arXiv:2006.09503, and Megatron-LM's interleaved
1F1B, arXiv:2104.04473 · Zero Bubble Pipeline Parallelism (ZB-H1), arXiv:2401.10241.

Read in this order: :class:`Action`, :func:`gpipe`, :func:`one_f_one_b` (exercise 4.4),
:func:`interleaved_one_f_one_b`, :func:`zb_h1`, :func:`schedule`, :func:`simulate` (a slot
timeline honouring the dependencies), :func:`bubble_fraction` (exercise 4.6).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["Action", "SCHEDULES", "PLACEMENTS", "schedule", "gpipe", "one_f_one_b", "interleaved_one_f_one_b",
           "zb_h1", "virtual_stage", "rank_of_stage", "validate_actions", "simulate", "measured_bubble",
           "bubble_fraction", "peak_stash", "render"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
PLACEMENTS = ("loop", "v")


class Action(NamedTuple):
    """One block of work on one stage: ``Action("F", 3)`` is the forward of micro-batch 3.

    kind:        "F" forward, "B" backward (input gradient only, if the schedule has "W"), "W" weight gradient
    microbatch:  0 … m−1
    chunk:       which model chunk of this rank (interleaved); virtual stage = chunk·p + rank
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward, micro-batches in order 0 … m−1 (as torch does;
    any backward order gives the same bubble)."""
    m = num_microbatches
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-Flush) order of one stage — exercise 4.4.

    Warm-up: min(m, p − stage − 1) forwards.  Steady state: one forward, then one backward (the
    oldest micro-batch in flight), until every forward has run.  Cool-down: the backwards left.
    Stage s thus holds at most p − s micro-batches' activations at once.

    Graded on: every stage's order for up to 24 stages and 6p micro-batches drawn at random, m = p and one stage,
    and the order run on 3 real ranks.
    """
    p, m, s = num_stages, num_microbatches, stage
    warmup = min(m, p - s - 1)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):                      # steady: F of the newest, B of the oldest
        order += [Action("F", warmup + i), Action("B", i)]
    order += [Action("B", i) for i in range(m - warmup, m)]
    return order


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int, rank: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (arXiv:2104.04473, §2.2) on one rank; needs m % p == 0.

    The rank runs m·v forwards and m·v backwards.  Its k-th forward takes micro-batches in groups
    of p: chunk (k // p) mod v, micro-batch (k // (p·v))·p + k mod p — p micro-batches through
    chunk 0, the same p through chunk 1, …, then the next p.  Backwards go the same way with the
    chunks in reverse (v−1 first).  Warm-up: (p − rank − 1)·2 + (v − 1)·p forwards (at most m·v),
    then one forward, one backward; then the backwards left.  Identical to the order of
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` when m is a multiple of p.
    """
    p, m, v, r = num_stages, num_microbatches, virtual_stages, rank
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action("F", microbatch(k), (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", microbatch(k), v - 1 - (k // p) % v)

    warmup = min(total, (p - r - 1) * 2 + (v - 1) * p)
    order = [forward(k) for k in range(warmup)]
    for j in range(total - warmup):
        order += [forward(warmup + j), backward(j)]
    order += [backward(j) for j in range(total - warmup, total)]
    return order


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZB-H1 (arXiv:2401.10241, §2.1): 1F1B with each backward split into B (input gradient, on
    the critical path) and W (weight gradient, off it).  Stage s runs W of micro-batch j right
    after B of micro-batch j + s (the last s W's at the end), so every stage holds at most p
    micro-batches — 1F1B's peak, on stage 0 — while the W's fill the cool-down bubble.
    """
    s, m = stage, num_microbatches
    order: list[Action] = []
    for a in one_f_one_b(num_stages, m, stage):
        order.append(a)
        if a.kind == "B" and a.microbatch >= s:
            order.append(Action("W", a.microbatch - s))
    order += [Action("W", j) for j in range(max(0, m - s), m)]
    return order


def _check(name: str, num_stages, num_microbatches, virtual_stages) -> None:
    """The ValueErrors of :func:`schedule` (the rules :func:`bubble_fraction` states again)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for what, x in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                    ("virtual_stages", virtual_stages)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {x!r}")
    p, m, v = num_stages, num_microbatches, virtual_stages
    if name == "interleaved_1f1b":
        if v < 2:
            raise ValueError("interleaved_1f1b needs virtual_stages >= 2 (model chunks per rank); "
                             "with one chunk per rank use '1f1b'")
        if m % p:
            raise ValueError(f"interleaved_1f1b sends micro-batches through each chunk in groups of p: "
                             f"num_microbatches ({m}) must be a multiple of num_stages ({p})")
    elif v != 1:
        raise ValueError(f"virtual_stages={v} needs an interleaved schedule; {name!r} runs one chunk per rank")
    if name in ("1f1b", "zb_h1") and m < p:
        raise ValueError(f"{name} needs num_microbatches >= num_stages (got m={m} < p={p}): with fewer "
                         f"micro-batches than stages the pipeline never reaches its steady one-forward-one-"
                         f"backward state, stages idle waiting for work that never comes; use 'gpipe' (or "
                         f"more micro-batches)")


def schedule(name: str, num_stages: int, num_microbatches: int, *, virtual_stages: int = 1) -> list[list[Action]]:
    """Every stage's ordered actions: ``schedule(name, p, m)[rank]``.

    name: "gpipe", "1f1b", "interleaved_1f1b" (needs ``virtual_stages`` ≥ 2 and m % p == 0) or
    "zb_h1" (actions "F", "B", "W").  Raises ValueError for impossible combinations — a pure
    function, so every rank can call it before sending anything.
    """
    _check(name, num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if name == "gpipe":
        return [gpipe(p, m, s) for s in range(p)]
    if name == "1f1b":
        return [one_f_one_b(p, m, s) for s in range(p)]
    if name == "interleaved_1f1b":
        return [interleaved_one_f_one_b(p, m, v, r) for r in range(p)]
    return [zb_h1(p, m, s) for s in range(p)]


# ----------------------------------------------------------------------------------------------
# Where each chunk sits


def virtual_stage(chunk: int, rank: int, num_stages: int, placement: str = "loop") -> int:
    """The virtual stage (piece of the model, in model order) that ``chunk`` of ``rank`` runs::

        loop   c·p + r                        interleaved 1F1B, breadth-first: p = 2, v = 2 → ranks 0 1 0 1
        v      r (chunk 0), 2p − 1 − r (1)    ZB-V, DualPipeV: p = 2 → ranks 0 1 1 0
    """
    if placement == "loop":
        return chunk * num_stages + rank
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"the V placement holds two chunks per rank (0 and 1), got chunk {chunk}")
        return rank if chunk == 0 else 2 * num_stages - 1 - rank
    raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def rank_of_stage(stage: int, num_stages: int, placement: str = "loop") -> int:
    """The rank holding virtual ``stage`` (the inverse of :func:`virtual_stage`)."""
    if placement == "v":
        return stage if stage < num_stages else 2 * num_stages - 1 - stage
    return virtual_stage(0, stage % num_stages, num_stages, placement)


# ----------------------------------------------------------------------------------------------
# Checking and simulating an order


def validate_actions(actions_per_stage: Sequence[Sequence[Action]], num_microbatches: int | None = None,
                     virtual_stages: int | None = None) -> tuple[int, int]:
    """Check an order (from :func:`schedule` or written by hand): every (micro-batch, chunk) of
    every stage has exactly one F and one B, after its F; with any W, exactly one W after its B.
    Returns ``(num_microbatches, virtual_stages)`` (inferred when not given).  Raises ValueError."""
    if not actions_per_stage:
        raise ValueError("an order needs at least one stage")
    acts = [Action(*a) for stage in actions_per_stage for a in stage]
    m = num_microbatches if num_microbatches is not None else 1 + max((a.microbatch for a in acts), default=-1)
    v = virtual_stages if virtual_stages is not None else 1 + max((a.chunk for a in acts), default=0)
    split = any(a.kind == "W" for a in acts)
    for s, stage in enumerate(actions_per_stage):
        seen: dict[tuple[str, int, int], int] = {}
        for n, a in enumerate(Action(*a) for a in stage):
            if a.kind not in ("F", "B", "W") or not (0 <= a.microbatch < m) or not (0 <= a.chunk < v):
                raise ValueError(f"stage {s}, action {n}: {a!r} is not an F/B/W of a micro-batch in 0..{m - 1} "
                                 f"and a chunk in 0..{v - 1}")
            if (a.kind, a.microbatch, a.chunk) in seen:
                raise ValueError(f"stage {s} runs {a} twice")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.microbatch, a.chunk) not in seen:
                raise ValueError(f"stage {s} runs {a} before {Action(before, a.microbatch, a.chunk)}")
            seen[(a.kind, a.microbatch, a.chunk)] = n
        kinds = ("F", "B", "W") if split else ("F", "B")
        missing = [Action(k, i, c) for c in range(v) for i in range(m) for k in kinds if (k, i, c) not in seen]
        if missing:
            raise ValueError(f"stage {s} never runs {', '.join(map(str, missing[:4]))}"
                             + (" …" if len(missing) > 4 else ""))
    return m, v


Timeline = list[list[tuple[float, float, Action]]]


Cost = dict[str, float] | Callable[[Action], float] | None


def _slot_cost(cost: Cost) -> Callable[[Action], float]:
    costs = {"F": 1.0, "B": 1.0, "W": 1.0}
    if isinstance(cost, dict):
        costs.update(cost)
    return cost if callable(cost) else (lambda a: costs[a.kind])


def simulate(actions_per_stage: Sequence[Sequence[Action]], *, cost: Cost | Sequence[Cost] = None,
             placement: str = "loop") -> Timeline:
    """Run an order in schedule slots: per stage, ``[(start, end, action), ...]``.

    Each stage runs its actions in its order, each as early as its inputs allow (messages take no
    time): F of micro-batch i at virtual stage k after F of i at k−1; B of i at k after F of i at k
    and after B of i at k+1 (on the last virtual stage: after its own F); W after its B.  ``cost``:
    slots per kind (default F = B = W = 1) or a function of the action — or a list of those, one per
    stage; ``placement``: where each chunk sits (:func:`virtual_stage`).  Raises ValueError when an
    order is invalid or stops: stages waiting for work that nobody will send (a deadlock).
    """
    m, v = validate_actions(actions_per_stage)
    if placement == "v" and v > 2:
        raise ValueError(f"the V placement holds two chunks per rank, this order has {v}")
    p, K = len(actions_per_stage), len(actions_per_stage) * v
    per_stage = isinstance(cost, (list, tuple))
    if per_stage and len(cost) != p:
        raise ValueError(f"cost: one entry per stage ({p}), got {len(cost)}")
    slots = [_slot_cost(cost[r] if per_stage else cost) for r in range(p)]
    orders = [[Action(*a) for a in stage] for stage in actions_per_stage]

    def needs(a: Action, k: int) -> list[tuple[str, int, int]]:      # (kind, virtual stage, micro-batch)
        if a.kind == "F":
            return [("F", k - 1, a.microbatch)] if k > 0 else []
        if a.kind == "B":
            return [("F", k, a.microbatch)] + ([("B", k + 1, a.microbatch)] if k < K - 1 else [])
        return [("B", k, a.microbatch)]

    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * p, [0] * p
    timeline: Timeline = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                k = virtual_stage(a.chunk, r, p, placement)
                deps = needs(a, k)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + slots[r](a)
                done[(a.kind, k, a.microbatch)] = free[r]
                timeline[r].append((start, free[r], a))
                pos[r] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(orders[r])]
    if stuck:
        waits = []
        for r in stuck:
            a = orders[r][pos[r]]
            k = virtual_stage(a.chunk, r, p, placement)
            kind, kk, i = next(d for d in needs(a, k) if d not in done)
            waits.append(f"stage {r} waits at {a} for {kind}{i} of virtual stage {kk} "
                         f"(rank {rank_of_stage(kk, p, placement)})")
        raise ValueError("this order deadlocks: " + "; ".join(waits))
    return timeline


def measured_bubble(timeline: Timeline) -> float:
    """Idle fraction of a timeline: 1 − busy / (stages × makespan), from time 0 to the last end."""
    span = max((end for stage in timeline for _, end, _ in stage), default=0.0)
    busy = sum(end - start for stage in timeline for start, end, _ in stage)
    return 1.0 - busy / (len(timeline) * span) if span else 0.0


def bubble_fraction(name: str, num_stages: int, num_microbatches: int, *, virtual_stages: int = 1) -> float:
    """The idle fraction of a schedule, by formula — exercise 4.6.

    name: "gpipe", "1f1b", "interleaved_1f1b" (v = ``virtual_stages`` chunks per rank) or "zb_h1".
    With every F, B (and W) one slot: idle slots / (p × the slots from the first start to the last end),
    which :func:`simulate` + :func:`measured_bubble` on :func:`schedule` measure (notebook 04b
    derives each case).  Raises ValueError for what :func:`schedule` refuses: an unknown name;
    p, m or v not an integer ≥ 1; interleaved_1f1b with v < 2 or m not a multiple of p; v ≠ 1
    with any other schedule; 1f1b or zb_h1 with m < p.

    Graded on: the bubble of GPipe, 1F1B and interleaved 1F1B for up to thousands of stages and millions of micro-
    batches (only a formula finishes in time), and ValueError for impossible sizes.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (p, m, v)):
        raise ValueError(f"num_stages, num_microbatches and virtual_stages must be integers >= 1, got {p!r}, {m!r}, "
                         f"{v!r}")
    if name == "interleaved_1f1b" and v < 2:
        raise ValueError("interleaved_1f1b needs virtual_stages >= 2 (model chunks per rank)")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(f"interleaved_1f1b: num_microbatches ({m}) must be a multiple of num_stages ({p})")
    if name != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v} needs an interleaved schedule; {name!r} runs one chunk per rank")
    if name in ("1f1b", "zb_h1") and m < p:
        raise ValueError(f"{name} needs num_microbatches >= num_stages (got m={m} < p={p})")
    work = {"gpipe": m, "1f1b": m, "interleaved_1f1b": v * m, "zb_h1": 3 * m}[name]
    return (p - 1) / (work + p - 1)


def peak_stash(actions_per_stage: Sequence[Sequence[Action]]) -> list[int]:
    """Per stage, the most micro-batches (per chunk) whose activations it holds at once: an F adds
    one, its B frees it (or its W, when the order has W's)."""
    split = any(Action(*a).kind == "W" for stage in actions_per_stage for a in stage)
    frees = "W" if split else "B"
    peaks = []
    for stage in actions_per_stage:
        held = peak = 0
        for a in stage:
            held += {"F": 1, frees: -1}.get(Action(*a).kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def render(timeline_or_actions, *, width: int = 3, placement: str = "loop") -> str:
    """Text diagram, one row per stage, one column per slot ("." idle), as in the module docstring.
    Takes a timeline from :func:`simulate` or an order (simulated with unit costs and ``placement``)."""
    tl = timeline_or_actions
    if tl and tl[0] and not isinstance(tl[0][0][0], (int, float)):
        tl = simulate(tl, placement=placement)
    end = int(round(max((e for stage in tl for _, e, _ in stage), default=0)))
    rows = []
    for r, stage in enumerate(tl):
        cells = ["."] * end
        for start, stop, a in stage:
            for t in range(int(round(start)), int(round(stop))):
                cells[t] = str(a)
        rows.append(f"stage {r} | " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)
