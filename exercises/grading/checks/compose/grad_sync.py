"""Checks for exercise 5c.2 sync_gradients: which group averages which gradient, on a composed grid.

The data is one real step of the tiny GPT on the grid, run by the reference in the grader
(``reference.compose.cases.sync_case``): every rank's raw gradients (of its own loss) and
the synchronised ones, which that function has checked, unsharded, against one process's
gradient.  The learner's ``sync_gradients`` gets the raw gradients on a world of the same grid
(``GradView``: parameters by kind, the groups, the grid) and must give back the synchronised ones.
Detectors recompute the usual wrong answers from the raw gradients — over dp only, summed, over
the whole world, experts over the wrong group, the tp sum of sequence parallelism missing — and
name the one that matches.
"""
from __future__ import annotations

import torch

from ...core import exercise
from ...feedback import Mismatch

H = "exercises.grading.harness.compose"
REF = "reference.compose.cases"

__all__ = ["SYNC", "HINTS"]

# The composed run's own syncs would answer by another road — its ZeRO step, the overlapped buckets
# and what they leave to sync_the_rest, the training step: switched off while 5c.2 is graded.
# Lecture 4a's sequence-parallel sum and lecture 5b's expert sync (the learner's own 5b.4 here) stay:
# building blocks the lecture names.
SYNC = exercise("5c.2", "Gradient synchronisation on a composed grid", "compose", ["sync_gradients"],
                mirrors=("reference.compose.zero:*", "reference.compose.overlap:*", "reference.compose.train:*"))

TINY = dict(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8)
KIND_WORDS = {"dense": "a dense parameter: the same tensor on every rank of its dp_cp group",
              "sp": "replicated over tp, fed S/tp rows per tp rank under sequence parallelism",
              "expert": "an expert's parameter: the same expert on every rank of its edp group"}


def _stack(raw: list[dict], ranks: list[int], name: str, shape) -> torch.Tensor | None:
    ts = [raw[q].get(name) for q in ranks]
    if any(t is None or t.shape != shape for t in ts):
        return None
    return torch.stack([t.double() for t in ts])


def _candidates(m: Mismatch) -> list[tuple[str, torch.Tensor]]:
    """(what it would mean, the gradient it gives) for the usual wrong answers, from the raw gradients."""
    grid, raw, name, kind = m.extra["grid"], m.extra["raw"], m.extra["name"], m.extra["kind"]
    r, shape = m.rank, m.expected.shape
    N = grid.dp * grid.cp
    out = [("this is the raw gradient, unchanged: nothing was synchronised for it (is it in the list you "
            "looped over, and did the all-reduce write back into .grad?)", raw[r][name].double())]

    def over(axis):
        return _stack(raw, grid.ranks(axis, r), name, shape)

    dp_cp, dp, world = over("dp_cp"), over("dp"), _stack(raw, list(range(grid.world_size)), name, shape)
    if kind in ("dense", "sp"):
        if grid.cp > 1 and dp is not None:
            out.append(("you averaged over the data-parallel group only: the context-parallel ranks hold the same "
                        "parameters and saw OTHER positions of the same sequences. Average over dp_cp "
                        f"(N = dp·cp = {N} ranks) — the context-parallel gradient sync is the one most often "
                        "forgotten.", dp.mean(0)))
        if dp_cp is not None and N > 1:
            out.append((f"you summed over dp_cp but did not divide by N = dp·cp = {N}: the objective is the MEAN "
                        "of the ranks' losses.", dp_cp.sum(0)))
        if kind == "sp" and dp_cp is not None:
            out.append(("with sequence parallelism each tp rank fed this replicated parameter only its S/tp rows: "
                        "its gradient is a partial sum. Sum it over the tp group first (as lecture 4a's "
                        "sync_sequence_parallel_grads does), then average over dp_cp.", dp_cp.mean(0)))
        if world is not None and grid.world_size != N:
            out.append(("you averaged over every rank of the world: tensor-parallel ranks saw the SAME tokens "
                        "(averaging their copies changes nothing, but dividing by the world size does), and "
                        "pipeline stages hold different layers. Average over dp_cp only.", world.mean(0)))
    else:
        edp = over("edp")
        if edp is not None and grid.edp != N:
            out.append((f"you averaged over the edp group (÷ {grid.edp}): the all-to-all already summed the ep "
                        f"group's tokens into each expert's gradient, so divide by N = dp·cp = {N} as for dense "
                        "parameters.", edp.mean(0)))
        if edp is not None and N > 1:
            out.append((f"you summed over edp but did not divide by N = dp·cp = {N}.", edp.sum(0)))
        kinds = m.extra["kinds"]
        theirs = [[n for n in raw[q] if kinds[q][n] == "expert"] for q in range(grid.world_size)]   # GradView's order
        mine = theirs[r]
        i = mine.index(name)
        same_slot = [raw[q][theirs[q][i]] for q in grid.ranks("dp_cp", r) if len(theirs[q]) > i]
        if grid.ep > 1 and len(same_slot) == N and all(t.shape == shape for t in same_slot):
            out.append(("you averaged expert gradients over dp_cp: its ranks hold DIFFERENT experts (the ep "
                        "group is inside dp_cp). Reduce expert gradients over edp, the ranks holding the same "
                        "experts (the list holds each rank's OWN experts, so the same position is a different expert).",
                        torch.stack([t.double() for t in same_slot]).mean(0)))
    return out


