"""Lecture 6 — the grader's truths, computed by the reference in the grader's own process.

    hang_reports        6.1: the course's report of each hang case, run on real ranks here (several worlds
                        at once), with the kind and the ranks at fault it was planted with
    divergence_case     6.2: a recorded run with a plant of :mod:`.plants` (or none) and one process's, as
                        plain data, and where :func:`.divergence.first_divergence` finds them parting
    accumulation_truth  6.3: one process's loss and gradients of the padded batch

Answers are cached by their arguments: a grader grades many submissions on the same inputs.
"""
from __future__ import annotations

import copy
from dataclasses import asdict

import torch

from .records import from_plain, to_plain

__all__ = ["hang_reports", "divergence_case", "divergence_cases", "divergence_table", "perturbed",
           "accumulation_truth", "accumulation_wrong"]

_CACHE: dict = {}


# ----------------------------------------------------------------------------------------------
# 6.1


def hang_reports(cases: tuple, timeout: float = 4.0) -> list[dict]:
    """For each case ``(name, world_size, faulty, options)`` — ``options`` a dict of the program's
    (``num_microbatches``; ``"detail": True`` runs it under TORCH_DISTRIBUTED_DEBUG=DETAIL) — the report
    of the hang (:func:`.hangs.run_hangs`: the worlds start and hang together) with ``"truth": {"kind",
    "ranks"}``, the kind and ranks it was planted with (for "group", every stuck rank).

    A report is only handed out if it shows what its bug leaves (the reference's
    :func:`.diagnose.diagnose_hang` reads the truth from it): on a machine so busy that a rank had not yet
    reached its hang (or DETAIL's check had not finished) when the timeout fired, the case runs again,
    with twice the time, up to twice."""
    from .diagnose import diagnose_hang
    from .hangs import run_hangs
    key = ("hangs", repr(cases), timeout)
    if key in _CACHE:
        return copy.deepcopy(_CACHE[key])
    out: list = [None] * len(cases)
    todo, wait = list(range(len(cases))), timeout
    for _ in range(3):
        runs = [(cases[i][0], cases[i][1], tuple(cases[i][2]),
                 {**{k: v for k, v in cases[i][3].items() if k != "detail"},
                  **({"env": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "world_timeout": 5 * wait}
                     if cases[i][3].get("detail") else {})}) for i in todo]
        for i, report in zip(todo, run_hangs(runs, wait)):
            name, _, faulty, _ = cases[i]
            stuck = sorted(r for r, v in report.get("ranks", {}).items() if v["state"] in ("blocked", "running"))
            report["truth"] = {"kind": name, "ranks": stuck if name == "group" else sorted(faulty)}
            out[i] = report
        def shows_its_bug(i: int) -> bool:
            try:
                return diagnose_hang({k: v for k, v in out[i].items() if k != "truth"}) == out[i]["truth"]
            except (ValueError, KeyError):
                return False
        todo, wait = [i for i in todo if not shows_its_bug(i)], 2 * wait
        if not todo:
            break
    if todo:
        raise RuntimeError(f"hang cases {[cases[i][0] for i in todo]} did not show their bug in three runs: "
                           "the machine is too busy to grade 6.1 now")
    for report in out:
        report.pop("seconds", None)               # how long it took is not part of the report
    _CACHE[key] = out
    return copy.deepcopy(out)


# ----------------------------------------------------------------------------------------------
# 6.2


def _divergence_plain(d) -> dict | None:
    if d is None:
        return None
    out = asdict(d)
    out["index"] = tuple(out["index"])
    return out


def divergence_case(plant: str | None, sizes: dict, *, where: dict | None = None, seed: int = 0, steps: int = 2,
                    family: str = "gpt", options: dict | None = None) -> dict:
    """A plant's run on ``sizes`` (None: a correct run) and one process's, both as plain data, and
    the reference's answer: {"parallel", "single", "answer" (a Divergence as a dict, or None)}."""
    return divergence_cases((dict(plant=plant, sizes=sizes, where=where or {}, seed=seed, steps=steps, family=family,
                                  options=options or {}),))[0]


def perturbed(case: dict, step: int, index: int, rank_piece: int, size: float) -> dict:
    """``case`` (a :func:`divergence_case` of a correct run) with a bug of our own: from record ``index``
    of step ``step`` on (and in every later step), piece ``rank_piece`` of each record off by ``size``
    relative to its largest entry; the answer recomputed by the reference."""
    from .divergence import first_divergence
    case = copy.deepcopy(case)
    single = case["single"]["records"]
    order = [(r[0], r[1], r[2], r[3]) for r in single]
    in_step = [i for i, k in enumerate(order) if k[0] == step]
    start = in_step[index % len(in_step)]
    touched = {k for i, k in enumerate(order) if i >= start and (k[0] > step or i == start)}
    parallel = from_plain(case["parallel"])
    for r in parallel.records:
        if r.key in touched and r.pieces:
            rank, o, b = r.pieces[rank_piece % len(r.pieces)]
            scale = float(b.abs().max()) or 1.0
            b.add_(torch.full_like(b, size * scale))
    case["parallel"] = to_plain(parallel)
    case["answer"] = _divergence_plain(first_divergence(parallel, from_plain(case["single"])))
    return case


# ----------------------------------------------------------------------------------------------
# 6.3


