"""Checks for exercise 3.2: buckets, grad_ready and finish_buckets, overlapped with backward."""
from __future__ import annotations

import random

import torch

from ...core import CheckFailed
from ...feedback import Mismatch
from ...referee import MARK, POST
from .common import BUCKETS, H, _compare_params, _data_seeds, _single


def _bucket_cases(ctx, seed: int) -> list[tuple[list[int], list[str], int]]:
    """(sizes, dtypes, cap in bytes) drawn from the check's seed: float64 alone, float32 alone
    (bytes, not elements), mixed, one cap no parameter fits, and one cap everything fits."""
    rng = random.Random(ctx.seed(seed))
    cases = []
    for kind in ("float64", "float32", "mixed", "tiny cap", "huge cap"):
        n = rng.randint(4, 8)
        sizes = [rng.randint(1, 12) for _ in range(n)]
        dtypes = [rng.choice(["float64", "float32"]) if kind in ("mixed", "tiny cap") else
                  ("float32" if kind == "float32" else "float64") for _ in range(n)]
        total = sum(s * (8 if d == "float64" else 4) for s, d in zip(sizes, dtypes))
        cap = {"tiny cap": 2, "huge cap": 10 ** 6}.get(kind, 4 * rng.randint(4, max(5, total // 8)))
        cases.append((sizes, dtypes, cap))
    return cases


@BUCKETS.check("assign_buckets: greedy in the given order, up to the cap in bytes, a big parameter alone")
def _(ctx):
    for sizes, dtypes, cap in _bucket_cases(ctx, 310):
        got = ctx.local(f"{H}:buckets_of", sizes, dtypes, cap)
        got = [list(map(int, b)) for b in got] if isinstance(got, (list, tuple)) else got
        want = ctx.oracle("reference.data.ddp:assign_buckets",
                          [torch.zeros(n, dtype=getattr(torch, dt)) for n, dt in zip(sizes, dtypes)], cap)
        words = f"sizes {sizes} elements of {dtypes}, cap {cap} bytes"
        if got != want:
            hint = ""
            if isinstance(got, list) and sorted(i for b in got for i in b) != list(range(len(sizes))):
                hint = " Every parameter index must appear exactly once."
            elif "float32" in dtypes:
                hint = " Count bytes (numel × element_size), not elements."
            ctx.expect(False, f"assign_buckets({words}) returned {got}, expected {want}.{hint}")


def _ddp_case(ctx, W: int, kind: str, seed: int, case: str, **kw):
    kw = dict(steps=1, seed=ctx.seed(seed), **kw)
    data = _data_seeds(ctx, seed, W)
    res = ctx.ranks(W, f"{H}:train_per_rank", "ddp", kind, "sgd", kw, per_rank=data)
    truth = _single(ctx, kind, "sgd", W, data_seed=data, **kw)
    for r, v in enumerate(res.values):
        for n, want in truth["grads"].items():
            ctx.compare(v["grads"].get(n), want, f"gradient of {n} after backward", rank=r, world_size=W,
                        atol=1e-10, rtol=1e-9, case=case)
    _compare_params(ctx, res, truth, W, case)
    return res


@BUCKETS.check("DataParallel with your hooks, 2 ranks, one bucket: gradients = one process on the whole batch",
               points=2)
def _(ctx):
    _ddp_case(ctx, 2, "mlp", 311, "W=2, MLP, one bucket")


@BUCKETS.check("3 ranks, transformer block, tiny buckets (many all-reduces in flight), and overlap=False", points=2)
def _(ctx):
    _ddp_case(ctx, 3, "block", 312, "W=3, block, 256-byte buckets", bucket_cap_mb=256 / 2 ** 20)
    _ddp_case(ctx, 3, "block", 313, "W=3, block, overlap=False", bucket_cap_mb=256 / 2 ** 20, overlap=False)


@BUCKETS.check("a parameter used on rank 0 only: nobody hangs; its gradient is the mean with zeros elsewhere")
def _(ctx):
    from torch.nn import functional as F

    from reference.data import workers
    W, seed = 2, ctx.seed(317)
    data = _data_seeds(ctx, 317, W)
    res = ctx.ranks(W, f"{H}:unused_per_rank", 200 / 2 ** 20, seed, per_rank=data, timeout=30)
    torch.manual_seed(seed)
    model = workers.Branchy().double()
    loss = sum(F.mse_loss(model(workers.batch("mlp", data[r], 0, 0, 0, d=4)[0], use_b=r == 0),
                          workers.batch("mlp", data[r], 0, 0, 0, d=4)[1]) for r in range(W)) / W
    loss.backward()
    for r, got in enumerate(res.values):
        for n, p in model.named_parameters():
            ctx.compare(got.get(n), p.grad, f"gradient of {n}", rank=r, world_size=W, atol=1e-12, rtol=1e-10,
                        case="b unused on rank 1")


def posted_too_late(m: Mismatch) -> str | None:
    """The result is the mean of what ``.grad`` held at the END: the bucket was reduced in finish_buckets."""
    late = m.extra.get("late")
    if isinstance(m.got, torch.Tensor) and late is not None and m.got.shape == late.shape \
            and torch.allclose(m.got.double(), late.double(), atol=1e-9, rtol=1e-9):
        return ("this is the mean of what the parameters' .grad held at the END of backward, not when their bucket "
                "was complete: the bucket's all-reduce was posted only in finish_buckets, so nothing overlapped "
                "with backward. grad_ready must post every complete bucket (in bucket order) at once, from a copy "
                "of its gradients, and never wait.")
    return None


def judge_posts(comm: list, layout: list[list[int]], sizes: list[int]) -> None:
    """From the referee's log (kept in the runner): after each call of grad_ready, every bucket that was
    complete by then has been posted — its elements all-reduced, in bucket order — and in all exactly
    the buckets' elements are (each bucket once)."""
    bucket_sizes = [sum(sizes[j] for j in idx) for idx in layout]
    total = sum(bucket_sizes)
    for r, log in enumerate(comm):
        posted, calls, done_by = 0, 0, []
        arrived, complete = [0] * len(layout), 0
        for b, idx in enumerate(layout):          # how many buckets are complete after each grad_ready call
            for _ in idx:
                arrived[b] += 1
                while complete < len(layout) and arrived[complete] == len(layout[complete]):
                    complete += 1
                done_by.append(sum(bucket_sizes[:complete]))
        for op, peer, n, _ok in log:
            if op == POST:
                posted += n
            elif op == MARK:
                if calls < len(done_by) and posted < done_by[calls]:
                    late = next(b for b in range(len(layout)) if sum(bucket_sizes[:b + 1]) > posted)
                    raise CheckFailed(
                        f"rank {r}: after grad_ready's call number {calls + 1} bucket {late} was complete but "
                        f"its all-reduce had not been posted (the grader counted {posted} of the "
                        f"{done_by[calls]} elements that were due by then). Overlap means the bucket's "
                        "all-reduce leaves from grad_ready the moment its last gradient arrives — a copy "
                        "reduced later in finish_buckets is no overlap.")
                calls += 1
        if calls != len(done_by):
            raise CheckFailed(f"rank {r}: the grader saw {calls} of the harness's {len(done_by)} grad_ready steps: "
                              "something in your code interfered with the grader's own messages.")
        if posted != total:
            raise CheckFailed(f"rank {r} all-reduced {posted} elements in all; the buckets hold {total}: each "
                              "bucket is reduced exactly once (" + ("something was reduced twice — a copy posted "
                              "and the real gradients reduced again later?)" if posted > total else
                              "some bucket was never reduced)."))


@BUCKETS.check("overlap, shown in values: a bucket's all-reduce leaves from grad_ready, with the gradients it had "
               "when it was complete (3 ranks); the grader counts each post as grad_ready returns", points=2)
def _(ctx):
    W = 3
    rng = random.Random(ctx.seed(315))
    g = torch.Generator().manual_seed(ctx.seed(316))
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(5, 8))]
    cuts = sorted(rng.sample(range(1, len(sizes)), 3))
    layout = [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [len(sizes)])]
    grads = [[torch.randn(n, generator=g, dtype=torch.float64) for n in sizes] for _ in range(W)]
    garbage = [[torch.randn(n, generator=g, dtype=torch.float64) * 1000 for n in sizes] for _ in range(W)]
    res = ctx.ranks(W, f"{H}:overlap_per_rank", layout, per_rank=[(grads[r], garbage[r]) for r in range(W)])
    judge_posts(res.comm, layout, sizes)
    for r, got in enumerate(res.values):
        ctx.expect(isinstance(got, list) and len(got) == len(sizes), f"rank {r}: finish_buckets left "
                   f"{type(got).__name__} gradients; every parameter's .grad must hold the mean.")
        for j, n in enumerate(sizes):
            want = torch.stack([grads[q][j] for q in range(W)]).mean(0)
            late = torch.stack([garbage[q][j] for q in range(W)]).mean(0)
            ctx.compare(got[j], want, f"gradient of parameter {j}", rank=r, world_size=W, atol=1e-12, rtol=1e-10,
                        case=f"buckets {layout}", detectors=[posted_too_late], extra={"late": late})


