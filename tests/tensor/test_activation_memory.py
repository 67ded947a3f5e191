"""Activation memory of a tensor-parallel block, measured (reference.saved: every storage autograd
saves for the backward, parameters excluded) against Korthikanti et al. (arXiv:2205.05198 §4).

In the paper's setting — 16-bit activations (bfloat16 here), dropout with 1-byte masks — one block
keeps per rank exactly

    tensor parallelism        sbh·(10 + 24/t + 5as/(ht))
    + sequence parallelism    sbh·(34 + 5as/h)/t

plus what the paper leaves out (reference.tensor.costs.not_in_the_formula: the LayerNorms' mean and
1/σ, the causal mask): equal to the byte.  The same block through ``column_parallel_linear`` (the
gathered input of qkv and fc1 saved) keeps 11 % more at t = 2 and 30 % more at t = 4.

Recomputation (§5): the same numbers as one process, the memory of the paper's formulas, the FLOPs
of what runs again (``torch.utils.flop_counter``), and — full recomputation — the forward's
collectives once more.
"""

import pytest
import torch

from reference.tensor import workers
from reference.tensor.costs import layer_activation_bytes, not_in_the_formula, wire_bytes
from reference.tensor.workers import block_worker
from tests.tensor.test_parallel import cfg_for, check

S, B, D, HEADS = 16, 2, 32, 4        # a·s/h = 2: the scores are 10 of the 44 sbh at t = 1
TOLERANCE = 0.03                     # measured / formula - 1, what is not in the formula included


def saved(world, t, sp, save_shard=True):
    res = world(t).run(block_worker, t, sp, S, B, D, HEADS, dropout_p=0.1, dtype=torch.bfloat16,
                       save_shard=save_shard)
    return [v["activation_bytes"] for v in res.values]


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_saved_activations_are_korthikantis_formula_plus_what_it_leaves_out(world, t, sp):
    formula = layer_activation_bytes(S, B, D, HEADS, t, sequence_parallel=sp)
    extra = not_in_the_formula(S, B, t, sequence_parallel=sp)
    for r, got in enumerate(saved(world, t, sp)):
        assert got == formula + extra, f"rank {r}: measured {got}, formula {formula} + {extra} not in it"
        assert abs(got / formula - 1) < TOLERANCE


def test_the_formula_is_the_papers():
    s, b, h, a = 2048, 1, 12288, 96         # GPT-3 175B, one sequence
    for t in (1, 8):
        assert layer_activation_bytes(s, b, h, a, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        assert layer_activation_bytes(s, b, h, a, t, sequence_parallel=True) == \
            pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)


@pytest.mark.parametrize("t,at_least", [(2, 0.10), (4, 0.25)])
def test_keeping_the_gathered_input_misses_the_formula(world, t, at_least):
    """column_parallel_linear (gather, then F.linear) saves the S rows of qkv's and fc1's input:
    2·sbh·e instead of 2·sbh·e/t — the test above would fail with it."""
    formula = layer_activation_bytes(S, B, D, HEADS, t, sequence_parallel=True)
    extra = not_in_the_formula(S, B, t, sequence_parallel=True)
    for got in saved(world, t, True, save_shard=False):
        assert got / formula - 1 > at_least
        assert got - formula - extra == 2 * S * B * D * 2 * (1 - 1 / t)


# ----------------------------------------------------------------------------------------------
# Activation recomputation (Korthikanti et al. §5): the same numbers, less memory, more FLOPs


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_changes_no_number(world, W, sp, recompute):
    """float64, dropout in both regions, inputs ×30: output, input and every weight gradient equal one
    process's (which recomputes nothing) within 1e-12 — the recomputed dropout masks are the same."""
    cfg = dict(cfg_for(W), scale=30.0, dropout_p=0.25, seed=W)
    res = world(W).run(workers.parallel, "block", sp, recompute=recompute, **cfg)
    check("block", W, res, workers.single("block", **cfg), cfg["d_model"], sp)


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_recomputation_keeps_what_korthikanti_section_5_says_for_the_flops_it_says(world, t, sp):
    """selective: sbh·(10 + 24/t) (34·sbh/t with SP), the scores term gone, for the attention core's
    4·b·s²·h/t FLOPs again; full: the block's input only, 2·sbh (/t with SP), for a whole forward again."""
    forward_flops = (24 * S * B * D * D + 4 * B * S * S * D) // t            # the block's matmuls, per rank
    runs = {rc: world(t).run(block_worker, t, sp, S, B, D, HEADS, dropout_p=0.1, dtype=torch.bfloat16,
                             recompute=rc).values for rc in ("none", "selective", "full")}
    assert runs["none"][0]["flops"] == 3 * forward_flops                     # forward + backward (2×)
    for rc, extra_flops in (("selective", 4 * B * S * S * D // t), ("full", forward_flops)):
        formula = layer_activation_bytes(S, B, D, HEADS, t, sequence_parallel=sp, recompute=rc)
        extra = not_in_the_formula(S, B, t, sequence_parallel=sp, recompute=rc)
        for r, v in enumerate(runs[rc]):
            assert v["activation_bytes"] == formula + extra, (rc, r, v["activation_bytes"], formula, extra)
            assert v["flops"] - runs["none"][r]["flops"] == extra_flops, (rc, r)
    assert layer_activation_bytes(S, B, D, HEADS, t, sequence_parallel=sp, recompute="selective") == \
        S * B * D * (34 / t if sp else 10 + 24 / t)
    assert layer_activation_bytes(S, B, D, HEADS, t, sequence_parallel=sp, recompute="full") == \
        2 * S * B * D / (t if sp else 1)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_full_recomputation_runs_the_forward_collectives_again(world, W, sp):
    """Per block: tensor parallelism 4 + 2 all-reduces (the planner's "6 with full recomputation"),
    sequence parallelism 10 + 4 collectives; selective recomputation sends what no recomputation does."""
    cfg = cfg_for(W)
    act = cfg["S"] * 2 * cfg["d_model"] * 8
    ops = ("all_reduce", "all_gather", "reduce_scatter")
    traces = {rc: world(W).run(workers.parallel, "block", sp, sync=False, recompute=rc, **cfg).trace
              for rc in ("none", "selective", "full")}
    wire = {rc: sum(wire_bytes(e.op, e.nbytes, W) for e in t.filter(rank=0, op=ops)) for rc, t in traces.items()}
    forward = {rc: [(e.op, e.meta["layer"]) for e in t.filter(rank=0, op=ops) if e.meta["direction"] == "forward"]
               for rc, t in traces.items()}
    assert forward["full"] == forward["none"] * 2 and forward["selective"] == forward["none"]
    assert wire["selective"] == wire["none"]
    assert wire["full"] == pytest.approx((14 if sp else 12) * (W - 1) / W * act)
