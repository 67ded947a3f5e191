"""Lecture 4b, multi-process: the pipeline executor on 1–4 gloo ranks, against one process.

Float64 everywhere: the loss and every parameter's gradient must equal the single-process step
(gradient accumulation over the same micro-batches, and the full batch at once) to 1e-12.  The
schedule, the stash and the bubble are read back from the trace alone.

One kept-alive world of 4 ranks serves every pipeline size: a p-stage pipeline runs on the first p
ranks (a subgroup when p < 4, so ``group=`` is exercised too); the other ranks return None.
"""
from __future__ import annotations


import pytest

from reference.launch import World, WorldError, run_world
from reference.pipeline import (Action, actions_from_trace, bubble_fraction, measured_bubble, peak_stashed_from_trace,
                                schedule, simulate, wall_clock_bubble, workers)
from reference.pipeline.oracles import single_process_truth

TOL = 1e-12


def run(world, p, fn, *args, **kwargs):
    """``fn`` on the first p ranks of the session's 4-rank world; values of those ranks only."""
    res = world(4).run(fn, *args, stages=p, **kwargs)
    assert all(v is None for v in res.values[p:])
    res.values = res.values[:p]
    return res


def gathered(values):
    """(loss from the last stage, {name: grad} over all ranks); every name exactly once."""
    losses = [v["loss"] for v in values if v["loss"] is not None]
    assert len(losses) == 1 and values[-1]["loss"] is not None, "the loss comes back from the last stage only"
    grads = {}
    for v in values:
        assert not set(v["grads"]) & set(grads), "a parameter lives on two ranks"
        grads.update(v["grads"])
    return losses[0], grads


def assert_matches_truth(values, m, **model):
    loss, grads = gathered(values)
    truth = single_process_truth(m, **model)
    assert set(grads) == set(truth["grads"])
    assert all(g is not None and g.abs().max() > 0 for g in grads.values())
    for ref_loss, ref_grads in ((truth["loss"], truth["grads"]), (truth["full_batch_loss"], truth["full_batch_grads"])):
        assert abs(loss - ref_loss) < TOL
        for n, g in grads.items():
            assert (g - ref_grads[n]).abs().max().item() < TOL, n


MS = {"gpipe": lambda p: [p, p + 1, 2 * p + 1], "1f1b": lambda p: [p, p + 1, 2 * p],
      "interleaved_1f1b": lambda p: [p, 2 * p], "zb_h1": lambda p: [p, p + 2]}


@pytest.mark.parametrize("name", list(MS))
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_loss_and_every_gradient_equal_one_process(world, p, name):
    v = 2 if name == "interleaved_1f1b" else 1
    for m in MS[name](p):
        res = run(world, p, workers.pipeline_worker, name, m, virtual_stages=v)
        assert [x["stages"] for x in res.values] == [[c * p + r for c in range(v)] for r in range(p)]
        assert_matches_truth(res.values, m, num_stages=p, virtual_stages=v)


@pytest.mark.parametrize("p,name,m", [(2, "1f1b", 4), (3, "gpipe", 4), (4, "zb_h1", 5), (2, "interleaved_1f1b", 4)])
def test_untraced_runs_post_straight_to_gloo_and_equal_one_process(world, p, name, m):
    """Without a trace recording (torchrun, benchmarks), where no check reads the messages' order back from the
    trace, every schedule — its receives all posted at a sender's first wait, each straight to gloo by
    ``comm.exchange`` — still gives the single process's loss and gradients."""
    w = world(4)
    v = 2 if name == "interleaved_1f1b" else 1
    w.record = False
    try:
        res = run(world, p, workers.pipeline_worker, name, m, virtual_stages=v)
    finally:
        w.record = True
    assert not res.trace.filter("send")                                   # nothing recorded
    assert_matches_truth(res.values, m, num_stages=p, virtual_stages=v)


@pytest.mark.parametrize("p,name,sizes", [(2, "gpipe", [1, 4]), (3, "1f1b", [3, 1, 1]), (3, "zb_h1", [1, 1, 4]),
                                          (2, "interleaved_1f1b", [2, 1, 3, 1]), (4, "1f1b", [1, 2, 1, 3])])
def test_uneven_splits(world, p, name, sizes):
    v = 2 if name == "interleaved_1f1b" else 1
    m = 2 * p
    res = run(world, p, workers.pipeline_worker, name, m, virtual_stages=v, layers=sum(sizes), sizes=sizes)
    assert_matches_truth(res.values, m, layers=sum(sizes))


# ----------------------------------------------------------------------------------------------
# What the trace says: schedule, messages, stash, bubble


