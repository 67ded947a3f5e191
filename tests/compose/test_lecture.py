"""Lecture 5c's teaching side: the planner widget's state function (pure) and its drawing."""
from __future__ import annotations

from reference.planner import Cluster, Composition, Model, plan
from reference.planner.published import H100_16K, LLAMA3_405B, LLAMA3_405B_16K_PLAN
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
    player.controls["ep"].value = 2                                   # experts at tp 4: etp·ep must divide tp·cp·dp
    assert "etp·ep = 4·2 = 8 must divide the stage's tp·cp·dp = 4·1·1 = 4" in player.state_at(0)["error"]


# -- the notebook's composed runs (small sizes): what the plots and tables show is what the runs did ----------

def test_composed_runs_demo_equals_one_process_and_its_byte_table_matches(world):
    from reference.compose import lecture
    runs = lecture.composed_runs(steps=2, layers=2, d_model=16, heads=2, d_ff=32, seq_len=8, bucket_cap_mb=0.002,
                                 world=world(8))
    assert set(runs) == {"3D", "4D", "3D, cp", "4D, cp"}
    assert runs["4D"]["moe"] and runs["4D, cp"]["moe"] and not runs["3D"]["moe"] and not runs["3D, cp"]["moe"]
    for name, run in runs.items():
        assert len(run["losses"]) == len(run["single"]) == 2
        assert run["max_diff"] <= 1e-10, (name, run["losses"], run["single"])
        assert len(run["measured"]) == len(run["formula"]) == 8
        axis = "cp" if "cp" in run["sizes"] else "pp"
        for got, want in zip(run["measured"], run["formula"]):
            assert want and {a: got.get(a, 0) for a in want} == want, (name, got, want)
            assert got["tp"] > 0 and got[axis] > 0 and got["dp_cp"] > 0
        # the overlap timeline: several dp_cp buckets, the first posted while backward still ran
        tl = run["timeline"]
        assert len(tl["buckets"]) > 1 and min(start for _, start, _ in tl["buckets"]) < tl["backward_end"], (name, tl)
        assert 0 < tl["hidden"] <= 1


def test_planner_vs_run_demo_is_exact_on_states_and_bytes(world):
    from reference.compose import lecture
    out = lecture.planner_vs_run(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8, world=world(8))
    assert sorted(out["ranks"]) == list(range(8))
    for r, v in out["ranks"].items():
        for kind in ("params", "grads", "optimizer"):
            assert v["memory"][kind][0] == v["memory"][kind][1] > 0, (r, kind, v["memory"][kind])
        assert set(v["bytes"]) == {"dp", "tp", "pp"}
        assert all(want == got > 0 for want, got in v["bytes"].values()), (r, v["bytes"])
        want, got = v["memory"]["activations"]
        assert abs(want - got) <= 0.1 * got, (r, want, got)


def test_player_keeps_the_published_interleaving_and_stage_layout_while_its_pipeline_does():
    from reference.planner.published import H100_16K_PRESET, LLAMA3_405B_STAGES
    player = planner_player({"405B": LLAMA3_405B}, {"16K": H100_16K_PRESET}, comp=LLAMA3_405B_16K_PLAN)
    st = player.state_at(0)
    assert st["error"] is None, st["error"]     # pp 16 × v 8 = 128 chunks for 126 layers: only with the layout's
    #                                              embedding-only first and loss-only last chunks
    assert st["step_time"] == plan(LLAMA3_405B, H100_16K_PRESET, LLAMA3_405B_16K_PLAN).step_time
    assert len(LLAMA3_405B_STAGES) == 128


