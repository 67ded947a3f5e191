"""Lecture 4b, beyond ZB-H1, single process: the V placement, breadth-first's order, the one clock (a full
backward two slots) and how long before a step ends each chunk's gradients are final — checked against
formulas and hand-counted slots, not against the code under test.  (The same schedules run by torch on
real ranks: test_vs_torch.py.)"""
from __future__ import annotations

import pytest

from reference.pipeline import Action, bubble_fraction, measured_bubble, peak_stash, render, schedule, simulate
from reference.pipeline.beyond import breadth_first, clock, gradients_final
from reference.pipeline.lecture import on_one_clock
from reference.pipeline.schedules import rank_of_stage, virtual_stage
from reference.pipeline.stages import chunks_of_rank


def test_the_v_placement_folds_two_chunks_per_rank_and_inverts():
    assert [virtual_stage(c, r, 4, "v") for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [virtual_stage(c, r, 2) for c in (0, 1) for r in range(2)] == [0, 1, 2, 3]           # loop: c·p + r
    for placement, v in (("loop", 3), ("v", 2)):
        for p in (1, 2, 5):
            assert sorted(virtual_stage(c, r, p, placement) for c in range(v) for r in range(p)) == list(range(p * v))
            assert all(rank_of_stage(virtual_stage(c, r, p, placement), p, placement) == r
                       for c in range(v) for r in range(p))
    with pytest.raises(ValueError, match="two chunks"):
        virtual_stage(2, 0, 4, "v")
    with pytest.raises(ValueError, match="placement"):
        virtual_stage(0, 0, 4, "zigzag")
    assert chunks_of_rank(list("abcdefgh"), 1, 4, "v") == ["b", "g"]
    with pytest.raises(ValueError, match="two pieces per rank"):
        chunks_of_rank(list("abcdef"), 0, 2, "v")


def test_simulate_follows_the_v_a_micro_batch_turns_on_the_last_rank_and_returns():
    # p = 2, one micro-batch, V placement: stages 0 1 | 2 3 on ranks 0 1 | 1 0
    order = [[Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0)],
             [Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0)]]
    tl = simulate(order, placement="v")
    starts = {(r, str(a)): s for r, acts in enumerate(tl) for s, _, a in acts}
    # F: stage 0 (rank 0) at 0, stage 1 (rank 1) at 1, stage 2 (rank 1) at 2, stage 3 (rank 0) at 3; then back
    assert [starts[(0, "F0")], starts[(1, "F0")], starts[(1, "F0c1")], starts[(0, "F0c1")]] == [0, 1, 2, 3]
    assert [starts[(0, "B0c1")], starts[(1, "B0c1")], starts[(1, "B0")], starts[(0, "B0")]] == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="deadlocks"):        # the loop placement reads the same order otherwise
        simulate([order[0][:2] + order[0][3:] + order[0][2:3], order[1]], placement="v")
    assert render(order, placement="v").splitlines()[0].startswith("stage 0 | F0")


def test_simulate_takes_one_cost_per_stage():
    order = schedule("1f1b", 2, 2)
    slow_last = simulate(order, cost=[{}, {"F": 3.0}])
    assert slow_last[1][0][:2] == (1.0, 4.0)                  # stage 1's F0 starts after stage 0's, takes 3
    with pytest.raises(ValueError, match="one entry per stage"):
        simulate(order, cost=[{}])


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (3, 5, 2), (4, 8, 2), (3, 6, 3)])
def test_breadth_first_has_interleavings_bubble_and_gpipes_memory(p, m, v):
    order = [breadth_first(p, m, v, r) for r in range(p)]
    assert order[0][:m] == [Action("F", i) for i in range(m)]                     # chunk 0, every micro-batch
    assert order[0][m * v] == Action("B", m - 1, v - 1)                           # backwards: last chunk, reversed
    for cost in ({}, {"B": 2.0}):                                                 # F = B, or a full backward of two
        assert measured_bubble(simulate(order, cost=cost)) == pytest.approx((p - 1) / (v * m + p - 1))
    assert peak_stash(order) == [m * v] * p
    if m % p == 0:                                                                # where interleaving exists
        assert measured_bubble(simulate(order)) == pytest.approx(bubble_fraction("interleaved_1f1b", p, m,
                                                                                 virtual_stages=v))
    with pytest.raises(ValueError):
        breadth_first(p, m, v, p)


