"""Lecture 3 around the reference: the timeline widget's pure state, the stubs' contract, and the
grader naming the classic mistakes of exercises 3.1-3.4 (a mutant solution package, graded once)."""
import dataclasses
import inspect
import sys
import textwrap

import pytest

from reference.trace import Event, Trace
from reference.widgets.buckets import (draw_timeline, step_exposed, step_time, thread_cpu, timeline_caption,
                                       timeline_state, timeline_stats)


def synthetic(overlap: bool = True) -> Trace:
    """Rank 0: backward layers 2, 1, 0 over [0, 3] ms; bucket 0 posted at 1 ms (or 3 ms), done at 3.5 ms;
    bucket 1 posted at 3 ms, done at 4 ms."""
    ms = 1e-3
    ev = [Event(0, "backward_start", start=0.0, end=0.0)]
    for i, layer in enumerate((2, 1, 0)):
        ev.append(Event(0, "compute", start=i * ms, end=(i + 1) * ms, meta={"layer": layer}))
        ev.append(Event(0, "grad_ready", start=(i + 1) * ms, end=(i + 1) * ms, meta={"bucket": 0 if i < 1 else 1}))
    ev.append(Event(0, "all_reduce", nbytes=64, start=(1 if overlap else 3) * ms, end=3.5 * ms, meta={"bucket": 0}))
    ev.append(Event(0, "all_reduce", nbytes=64, start=3 * ms, end=4 * ms, meta={"bucket": 1}))
    return Trace(ev)


def test_stats_hidden_fraction_and_exposed_tail_from_the_intervals():
    s = timeline_stats(synthetic())[0]
    assert s["backward_end"] == pytest.approx(3e-3) and s["buckets"] == 2
    assert s["comm_busy"] == pytest.approx(3e-3)               # union of [1, 3.5] and [3, 4]
    assert s["hidden"] == pytest.approx(2e-3)                  # [1, 3] lies inside backward
    assert s["hidden_fraction"] == pytest.approx(2 / 3) and s["exposed"] == pytest.approx(1e-3)
    late = timeline_stats(synthetic(overlap=False))[0]
    assert late["hidden_fraction"] == 0 and late["exposed"] == pytest.approx(1e-3)


def test_the_steps_exposed_tail_starts_when_the_last_rank_ends_backward():
    """Rank 1 (a copy of rank 0, 2 ms later) ends backward at 5 ms, its last all-reduce at 6 ms: rank 0's own
    tail (3 → 6 ms, waiting for its peer) is 3 ms, the step's is 1 ms."""
    ms = 1e-3
    late = [dataclasses.replace(e, rank=1, start=e.start + 2 * ms, end=e.end + 2 * ms) for e in synthetic()]
    early = [dataclasses.replace(e, end=6 * ms) if e.op == "all_reduce" and e.meta["bucket"] == 1 else e
             for e in synthetic()]
    both = Trace(early + late)
    assert timeline_stats(both)[0]["exposed"] == pytest.approx(3 * ms)
    assert step_exposed(both) == pytest.approx(1 * ms)
    assert step_exposed(synthetic()) == pytest.approx(timeline_stats(synthetic())[0]["exposed"])
    assert step_exposed(Trace()) == 0.0


def test_the_step_is_every_ranks_backward_and_then_the_exposed_tail():
    """Rank 0's backward runs 0 → 3 ms, rank 1's 2 → 5 ms; the last all-reduce ends at 6 ms: the step pays
    5 ms of backward (first start to last end) and 1 ms of tail."""
    ms = 1e-3
    late = [dataclasses.replace(e, rank=1, start=e.start + 2 * ms, end=e.end + 2 * ms) for e in synthetic()]
    st = step_time(Trace(synthetic() + late))
    assert st["backward"] == pytest.approx(5 * ms) and st["exposed"] == pytest.approx(1 * ms)
    assert st["step"] == pytest.approx(6 * ms)
    assert step_time(synthetic())["step"] == pytest.approx(4 * ms)
    assert step_time(Trace()) == {"backward": 0.0, "exposed": 0.0, "step": 0.0}