def accumulation_truth(batch: int, seq_len: int, *, seed: int, data_seed: int, min_len: int = 0, empty: tuple = (),
                       **config) -> dict:
    """One process's loss and gradients (by parameter name) of the padded batch: the mean cross-entropy
    over its real tokens (0 and zero gradients if it has none)."""
    import torch.nn.functional as F

    from .accumulate import IGNORE, _model, padded_batch
    key = ("accumulation", batch, seq_len, seed, data_seed, min_len, tuple(empty), repr(sorted(config.items())))
    if key not in _CACHE:
        model = _model(seed, seq_len=seq_len, **config)
        x, y = padded_batch(batch, seq_len, seed=data_seed, min_len=min_len, empty=empty)
        real = int((y != IGNORE).sum())
        summed = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss = summed / max(real, 1)
        loss.backward()
        _CACHE[key] = {"loss": float(loss.detach()), "real_tokens": real,
                       "grads": {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                                 for n, p in model.named_parameters()}}
    return copy.deepcopy(_CACHE[key])


def accumulation_wrong(batch: int, seq_len: int, world_size: int, num_microbatches: int, *, seed: int, data_seed: int,
                       min_len: int = 0, empty: tuple = (), **config) -> dict:
    """The gradients the usual wrong steps give (for the grader's feedback), by name:
    "given" — each micro-batch's mean ÷ m, averaged over ranks (the given step's);
    "rank_mean" — each rank's own token mean, averaged over ranks (accumulation fixed, the ranks not)."""
    import torch.nn.functional as F

    from .accumulate import IGNORE, _model, microbatches, padded_batch
    key = ("accumulation_wrong", batch, seq_len, world_size, num_microbatches, seed, data_seed, min_len, tuple(empty),
           repr(sorted(config.items())))
    if key not in _CACHE:
        x, y = padded_batch(batch, seq_len, seed=data_seed, min_len=min_len, empty=empty)
        out = {}
        for how in ("given", "rank_mean"):
            model = _model(seed, seq_len=seq_len, **config)
            for r in range(world_size):
                mbs = microbatches(x, y, r, world_size, num_microbatches)
                n_rank = sum(int((t != IGNORE).sum()) for _, t in mbs)
                for xb, yb in mbs:
                    s = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten(), ignore_index=IGNORE, reduction="sum")
                    if how == "given":
                        loss = s / (yb != IGNORE).sum() / num_microbatches / world_size
                    else:
                        loss = s / max(n_rank, 1) / world_size
                    loss.backward()
            out[how] = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                        for n, p in model.named_parameters()}
        _CACHE[key] = out
    return copy.deepcopy(_CACHE[key])


def divergence_cases(cases: tuple) -> list[dict]:
    """:func:`divergence_case` for each case (a dict of its arguments), the parallel runs of one world
    size in one world (started once, closed after): what one check needs in one call."""
    from ..launch import World
    from .divergence import first_divergence
    from .runs import record_many, record_single
    todo: dict[int, list] = {}
    for i, c in enumerate(cases):
        key = ("divergence", repr(sorted(c.items())))
        if key not in _CACHE:
            sizes = c["sizes"]
            n = 1
            for a in ("tp", "cp", "dp", "pp"):
                n *= sizes.get(a, 1)
            todo.setdefault(n, []).append(i)
    for n, idx in todo.items():
        world = World(n, timeout=120, echo=False)
        try:
            runs = record_many([dict(family=cases[i].get("family", "gpt"), sizes=cases[i]["sizes"],
                                     steps=cases[i].get("steps", 2), plant=cases[i].get("plant"),
                                     where=cases[i].get("where") or {}, seed=cases[i].get("seed", 0),
                                     **cases[i].get("options", {})) for i in idx], n, world)
        finally:
            world.close()
        for i, par in zip(idx, runs):
            c = cases[i]
            opts = c.get("options", {})
            single = (c.get("family", "gpt"), c.get("steps", 2), c.get("seed", 0),
                      tuple(sorted((k, v) for k, v in opts.items()
                                   if k in ("clip_grad_norm", "num_experts", "top_k", "moe_every"))))
            if ("single",) + single not in _CACHE:
                _CACHE[("single",) + single] = to_plain(record_single(single[0], single[1], seed=single[2],
                                                                      **dict(single[3])))
            one = _CACHE[("single",) + single]
            _CACHE[("divergence", repr(sorted(c.items())))] = {
                "parallel": to_plain(par), "single": one,
                "answer": _divergence_plain(first_divergence(par, from_plain(one)))}
    # one deep copy of them all: cases of one configuration keep sharing their one-process run
    return copy.deepcopy([_CACHE[("divergence", repr(sorted(c.items())))] for c in cases])


def divergence_table(cases: tuple) -> dict:
    """:func:`divergence_cases` with each distinct one-process run once: ``{"singles": [run, ...], "cases":
    [{"parallel", "single": index into singles, "answer"}, ...]}`` — what 6.2's checks record (a student
    release ships it: runs of one configuration share one one-process run, and plain data keeps no sharing)."""
    singles: list = []
    index: dict[int, int] = {}
    out = []
    for case in divergence_cases(cases):
        one = case["single"]
        if id(one) not in index:
            index[id(one)] = len(singles)
            singles.append(one)
        out.append({"parallel": case["parallel"], "single": index[id(one)], "answer": case["answer"]})
    return {"singles": singles, "cases": out}
