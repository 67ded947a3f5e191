"""Lecture 5b's top-1 vs top-2 run (reference.moe.lecture.topk_quality) on a few steps: top-2 dispatches
and computes exactly twice top-1's tokens, the losses are finite, and each curve is the one
``train_single`` gives for the same setting and seed; the story guard names a contradicting run."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from reference.gpt import train_single
from reference.moe.lecture import topk_quality, topk_story, topk_summary

SIZE = dict(d_model=16, heads=2, layers=2, d_ff=32, seq_len=8, moe_every=2)


@pytest.fixture(scope="module")
def small():
    return topk_quality(steps=6, seeds=(0, 1), num_experts=4, batch_size=4, eval_every=3, **SIZE)


def test_top2_dispatches_and_computes_exactly_twice_top1(small):
    cost, d, d_ff = small["cost"], SIZE["d_model"], SIZE["d_ff"]
    tokens = small["config"]["heldout_tokens"]
    assert cost["dense"]["dispatched"] == 0 and cost["dense"]["moe_layers"] == 0
    assert cost["top-1"]["dispatched"] == tokens and cost["top-1"]["moe_layers"] == 1
    assert cost["top-2"]["dispatched"] == 2 * cost["top-1"]["dispatched"]
    # block 1 is the MoE block: k expert FFNs of 2 matmuls (2·d·d_ff FLOPs each) per token; block 0 stays dense
    for name, k in (("dense", 1), ("top-1", 1), ("top-2", 2)):
        assert cost[name]["ffn_flops_per_token"] == [4 * d * d_ff, k * 4 * d * d_ff]
    assert cost["top-1"]["router_flops_per_token"] == cost["top-2"]["router_flops_per_token"] == 2 * d * 4
    assert cost["top-1"]["params"] == cost["top-2"]["params"] > cost["dense"]["params"]
    s = topk_summary(small)
    assert (s["top-1"]["dispatched"], s["top-2"]["dispatched"]) == (1.0, 2.0)
    assert s["top-2"]["ffn_flops"] == 2 * s["top-1"]["ffn_flops"] == 2 * s["dense"]["ffn_flops"]


def test_losses_are_finite_and_held_out_at_the_eval_steps(small):
    for run in small["runs"].values():
        assert len(run["losses"]) == len(run["heldout"]) == 2
        assert all(len(c) == 6 and all(math.isfinite(v) for v in c) for c in run["losses"])
        assert all([s for s, _ in curve] == [3, 6] and all(math.isfinite(v) for _, v in curve)
                   for curve in run["heldout"])


def test_each_curve_is_train_singles(small):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                    # as the run does: one thread sums in one order
    try:
        _same_curves(small)
    finally:
        torch.set_num_threads(threads)


def _same_curves(small):
    for name, extra in (("dense", {}), ("top-1", dict(num_experts=4, top_k=1)),
                        ("top-2", dict(num_experts=4, top_k=2))):
        for i, seed in enumerate((0, 1)):
            config = dict(SIZE) if extra else {k: v for k, v in SIZE.items() if k != "moe_every"}
            want = train_single(6, batch_size=4, lr=1e-2, seed=seed, **config, **extra)
            assert small["runs"][name]["losses"][i] == want, (name, seed)


def test_the_plot_draws_both_panels(small):
    import matplotlib.pyplot as plt

    from reference.notebook import plots
    fig = plots.topk_quality(small)
    assert len(fig.axes) == 2 and all(len(ax.get_legend().get_texts()) == 3 for ax in fig.axes)
    plt.close(fig)


def test_story_names_a_run_that_contradicts_the_text():
    runs = {name: {"losses": [[1.0]] * 3, "heldout": [[(1, v)] for v in vals]}
            for name, vals in (("dense", (1.00, 1.10, 0.90)), ("top-1", (1.02, 1.08, 0.92)),
                               ("top-2", (1.00, 1.05, 0.90)))}
    cost = {name: {"tokens": 8, "moe_layers": int(k > 0), "dispatched": 8 * k,
                   "ffn_flops_per_token": [4.0, 4.0 * max(k, 1)], "model_flops_per_token": 1.0, "params": 1}
            for name, k in (("dense", 0), ("top-1", 1), ("top-2", 2))}
    ok = {"config": {"layers": 2, "moe_every": 2, "seeds": (0, 1, 2)}, "runs": runs, "cost": cost}
    assert topk_story(ok) == []
    worse = copy.deepcopy(ok)
    worse["runs"]["top-2"]["heldout"][1] = [(1, 1.2)]
    assert any("every seed" in b for b in topk_story(worse))
    far = copy.deepcopy(ok)
    far["runs"]["top-2"]["heldout"] = [[(1, v - 0.5)] for v in (1.00, 1.05, 0.90)]
    assert any("larger than the seed spread" in b for b in topk_story(far))


def test_runs_shared_out_over_ranks_are_the_same_runs(small, world):
    """The notebook shares the nine runs out over its ranks: the same numbers, curves and costs alike."""
    shared = topk_quality(steps=6, seeds=(0, 1), num_experts=4, batch_size=4, eval_every=3, worlds={2: world(2)},
                          **SIZE)
    assert shared == small