def test_thread_cpu_averages_what_each_rank_reported():
    tr = Trace([Event(0, "thread_cpu", meta={"compute": 0.04, "communication": 0.01}),
                Event(1, "thread_cpu", meta={"compute": 0.06, "communication": 0.03})])
    assert thread_cpu(tr) == pytest.approx({"compute": 0.05, "communication": 0.02})
    assert thread_cpu(synthetic()) is None


def test_state_clips_blocks_at_the_cursor_and_counts_what_is_in_flight():
    st = timeline_state(synthetic(), step=11, n_steps=16)      # t = 4 ms · 12/16 = 3 ms
    assert st["t"] == pytest.approx(3e-3)
    assert [c["layer"] for c in st["compute"]] == [2, 1, 0] and all(c["done"] for c in st["compute"])
    assert [c["bucket"] for c in st["comm"]] == [0, 1] and st["in_flight"] == 2
    assert st["comm"][0]["end"] == pytest.approx(3e-3)         # clipped at the cursor
    st = timeline_state(synthetic(), step=15, n_steps=16)
    assert st["in_flight"] == 0 and "67% of all-reduce time hidden" in timeline_caption(st)
    assert timeline_state(synthetic(), step=0, n_steps=16)["comm"] == []


def test_every_frame_draws_and_an_empty_trace_says_what_to_record():
    from reference.widgets.player import render_png
    for step in (0, 7, 15):
        assert render_png(draw_timeline, timeline_state(synthetic(), step, 16), dpi=30).startswith(b"\x89PNG")
    empty = timeline_state(Trace(), 0)
    assert "record a DataParallel backward" in timeline_caption(empty)
    assert render_png(draw_timeline, empty, dpi=30).startswith(b"\x89PNG")


def test_a_profiled_backward_gives_both_traces_of_the_same_step_on_one_clock(world, tmp_path):
    """profiled_run on 2 live ranks (3 layers in 2 buckets): the course's trace and torch.profiler's of the same
    backward.  The profiler shows each bucket's all-reduce once, on one of gloo's own threads (not the thread that
    computes); mapped onto the course's clock, each starts inside the course's span of a bucket (posted → waited
    for).  (Not its end: gloo's thread records that after it has woken the waiter, later on a busy machine.)
    Both files load as Chrome traces, the course's holding every event with its rank, op and bytes; every rank's
    backward also reports the CPU its gloo threads used."""
    import json

    from reference.data.lecture import chrome_lanes_of, profiled_run, write_chrome_traces
    run = profiled_run(world=world(2), layers=3, width=64, rows=8)
    tr = run["trace"]
    for r, (doc, offset) in enumerate(zip(run["profiles"], run["offsets"])):
        assert sorted(e.meta["layer"] for e in tr.filter("compute", rank=r)) == [0, 1, 2]
        spans = [(e.start, e.end) for e in tr.filter("all_reduce", rank=r)]
        assert len(spans) == 2 and len(tr.filter("backward_start", rank=r)) == 1
        assert tr.filter("thread_cpu", rank=r)[0].meta["communication"] > 0
        assert doc["distributedInfo"]["rank"] == r
        ars = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("name") == "gloo:all_reduce"]
        assert len(ars) == 2 and all(e["tid"] != e["pid"] for e in ars)
        slack = 2e-3
        for e in ars:
            start, end = e["ts"] / 1e6 - offset, (e["ts"] + e["dur"]) / 1e6 - offset
            assert any(s - slack <= start <= t + slack for s, t in spans), (start, end, spans)
    paths = write_chrome_traces(run, tmp_path / "build")
    course = json.load(open(paths["course"]))["traceEvents"]
    xs = [e for e in course if e["ph"] == "X"]
    assert len(xs) == len(tr) and all({"rank", "op", "nbytes"} <= set(e["args"]) for e in xs)
    assert sum(e["args"]["nbytes"] for e in xs if e["args"]["op"] == "all_reduce") == \
        sum(e.nbytes for e in tr.filter("all_reduce"))
    profiler = json.load(open(paths["profiler"]))["traceEvents"]
    assert len({e["pid"] for e in profiler if e.get("ph") == "X" and isinstance(e.get("pid"), int)}) == 2
    lanes = chrome_lanes_of(run)
    labels = [lane["label"] for lane in lanes["profiler"]]
    assert "rank 0 · main thread" in labels and any("gloo" in lb for lb in labels)
    assert lanes["window"][0] < 0 < lanes["window"][1]


