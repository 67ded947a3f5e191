"""Lecture 5b's expert-grid widget (reference.widgets.expert_grid): both grids' ep groups are RankGrid's, the bytes
placement.cross_node_bytes's, a grid that cannot be built says why, and every state draws."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from reference.mesh import RankGrid  # noqa: E402
from reference.moe.placement import cross_node_bytes  # noqa: E402
from reference.widgets.expert_grid import MODEL, draw_grids, grid_caption, grid_state  # noqa: E402


def test_tp8_unfolded_crosses_every_node_and_folded_stays_in_one():
    st = grid_state(tp=8, ep=8, group=0)
    unfolded, folded = st["panels"]
    assert st["n_groups"] == 8 and unfolded["error"] is None and folded["error"] is None
    assert unfolded["members"] == list(range(0, 64, 8)) == RankGrid(64, tp=8, dp=8, ep=8).ranks("ep", 0)
    assert folded["members"] == list(range(8)) == RankGrid(64, tp=8, dp=8, ep=8, etp=1).ranks("ep", 0)
    assert unfolded["nodes_spanned"] == 8 and folded["nodes_spanned"] == 1
    assert all(across for _, across in unfolded["peers"]) and not any(across for _, across in folded["peers"])
    want = cross_node_bytes(RankGrid(64, tp=8, dp=8, ep=8), 8, **MODEL)
    assert unfolded["cross_node_bytes"] == want["cross_node_bytes"] == want["dispatch_bytes"] > 0
    assert folded["cross_node_bytes"] == 0 and folded["dispatch_bytes"] == want["dispatch_bytes"]


def test_each_step_highlights_the_next_ep_group_and_its_first_rank_sends():
    groups = RankGrid(64, tp=4, dp=16, ep=4, etp=1).all_groups("ep")
    for step in (0, 5, len(groups) + 5):                           # steps past the last wrap around
        folded = grid_state(tp=4, ep=4, group=step)["panels"][1]
        assert folded["members"] == groups[step % len(groups)] and folded["sender"] == folded["members"][0]
        assert sorted(r for r, _ in folded["peers"]) == folded["members"][1:]


def test_a_grid_that_cannot_be_built_names_the_sizes_and_the_other_still_draws():
    st = grid_state(tp=2, ep=64)                                   # DeepSeek-V3's EP 64 beside tp 2: folded only
    unfolded, folded = st["panels"]
    assert "128 must divide" in unfolded["error"] and folded["error"] is None and folded["nodes_spanned"] == 8
    assert "cannot be built" in grid_caption(st) and "8 node(s)" in grid_caption(st)
    fig = Figure(figsize=(12, 6.2))
    draw_grids(fig, st)
    assert len(fig.axes) == 2 and any("cannot be built" in t.get_text() for t in fig.axes[0].texts)
