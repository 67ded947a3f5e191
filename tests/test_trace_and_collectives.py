"""The trace format and lecture 0's ring collectives: results equal torch's, bytes equal the formulas,
the widget's state replays the algorithm, and the reference runs unchanged under torchrun."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference import trace
from reference.trace import Event, Trace
from reference.widgets.collective import collective_frames
from tests.workers import collective_workers as C

ROOT = Path(__file__).resolve().parent.parent


def test_events_are_plain_data_that_pickle():
    e = Event(1, "send", 2, 64, 0, 1.0, 2.0, {"chunk": 3})
    assert pickle.loads(pickle.dumps(e)) == e
    assert e.duration == 1.0 and e.to_dict()["meta"] == {"chunk": 3}


def test_nothing_is_recorded_unless_recording():
    assert not trace.is_recording()
    trace.emit("send", peer=1, nbytes=8)
    with trace.span("compute", pairs=3):
        pass
    with trace.recording(rank=5) as tr:
        trace.emit("send", peer=1, nbytes=8, step=0)
        with trace.span("compute", step=0, pairs=3) as meta:
            meta["extra"] = 1
    assert [(e.rank, e.op, e.nbytes) for e in tr] == [(5, "send", 8), (5, "compute", 0)]
    assert tr[1].meta == {"pairs": 3, "extra": 1} and tr[1].end >= tr[1].start
    assert not trace.is_recording()


def test_trace_queries():
    tr = Trace([Event(0, "send", 1, 10, 0), Event(1, "send", 0, 20, 0), Event(0, "send", 1, 5, 1),
                Event(0, "compute", None, 0, 0, meta={"pairs": 4}), Event(1, "compute", None, 0, 1, meta={"pairs": 6})])
    assert tr.bytes_by_rank() == {0: 15, 1: 20}
    assert tr.meta_sum("pairs") == {0: 4, 1: 6}
    assert len(tr.filter(op="send", rank=0, step=1)) == 1
    assert tr.steps() == [0, 1]


def test_a_real_trace_exports_to_the_chrome_format_with_every_event_and_its_messages(world, tmp_path):
    import json
    res = world(3).run(C.all_reduce_case, 36, 1.0)
    tr = res.trace
    path = tmp_path / "ring.json"
    doc = tr.to_chrome(str(path))
    assert json.loads(path.read_text()) == doc
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    t0 = min(e.start for e in tr)
    assert len(events) == len(tr)
    got = sorted((e["args"]["rank"], e["args"]["op"], e["args"]["peer"], e["args"]["nbytes"], e["args"]["step"],
                  round(e["ts"], 3), round(e["dur"], 3)) for e in events)
    want = sorted((e.rank, e.op, e.peer, e.nbytes, e.step, round((e.start - t0) * 1e6, 3),
                   round(e.duration * 1e6, 3)) for e in tr)
    assert got == want
    assert all(e["pid"] == e["args"]["rank"] for e in events)
    names = {(m["pid"], m["args"]["name"]) for m in doc["traceEvents"] if m["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(3)}
    # each of the ring's sends is joined to the matching receive by a flow arrow
    starts = [e for e in doc["traceEvents"] if e["ph"] == "s"]
    assert len(starts) == len(tr.filter(op="send")) == len(tr.filter(op="recv"))
    assert {e["id"] for e in starts} == {e["id"] for e in doc["traceEvents"] if e["ph"] == "f"}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_all_reduce_equals_sum_in_float64_including_odd_sizes(world, n):
    res = world(n).run(C.all_reduce_case, 13, 1e6)
    for got, want in res.values:
        assert torch.equal(got, want) or torch.allclose(got, want, rtol=1e-12, atol=1e-3)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_sends_exactly_2_n_minus_1_over_n_bytes(world, n):
    numel = 12 * n
    res = world(n).run(C.all_reduce_case, numel, 1.0)
    size = numel * 8
    want = 2 * (n - 1) * size // n
    assert res.trace.bytes_by_rank("send") == {r: want for r in range(n)}
    assert res.trace.bytes_by_rank("recv") == {r: want for r in range(n)}
    nxt = {r: {e.peer for e in res.trace.filter(op="send", rank=r)} for r in range(n)}
    assert nxt == {r: {(r + 1) % n} for r in range(n)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_gather_rebuilds_the_tensor_and_sends_n_minus_1_over_n_bytes(world, n):
    numel = 6 * n
    res = world(n).run(C.all_gather_case, numel)
    for got, want in res.values:
        assert torch.equal(got, want)
    assert res.trace.bytes_by_rank("send") == {r: (n - 1) * numel * 8 // n for r in range(n)}


def test_library_collectives_through_comm_are_traced_once(world):
    res = world(2).run(C.library_collectives, 8)
    ops = sorted({(e.op, e.nbytes) for e in res.trace if e.rank == 0})
    assert ops == [("all_gather", 16), ("all_reduce", 32), ("compute", 0)]
    assert len(res.trace.filter(op="all_reduce")) == 2  # one per rank, not doubled by the raw wrappers


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_widget_state_replays_reduce_scatter_then_all_gather(world, n):
    res = world(n).run(C.all_reduce_case, 4 * n, 1.0)
    frames = collective_frames(res.trace, n)
    assert len(frames) == 1 + 2 * (n - 1)
    assert all(not frames[0].complete(r) for r in range(n))
    after_rs = frames[n - 1]
    assert [after_rs.complete(r) for r in range(n)] == [[(r + 1) % n] for r in range(n)]
    for k in range(1, n - 1):  # during reduce-scatter no chunk is complete yet
        assert all(not frames[k].complete(r) for r in range(n))
    assert all(frames[-1].complete(r) == list(range(n)) for r in range(n))
    assert frames[-1].bytes_sent == [2 * (n - 1) * 4 * 8] * n
    # every message goes to the next rank on the ring
    assert all(dst == (src + 1) % n for f in frames for src, dst, _, _ in f.messages)


@pytest.mark.parametrize("n", [3, 4])
def test_collective_widget_replays_a_learners_run_whose_messages_carry_no_phase_or_chunk(world, n):
    """A learner's ring all-reduce passes no phase= or chunk= (an independent one passing step= only, and the
    reference's trace with every step and meta stripped): the frames are the reference's own."""
    from dataclasses import replace

    from reference.notebook import primer
    from reference.widgets.collective import inferred
    ref = world(n).run(primer.ring_all_reduce, 4 * n).trace
    theirs = world(n).run(primer.ring_all_reduce, 4 * n, "tests.submissions._ring").trace
    bare = [replace(e, step=None, meta={}) for e in ref]
    want = collective_frames(ref, n)
    assert not inferred(ref) and inferred(theirs) and inferred(bare)
    for events in (theirs, bare):
        got = collective_frames(events, n)
        assert [(f.label, f.messages, f.holdings, f.bytes_sent) for f in got] == \
               [(f.label, f.messages, f.holdings, f.bytes_sent) for f in want]
    assert [f.complete(0) for f in want][-1] == list(range(n))


def test_collective_widget_renders_a_static_first_frame(world):
    from reference.widgets.collective import collective_player
    res = world(3).run(C.all_reduce_case, 12, 1.0)
    p = collective_player(res.trace, 3, total_bytes=2 * 2 * 32, formula="2(N-1)/N·n")
    png = p.png(2)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    bundle = p._repr_mimebundle_()
    assert "image/png" in bundle and "application/vnd.jupyter.widget-view+json" in bundle


def test_reference_runs_unchanged_under_torchrun(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "workers" / "torchrun_check.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["OK 2", "OK 2"]
