"""Checks for lecture 3 (the data axis): the gradient all-reduce, buckets with overlap, a ZeRO-1/2
step, and ZeRO-3's collectives.

Ground truth is computed here, in the grader, by ONE process in float64: the mean of the ranks'
gradients for 3.1, and for the rest a single process training the same seeded model on the whole
batch (``reference.data.workers.train("single", ...)``, plain torch — no graded function).  The
learner's functions run inside the reference's own DataParallel / ZeroOptimizer /
FullyShardedDataParallel on real ranks (the grader makes those call the learner's code).
Checks about HOW the work was done (overlap seen in the trace, memory held) give feedback and
0 points: the trace and the memory report are recorded inside the learner's processes.
"""
from __future__ import annotations

import random

import torch

from ..core import CheckFailed, exercise
from ..feedback import Mismatch
from ..referee import MARK, POST

H = "exercises.grading.harness.data"

# What the learner writes, and what the exercise's ranks switch off (exercises.grading.shortcuts):
# 3.1's answer is one library all-reduce per gradient, and that stays.  The wrappers broadcast the
# replicas' first parameters (given code); the learner's code may not broadcast — what
# ZeroRedundancyOptimizer and DDP's constructor need.
ALLREDUCE = exercise("3.1", "The gradient all-reduce: a mean over ranks", "data", ["all_reduce_gradients"],
                     comm=("all_reduce",))
BUCKETS = exercise("3.2", "Buckets, overlapped with backward", "data",
                   ["assign_buckets", "grad_ready", "finish_buckets"],
                   comm=("all_reduce", "all_gather"), driver_comm=("broadcast",), shortcuts=("ddp",),
                   counted=("all_reduce",))
# 3.3: before the learner's zero_step sees them, the parameters outside this rank's shard are garbage
# (harness.data.garble_outside_shard): only a step that all-gathers the owners' shards is right.
ZERO = exercise("3.3", "A ZeRO-1/2 optimizer step: reduce, update my shard, all-gather", "data", ["zero_step"],
                comm=("all_reduce", "reduce_scatter", "all_gather"), driver_comm=("broadcast",),
                shortcuts=("zero_redundancy_optimizer", "ddp", "fsdp"),
                before={"zero_step": "exercises.grading.harness.data:garble_outside_shard"},
                mirrors=("reference.data.zero:ShardBuckets",))
ZERO3 = exercise("3.4", "ZeRO-3's collectives: gather before use, reduce-scatter the gradient", "data",
                 ["gather_full_params", "reduce_scatter_grad"], comm=("all_gather", "reduce_scatter"),
                 driver_comm=("broadcast",), shortcuts=("fsdp", "zero_redundancy_optimizer"))

T1_31 = ('Every rank must end with the gradient of the MEAN loss over ranks. Which collective gives every rank'
         ' the same total, and what turns a total into a mean?')
T1_32 = ('assign_buckets is one greedy pass in the given order, counting bytes; grad_ready counts a gradient '
         'and posts every complete bucket next in line with comm.all_reduce_async, never waiting; '
         'finish_buckets posts the rest, waits, turns sums into means and puts the gradients back.')
T1_33 = ('Reduce the flat gradient (stage 1 and stage 2 differ here), let the optimizer update only this '
         "rank's shard, then share the updated shards. Which elements does rank r own?")
T1_34 = ("gather_full_params: every rank's shard, in rank order (one all-gather). reduce_scatter_grad: only "
         'your own S elements of the gradient summed over ranks — and as a mean.')