def which_group(m: Mismatch) -> str | None:
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape:
        return None
    g = m.got.detach().double()
    for words, cand in _candidates(m):
        if torch.allclose(g, cand, rtol=1e-9, atol=1e-13) and not torch.allclose(cand, m.expected.double(),
                                                                                   rtol=1e-9, atol=1e-13):
            return words
    return f"{m.extra['name']} is {KIND_WORDS[m.extra['kind']]}."


# The visible 4-rank cases: (sizes, config, sequence_parallel, seed); the reference computes them in one world.
CASES4 = [({"dp": 2, "cp": 2}, TINY, False, 521), ({"dp": 2, "tp": 2}, TINY, True, 522),
          ({"dp": 2, "cp": 2, "ep": 2}, dict(TINY, num_experts=4), False, 523)]


def _case_kw(ctx, config: dict, sequence_parallel: bool, seed: int, num_microbatches: int = 1) -> dict:
    return dict(config, sequence_parallel=sequence_parallel, seed=ctx.seed(seed),
                num_microbatches=num_microbatches)


def _sync_case(ctx, sizes: dict, config: dict, case: str, seed: int, *, sequence_parallel: bool = False,
               num_microbatches: int = 1, together: bool = False) -> None:
    from reference.mesh import RankGrid
    others = tuple((s, _case_kw(ctx, c, sp, sd)) for s, c, sp, sd in CASES4) if together else ()
    data = ctx.oracle(f"{REF}:sync_case", sizes, together=others,
                      **_case_kw(ctx, config, sequence_parallel, seed, num_microbatches))
    W = len(data["raw"])
    moe = bool(config.get("num_experts"))
    res = ctx.ranks(W, f"{H}:grad_sync_per_rank", sizes, moe, sequence_parallel,
                    per_rank=list(zip(data["raw"], data["kinds"])))
    grid = RankGrid(W, **sizes)
    for r, got in enumerate(res.values):
        got = got if isinstance(got, dict) else {}
        for name, want in data["synced"][r].items():
            kind = data["kinds"][r][name]
            ctx.compare(got.get(name), want, f"gradient of {name} ({kind})", rank=r, world_size=W, atol=1e-13,
                        rtol=1e-10, case=case, detectors=[which_group],
                        extra=dict(grid=grid, raw=data["raw"], name=name,
                                   kind=kind, kinds=data["kinds"]))


@SYNC.check("one rank (every group of size 1): the gradients stay as they are", requires_value=True)
def _(ctx):
    g = torch.Generator().manual_seed(ctx.seed(520))
    raw = {"blocks.0.ln1.weight": torch.randn(4, generator=g, dtype=torch.float64),
           "blocks.0.attn.qkv.weight": torch.randn(6, 4, generator=g, dtype=torch.float64),
           "blocks.1.mlp.moe.experts.0.0.weight": torch.randn(3, 4, generator=g, dtype=torch.float64)}
    kinds = {"blocks.0.ln1.weight": "dense", "blocks.0.attn.qkv.weight": "dense",
             "blocks.1.mlp.moe.experts.0.0.weight": "expert"}
    res = ctx.ranks(1, f"{H}:grad_sync_per_rank", {}, True, False, per_rank=[(raw, kinds)])
    got = res.values[0] if isinstance(res.values[0], dict) else {}
    for name, want in raw.items():
        ctx.compare(got.get(name), want, f"gradient of {name}", rank=0, world_size=1, atol=0, rtol=0, case="one rank")


@SYNC.check("dp × cp = 2 × 2 on 4 ranks: every gradient = the one-process gradient of the whole batch", points=3,
            timeout=120)
def _(ctx):
    _sync_case(ctx, *CASES4[0][:2], "dp=2, cp=2", 521, together=True)


@SYNC.check("dp × tp = 2 × 2 with sequence parallelism: LayerNorms and row biases too", points=2, timeout=120)
def _(ctx):
    _sync_case(ctx, *CASES4[1][:2], "dp=2, tp=2, sequence parallel", 522, sequence_parallel=True, together=True)


@SYNC.check("dp × cp × ep = 2 × 2 × 2 (edp 2), MoE: experts over edp, the rest over dp_cp", points=2, timeout=120)
def _(ctx):
    _sync_case(ctx, *CASES4[2][:2], "dp=2, cp=2, ep=2, MoE", 523, together=True)


HINTS = {
    "5c.2": [
        "For each kind of parameter, ask which ranks hold the same tensor AND saw different tokens: those are "
        "the ranks its gradient must be averaged over. Tensor-parallel ranks saw the same tokens; pipeline "
        "stages hold different layers.",
        "Dense parameters: the data-parallel AND the context-parallel ranks (model.groups['dp_cp']) — each cp "
        "rank saw other positions of the same sequences. Average: all-reduce, then divide by dp·cp. Experts: "
        "lecture 5b's rule, with dp_cp as the data-parallel group (your 5b.4 sync_moe_gradients does it).",
        "Under sequence parallelism, first SUM model.sequence_parallel_params() over model.groups['tp'] (each tp "
        "rank saw S/tp rows), then treat them like every other dense parameter. Skip grads that are None.",
    ],
}