@BUCKETS.check("overlap, seen in the trace: buckets posted during backward, not waited for there (feedback only)",
               points=0)
def _(ctx):
    kw = dict(steps=1, seed=ctx.seed(314), bucket_cap_mb=256 / 2 ** 20)
    res = ctx.ranks(2, f"{H}:train_per_rank", "ddp", "block", "sgd", kw, per_rank=_data_seeds(ctx, 314, 2))
    for r in range(2):
        ready = sorted(e["start"] for e in res.events("grad_ready", rank=r))
        ars = [e for e in res.events("all_reduce", rank=r) if e["meta"].get("what") == "grads"]
        ctx.expect(bool(ready) and bool(ars), f"rank {r}: no gradient all-reduce in the trace (use "
                                              f"comm.all_reduce_async).")
        last = ready[-1]
        ctx.expect(min(e["start"] for e in ars) < last,
                   f"rank {r}: every bucket's all-reduce started after the last gradient of backward: nothing "
                   f"overlaps. "
                   "Post a bucket from grad_ready as soon as it is complete.")
        early = [e for e in ars if e["end"] < last]
        ctx.expect(not early, f"rank {r}: the all-reduce of bucket(s) "
                   f"{sorted({e['meta'].get('bucket') for e in early})} "
                   "finished before backward produced its last gradient: a bucket waited for too early (a .wait() or a "
                   "blocking all_reduce in grad_ready), so backward stood still while it flew. Post with "
                   "comm.all_reduce_async in grad_ready and wait only in finish_buckets.")


