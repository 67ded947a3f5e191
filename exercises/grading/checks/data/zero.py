"""Checks for exercises 3.3 (a ZeRO-1/2 step) and 3.4 (ZeRO-3's collectives)."""
from __future__ import annotations

import torch

from ...feedback import Mismatch
from .common import ZERO, ZERO3, H, _compare_params, _data_seeds, _single


def garbage_kept(m: Mismatch) -> str | None:
    """The elements outside some shard hold (or were stepped from) the garbage the grader wrote there
    before zero_step (harness.data.garble_outside_shard): the owners' shards never came back."""
    got, names, W, S, r = m.extra.get("all_got"), m.extra.get("names"), m.extra.get("W"), m.extra.get("S"), m.rank
    if not got or not names or not W or not S or r is None:
        return None
    try:
        g = torch.cat([got[n].reshape(-1).double() for n in names])
    except Exception:
        return None
    gen = torch.Generator().manual_seed(0xBAD)
    garbage = torch.cat([torch.randn(got[n].numel(), generator=gen, dtype=torch.float64) * 1e3 + 7.0 for n in names])
    outside = torch.ones(g.numel(), dtype=torch.bool)
    outside[r * S:(r + 1) * S] = False
    if not bool(outside.any()):
        return None
    diff = (g[outside] - garbage[outside]).abs()
    if bool((diff == 0).all()):
        return (f"the parameters outside rank {r}'s shard still hold the values the grader wrote there before your "
                "zero_step: the owners' updated shards never came back. All-gather every rank's shard and copy it "
                "into the parameters.")
    if float(diff.max()) < 100:
        return (f"the parameters outside rank {r}'s shard moved from values the grader wrote there before your "
                "zero_step: your step updated every parameter itself (a full optimizer, no sharding). In ZeRO the "
                "optimizer steps only this rank's shard; the other shards come back from their owners (all-gather).")
    return None


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
                        world_size=W, atol=1e-10, rtol=1e-9, case=case, detectors=[garbage_kept, wrong_shard],
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
