"""Lecture 5c's teaching side: the planner widget's state function (pure) and its drawing."""
from __future__ import annotations

import pytest

from reference.planner import Cluster, Composition, Model, plan
from reference.published import H100_16K, LLAMA3_405B, LLAMA3_405B_16K_PLAN
from reference.widgets.planner import draw_planner, planner_caption, planner_player, planner_state, shown_axes

TINY = Model("tiny", layers=4, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=27, seq_len=32, global_batch=8,
             num_experts=4, top_k=2, moe_every=2)
TWO_NODES = Cluster("2 nodes × 4", devices=8, memory=1e9, flops=1e12, intra_bw=1e11, inter_bw=1e10,
                    devices_per_node=4)


def test_state_colours_ranks_by_their_group_one_row_per_node():
    comp = Composition(dp=2, tp=2, pp=2, ep=2)
    st = planner_state(TINY, TWO_NODES, comp, "pp")
    assert st["error"] is None
    assert st["nodes"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # pp groups {0,4} {1,5} {2,6} {3,7}: the same colour in both rows, four colours
    assert [st["group"][r] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert st["crosses_nodes"] and st["group_size"] == 2
    tp = planner_state(TINY, TWO_NODES, comp, "tp")
    assert [tp["group"][r] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3] and not tp["crosses_nodes"]
    pl = plan(TINY, TWO_NODES, comp)
    assert st["memory"]["params"] == pl.memory["params"] and st["fits"] == pl.fits
    assert st["comm"]["pp"] == (pl.comm_bytes["pp"], pl.comm_time["pp"], "inter")
    assert st["comm"]["tp"][2] == "intra"
    assert "pp groups of 2" in planner_caption(st) and "crosses nodes" in planner_caption(st)


def test_frames_walk_through_the_axes_of_the_composition():
    assert shown_axes(Composition(dp=2, tp=2, pp=2, ep=2)) == ["tp", "dp", "pp", "ep"]
    assert shown_axes(Composition(dp=4, cp=2, ep=4)) == ["cp", "dp", "ep", "edp"]
    assert shown_axes(Composition()) == ["tp"]


def test_impossible_composition_is_shown_not_raised():
    st = planner_state(TINY, TWO_NODES, Composition(dp=4), "dp")
    assert "cluster has 8 devices" in st["error"]
    assert planner_caption(st).startswith("cannot build")


def test_large_cluster_shows_the_first_nodes_only():
    st = planner_state(LLAMA3_405B, H100_16K, LLAMA3_405B_16K_PLAN, "tp", max_nodes=4)
    assert len(st["nodes"]) == 4 and st["nodes_total"] == 2048 and st["nodes"][1][0] == 8
    assert len(set(st["group"].values())) == 4                      # one tp group of 8 per node


def test_drawing_and_player_render_headless():
    import matplotlib
    matplotlib.use("Agg")
    from reference.widgets.player import render_png
    comp = Composition(dp=2, tp=2, pp=2, ep=2)
    for axis in ("pp",):
        assert render_png(draw_planner, planner_state(TINY, TWO_NODES, comp, axis))[:4] == b"\x89PNG"
    assert render_png(draw_planner, planner_state(TINY, TWO_NODES, Composition(dp=3), "dp"))[:4] == b"\x89PNG"
    player = planner_player({"tiny": TINY}, {"two nodes": TWO_NODES}, comp=comp)
    assert player.n_steps == 4
    assert player.state_at(3)["axis"] == "ep"
    player.widget()
    player.controls["ep"].value = 1
    player.controls["tp"].value = 4                                   # rebuilds: dp = 8 / (4·2·1) = 1
    assert player.n_steps == 2 and player.state_at(0)["title"].endswith("tp4 pp2")
    player.controls["ep"].value = 2                                   # ep must divide dp·cp = 1
    assert "ep=2 must divide" in player.state_at(0)["error"]