# Hints in tiers: tier 1 is what the stub raises; hint("3.2") shows the next.
HINTS = {
    "3.1": [T1_31,
            "L = (1/N) Σ_r L_r, so ∇L = (1/N) Σ_r ∇L_r: the all-reduce gives the Σ, you give the 1/N.",
            "for p in parameters: if p.grad is not None: comm.all_reduce(p.grad, group=group); then divide "
            "p.grad in place by comm.world_size(group)."],
    "3.2": [T1_32,
            "assign_buckets: keep `filled` (bytes in the current bucket); a parameter starts a new bucket when "
            "the current one is non-empty and filled + its bytes > cap.",
            "grad_ready: collectives match by order, so every rank must post the same buckets in the same order "
            "whatever order its gradients arrive in. After counting, walk the buckets from the first one not yet "
            "posted and stop at the first that is still incomplete; posting one means packing its gradients into "
            "one flat buffer and keeping the handle comm.all_reduce_async returns.",
            "A sketch of finish_buckets: post whatever is still unposted (a missing gradient counts as zeros, so "
            "every rank posts the same collectives); then, bucket by bucket, wait (the wait hands back the summed "
            "buffer), divide by N and unpack each parameter's slice into its .grad (creating it where it is None); "
            "leave every bucket ready for the next step."],
    "3.3": [T1_33,
            "Rank r owns flat elements [r·S, (r+1)·S), S = shard.numel(). Build a flat gradient of N·S zeros and copy "
            "each p.grad at its offset (parameters in order).",
            "stage 1: comm.all_reduce(flat); flat /= N; p.grad = flat[offset:...].view_as(p); shard.grad = "
            "flat[r*S:(r+1)*S].  stage 2: mine = shard.new_empty(S); comm.reduce_scatter_tensor(mine, flat); "
            "mine /= N; "
            "p.grad = None; shard.grad = mine.",
            "Then optimizer.step(); full = shard.new_empty(N*S); comm.all_gather_into_tensor(full, shard.detach()); "
            "with torch.no_grad(): p.copy_(full[offset:...].view_as(p)) for each parameter."],
    "3.4": [T1_34,
            "Both work on flat 1-D tensors: gather takes S elements and returns N·S; reduce-scatter takes N·S and "
            "returns S. S = shard.numel() = flat_grad.numel() // N, N = comm.world_size(group).",
            "gather: full = shard.new_empty(N * shard.numel()); comm.all_gather_into_tensor(full, shard.detach(), "
            "group=group, what='params', layer=layer, phase=phase); return full.",
            "reduce-scatter: out = flat_grad.new_empty(flat_grad.numel() // N); comm.reduce_scatter_tensor(out, "
            "flat_grad, group=group, what='grads', layer=layer); return out / N."],
}


# ----------------------------------------------------------------------------------------------
# Harnesses: run in the runner (or on its ranks), call learner code, return plain values.


# ----------------------------------------------------------------------------------------------
# Ground truth (one process, float64)


def _single(ctx, kind: str, opt: str, W: int, **kw) -> dict:
    from reference.data import workers
    return workers.train("single", kind, opt, world_size=W, **kw)


def _data_seeds(ctx, seed: int, W: int) -> list[int]:
    """A seed of its own for each rank's micro-batches (rank r is sent its own only: no rank can make
    another's batches, so no rank can compute the mean gradient without the others)."""
    return [ctx.seed(1000 * seed + 1 + r) for r in range(W)]


def _compare_params(ctx, res, truth, W, case, start=None, detectors=()):
    """Compare each rank's parameters, or their update (after − ``start``) when ``start`` is given."""
    for r, v in enumerate(res.values):
        for n, want in truth["params"].items():
            got = v["params"].get(n)
            if start is not None and isinstance(got, torch.Tensor):
                got, want = got - start[n], want - start[n]
            ctx.compare(got, want, f"{'update of' if start is not None else 'parameter'} {n}", rank=r, world_size=W,
                        atol=1e-10, rtol=1e-9, case=case, detectors=detectors,
                        extra={"all_got": v["params"], "all_want": truth["params"], "start": start, "name": n})


# ----------------------------------------------------------------------------------------------
# 3.1 — the gradient all-reduce


