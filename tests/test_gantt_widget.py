"""The pipeline Gantt widget (reference/widgets/gantt.py) on hand-built traces: slot layout, the
bubble, the stash curves, wall-clock mode, drawing and the player's controls."""
from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from reference.trace import Event
from reference.widgets.gantt import draw_gantt, gantt_player, gantt_state


def traced(order: list[list[tuple[str, int]]]) -> list[Event]:
    """Compute events for a per-rank order, one per action, at made-up (but per-rank increasing) times."""
    out = []
    for r, acts in enumerate(order):
        for n, (kind, i) in enumerate(acts):
            t = 10.0 + n + 0.1 * r
            out.append(Event(r, "compute", step=i, start=t, end=t + 0.5,
                             meta={"what": kind, "microbatch": i, "chunk": 0, "stage": r}))
    return out


def gpipe(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p, m):   # written out independently of reference.pipeline
    out = []
    for s in range(p):
        w = min(m, p - s - 1)
        acts = [("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [("F", w + i), ("B", i)]
        out.append(acts + [("B", i) for i in range(m - w, m)])
    return out


@pytest.mark.parametrize("order,p,m", [(gpipe(2, 3), 2, 3), (gpipe(4, 8), 4, 8), (one_f_one_b(3, 4), 3, 4),
                                       (one_f_one_b(4, 8), 4, 8)])
def test_slots_give_the_makespan_and_bubble_of_the_formula(order, p, m):
    st = gantt_state(traced(order), 1e9)
    assert st.span == 2 * (m + p - 1)
    assert st.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert len(st.blocks) == 2 * m * p and st.ranks == p and st.microbatches == m


def test_stash_peaks_at_m_for_gpipe_and_p_minus_rank_for_1f1b():
    peak = lambda st: {r: max(h for _, h in c) for r, c in st.stash.items()}    # noqa: E731
    assert peak(gantt_state(traced(gpipe(3, 5)), 1e9)) == {0: 5, 1: 5, 2: 5}
    assert peak(gantt_state(traced(one_f_one_b(4, 8)), 1e9)) == {0: 4, 1: 3, 2: 2, 3: 1}
    st = gantt_state(traced(one_f_one_b(4, 8)), 1e9)
    assert all(c[-1][1] == 0 for c in st.stash.values())        # everything freed at the end


def test_weight_gradients_count_as_work_and_free_the_stash():
    order = [[("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1), ("W", 1)]]
    st = gantt_state(traced(order), 1e9)
    assert st.span == 6 and st.bubble == 0
    assert [h for _, h in st.stash[0]] == [0, 1, 2, 1, 0]


def test_time_cuts_the_picture_and_the_caption_names_idle_ranks():
    from reference.widgets.gantt import _caption
    tr = traced(gpipe(2, 2))
    st = gantt_state(tr, 0.5)
    assert st.running()[0].kind == "F" and st.running()[1] is None
    assert "idle (bubble): rank 1" in _caption(st)
    assert all(b.start >= 0 for b in gantt_state(tr, 0.0).blocks)


def test_wall_clock_uses_the_measured_times_in_milliseconds():
    tr = traced(gpipe(2, 2))
    st = gantt_state(tr, 1e9, clock="wall")
    first = min(b.start for b in st.blocks)
    assert first == 0 and st.span == pytest.approx((3 + 0.1 + 0.5) * 1e3)
    assert 0 < st.bubble < 1


def test_draw_puts_one_bar_per_block_and_a_bubble_bar_per_rank():
    st = gantt_state(traced(one_f_one_b(3, 4)), 1e9, predicted=2 / 6, title="1f1b")
    fig = Figure(figsize=(9, 4))
    draw_gantt(fig, st)
    bars = [p for p in fig.axes[0].patches]
    assert len(bars) == len(st.blocks) + st.ranks
    assert "formula 33.3%" in fig.axes[0].get_title() and "measured bubble 33.3%" in fig.axes[0].get_title()


def test_player_switches_runs_with_its_controls():
    runs = {("gpipe", 2, 4): traced(gpipe(2, 4)), ("1f1b", 2, 4): traced(one_f_one_b(2, 4)),
            ("gpipe", 2, 1): traced(gpipe(2, 1))}
    p = gantt_player(runs, schedule="gpipe", num_stages=2, num_microbatches=4)
    p.widget()
    last = p.state_at(p.n_steps - 1)
    assert last.span == 10 and max(h for _, h in last.stash[0]) == 4
    p.controls["schedule"].value = "1f1b"
    assert max(h for _, h in p.state_at(p.n_steps - 1).stash[0]) == 2
    p.controls["m"].value = 1                     # 1F1B needs m ≥ p: the chart falls back to GPipe, says so
    st = p.state_at(0)
    assert "needs m ≥ p" in st.title and st.span == 4
    assert p.png(3)[:4] == b"\x89PNG"