GRADED = ["all_reduce_gradients", "assign_buckets", "grad_ready", "finish_buckets", "zero_step", "gather_full_params",
          "reduce_scatter_grad"]


def test_a_learners_bucket_all_reduces_that_say_nothing_keep_their_place_on_the_timeline():
    """A learner's 3.2 posts each bucket with a bare comm.all_reduce_async: without what="grads" and bucket=
    they are still the step's gradient all-reduces, numbered in the order they were posted."""
    from reference.data.lecture import _bucket_order, _gradient_all_reduce
    ref = synthetic()
    bare = Trace(dataclasses.replace(e, meta={}) if e.op == "all_reduce" else e for e in ref)
    kept = _bucket_order(Trace(e for e in bare if e.op != "all_reduce" or _gradient_all_reduce(e)))
    assert sorted((e.start, e.meta["bucket"]) for e in kept if e.op == "all_reduce") == \
        sorted((e.start, e.meta["bucket"]) for e in ref if e.op == "all_reduce")
    assert timeline_state(kept, 9) == timeline_state(ref, 9) and step_exposed(kept) == step_exposed(ref)
    loss = Event(0, "all_reduce", nbytes=8, start=0.0, end=0.0, meta={"what": "loss"})
    assert not _gradient_all_reduce(loss)


def test_the_overlap_story_is_checked_before_a_recording_ships():
    """The release refuses a timeline that tells the opposite of the text: one bucket hiding its all-reduce,
    or overlap off exposing less than overlap on (as a loaded machine once recorded)."""
    from reference.data.lecture import ddp_story
    one, on, off = Trace(synthetic(False)), synthetic(True), synthetic(False)
    one = Trace(e for e in one if not (e.op == "all_reduce" and e.meta["bucket"] == 1))
    runs = {"timelines": {"one bucket (25 MB)": {"trace": one}, "2 layers per bucket": {"trace": on},
                          "2 layers per bucket, overlap=False": {"trace": off}}}
    assert ddp_story(runs) == []
    late = Trace(dataclasses.replace(e, end=e.end + 5e-3 * (e.op == "all_reduce"))
                 for e in on)   # overlap on, now with the longer tail
    runs["timelines"]["2 layers per bucket"]["trace"] = late
    assert any("overlap off exposed less" in b for b in ddp_story(runs))
    runs["timelines"]["one bucket (25 MB)"]["trace"] = on
    assert any("one bucket hid" in b for b in ddp_story(runs))


@pytest.mark.parametrize("name", GRADED)
def test_stub_keeps_the_reference_contract_and_raises_naming_its_exercise(name):
    import exercises.data as stubs
    import reference.data as ref
    a, b = getattr(stubs, name), getattr(ref, name)
    assert inspect.signature(a) == inspect.signature(b) and a.__doc__ == b.__doc__
    params = inspect.signature(a).parameters.values()
    with pytest.raises(NotImplementedError, match=r"Exercise 3\.\d"):
        a(*[None for p in params if p.default is inspect.Parameter.empty and p.kind != p.KEYWORD_ONLY],
          **{p.name: 1 for p in params if p.kind == p.KEYWORD_ONLY and p.default is inspect.Parameter.empty})


# ----------------------------------------------------------------------------------------------
# The grader names the classic mistakes