def test_the_clock_prices_full_and_split_backwards():
    one = schedule("1f1b", 3, 4)
    assert simulate(one, cost=clock(one)) == simulate(one, cost={"B": 2.0})
    zb = schedule("zb_h1", 3, 4)
    assert simulate(zb, cost=clock(zb)) == simulate(zb)
    # a mixed order: rank 0's B0 is a full backward (2 slots, its W none), B1 is split (1 + 1)
    mixed = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("B", 1), Action("W", 1)]]
    tl = simulate(mixed, cost=clock(mixed, [(0, Action("B", 0))]))
    assert [(s, e) for s, e, _ in tl[0]] == [(0, 1), (1, 2), (2, 4), (4, 4), (4, 5), (5, 6)]


def test_gradients_final_counts_the_slots_left_after_each_chunks_last_gradient():
    for p, m in ((2, 3), (4, 8), (5, 5)):
        one = schedule("1f1b", p, m)
        # a full backward takes 2 slots and stage s's last one ends s hops (2 slots each) before stage 0's
        assert gradients_final(one, cost=clock(one)) == [{0: 2.0 * s} for s in range(p)]
        assert gradients_final(schedule("zb_h1", p, m)) == [{0: 0.0}] * p      # the W's fill the drain
    bfs = [breadth_first(4, 8, 2, r) for r in range(4)]
    # chunk 1 of rank r ends its backwards m full backwards (2m slots) before chunk 0 does
    assert gradients_final(bfs, cost=clock(bfs)) == [{0: 2.0 * r, 1: 2.0 * r + 16} for r in range(4)]


def test_on_one_clock_keeps_every_schedules_bubble_fraction():
    rows = on_one_clock({}, p=4, m=8)
    assert rows["1f1b"]["bubble"] == pytest.approx(bubble_fraction("1f1b", 4, 8))
    assert rows["interleaved_1f1b"]["bubble"] == pytest.approx(bubble_fraction("interleaved_1f1b", 4, 8,
                                                                               virtual_stages=2))
    assert rows["zb_h1"]["bubble"] == pytest.approx(bubble_fraction("zb_h1", 4, 8))
    assert rows["interleaved_1f1b"]["peak"][0] == pytest.approx(4 * (1 + 3 / 8))  # 1 + (p − 1)/(p·v) of 1F1B's


def test_an_order_is_drawn_whole_with_its_overlapped_pairs_outlined():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from reference.widgets.pipeline import draw_order, order_timeline
    order = [[Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0)],
             [Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0)]]
    tl = order_timeline(order, placement="v", cost={"B": 2.0})
    assert tl.span == 12 and tl.bubble == pytest.approx(1 - 12 / 24)
    assert {(b.rank, b.stage) for b in tl.blocks} == {(0, 0), (1, 1), (1, 2), (0, 3)}
    assert [(m.src, m.dst, m.what) for m in tl.messages] == [(0, 1, "activation"), (1, 0, "activation"),
                                                             (0, 1, "gradient"), (1, 0, "gradient")]
    fig = plt.figure(figsize=(8, 3))
    draw_order(fig, tl, title="test", pairs=[(1, Action("F", 0, 1), Action("B", 0, 1))])
    boxes = [p for p in fig.axes[0].patches if p.get_gid() == "overlap"]
    assert len(boxes) == 1 and boxes[0].get_x() == 2 and boxes[0].get_width() == 6      # F0c1 at 2, B0c1 ends at 8
    assert "slot bubble 50.0%" in fig.axes[0].get_title(loc="left")
    plt.close(fig)