def _grads(ctx, W: int, seed: int, scale: float = 1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(ctx.seed(seed))
    shapes = [(3, 4), (5,), None, (2, 2, 2)]
    return [[None if s is None else (torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype)
             for s in shapes] for _ in range(W)]


def _allreduce_case(ctx, W: int, seed: int, scale: float = 1.0, dtype=torch.float64):
    per_rank = _grads(ctx, W, seed, scale, dtype)
    res = ctx.ranks(W, f"{H}:grads_per_rank", per_rank=per_rank)
    for r, got in enumerate(res.values):
        for i, g in enumerate(per_rank[0]):
            if g is None:
                ctx.expect(got[i] is None, f"rank {r}: parameter {i} had no gradient on any rank; its .grad must stay "
                           "None (skip it: every rank skips the same ones).")
                continue
            want = torch.stack([per_rank[q][i].double() for q in range(W)]).mean(0)
            ctx.compare(got[i], want.to(dtype), f"gradient {i}", rank=r, world_size=W, case=f"W={W}, scale {scale:g}",
                        atol=1e-12 * scale if dtype == torch.float64 else 1e-5 * scale,
                        rtol=1e-10 if dtype == torch.float64 else 1e-5,
                        extra={"input": per_rank[r][i]})


@ALLREDUCE.check("2 ranks: every .grad becomes the mean over ranks; a missing .grad stays None", points=2)
def _(ctx):
    _allreduce_case(ctx, 2, seed=301)


@ALLREDUCE.check("4 ranks, gradients of magnitude 1e6", points=2)
def _(ctx):
    _allreduce_case(ctx, 4, seed=302, scale=1e6)


# ----------------------------------------------------------------------------------------------
# 3.2 — buckets


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


# ----------------------------------------------------------------------------------------------
# 3.3 — a ZeRO-1/2 step


def wrong_shard(m: Mismatch) -> str | None:
    """The update of one rank's block of the flat vector matches another block's true update."""
    got, want, start = m.extra.get("all_got"), m.extra.get("all_want"), m.extra.get("start")
    W, S = m.extra.get("W"), m.extra.get("S")
    if not got or start is None or not W or not S:
        return None
    names = m.extra.get("names") or list(want)
    flat = lambda d: torch.cat([(d[n] - start[n]).reshape(-1) for n in names])   # noqa: E731
    try:
        g, w = flat(got), flat(want)
    except Exception:
        return None
    pad = W * S - g.numel()
    g, w = torch.cat([g, g.new_zeros(pad)]), torch.cat([w, w.new_zeros(pad)])
    gb, wb = g.view(W, S), w.view(W, S)
    right = [q for q in range(W) if torch.allclose(gb[q], wb[q], atol=1e-10, rtol=1e-8)]
    if len(right) == W:
        return None
    if all(bool((gb[q] == 0).all()) for q in range(W) if q not in right):
        return (f"only the elements of rank(s) {right}'s shard changed: the other ranks' updated shards never came "
                "back — all-gather every rank's shard and copy it into the parameters.")
    for q in range(W):
        if q in right:
            continue
        for p in range(W):
            if p != q and torch.allclose(gb[q], wb[p], atol=1e-10, rtol=1e-8):
                return (f"elements [{q}·S, {q + 1}·S) (rank {q}'s shard, S = {S}) got the update that belongs to "
                        f"rank {p}'s elements: a rank updated the wrong shard. Rank r owns [r·S, (r+1)·S): its "
                        "shard.grad must be that slice of the reduced gradient.")
    return None


def _zero_case(ctx, W: int, stage: int, kind: str, opt: str, seed: int, steps: int):
    kw = dict(steps=steps, seed=ctx.seed(seed), return_grads=False)
    data = _data_seeds(ctx, seed, W)
    res = ctx.ranks(W, f"{H}:train_per_rank", f"zero{stage}", kind, opt, kw, per_rank=data)
    truth = _single(ctx, kind, opt, W, data_seed=data, **kw)
    start = _single(ctx, kind, opt, W, data_seed=data, **{**kw, "steps": 0})["params"]
    from reference.data.models import make_model
    from reference.data.zero import shard_size
    model = make_model(kind)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    names = [n for n, p in model.named_parameters() if p.requires_grad]      # the flat layout's order
    case = f"W={W}, stage {stage}, {kind}, {opt}, {steps} step(s)"
    for r, v in enumerate(res.values):
        for n, want in truth["params"].items():
            got = v["params"].get(n)
            ctx.compare(None if got is None else got - start[n], want - start[n], f"update of {n}", rank=r,
                        world_size=W, atol=1e-10, rtol=1e-9, case=case, detectors=[wrong_shard],
                        extra={"all_got": v["params"], "all_want": truth["params"], "start": start, "W": W,
                               "S": shard_size(psi, W), "names": names})
    return res, psi


@ZERO.check("stage 1, 2 ranks, one plain SGD step: every parameter moves by −lr × the mean gradient", points=2)
def _(ctx):
    _zero_case(ctx, 2, 1, "mlp", "plain_sgd", 321, 1)


@ZERO.check("stage 2, 3 ranks (uneven shards), 3 AdamW steps = one process on the whole batch", points=2)
def _(ctx):
    _zero_case(ctx, 3, 2, "mlp", "adamw", 322, 3)


@ZERO.check("stage 2, 2 ranks, transformer block, SGD with momentum", points=1)
def _(ctx):
    _zero_case(ctx, 2, 2, "block", "sgd", 323, 2)


@ZERO.check("memory measured: stage 2 keeps 1/N of the gradient, both stages 1/N of the optimizer state "
            "(feedback only)", points=0)
def _(ctx):
    from reference.data.zero import shard_size
    W = 2
    for stage in (1, 2):
        res, psi = _zero_case(ctx, W, stage, "mlp", "adamw", 324 + stage, 1)
        S = shard_size(psi, W)
        for r, v in enumerate(res.values):
            mem = v["memory"]
            want = W * S * 8 if stage == 1 else S * 8
            ctx.expect(mem["grads"] == want,
                       f"stage {stage}, rank {r}: holds {mem['grads']} bytes of gradient after the "
                       f"step, expected {want} ({'the full mean gradient, N·S' if stage == 1 else 'only its shard, S'} "
                       "float64 elements)." + (" Set each p.grad to None in stage 2: the reduce-scatter gave you "
                                               "your shard." if stage == 2 and mem["grads"] > want else ""))
            ctx.expect(mem["optimizer_state"] <= 2 * S * 8 + 8,
                       f"stage {stage}, rank {r}: {mem['optimizer_state']} bytes "
                       f"of optimizer state; AdamW on an S = {S} shard holds 2·S·8 + a step counter. The optimizer "
                       "state is not sharded: update `shard` with the optimizer you were given, nothing else.")


# ----------------------------------------------------------------------------------------------
# 3.4 — ZeRO-3's collectives


def gathered_out_of_order(m: Mismatch) -> str | None:
    shards = m.extra.get("shards")
    if not isinstance(m.got, torch.Tensor) or shards is None or m.got.shape != m.expected.shape:
        return None
    W = len(shards)
    for k in range(1, W):
        if torch.equal(m.got, torch.cat([shards[(q + k) % W] for q in range(W)])):
            return f"your gathered vector is rotated by {k} rank(s): put rank q's shard at [q·S, (q+1)·S)."
    if torch.equal(m.got, torch.cat(shards[::-1])):
        return "your gathered vector has the shards in reverse rank order."
    return None


def wrong_chunk(m: Mismatch) -> str | None:
    chunks = m.extra.get("chunks")
    if not isinstance(m.got, torch.Tensor) or chunks is None or m.got.shape != m.expected.shape:
        return None
    for q, c in enumerate(chunks):
        if q != m.rank and (torch.allclose(m.got, c, atol=1e-12) or torch.allclose(m.got, c * len(chunks), atol=1e-9)):
            return f"rank {m.rank} got rank {q}'s part of the gradient: rank r keeps elements [r·S, (r+1)·S)."
    return None


@ZERO3.check("gather_full_params, 3 ranks: every rank gets every shard, in rank order")
def _(ctx):
    W, S = 3, 5
    g = torch.Generator().manual_seed(ctx.seed(331))
    shards = [torch.randn(S, generator=g, dtype=torch.float64) for _ in range(W)]
    res = ctx.ranks(W, f"{H}:collective_per_rank", "gather_full_params", {"layer": "check"}, per_rank=shards)
    want = torch.cat(shards)
    for r, got in enumerate(res.values):
        ctx.compare(got, want, "gathered parameters", rank=r, world_size=W, atol=0, rtol=0,
                    detectors=[gathered_out_of_order], extra={"shards": shards, "input": shards[r]})


@ZERO3.check("reduce_scatter_grad, 3 ranks: each rank gets its S elements of the MEAN gradient")
def _(ctx):
    W, S = 3, 4
    g = torch.Generator().manual_seed(ctx.seed(332))
    grads = [torch.randn(W * S, generator=g, dtype=torch.float64) * 100 for _ in range(W)]
    mean = torch.stack(grads).mean(0)
    chunks = list(mean.split(S))
    res = ctx.ranks(W, f"{H}:collective_per_rank", "reduce_scatter_grad", {"layer": "check"}, per_rank=grads)
    for r, got in enumerate(res.values):
        ctx.compare(got, chunks[r], "gradient shard", rank=r, world_size=W, atol=1e-12, rtol=1e-12,
                    detectors=[wrong_chunk], extra={"chunks": chunks})


@ZERO3.check("FullyShardedDataParallel with your collectives, 2 ranks, transformer block, 2 AdamW steps = one process",
             points=2)
def _(ctx):
    kw = dict(steps=2, seed=ctx.seed(333), return_grads=False)
    data = _data_seeds(ctx, 333, 2)
    res = ctx.ranks(2, f"{H}:train_per_rank", "fsdp", "block", "adamw", kw, per_rank=data)
    _compare_params(ctx, res, _single(ctx, "block", "adamw", 2, data_seed=data, **kw), 2, "W=2, block, FSDP")


@ZERO3.check("3 ranks (uneven shards), MLP with a tied weight, 3 SGD steps = one process", points=2)
def _(ctx):
    kw = dict(steps=3, seed=ctx.seed(334), return_grads=False)
    data = _data_seeds(ctx, 334, 3)
    res = ctx.ranks(3, f"{H}:train_per_rank", "fsdp", "mlp", "sgd", kw, per_rank=data)
    _compare_params(ctx, res, _single(ctx, "mlp", "sgd", 3, data_seed=data, **kw), 3, "W=3, MLP, FSDP")
