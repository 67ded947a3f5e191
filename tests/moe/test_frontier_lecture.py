"""Lecture 5b §8's measurements (reference.moe.frontier_workers, reference.moe.lecture_frontier), each against what
it claims: fine-grained experts keep FLOPs and parameters and multiply the rows; torch._grouped_mm on CPU runs one mm
per expert; node-limited routing caps the nodes a token reaches; the bytes a folded grid keeps inside a node equal
the routing's, counted in one process; the loss-free bias counted over every routing rank is one process's; the
imbalance run's rows follow its bias; the overlapped halves hide part of the all-to-all.  No timing is asserted."""
from __future__ import annotations

import math

import pytest
import torch

from reference.mesh import RankGrid
from reference.moe import MoELayer, lecture_frontier
from reference.moe.frontier_workers import fine_grained_costs, grouped_gemm_on_cpu, nodes_per_token
from reference.moe.placement import node_of


def test_fine_grained_experts_keep_flops_and_parameters_and_send_k_rows():
    d = 16
    rows = fine_grained_costs([{"num_experts": 4, "k": 1, "expert_ffn": 32},
                               {"num_experts": 16, "k": 4, "expert_ffn": 8},
                               {"num_experts": 16, "k": 3, "expert_ffn": 8, "shared_experts": 1}], d_model=d, tokens=32)
    for r in rows:                                   # a GELU expert: 2 matmuls of d × f, 4·d·f FLOPs per row
        assert r["expert_flops_per_token"] == 4 * d * 32
        assert r["router_flops_per_token"] == 2 * d * r["num_experts"]
        assert r["rows_per_token"] == r["k"] and r["combinations"] == math.comb(r["num_experts"], r["k"])
        f, n = r["expert_ffn"], r["num_experts"] + r.get("shared_experts", 0)
        assert r["expert_params"] == n * (2 * d * f + d + f)


def test_grouped_gemm_on_cpu_equals_the_loop_and_runs_one_mm_per_expert():
    g = grouped_gemm_on_cpu(num_experts=4, d_model=16, d_ff=8, rows=64, reps=1)
    assert g["max_diff"] <= 1e-6 and g["grouped_calls"] == 2 and g["mm_per_grouped_call"] == 4
    assert g["loop_mm_calls"] == 8 and g["grouped_s"] > 0 and g["loop_s"] > 0


def test_node_limited_routing_never_reaches_more_than_m_nodes():
    n = nodes_per_token(num_experts=16, nodes=4, k=4, max_nodes=2, tokens=256)
    assert n["limited"]["max"] <= 2 < n["unlimited"]["max"]
    for h in (n["limited"], n["unlimited"]):
        assert sum(h["histogram"].values()) == 256 and h["mean"] == pytest.approx(
            sum(k * v for k, v in h["histogram"].items()) / 256)