def test_the_lectures_predictions_and_worked_answers_hold_in_the_planner():
    """05c's quizzes and worked problems state what the planner prints: if a change to the planner moves an answer,
    this says which (the notebook's text must move with it)."""
    from dataclasses import replace

    from reference.planner import Composition as C
    from reference.planner.published import (DEEPSEEK_V3, DEEPSEEK_V3_PLAN, H100_16K_PRESET, H800_2048, LLAMA3_70B,
                                             LLAMA3_405B_16K_PLAN)
    from reference.planner.sparse_runs import MIXTRAL_8X7B
    from reference.planner.thresholds import fsdp_tokens, link_of
    from reference.planner import Cluster, time_terms, with_sizes
    # "which of the three fits?" — Llama 3 405B: only the published plan
    fits = [plan(LLAMA3_405B, H100_16K_PRESET, c).fits for c in
            (C(dp=2048, pp=8, zero=1), C(dp=2048, tp=8, zero=1), LLAMA3_405B_16K_PLAN)]
    assert fits == [False, False, True]
    # DeepSeek-V3: neither no-pipeline nor DeepSeek's own by the planner's bf16 activations; fully recomputed, it fits
    fits = [plan(DEEPSEEK_V3, H800_2048, c).fits for c in
            (with_sizes(DEEPSEEK_V3_PLAN, dp=256, tp=8, pp=1, etp=1), DEEPSEEK_V3_PLAN,
             with_sizes(DEEPSEEK_V3_PLAN, recompute="full"))]
    assert fits == [False, False, True]
    # §6: folding Mixtral 8x7B at tp 8 moves its all-to-all from across nodes into one
    h64 = Cluster.preset("h100-80gb-sxm", 64)
    at_tp = C(dp=8, tp=8, ep=8, flash=True, distributed_optimizer=True)
    assert plan(MIXTRAL_8X7B, h64, at_tp).link["ep"] == "inter"
    assert plan(MIXTRAL_8X7B, h64, with_sizes(at_tp, etp=1)).link["ep"] == "intra"
    # problem 1: FSDP over 64 at micro-batch 1 leaves its gathers exposed (8K tokens, under the bar), at 2 hides them,
    # at 4 does not fit; without recomputation nothing fits
    m70 = replace(LLAMA3_70B, global_batch=512)
    bar = fsdp_tokens(link_of(h64, "inter"), 64)
    assert 8192 < 0.5 * bar and abs(2 * 8192 / bar - 1) < 0.15          # b = 1 far under the bar, b = 2 near it
    fsdp = {b: plan(m70, h64, C(dp=64, zero=3, flash=True, recompute="full", micro_batch=b)) for b in (1, 2, 4)}
    assert time_terms(fsdp[1])["zero3"] > 0.2 * fsdp[1].step_time
    assert time_terms(fsdp[2]).get("zero3", 0.0) < 0.01 * fsdp[2].step_time and fsdp[2].fits
    assert not fsdp[4].fits and not plan(m70, h64, C(dp=64, zero=3, flash=True)).fits
    # problem 2: on 1,024 GPUs, tp 8 × dp 128 with ZeRO-1 beats ZeRO-3 (re-gathered per 8K-token micro-batch) and pp 2
    h1k = Cluster.preset("h100-80gb-sxm", 1024)
    z1, z3, pp2 = (plan(m70, h1k, c) for c in (C(dp=128, tp=8, zero=1, flash=True), C(dp=128, tp=8, zero=3, flash=True),
                                               C(dp=512, pp=2, zero=3, flash=True, recompute="full")))
    assert z1.fits and z1.step_time < z3.step_time < pp2.step_time and abs(pp2.bubble - 0.5) < 0.01


def test_a_folded_expert_grid_is_drawn_with_its_ep_groups_inside_a_node():
    from reference.planner.sparse_runs import MIXTRAL_8X7B
    h64 = Cluster.preset("h100-80gb-sxm", 64)
    at_tp = Composition(dp=8, tp=8, ep=8, flash=True)
    folded = Composition(dp=8, tp=8, ep=8, etp=1, flash=True)
    assert shown_axes(at_tp) == ["tp", "dp", "ep"]                        # edp = 64 / (8·8) = 1: not shown
    assert shown_axes(folded) == ["tp", "dp", "ep", "edp"]                  # etp 1: nothing to colour
    unfolded_ep = planner_state(MIXTRAL_8X7B, h64, at_tp, "ep")
    folded_ep = planner_state(MIXTRAL_8X7B, h64, folded, "ep")
    assert unfolded_ep["rank0_group"] == list(range(0, 64, 8)) and unfolded_ep["crosses_nodes"]
    assert folded_ep["rank0_group"] == list(range(8)) and not folded_ep["crosses_nodes"]
    assert folded_ep["comm"]["ep"][2] == "intra" and unfolded_ep["comm"]["ep"][2] == "inter"
    player = planner_player({"8x7B": MIXTRAL_8X7B}, {"64": h64}, comp=folded)
    assert player.controls["etp"].value == 1 and player.state_at(2)["axis"] == "ep"
    values = {k: c.value for k, c in player.controls.items()} | {"etp": 0}   # "= tp": experts cut like the MLP
    state_at, n = player.rebuild(**values)                                 # what moving the control calls
    assert n == 3 and state_at(2)["rank0_group"] == list(range(0, 64, 8))
