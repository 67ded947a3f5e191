"""Lecture 5c: the grid's dp_cp all-reduce overlapped with backward (reference.compose.overlap) — lecture 3's
buckets posted from gradient hooks.  The losses of every grid in test_train.py already run through it (it is
train_step's default); here: the overlap is real (a bucket's all-reduce posted before backward's last gradient),
the synchronised gradients equal the after-backward ``sync_gradients``'s, with pipelines (a gradient is complete
only at its m-th accumulation), sequence parallelism (those copies are summed over tp after backward) and experts.
With ZeRO the same hooks post its reduce-scatters (stage 1: all-reduces) through lecture 3's ShardBuckets: posted
before the last gradient, the same bytes, the same results as its after-backward step.
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


# ----------------------------------------------------------------------------------------------
# ZeRO: the same hooks post its reduce-scatters (stage 1: all-reduces) — lecture 3's ShardBuckets


ZERO_OP = {1: "all_reduce", 2: "reduce_scatter"}


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_reduce_is_posted_before_the_last_gradient_is_ready_with_the_same_bytes(world, zero):
    a = world(2).run(overlap_workers.zero_step, {"dp": 2}, zero=zero, overlap=True, bucket_cap_mb=CAP, **TINY)
    b = world(2).run(overlap_workers.zero_step, {"dp": 2}, zero=zero, overlap=False, **TINY)
    for r in range(2):
        ends = sorted(e.end for e in a.trace.filter("all_reduce", rank=r, what="loss"))
        last = max(e.start for e in a.trace.filter("grad_ready", rank=r) if e.start > ends[0])     # step 2's
        posted = [e for e in a.trace.filter(ZERO_OP[zero], rank=r, what="grads") if e.start > ends[0]]
        assert len(posted) > 2 and min(e.start for e in posted) < last, (len(posted), last)
        assert not a.trace.filter(rank=r, what="dense_grads")                                # nothing sent twice
        for op in ("all_reduce", "reduce_scatter", "all_gather"):          # bytes: the one message's, exactly
            got, want = (sum(e.meta["ring_bytes"] for e in res.trace.filter(op, rank=r) if e.meta.get("what") in
                             ("grads", "params")) for res in (a, b))
            assert got == want, (op, got, want)
        assert len(b.trace.filter(ZERO_OP[zero], rank=r, what="grads")) == 2 and not b.trace.filter("grad_ready")
        _same(a.values[r], b.values[r], r)


def _same(va: dict, vb: dict, r: int) -> None:
    assert max(abs(x - y) for x, y in zip(va["losses"], vb["losses"])) <= 1e-12, (va["losses"], vb["losses"])
    err = (va["shard_grad"] - vb["shard_grad"]).abs().max().item()
    assert err <= 1e-12, f"rank {r} shard.grad: {err:.3g}"
    assert va["params"].keys() == vb["params"].keys()
    for name in va["params"]:
        err = (va["params"][name] - vb["params"][name]).abs().max().item()
        assert err <= 1e-12, f"rank {r} {name}: {err:.3g}"
    if va["norm"] is not None:
        assert abs(va["norm"] - vb["norm"]) <= 1e-12


@pytest.mark.parametrize("zero, sizes, kw", [
    (2, {"dp": 2, "pp": 2}, dict(num_microbatches=2, schedule="1f1b")),
    (1, {"dp": 2, "pp": 2}, dict(num_microbatches=2, schedule="1f1b", clip_grad_norm=0.5)),
    (2, {"dp": 2, "cp": 2, "ep": 2}, dict(num_experts=4)),
    (2, {"dp": 2, "tp": 2}, dict(sequence_parallel=True, clip_grad_norm=0.5)),
    (2, {"dp": 3}, dict(batch_size=6)),          # N = 3: shards padded, buckets cut across the padding
    (1, {"dp": 3}, dict(batch_size=6, clip_grad_norm=0.5)),
], ids=["zero2-dp-pp-1f1b", "zero1-dp-pp-1f1b-clip", "zero2-dp-cp-ep", "zero2-dp-tp-sp-clip", "zero2-dp3",
        "zero1-dp3-clip"])
def test_zero_overlapped_equals_the_after_backward_step(world, zero, sizes, kw):
    n = sizes.get("dp", 1) * sizes.get("cp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1)     # ep: within dp·cp
    a = world(n).run(overlap_workers.zero_step, sizes, zero=zero, overlap=True, bucket_cap_mb=CAP, **TINY, **kw)
    b = world(n).run(overlap_workers.zero_step, sizes, zero=zero, overlap=False, **TINY, **kw)
    for r in range(n):
        ends = sorted(e.end for e in a.trace.filter("all_reduce", rank=r, what="loss"))
        ready = [e.start for e in a.trace.filter("grad_ready", rank=r) if e.start > ends[0]]
        posted = [e.start for e in a.trace.filter(ZERO_OP[zero], rank=r, what="grads") if e.start > ends[0]]
        assert len(posted) > 1 and ready and min(posted) < max(ready), (r, len(posted))
        _same(a.values[r], b.values[r], r)