def test_folded_grid_sends_nothing_across_nodes_and_unfolded_sends_exactly_the_remote_rows(world):
    fb = lecture_frontier.folding_bytes(worlds={4: world(4)})
    cfg = lecture_frontier.FOLDING
    torch.manual_seed(0)                                              # folded_dispatch's layer and tokens, here
    layer = MoELayer(cfg["d_model"], cfg["d_ff"], cfg["num_experts"], k=cfg["k"], dropless=True)
    grid = RankGrid(4, tp=2, dp=2, ep=2)
    per = cfg["num_experts"] // 2
    for r in range(4):
        x = torch.randn(cfg["tokens"], cfg["d_model"], generator=torch.Generator().manual_seed(1 + r))
        with torch.no_grad():
            choices = layer(x)[1]["routing"]["expert_index"].flatten().tolist()
        group = grid.ranks("ep", r)
        remote = sum(node_of(group[e // per], 2) != node_of(r, 2) for e in choices)
        assert fb["unfolded"]["measured"][r] == remote * cfg["d_model"] * 4 > 0
    assert fb["unfolded"]["ep_groups"] == [[0, 2], [1, 3]] and fb["folded"]["ep_groups"] == [[0, 1], [2, 3]]
    assert fb["folded"]["measured"] == [0, 0, 0, 0] and fb["folded"]["formula"] == 0


def test_bias_counted_over_every_routing_rank_is_one_process_and_over_the_ep_group_drifts(world):
    steps, E, rate = 6, 8, 1e-3
    drift = lecture_frontier.bias_drift(steps=steps, worlds={4: world(4)})
    loads = [[torch.randint(0, 64, (E,), generator=g).double() for _ in range(steps)]
             for g in (torch.Generator().manual_seed(1 + r) for r in range(4))]          # each rank's, as it drew them

    def truth(ranks):
        bias = torch.zeros(E, dtype=torch.float64)
        for s in range(steps):
            load = sum(loads[r][s] for r in ranks)
            bias += rate * torch.sign(load.mean() - load)
        return bias.tolist()
    assert all(d["every_rank"] == truth(range(4)) for d in drift)
    assert [d["ep_group"] for d in drift] == [truth((0, 1))] * 2 + [truth((2, 3))] * 2
    assert drift[0]["ep_group"] != drift[2]["ep_group"]                  # two replicas, two biases


def test_imbalance_rows_follow_the_bias_towards_rank_0(world):
    rows = lecture_frontier.imbalance_cost(skews=(0.0, 0.2), reps=1, worlds={2: world(2)})
    cfg = lecture_frontier.IMBALANCE
    for r in rows:
        assert sum(r["rows"]) == cfg["k"] * cfg["tokens"] * 2
        assert r["max_over_mean"] == max(r["rows"]) / (cfg["k"] * cfg["tokens"])
        assert min(r["experts_cpu_s"]) > 0 and min(r["experts_s"]) > 0 and min(r["combine_s"]) > 0 and r["step_s"] > 0
    assert rows[0]["max_over_mean"] < 1.1 < 1.5 < rows[1]["max_over_mean"] and rows[1]["rows"][0] > rows[1]["rows"][1]


def test_overlapped_halves_hide_part_of_the_all_to_all_and_the_plain_layer_none(world):
    ov = lecture_frontier.overlap_hidden(reps=1, worlds={2: world(2)})
    assert ov["plain"]["hidden"] == 0.0 and ov["plain"]["all_to_alls"] == 4
    assert 0.0 < ov["overlapped"]["hidden"] <= 1.0 and ov["overlapped"]["all_to_alls"] == 8     # two halves
    assert lecture_frontier.overlap_story(ov) == [] or ov["overlapped"]["hidden"] < 0.1


def _imbalance_rows(combine_light=(0.003, 0.013), experts_cpu_busy=(0.011, 0.016)) -> list[dict]:
    """Two imbalance_cost-shaped rows, balanced then pushed: rank 1 the lighter at the push."""
    return [{"skew": 0.0, "rows": [1040, 1008], "max_over_mean": 1.02, "experts_cpu_s": [experts_cpu_busy[0], 0.009],
             "experts_s": [0.023, 0.018], "combine_s": [0.003, combine_light[0]], "step_s": 0.07},
            {"skew": 0.2, "rows": [1946, 102], "max_over_mean": 1.90, "experts_cpu_s": [experts_cpu_busy[1], 0.002],
             "experts_s": [0.017, 0.003], "combine_s": [0.0035, combine_light[1]], "step_s": 0.06}]


def test_the_imbalance_story_holds_for_a_run_that_waits_and_names_one_that_does_not():
    story = lecture_frontier.imbalance_story
    assert story(_imbalance_rows()) == []
    assert any("wait longer" in b for b in story(_imbalance_rows(combine_light=(0.003, 0.002))))
    assert any("CPU time" in b for b in story(_imbalance_rows(experts_cpu_busy=(0.016, 0.011))))


def test_the_overlap_story_names_a_plain_layer_that_hides_or_halves_that_hide_nothing():
    ok = {"plain": {"hidden": 0.0}, "overlapped": {"hidden": 0.5}}
    assert lecture_frontier.overlap_story(ok) == []
    assert lecture_frontier.overlap_story({**ok, "overlapped": {"hidden": 0.05}})
    assert lecture_frontier.overlap_story({**ok, "plain": {"hidden": 0.2}})


def test_the_balance_story_holds_for_the_lectures_shape_and_names_each_contradiction():
    from reference.moe.lecture import balance_story

    def result(last: dict, task: dict) -> dict:
        return {"runs": {name: {"max_over_mean": [2.0] * 10 + [last[name]] * 20, "task": [3.0] * 10 + [task[name]] * 20}
                         for name in ("none", "aux", "loss_free")}}
    same = {"none": 1.8, "aux": 1.8, "loss_free": 1.8}
    assert balance_story(result({"none": 1.7, "aux": 1.85, "loss_free": 1.3}, same)) == []
    assert any("most balanced" in b for b in balance_story(result({"none": 1.7, "aux": 1.8, "loss_free": 1.75}, same)))
    assert any("away from no balancing" in b for b in balance_story(result({"none": 1.9, "aux": 1.5, "loss_free": 1.3},
                                                                           same)))
    assert any("cross-entropies" in b for b in balance_story(result({"none": 1.7, "aux": 1.8, "loss_free": 1.3},
                                                                    {**same, "aux": 2.0})))


def test_the_imbalance_plot_draws_each_ranks_work_and_the_lightest_ranks_wait():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from reference.notebook import plots
    fig = plots.imbalance(_imbalance_rows())
    try:
        work, wait = fig.axes
        assert len(work.lines) == 2 and [list(line.get_xdata()) for line in work.lines] == [[1040, 1946], [1008, 102]]
        extra, combine = wait.lines                      # busiest − lightest experts; the lightest's combine, in ms
        assert list(extra.get_ydata()) == pytest.approx([1e3 * (0.023 - 0.018), 1e3 * (0.017 - 0.003)])
        assert list(combine.get_ydata()) == pytest.approx([1e3 * 0.003, 1e3 * 0.013])
    finally:
        plt.close(fig)