MUTANT = '''
import torch
from reference import comm
from reference.data.ddp import Bucket
from reference.data.zero import shard_size


def all_reduce_gradients(parameters, *, group=None):            # MISTAKE: a sum, never divided by N
    for p in parameters:
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group)


def assign_buckets(params, bucket_cap_bytes):
    out, filled = [], 0
    for i, p in enumerate(params):
        n = p.numel() * p.element_size()
        if out and filled + n <= bucket_cap_bytes:
            out[-1].append(i); filled += n
        else:
            out.append([i]); filled = n
    return out


def grad_ready(buckets, index, *, group=None):                  # MISTAKE: waits for each bucket at once
    buckets[index].ready += 1
    for b in buckets:
        if b.work is not None:
            continue
        if b.ready < len(b.params):
            break
        b.buffer = torch.cat([p.grad.reshape(-1) for p in b.params])
        b.work = comm.all_reduce_async(b.buffer, group=group, what="grads", bucket=b.index)
        b.work.wait()


def finish_buckets(buckets, *, group=None):
    N = comm.world_size(group)
    for b in buckets:
        if b.work is None:
            b.buffer = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in b.params])
            b.work = comm.all_reduce_async(b.buffer, group=group, what="grads", bucket=b.index)
    for b in buckets:
        flat, o = b.work.wait() / N, 0
        for p in b.params:
            g = flat[o:o + p.numel()].view_as(p); o += p.numel()
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        b.ready, b.buffer, b.work = 0, None, None


def zero_step(params, shard, optimizer, *, stage, group=None):  # MISTAKE: every rank takes rank 0's gradient slice
    N, S = comm.world_size(group), shard.numel()
    flat, o = shard.new_zeros(N * S), 0
    for p in params:
        if p.grad is not None:
            flat[o:o + p.numel()] = p.grad.reshape(-1)
        o += p.numel()
    comm.all_reduce(flat, group=group)
    flat /= N
    shard.grad = flat[0:S].clone()
    optimizer.step()
    full = shard.new_empty(N * S)
    comm.all_gather_into_tensor(full, shard.detach(), group=group)
    with torch.no_grad():
        o = 0
        for p in params:
            p.copy_(full[o:o + p.numel()].view_as(p)); o += p.numel()


def gather_full_params(shard, *, group=None, layer=None, phase="forward"):
    full = shard.new_empty(comm.world_size(group) * shard.numel())
    return comm.all_gather_into_tensor(full, shard.detach(), group=group, what="params", layer=layer, phase=phase)


def reduce_scatter_grad(flat_grad, *, group=None, layer=None):  # MISTAKE: the sum, not the mean
    out = flat_grad.new_empty(flat_grad.numel() // comm.world_size(group))
    return comm.reduce_scatter_tensor(out, flat_grad, group=group, what="grads", layer=layer)
'''


@pytest.fixture(scope="module")
def mutant_results(tmp_path_factory):
    from exercises.grading import session
    root = tmp_path_factory.mktemp("mutant")
    pkg = root / "data_mutant"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "data.py").write_text(textwrap.dedent(MUTANT))
    sys.path.insert(0, str(root))
    try:
        yield {r.exercise.id: r for r in session.grade("data_mutant", ["3.1", "3.2", "3.3", "3.4"])}
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("data_mutant", None)


@pytest.mark.slow
@pytest.mark.parametrize("ex_id,words,scored", [
    ("3.1", "a sum where a mean belongs", False),
    ("3.2", "a bucket waited for too early", True),            # feedback only: the 0-point check fails, points stay
    ("3.3", "a rank updated the wrong shard", False),
    ("3.4", "a sum where a mean belongs", False),
])
def test_grader_names_the_classic_mistake(mutant_results, ex_id, words, scored):
    res = mutant_results[ex_id]
    failed = [c.message for c in res.checks if not c.passed]
    assert failed and any(words in m for m in failed), failed
    assert (res.score == res.max_score) == scored
