"""Lecture 4b against PyTorch's own pipeline: ``torch.distributed.pipelining`` on gloo.

Same float64 model, split the same way, same micro-batches, loss_fn = mean squared error per
micro-batch.  Scaling: torch calls ``loss_fn`` per micro-batch and backprops it *undivided*, then
(``scale_grads=True``, its default) divides every gradient by m at the end; we divide each
micro-batch's loss by m before its backward.  Both leave the full-batch mean gradient — and with
``scale_grads=False`` torch's gradients are exactly m× ours, asserted below.

Orders: torch exposes ``pipeline_order`` (rank → [_Action(stage_index, type, microbatch) | None])
for all of these schedules in 2.13; we also record the order in which its stages actually ran
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``, and both must
equal our schedule.  ZB-H1 is compared with ``ScheduleInterleavedZeroBubble`` given one stage per
rank: its W placement (rank r defers W by r backwards) is then exactly ZB-H1's.
"""
from __future__ import annotations

import pytest

from reference.pipeline import Action, schedule, workers
from reference.pipeline.oracles import single_process_truth

TOL = 1e-12


def run(world, p, fn, *args, **kwargs):
    res = world(4).run(fn, *args, stages=p, **kwargs)
    assert all(v is None for v in res.values[p:])
    return res.values[:p]


def loss_and_grads(values):
    loss = [v["loss"] for v in values if v["loss"] is not None]
    assert len(loss) == 1
    grads = {n: g for v in values for n, g in v["grads"].items()}
    return loss[0], grads


CASES = [(2, "gpipe", 3, 1, None), (4, "gpipe", 5, 1, None), (3, "1f1b", 4, 1, None), (4, "1f1b", 6, 1, [2, 1, 3, 1]),
         (2, "interleaved_1f1b", 4, 2, None), (4, "interleaved_1f1b", 4, 2, None), (3, "interleaved_1f1b", 6, 2, None),
         (3, "zb_h1", 3, 1, None), (4, "zb_h1", 5, 1, None)]


@pytest.mark.parametrize("p,name,m,v,sizes", CASES, ids=[f"{c[1]}-p{c[0]}-m{c[2]}" for c in CASES])
def test_same_loss_gradients_and_order_as_torch_pipelining(world, p, name, m, v, sizes):
    model = dict(virtual_stages=v, sizes=sizes, layers=sum(sizes) if sizes else None)
    theirs = run(world, p, workers.torch_pipeline_worker, name, m, **model)
    ours = run(world, p, workers.pipeline_worker, name, m, **model)
    (tl, tg), (ol, og) = loss_and_grads(theirs), loss_and_grads(ours)
    truth = single_process_truth(m, num_stages=p, virtual_stages=v, layers=model["layers"])
    assert set(tg) == set(og) == set(truth["grads"])
    assert abs(tl - ol) < TOL and abs(ol - truth["full_batch_loss"]) < TOL
    for n in og:
        assert (tg[n] - og[n]).abs().max().item() < TOL, n
        assert (og[n] - truth["full_batch_grads"][n]).abs().max().item() < TOL, n

    plan = schedule(name, p, m, virtual_stages=v)
    assert [t["executed"] for t in theirs] == plan                       # what torch actually ran, per rank
    order = theirs[0]["order"]
    if name == "1f1b":
        # torch 2.13's Schedule1F1B.pipeline_order numbers the last rank's forwards 1 … m (its steady
        # loop increments the micro-batch before using it when there is no warm-up); it *runs*
        # 0 … m−1 (checked just above).  Accept that label shift on the last rank only.
        shifted = [a._replace(microbatch=a.microbatch + 1) if a.kind == "F" else a for a in plan[-1]]
        assert order[:-1] == plan[:-1] and order[-1] in (plan[-1], shifted)
    else:
        assert order == plan


def test_torch_without_scale_grads_leaves_m_times_our_gradients(world):
    p, m = 2, 4
    theirs = loss_and_grads(run(world, p, workers.torch_pipeline_worker, "1f1b", m, scale_grads=False))[1]
    ours = loss_and_grads(run(world, p, workers.pipeline_worker, "1f1b", m))[1]
    for n in ours:
        assert (theirs[n] - m * ours[n]).abs().max().item() < TOL * m, n
        assert (theirs[n] - ours[n]).abs().max().item() > 1e-6        # not equal: the relation is real


def test_torch_order_conversion():
    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as T
    order = {0: [_Action(0, T.FORWARD, 0), None, _Action(2, T.FORWARD, 0), _Action(2, T.BACKWARD_INPUT, 0),
                 _Action(2, T.BACKWARD_WEIGHT, 0), _Action(0, T.FULL_BACKWARD, 0), _Action(0, T.REDUCE_GRAD, None)],
             1: []}
    assert workers.torch_order_as_actions(order, 2) == [
        [Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("W", 0, 1), Action("B", 0)], []]


# Beyond ZB-H1 (lecture 4b, §8): torch's breadth-first, ZB-V and DualPipeV, two chunks per rank, the V-shaped
# ones folded (chunk 0 of rank r is stage r, chunk 1 stage 2p − 1 − r): one process's loss and gradients, each
# rank running its plan; breadth-first's plan is the one this course states.
@pytest.mark.parametrize("name,p,m", [("breadth_first", 4, 8), ("zb_v", 4, 8), ("dualpipe_v", 4, 8), ("zb_v", 3, 5)])
def test_torchs_newer_schedules_give_one_process_gradients_and_run_as_planned(world, name, p, m):
    from reference.pipeline.beyond import breadth_first
    values = run(world, p, workers.torch_pipeline_worker, name, m, virtual_stages=2)
    loss, grads = loss_and_grads(values)
    truth = single_process_truth(m, num_stages=p, virtual_stages=2)
    assert set(grads) == set(truth["grads"]) and abs(loss - truth["loss"]) < TOL
    for n in grads:
        assert (grads[n] - truth["grads"][n]).abs().max().item() < TOL, n
    plan = values[0]
    assert [v["executed"] for v in values] == plan["order"]
    assert plan["placement"] == ("loop" if name == "breadth_first" else "v")
    # a full backward becomes B then W for the one clock (nothing else changes); every pair DualPipeV
    # overlaps is the forward of one chunk beside the backward of the other
    def strip(order):
        return [[a for a in acts if a.kind != "W"] for acts in order]
    assert strip(plan["order_split"]) == strip(plan["order"])
    assert sum(map(len, plan["order_split"])) - sum(map(len, plan["order"])) == len(plan["full_backwards"])
    assert bool(plan["overlapped"]) == (name == "dualpipe_v")
    assert all(f.kind == "F" and b.kind == "B" and f.chunk != b.chunk for _, f, b in plan["overlapped"])
    if name == "breadth_first":
        assert plan["order"] == [breadth_first(p, m, 2, r) for r in range(p)]
