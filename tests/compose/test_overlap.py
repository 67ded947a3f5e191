"""Lecture 5c: the grid's dp_cp all-reduce overlapped with backward (reference.compose.overlap) — lecture 3's
buckets posted from gradient hooks.  The losses of every grid in test_train.py already run through it (it is
train_step's default); here: the overlap is real (a bucket's all-reduce posted before backward's last gradient),
the synchronised gradients equal the after-backward ``sync_gradients``'s, with pipelines (a gradient is complete
only at its m-th accumulation), sequence parallelism (those copies are summed over tp after backward) and experts.
"""
from __future__ import annotations

import pytest

from tests.workers import overlap_workers

TINY = dict(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8)
CAP = 0.002        # 2 KiB: several buckets for this tiny model


def test_a_bucket_all_reduce_is_posted_before_the_last_gradient_is_ready(world):
    res = world(2).run(overlap_workers.one_step, {"dp": 2}, overlap=True, bucket_cap_mb=CAP, **TINY)
    for r in range(2):
        last = max(e.start for e in res.trace.filter("grad_ready", rank=r))
        ars = res.trace.filter("all_reduce", rank=r, what="grads")
        assert len(ars) > 2 and min(e.start for e in ars) < last, (len(ars), last)
        assert not res.trace.filter("all_reduce", rank=r, what="dense_grads")   # nothing sent twice
    late = world(2).run(overlap_workers.one_step, {"dp": 2}, overlap=False, **TINY)
    assert not late.trace.filter("grad_ready") and len(late.trace.filter("all_reduce", rank=0, what="dense_grads")) == 1


@pytest.mark.parametrize("sizes, kw", [
    ({"dp": 2, "pp": 2}, dict(num_microbatches=2, schedule="1f1b")),
    ({"dp": 2, "pp": 2}, dict(num_microbatches=2, schedule="zb_h1")),
    ({"dp": 2, "tp": 2}, dict(sequence_parallel=True)),
    ({"dp": 2, "cp": 2}, dict(num_experts=4, ep=2)),
], ids=["dp-pp-1f1b", "dp-pp-zbh1", "dp-tp-sp", "dp-cp-ep"])
def test_overlapped_gradients_equal_the_after_backward_sync(world, sizes, kw):
    kw = dict(kw)
    if "ep" in kw:
        sizes = dict(sizes, ep=kw.pop("ep"))
    n = sizes.get("dp", 1) * sizes.get("cp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1)     # ep: within dp·cp
    a = world(n).run(overlap_workers.one_step, sizes, overlap=True, bucket_cap_mb=CAP, **TINY, **kw)
    b = world(n).run(overlap_workers.one_step, sizes, overlap=False, **TINY, **kw)
    assert a.trace.filter("all_reduce", what="grads"), "no bucket was sent"
    for r, (ga, gb) in enumerate(zip(a.values, b.values)):
        assert ga["loss"] == pytest.approx(gb["loss"], abs=1e-12)
        assert ga["grads"].keys() == gb["grads"].keys(), r
        for name in ga["grads"]:
            err = (ga["grads"][name] - gb["grads"][name]).abs().max().item()
            assert err <= 1e-12, f"rank {r} {name}: {err:.3g}"
