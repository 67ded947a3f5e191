"""The planner, validated: its predictions for the tiny GPT against real composed trainings.

Each grid takes one float64 Adam step of the tiny GPT on gloo ranks (``reference.compose.memory.
measure_worker``); the planner (``reference.planner.tiny_gpt``, ``plan(..., stage=k)``) describes
each rank's pipeline stage from its own formulas.  On every rank:

* bytes per step per axis (ring wire bytes; the planner's "dp" is the trace's "dp_cp") equal the
  bytes measured from the trace EXACTLY — dp, tp (embedding, layers, head, the loss's 3 per-token
  all-reduces, SP's gradient sync), cp, pp; for ep, the routing-independent payload handed to the
  dispatch and the combine's backward all-to-alls (what leaves the rank depends on the routing);
* parameters, gradients and Adam's moments counted from the rank's tensors equal the planner's
  EXACTLY (padded vocabulary, replicated norms and biases, position table, final norm);
* the peak of the floating-point tensors saved for the backward is within 10 % of the planner's
  activations + output layer (dense grids within 1 %; what is not counted:
  ``reference.compose.memory``'s docstring).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from reference import planner as P
from reference.compose import memory
from reference.gpt import GPTConfig

DENSE = dict(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8)
MOE = dict(DENSE, num_experts=4)                 # block 1 is MoE (moe_every=2), top-2, dropless
BATCH = 4
WORLD = 8

# One 8-rank world for every grid (starting ranks is what costs time on 2 cores): every axis, and
# each of them composed with others.  (name, sizes, GPTConfig fields, batch, run options)
CASES = [
    ("dp×tp×pp 1f1b", {"dp": 2, "tp": 2, "pp": 2}, DENSE, 4, {"num_microbatches": 2}),
    ("tp×cp×pp 1f1b m=4", {"tp": 2, "cp": 2, "pp": 2}, DENSE, 4, {"num_microbatches": 4}),
    ("dp×tp×cp", {"dp": 2, "tp": 2, "cp": 2}, DENSE, 4, {}),
    ("dp×tp+sp", {"dp": 4, "tp": 2}, DENSE, 4, {"sequence_parallel": True}),
    ("dp×ep", {"dp": 8, "ep": 2}, MOE, 16, {}),
]
TOLERANCE = {"dp×ep": 0.10}                      # the rest: 1 %
# The planner assumes perfectly balanced experts; an untrained router is not (rank 1 of each ep pair
# gets up to ~25 % more rows here).  Dropless routing sends the ep group's k·T·ep rows somewhere,
# so the mean over ranks is routing-independent: MoE activations are compared as the mean.
MEAN_OVER_RANKS = {"dp×ep"}


def world_size(sizes: dict) -> int:
    n = 1
    for a in ("tp", "cp", "dp", "pp"):
        n *= sizes.get(a, 1)
    return n


@pytest.mark.parametrize("name,sizes,config,batch,kw", CASES, ids=[c[0] for c in CASES])
def test_planner_predicts_the_measured_run(world, name, sizes, config, batch, kw):
    assert world_size(sizes) == WORLD
    res = world(WORLD).run(memory.measure_worker, sizes, batch_size=batch, **kw, **config)
    tol = TOLERANCE.get(name, 0.01)
    acts = []
    for r in range(WORLD):
        table = memory.planner_vs_measured(res, sizes, rank=r, batch_size=batch, **kw, **config)
        # every axis in use moves bytes in the plan, and exactly the measured ones
        used = {a for a in ("dp", "tp", "cp", "pp") if sizes.get(a, 1) > 1}
        if sizes.get("cp", 1) > 1:
            used.add("dp")                                       # gradients average over dp·cp
        assert used <= set(table["bytes"]), (r, table["bytes"])
        for axis, (planned, measured) in table["bytes"].items():
            assert planned > 0 and planned == measured, f"rank {r} {axis}: planner {planned}, measured {measured}"
        if sizes.get("ep", 1) > 1:
            assert "ep payload" in table["bytes"]
        for kind in ("params", "grads", "optimizer"):
            planned, measured = table["memory"][kind]
            assert planned == measured, f"rank {r} {kind}: planner {planned}, measured {measured}"
        acts.append(table["memory"]["activations"])
    per_rank = [(f"rank {r}", p, m) for r, (p, m) in enumerate(acts)]
    if name in MEAN_OVER_RANKS:
        per_rank = [("mean over ranks", sum(p for p, _ in acts) / WORLD, sum(m for _, m in acts) / WORLD)]
    for who, planned, measured in per_rank:
        assert measured > 0 and abs(planned / measured - 1) <= tol, \
            f"{who} activations: planner {planned}, measured {measured} ({planned / measured - 1:+.1%})"


def test_the_planner_counts_what_korthikanti_leaves_out_only_when_asked():
    """The tiny GPT's description changes the numbers where it should (the comparisons above can
    fail): without ``stats_bytes`` (Korthikanti's accounting) the layer is short by exactly the
    LayerNorms' statistics and the log-sum-exp; the parameter count is TinyGPT's own."""
    cfg = GPTConfig(vocab=27, **DENSE)
    tiny = P.tiny_gpt(cfg, batch_size=BATCH)
    comp = P.Composition(flash=True, sequence_parallel=False)
    full = P.activation_bytes_per_layer(tiny, flash=True, sequence_parallel=False)
    bare = P.activation_bytes_per_layer(replace(tiny, stats_bytes=0), flash=True, sequence_parallel=False)
    s, b, h, a = 8, BATCH, 16, 2
    assert full - bare == 8 * s * b * (2 * 2 + a)                 # mean, 1/σ of 2 LayerNorms; lse per head
    assert bare == 8 * s * b * (4 * h + 4 * h + 2 * 32)           # 4sbh replicated, Q K V O, GELU in/out
    # parameters: the tiny GPT's count is TinyGPT's own
    from reference.gpt import TinyGPT
    assert sum(P.param_counts(tiny).values()) == sum(p.numel() for p in TinyGPT(cfg).parameters())
    moe_cfg = GPTConfig(vocab=27, **MOE)
    assert sum(P.param_counts(P.tiny_gpt(moe_cfg, batch_size=BATCH)).values()) == \
        sum(p.numel() for p in TinyGPT(moe_cfg).parameters())
    pl = P.plan(tiny, P.cpu_cluster(1), comp)
    assert pl.memory["optimizer"] == 2 * pl.memory["params"] == 2 * 8 * sum(P.param_counts(tiny).values())


def test_stage_none_is_the_busiest_stage_of_each_entry():
    cfg = GPTConfig(vocab=27, **dict(DENSE, layers=4))
    tiny = P.tiny_gpt(cfg, batch_size=BATCH, micro_batch=1)
    comp = P.Composition(pp=4, micro_batches=4, flash=True, sequence_parallel=False)
    stages = [P.plan(tiny, P.cpu_cluster(4), comp, stage=k) for k in range(4)]
    whole = P.plan(tiny, P.cpu_cluster(4), comp)
    assert whole.memory["activations"] == stages[0].memory["activations"] > stages[3].memory["activations"]
    assert whole.memory["logits"] == stages[3].memory["logits"] and "logits" not in stages[0].memory
    assert whole.comm_bytes["pp"] == stages[1].comm_bytes["pp"] == 2 * stages[0].comm_bytes["pp"]
    assert whole.memory["params"] == max(pl.memory["params"] for pl in stages)
    with pytest.raises(ValueError, match="stage=4"):
        P.plan(tiny, P.cpu_cluster(4), comp, stage=4)