@pytest.mark.parametrize("p,name,m", [(3, "1f1b", 4), (2, "interleaved_1f1b", 4), (3, "zb_h1", 3), (4, "gpipe", 3)])
def test_trace_schema_order_and_messages(world, p, name, m):
    v = 2 if name == "interleaved_1f1b" else 1
    res = run(world, p, workers.pipeline_worker, name, m, virtual_stages=v)
    tr = res.trace
    compute = tr.filter(op="compute")
    plan = schedule(name, p, m, virtual_stages=v)
    for e in compute:
        assert set(e.meta) == {"what", "stage", "microbatch", "chunk", "stashed"}
        assert e.step == e.meta["microbatch"] and e.meta["stage"] == e.meta["chunk"] * p + e.rank
    assert actions_from_trace(tr, p) == plan                                 # ran exactly its schedule
    sends, recvs = tr.filter(op="send"), tr.filter(op="recv")
    sends, recvs = [e for e in sends if e.meta["what"] != "shape"], [e for e in recvs if e.meta["what"] != "shape"]
    K = p * v
    assert len(sends) == len(recvs) == 2 * m * (K - 1)                       # one each way per boundary and micro-batch
    key = lambda e, me, other: (e.meta["what"], e.meta["microbatch"], e.meta[me], e.meta[other])  # noqa: E731
    by_recv = {key(e, "peer_stage", "stage"): e for e in recvs}
    for s in sends:
        assert set(s.meta) == {"what", "microbatch", "chunk", "stage", "peer_stage"} and s.step == s.meta["microbatch"]
        assert s.meta["peer_stage"] == s.meta["stage"] + (1 if s.meta["what"] == "activation" else -1)
        r = by_recv[key(s, "stage", "peer_stage")]                            # the matching receive
        assert (s.peer, r.peer) == (r.rank, s.rank) and s.nbytes == r.nbytes > 0
        assert r.meta["chunk"] * p + r.rank == r.meta["stage"]
        assert s.start <= r.end
    # a stage's F of micro-batch i starts only after the activation arrived
    arrived = {(e.meta["microbatch"], e.meta["stage"]): e.end for e in recvs if e.meta["what"] == "activation"}
    for e in compute.filter(what="F"):
        if e.meta["stage"] > 0:
            assert e.start >= arrived[(e.meta["microbatch"], e.meta["stage"])]


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4), (4, 6)])
def test_peak_stash_from_the_trace(world, p, m):
    peaks = {name: peak_stashed_from_trace(run(world, p, workers.pipeline_worker, name, m).trace)
             for name in ("gpipe", "1f1b", "zb_h1")}
    assert peaks["gpipe"] == {r: m for r in range(p)}
    assert peaks["1f1b"] == {r: min(m, p - r) for r in range(p)}
    assert all(peaks["1f1b"][r] <= p - r for r in range(p))
    assert peaks["zb_h1"] == {r: p for r in range(p)}                       # never above 1F1B's worst stage


@pytest.mark.parametrize("p", [2, 3, 4])
def test_bubble_rebuilt_from_the_trace(world, p):
    m = 2 * p
    bubbles = {}
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        v = 2 if name == "interleaved_1f1b" else 1
        res = run(world, p, workers.pipeline_worker, name, m, virtual_stages=v)
        slots = simulate(actions_from_trace(res.trace, p))                     # the traced order, in slots
        bubbles[name] = measured_bubble(slots)
        assert bubbles[name] == pytest.approx(bubble_fraction(name, p, m, virtual_stages=v), abs=1e-12)
        print(f"p={p} m={m} {name:17s} slot bubble {bubbles[name]:.3f}   "
              f"wall-clock {wall_clock_bubble(res.trace):.3f} (printed, not asserted)")
    assert bubbles["gpipe"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["zb_h1"] < bubbles["1f1b"] and bubbles["interleaved_1f1b"] < bubbles["1f1b"]


def test_twenty_steps_in_one_world_never_hang(world):
    for step in range(20):
        name = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")[step % 4]
        res = run(world, 4, workers.pipeline_worker, name, 4, virtual_stages=2 if name == "interleaved_1f1b" else 1,
                  seed=step, timeout=30)
        assert res.values[-1]["loss"] is not None


# ----------------------------------------------------------------------------------------------
# Errors: a ValueError on every rank before any message; a deadlocking order names the ranks


def expect_value_error_on_every_rank(p, *args, match, **kwargs):
    with pytest.raises(WorldError) as info:
        run_world(workers.pipeline_worker, p, *args, timeout=30, **kwargs)
    err = info.value                          # "exception", not a hang reported by the timeout
    assert err.kind == "exception" and sorted(err.failures) == list(range(p)), err
    assert all(f.exc_type == "ValueError" and match in f.message for f in err.failures.values()), err
    assert not err.trace.filter(op=("send", "recv")), "a message went out before the check"


@pytest.mark.parametrize("args,kwargs,match", [
    (("1f1b", 1), {}, "m=1 < p=2"),
    (("gpipe", 3), {"batch": 8}, "num_microbatches=3 equal parts"),
    (("interleaved_1f1b", 3), {"virtual_stages": 2}, "multiple of num_stages"),
], ids=["1f1b-m<p", "batch-not-divisible", "interleaved-m%p"])
def test_bad_inputs_raise_value_error_on_every_rank_before_any_message(args, kwargs, match):
    expect_value_error_on_every_rank(2, *args, match=match, **kwargs)


DEADLOCK = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],   # stage 0 waits for B0's gradient
            [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]   # stage 1 waits for F1's activation


def test_a_deadlocking_order_is_refused_then_reported_by_rank(no_orphans):
    expect_value_error_on_every_rank(2, "1f1b", 2, actions=DEADLOCK, match="deadlocks")
    with World(2, timeout=30, echo=False) as w:
        w.run(workers.pipeline_worker, "1f1b", 2)                  # imports done: the ranks reach the deadlock at once
        with pytest.raises(WorldError) as info:
            w.run(workers.pipeline_worker, "1f1b", 2, actions=DEADLOCK, check=False, timeout=3)
    err = info.value
    assert err.kind == "timeout" and err.ranks == [0, 1]
    assert "recv from rank 1" in err.failures[0].blocked_in and "recv from rank 0" in err.failures[1].blocked_in
