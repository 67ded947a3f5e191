"""The pipeline Gantt widget (reference/widgets/pipeline.py) on hand-built traces: the slot rebuild
(makespan, bubble, messages, stash), wall-clock mode, cutting at t, the caption, drawing and the
player's controls.  Stand-alone: no reference.pipeline, no ranks."""
from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from reference.trace import Event
from reference.widgets.pipeline import Timeline, caption, draw_gantt, gantt_state, pipeline_player, pipeline_timeline

# GPipe, p = 2, m = 3, laid out by hand in unit slots ("." = idle): what the slot rebuild must give
GPIPE_2_3 = ["F0 F1 F2 .  .  B0 B1 B2",
             ".  F0 F1 F2 B0 B1 B2 ."]

# 1F1B, p = 3, m = 4: stage s warms up with p − s − 1 forwards, then alternates
ONE_F_ONE_B_3_4 = ["F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
                   ".  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .",
                   ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  ."]


def parse(rows: list[str]) -> list[list[tuple[str, int, int, int]]]:
    """Per rank, (kind, microbatch, chunk, slot) of every block of a hand-written slot layout."""
    out = []
    for row in rows:
        acts = []
        for slot, cell in enumerate(row.split()):
            if cell != ".":
                kind, rest = cell[0], cell[1:]
                mb, _, chunk = rest.partition("c")
                acts.append((kind, int(mb), int(chunk or 0), slot))
        out.append(acts)
    return out


def traced(rows: list[str], *, packed: bool = True, stashed: bool = False, p: int | None = None) -> list[Event]:
    """Compute events for a layout.  ``packed``: each rank's blocks back to back from t = 10 s
    (its order only, the idle slots lost — the slot rebuild has to find them again from the
    dependencies); else at the layout's own slots, 0.01 s each."""
    layout, out = parse(rows), []
    p = p or len(rows)
    for r, acts in enumerate(layout):
        held = 0
        for n, (kind, i, c, slot) in enumerate(acts):
            t = 10.0 + n * 0.5 + 0.1 * r if packed else 10.0 + 0.01 * slot
            held += {"F": 1, "B": -1}.get(kind, 0)
            meta = {"what": kind, "microbatch": i, "chunk": c, "stage": c * p + r}
            if stashed:
                meta["stashed"] = held
            out.append(Event(r, "compute", step=i, start=t, end=t + (0.4 if packed else 0.01), meta=meta))
    return out


def starts(tl: Timeline) -> dict[tuple[int, str, int, int], float]:
    return {(b.rank, b.kind, b.microbatch, b.chunk): b.start for b in tl.blocks}


def expected_starts(rows: list[str]) -> dict[tuple[int, str, int, int], float]:
    return {(r, k, i, c): float(s) for r, acts in enumerate(parse(rows)) for k, i, c, s in acts}


@pytest.mark.parametrize("rows,p,m", [(GPIPE_2_3, 2, 3), (ONE_F_ONE_B_3_4, 3, 4)])
def test_slot_rebuild_recovers_the_idealised_schedule_and_the_formula_bubble(rows, p, m):
    tl = pipeline_timeline(traced(rows), "slots")
    assert starts(tl) == expected_starts(rows)
    assert tl.span == 2 * (m + p - 1) and tl.ranks == p and tl.num_microbatches == m
    assert tl.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert tl.bubble_per_rank == pytest.approx({r: (p - 1) / (m + p - 1) for r in range(p)})
    assert all(b.end - b.start == 1 for b in tl.blocks)


def test_idle_gaps_are_the_dots_of_the_layout():
    tl = pipeline_timeline(traced(GPIPE_2_3), "slots")
    assert tl.idle(0) == [(3.0, 5.0)] and tl.idle(1) == [(0.0, 1.0), (7.0, 8.0)]
    assert tl.idle(1, upto=4) == [(0.0, 1.0)]


def test_messages_are_the_dependencies_that_cross_ranks():
    tl = pipeline_timeline(traced(GPIPE_2_3), "slots")
    acts = [(m.src, m.dst, m.microbatch, m.depart, m.arrive) for m in tl.messages if m.what == "activation"]
    grads = [(m.src, m.dst, m.microbatch, m.depart, m.arrive) for m in tl.messages if m.what == "gradient"]
    assert sorted(acts) == [(0, 1, 0, 1, 1), (0, 1, 1, 2, 2), (0, 1, 2, 3, 3)]
    assert sorted(grads) == [(1, 0, 0, 5, 5), (1, 0, 1, 6, 6), (1, 0, 2, 7, 7)]


def test_stash_peaks_at_m_for_gpipe_and_p_minus_rank_for_1f1b():
    g = pipeline_timeline(traced(GPIPE_2_3), "slots")
    assert g.peak_stash == {0: 3, 1: 3}
    assert [h for _, h in g.stash[0]] == [0, 1, 2, 3, 2, 1, 0]
    f = pipeline_timeline(traced(ONE_F_ONE_B_3_4), "slots")
    assert f.peak_stash == {0: 3, 1: 2, 2: 1}
    assert all(c[-1][1] == 0 for c in f.stash.values())


def test_stash_reads_the_traces_stashed_counts_when_present():
    tr = traced(ONE_F_ONE_B_3_4, stashed=True)
    for e in tr:
        e.meta["stashed"] *= 10                       # a recorded count wins over counting F and B
    assert pipeline_timeline(tr, "slots").peak_stash == {0: 30, 1: 20, 2: 10}


def test_weight_gradients_are_work_and_free_the_stash():
    # ZB-like, p = 2, m = 2: W after its B; the bubble is (p − 1) / (3m + p − 1)
    rows = ["F0 F1 B0 W0 B1 W1", "F0 B0 F1 B1 W0 W1"]
    tl = pipeline_timeline(traced(rows), "slots")
    assert starts(tl) == {(0, "F", 0, 0): 0, (0, "F", 1, 0): 1, (0, "B", 0, 0): 3, (0, "W", 0, 0): 4,
                          (0, "B", 1, 0): 5, (0, "W", 1, 0): 6, (1, "F", 0, 0): 1, (1, "B", 0, 0): 2,
                          (1, "F", 1, 0): 3, (1, "B", 1, 0): 4, (1, "W", 0, 0): 5, (1, "W", 1, 0): 6}
    assert tl.span == 7 and tl.bubble == pytest.approx(1 / 7)
    assert sum(b.kind == "W" for b in tl.blocks) == 4
    assert [h for _, h in tl.stash[0]] == [0, 1, 2, 2, 1, 1, 0]      # freed by W, not by B


def test_interleaved_chunks_are_virtual_stages():
    # p = 2, v = 2 (rank 0: stages 0, 2; rank 1: stages 1, 3), m = 2, all forwards then all backwards
    order = "F0c0 F1c0 F0c1 F1c1 B0c1 B1c1 B0c0 B1c0"
    tl = pipeline_timeline(traced([order, order]), "slots")
    assert tl.virtual_stages == 2 and tl.span == 10
    assert tl.bubble == pytest.approx(1 / (2 * 2 + 1))                 # (p − 1) / (v·m + p − 1)
    s = starts(tl)
    assert s[(0, "F", 0, 1)] == 2 and s[(1, "F", 1, 1)] == 4 and s[(0, "B", 1, 0)] == 9
    assert len(tl.messages) == 12 and {(m.src, m.dst) for m in tl.messages} == {(0, 1), (1, 0)}


def test_an_order_that_deadlocks_is_named():
    with pytest.raises(ValueError, match="deadlocks"):
        pipeline_timeline(traced(["F0 B0", "B0 F0"]), "slots")


def test_wall_clock_uses_the_measured_times_from_the_first_block():
    tr = traced(GPIPE_2_3)
    tl = pipeline_timeline(tr, "wall")
    t0 = min(e.start for e in tr)
    assert tl.unit == "ms" and min(b.start for b in tl.blocks) == 0
    assert tl.span == pytest.approx((max(e.end for e in tr) - t0) * 1e3)
    got = {(b.rank, b.kind, b.microbatch): (b.start, b.end) for b in tl.blocks}
    for e in tr:
        assert got[(e.rank, e.meta["what"], e.meta["microbatch"])] == pytest.approx(((e.start - t0) * 1e3,
                                                                                     (e.end - t0) * 1e3))
    busy = sum(e.end - e.start for e in tr) * 1e3
    assert tl.bubble == pytest.approx(1 - busy / (2 * tl.span))
    assert tl.bubble != pytest.approx(pipeline_timeline(tr, "slots").bubble)


def test_wall_clock_messages_run_from_the_send_to_the_receive():
    tr = traced(GPIPE_2_3, packed=False)
    for e in tr:
        if e.rank == 1:                               # the receiver runs 5 ms behind: the message travels
            e.start, e.end = e.start + 0.005, e.end + 0.005
    f0 = next(e for e in tr if e.rank == 0 and e.meta["what"] == "F" and e.meta["microbatch"] == 1)
    tr += [Event(0, "send", peer=1, nbytes=96, step=1, start=f0.end + 0.001, end=f0.end + 0.02,
                 meta={"what": "activation", "microbatch": 1, "chunk": 0}),
           Event(1, "recv", peer=0, nbytes=96, step=1, start=9.0, end=f0.end + 0.004,
                 meta={"what": "activation", "microbatch": 1, "chunk": 0}),
           Event(0, "send", peer=1, nbytes=8, start=9.5, end=9.6, meta={"what": "shape"})]    # ignored
    tl = pipeline_timeline(tr, "wall")
    msg = next(m for m in tl.messages if m.what == "activation" and m.microbatch == 1)
    t0 = min(e.start for e in tr if e.op == "compute")
    assert msg.depart == pytest.approx((f0.end + 0.001 - t0) * 1e3) and msg.nbytes == 96
    assert msg.arrive == pytest.approx((f0.end + 0.004 - t0) * 1e3)
    assert len(tl.messages) == 6


def test_state_at_zero_shows_nothing_and_at_the_end_everything():
    tl = pipeline_timeline(traced(ONE_F_ONE_B_3_4), "slots")
    first = gantt_state(tl, 0)
    assert first.blocks == [] and first.messages == [] and first.stash_now == {0: 0, 1: 0, 2: 0}
    assert first.now == {0: None, 1: None, 2: None} and first.idle == {0: [], 1: [], 2: []}
    assert caption(first).startswith("t = 0: nothing has run")
    last = gantt_state(tl, tl.span)
    assert len(last.done) == len(last.blocks) == 24 and len(last.messages) == len(tl.messages) == 16
    assert last.finished and last.in_flight == [] and last.stash_now == {0: 0, 1: 0, 2: 0}
    assert "measured bubble 33.3%" in caption(last) and "[3, 2, 1]" in caption(last)


def test_state_mid_run_cuts_blocks_and_says_who_idles_and_why():
    tl = pipeline_timeline(traced(GPIPE_2_3), "slots")
    st = gantt_state(tl, 3)
    assert sorted((b.rank, b.kind, b.microbatch) for b in st.blocks) == [(0, "F", 0), (0, "F", 1), (0, "F", 2),
                                                                         (1, "F", 0), (1, "F", 1)]
    assert st.now[0].microbatch == 2 and st.now[1].microbatch == 1 and st.stash_now == {0: 3, 1: 2}
    assert caption(st) == "t=3: stage 0 runs F2, stage 1 runs F1"
    st = gantt_state(tl, 5)
    assert st.now[0] is None and st.now[1].kind == "B" and st.idle[0] == [(3.0, 5.0)]
    assert caption(st) == ("t=5: stage 1 runs B0; stage 0 idle (bubble: waits for the gradient of micro-batch 0 "
                           "from rank 1)")
    assert "stage 1 idle (bubble: drained" in caption(gantt_state(tl, 7.5))
    assert "stage 1 idle (bubble: fill, waits for the activation of micro-batch 0 from rank 0)" in \
        caption(gantt_state(tl, 0.5))
    half = gantt_state(pipeline_timeline(traced(GPIPE_2_3), "wall"), 1.0)   # wall: blocks cut at t
    assert len(half.blocks) == 1 and half.blocks[0].end > 1.0


def test_plain_dict_events_work_too():
    tr = [e.to_dict() for e in traced(GPIPE_2_3)] + [{"rank": 0, "op": "barrier", "start": 0.0, "end": 0.0}]
    assert pipeline_timeline(tr, "slots").span == 8


def _count(fig, gid):
    return sum(p.get_gid() == gid for p in fig.axes[0].patches)


def test_draw_puts_one_patch_per_block_and_per_bubble():
    tl = pipeline_timeline(traced(ONE_F_ONE_B_3_4), "slots")
    fig = Figure(figsize=(11, 5), dpi=80)
    draw_gantt(fig, gantt_state(tl, tl.span, predicted=2 / 6, title="1f1b"))
    assert _count(fig, "block") == 24
    assert _count(fig, "bubble") == sum(len(tl.idle(r)) for r in range(3)) == 9
    title = fig.axes[0].get_title(loc="left")
    assert "measured bubble 33.3% · formula 33.3%" in title and title.startswith("1f1b")
    assert [t.get_text() for t in fig.axes[0].texts].count("B3") == 3
    assert len(fig.axes[1].get_lines()) >= 3                              # one stash curve per rank
    fig = Figure(figsize=(11, 5), dpi=80)
    draw_gantt(fig, gantt_state(tl, 4))
    assert _count(fig, "block") == 7 and "formula" not in fig.axes[0].get_title(loc="left")


def test_player_switches_runs_with_its_controls():
    gpipe_3_4 = ["F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3", ".  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .",
                 ".  .  F0 F1 F2 F3 B0 B1 B2 B3 .  ."]
    runs = {("gpipe", 2, 3): traced(GPIPE_2_3), ("gpipe", 3, 4): {"trace": traced(gpipe_3_4), "predicted": 1 / 3},
            ("1f1b", 3, 4): traced(ONE_F_ONE_B_3_4)}
    pl = pipeline_player(runs, schedule="gpipe", num_stages=2, num_microbatches=3, predicted={("gpipe", 2, 3): 0.25})
    pl.widget()
    assert list(pl.controls["schedule"].options) == ["gpipe", "1f1b"] and list(pl.controls["p"].options) == [2, 3]
    assert pl.n_steps == 9 and pl.state_at(0).blocks == []                  # one frame per slot, 0 … 8
    last = pl.state_at(pl.n_steps - 1)
    assert last.finished and last.predicted == 0.25 and last.timeline.peak_stash == {0: 3, 1: 3}
    pl.controls["p"].value = 3                   # gpipe 3 × 3 was not recorded: nearest m, said in the title
    st = pl.state_at(pl.n_steps - 1)
    assert st.timeline.span == 12 and "no gpipe run with p=3, m=3" in st.title and st.predicted == 1 / 3
    pl.controls["m"].value = 4
    pl.controls["schedule"].value = "1f1b"
    assert pl.state_at(pl.n_steps - 1).timeline.peak_stash == {0: 3, 1: 2, 2: 1}
    pl.controls["clock"].value = "wall"
    assert pl.n_steps == 41 and pl.state_at(0).timeline.clock == "wall"
    assert pl.state_at(40).finished and pl.slider.max == 40
    pl.slider.value = 20                         # drawn off the kernel's message loop (Player._ask) ...
    pl.show(20)                                  # ... show() returns once that frame is on screen
    assert pl.image.value[:4] == b"\x89PNG" and "t=" in pl.text.value and " ms:" in pl.text.value
