"""Chrome trace files drawn as a static timeline (reference/widgets/chrome.py), on hand-built documents in the two
dialects it reads: the course's (Trace.to_chrome) and torch.profiler's (export_chrome_trace).  No ranks."""
from __future__ import annotations

import matplotlib

from reference.trace import Event, Trace
from reference.widgets.chrome import chrome_lanes, is_communication, side_by_side

matplotlib.use("Agg")


def profiler_doc(rank: int, pid: int) -> dict:
    """What torch.profiler writes for one rank: a main thread with nested ops, a gloo thread named twice, the
    profiler's own "Spans" row, instants."""
    X = lambda name, tid, ts, dur: {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    return {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}, "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "args": {"name": f"thread {pid} (python)"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 7, "args": {"name": "thread 7 (pt_gloo_runloop)"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 7, "args": {"name": "thread 7 (python)"}},
        X("autograd::engine::evaluate_function: AddmmBackward0", pid, 1000, 500),
        X("aten::mm", pid, 1100, 300),                          # inside AddmmBackward0: not top level
        X("aten::tanh_backward", pid, 1600, 100),
        X("gloo:all_reduce", 7, 1200, 900),
        X("gloo:all_reduce", 7, 2200, 100),
        {"ph": "X", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": 0, "ts": 0, "dur": 9999},
        {"ph": "i", "name": "instant", "pid": pid, "tid": pid, "ts": 1500},
        X("zero", pid, 1700, 0),
    ]}


def test_profiler_lanes_keep_top_level_events_per_thread_labelled_by_rank_and_thread():
    lanes = chrome_lanes(profiler_doc(1, 4242), shift_us=1000)
    assert [lane["label"] for lane in lanes] == ["rank 1 · main thread", "rank 1 · pt_gloo_runloop"]
    main = next(lane for lane in lanes if lane["label"].endswith("main thread"))
    assert [(s, d, n.rsplit(": ", 1)[-1], c) for s, d, n, c, _ in main["events"]] == \
        [(0.0, 0.5, "AddmmBackward0", False), (0.6, 0.1, "aten::tanh_backward", False)]
    gloo = next(lane for lane in lanes if "gloo" in lane["label"])
    assert [(s, c) for s, _, _, c, _ in gloo["events"]] == [(0.2, True), (1.2, True)] and gloo["levels"] == 1
    late = chrome_lanes(profiler_doc(0, 1), shift_us=1000, window_ms=(1.15, 5))     # the main thread is done by then
    assert [lane["label"] for lane in late] == ["rank 0 · pt_gloo_runloop"] and late[0]["events"][0][0] == 1.2


def test_course_lanes_stack_collectives_in_flight_together_and_name_layers_and_buckets():
    ms = 1e-3
    tr = Trace([Event(0, "compute", start=0, end=2 * ms, meta={"layer": 1}),
                Event(0, "compute", start=2 * ms, end=4 * ms, meta={"layer": 0}),
                Event(0, "grad_ready", start=2 * ms, end=2 * ms),
                Event(0, "all_reduce", nbytes=64, start=1 * ms, end=5 * ms, meta={"bucket": 0}),
                Event(0, "all_reduce", nbytes=64, start=3 * ms, end=6 * ms, meta={"bucket": 1}),
                Event(1, "all_reduce", nbytes=64, start=1 * ms, end=2 * ms, meta={"bucket": 0})])
    lanes = chrome_lanes(tr.to_chrome())
    assert [lane["label"] for lane in lanes] == ["rank 0 · compute", "rank 0 · communication", "rank 1 · communication"]
    assert [e[2] for e in lanes[0]["events"]] == ["compute layer 1", "compute layer 0"]
    comm = lanes[1]
    assert comm["levels"] == 2 and [(e[2], e[4]) for e in comm["events"]] == [("all_reduce bucket 0", 0),
                                                                              ("all_reduce bucket 1", 1)]
    assert all(e[3] for e in comm["events"]) and not any(e[3] for e in lanes[0]["events"])


def test_communication_is_recognised_in_both_dialects():
    assert is_communication({"name": "gloo:all_reduce"}) and is_communication({"name": "nccl:all_gather"})
    assert is_communication({"name": "recv from 3", "cat": "comm"}) and is_communication({"name": "c10d::allreduce_"})
    assert not is_communication({"name": "autograd::engine::evaluate_function: AddmmBackward0"})


def test_side_by_side_draws_both_traces_on_one_time_axis():
    top = chrome_lanes(profiler_doc(0, 1), shift_us=1000)
    fig = side_by_side(top, chrome_lanes(profiler_doc(1, 2), shift_us=1000), titles=("a", "b"), window_ms=(0, 2))
    assert len(fig.axes) == 2 and fig.axes[0].get_xlim() == fig.axes[1].get_xlim() == (0, 2)
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()][-1].startswith("rank 1")
