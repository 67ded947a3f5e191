"""Teachers' hidden checks: run by the autograder, shown as hidden in Gradescope, never released.

``make release`` leaves this file out of the student release (the grader there simply finds no
hidden checks).  Add a check to any registered exercise with :func:`core.hidden_check`; it is
written like any other check (see ``checks/collectives.py``) and runs after the visible ones::

    @hidden_check("5a.1", "merge is symmetric in its two sides", points=1)
    def _(ctx):
        ...

Keep hidden checks about behaviour the lecture asked for (other sizes, dtypes, edge cases), so
that a student who passes every visible check for the right reasons passes these too.
"""
from __future__ import annotations

import random

import torch

from .core import EXERCISES, hidden_check, salted_seed

H = "exercises.grading.harness"


if "0.1" in EXERCISES:
    @hidden_check("0.1", "sums an int64 tensor exactly on 3 ranks")
    def _(ctx):
        g = torch.Generator().manual_seed(salted_seed(101))
        xs = [torch.randint(-10**12, 10**12, (7,), generator=g, dtype=torch.int64) for _ in range(3)]
        from .checks.collectives import judge_input_kept, ring_rules
        res = ctx.ranks(3, f"{H}:call_per_rank", "ring_all_reduce", None, True, per_rank=[(x,) for x in xs],
                        rules=ring_rules(7, 3, 2))
        want = torch.stack(xs).sum(0)
        for r, v in enumerate(judge_input_kept(res.values, xs, "ring_all_reduce")):
            ctx.compare(v, want, "sum", rank=r, world_size=3, atol=0, rtol=0)


if "0.2" in EXERCISES:
    @hidden_check("0.2", "gathers float32 on 3 ranks with 7 elements (chunks of 3, 2, 2)")
    def _(ctx):
        from reference.collectives import chunk_bounds
        full = torch.randn(7, generator=torch.Generator().manual_seed(salted_seed(102))).float()
        bounds = chunk_bounds(7, 3)
        args = [(full[slice(*bounds[(r + 1) % 3])].clone(), 7) for r in range(3)]
        from .checks.collectives import judge_input_kept, ring_rules
        res = ctx.ranks(3, f"{H}:call_per_rank", "ring_all_gather", None, True, per_rank=args,
                        rules=ring_rules(7, 3, 1))
        for r, v in enumerate(judge_input_kept(res.values, [a[0] for a in args], "ring_all_gather")):
            ctx.compare(v, full, "gathered tensor", rank=r, world_size=3, atol=0, rtol=0)


if "3.1" in EXERCISES:
    @hidden_check("3.1", "3 ranks, float32 gradients: the mean in the gradients' own dtype")
    def _(ctx):
        from .checks.data import _allreduce_case
        _allreduce_case(ctx, 3, seed=391, dtype=torch.float32)


if "3.2" in EXERCISES:
    @hidden_check("3.2", "4 ranks, MLP, one tensor per bucket: gradients = one process")
    def _(ctx):
        from .checks.data import _ddp_case
        _ddp_case(ctx, 4, "mlp", 392, "W=4, one tensor per bucket", bucket_cap_mb=1e-6)


if "3.3" in EXERCISES:
    @hidden_check("3.3", "stage 1, 4 ranks (Ψ = 288 → S = 72), transformer block (uneven: 3 ranks), AdamW", points=1)
    def _(ctx):
        from .checks.data import _zero_case
        _zero_case(ctx, 4, 1, "mlp", "adamw", 393, 2)
        _zero_case(ctx, 3, 1, "block", "adamw", 394, 2)


if "3.4" in EXERCISES:
    @hidden_check("3.4", "4 ranks, uneven layer shards, float32 gather; FSDP on the MLP = one process")
    def _(ctx):
        from .checks.data import H, _compare_params, _data_seeds, _single
        W = 4
        g = torch.Generator().manual_seed(ctx.seed(395))
        shards = [torch.randn(3, generator=g).float() for _ in range(W)]
        res = ctx.ranks(W, f"{H}:collective_per_rank", "gather_full_params", {"layer": "hidden"}, per_rank=shards)
        for r, got in enumerate(res.values):
            ctx.compare(got, torch.cat(shards), "gathered float32 parameters", rank=r, world_size=W, atol=0, rtol=0)
        kw = dict(steps=2, seed=ctx.seed(396), return_grads=False)
        data = _data_seeds(ctx, 396, W)
        res = ctx.ranks(W, f"{H}:train_per_rank", "fsdp", "mlp", "adamw", kw, per_rank=data)
        _compare_params(ctx, res, _single(ctx, "mlp", "adamw", W, data_seed=data, **kw), W, "W=4, MLP, FSDP")


if "4.1" in EXERCISES:
    from .checks import tensor as _tensor

    @hidden_check("4.1", "f and g on 4 ranks")
    def _(ctx):
        for which in ("f", "g"):
            _tensor._fg(ctx, which, 4, ctx.seed(401))


if "4.2" in EXERCISES:
    from .checks import tensor as _tensor

    @hidden_check("4.2", "parallel MLP on 4 ranks in float32, inputs ×30")
    def _(ctx):
        _tensor._mlp(ctx, 4, ctx.seed(402), scale=30.0, dtype=torch.float32, tol=2e-4)


if "4.3" in EXERCISES:
    from .checks import tensor as _tensor

    @hidden_check("4.3", "4 ranks, float64 logits ×30 with a +100 token, targets at every shard edge")
    def _(ctx):
        _tensor._xent(ctx, 4, ctx.seed(403), 30.0)


if "4.4" in EXERCISES:
    from .checks import pipeline as _pipeline

    @hidden_check("4.4", "6 to 8 stages, more micro-batches than stages: every stage's order")
    def _(ctx):
        rng = random.Random(salted_seed(404))
        p = rng.randint(6, 8)
        _pipeline._order_case(ctx, p, rng.randint(p + 1, 3 * p))

    @hidden_check("4.5", "3 stages, an uneven split, GPipe, m = 3, another model", timeout=_pipeline.RANKS_TIMEOUT)
    def _(ctx):
        rng = random.Random(salted_seed(405))
        sizes = [rng.randint(1, 3) for _ in range(3)]
        _pipeline._step_case(ctx, 3, "gpipe", 3, {"layers": sum(sizes), "sizes": sizes, "seed": salted_seed(406)},
                             f"GPipe, p=3, blocks {sizes}")

    @hidden_check("4.6", "more stages than micro-batches (GPipe); 4 stages × 3 chunks")
    def _(ctx):
        rng = random.Random(salted_seed(407))
        p = rng.randint(6, 12)
        _pipeline._bubble_case(ctx, "gpipe", p, rng.randint(1, p - 1))
        _pipeline._bubble_case(ctx, "interleaved_1f1b", 4, 4 * rng.randint(2, 5), 3)


if "5a.5" in EXERCISES:
    from .checks.sequence import ring_backward as _ring_backward

    @hidden_check("5a.5", "GQA (fewer K/V heads) in float32, and float64 with scores ~ ±50: W, layout and shape "
                  "drawn from the seed", timeout=_ring_backward.RANKS_TIMEOUT)
    def _(ctx):
        rng = random.Random(salted_seed(570))
        case = _ring_backward.fresh_case(rng)
        h_kv = rng.choice((1, 2))
        case["H"] = h_kv * rng.choice((2, 3))
        _ring_backward._fresh_run(ctx, case, 571, H_kv=h_kv, dtype=torch.float32, atol=1e-3, rtol=1e-4)
        case = dict(_ring_backward.fresh_case(rng), causal=True)
        _ring_backward._fresh_run(ctx, case, 575, q_scale=50.0)


if "5b.5" in EXERCISES:
    from .checks.moe import bias as _bias

    @hidden_check("5b.5", "4 ranks, one routing group, E and γ drawn from the seed, a bfloat16 bias; 3 ranks as "
                  "groups {0, 2} and {1} (a group of one: its own counts); every load equal: no bias moves")
    def _(ctx):
        rng = random.Random(salted_seed(581))
        E = rng.choice((10, 12, 16))
        _bias._case(ctx, 4, E, seed=582, case=f"W=4, group = every rank, E={E}, bfloat16 bias",
                    dtype=torch.bfloat16, rate=rng.choice((4e-3, 1e-2, 2e-2)))
        _bias._case(ctx, 3, 8, seed=583, case="W=3, groups {0, 2} and {1}, E=8", groups=[[0, 2], [1]],
                    dtype=torch.float64, rate=1e-3)
        _bias._case(ctx, 2, 6, seed=584, case="W=2, every expert's load equal to the mean", ties=6)


if "5c.1" in EXERCISES:
    from .checks.compose import groups as _groups

    @hidden_check("5c.1", "folded expert grids with pp drawn from the seed: every expert axis, ep × etp together")
    def _(ctx):
        rng = random.Random(salted_seed(591))
        for _ in range(2):
            grid = _groups._folded(rng)
            _groups._folded_case(ctx, grid, axes=("etp", "ep", "edp", ("ep", "etp"), "pp"))


if "5c.2" in EXERCISES:
    from .checks.compose import grad_sync as _grad_sync
    from .checks.compose import step_bytes as _step_bytes

    @hidden_check("5c.2", "pp × dp = 2 × 2, 1F1B with 2 micro-batches: each stage syncs its own layers, nothing "
                  "crosses stages", timeout=120)
    def _(ctx):
        _grad_sync._sync_case(ctx, {"pp": 2, "dp": 2}, _grad_sync.TINY, "pp=2, dp=2, 1F1B, m=2", 524,
                              num_microbatches=2)

    @hidden_check("5c.3", "cp = 4 with tp = 2, and 5 stages with 3 data replicas: every rank")
    def _(ctx):
        rng = random.Random(salted_seed(408))
        cases = [_step_bytes._rank_case(ctx, {"cp": 4, "tp": 2}, r, layers=rng.randint(2, 4),
                                        d_model=8 * rng.randint(2, 4), heads=4, seq_len=8 * rng.randint(2, 4),
                                        batch=2) for r in range(8)]
        cases += [_step_bytes._rank_case(ctx, {"pp": 5, "dp": 3}, r, m=2, layers=rng.randint(5, 8), d_model=16,
                                         heads=2, seq_len=8, batch=6) for r in (0, 4, 7, 14)]
        _step_bytes._check(ctx, cases, "hidden grids")


if "6.1" in EXERCISES:
    from .checks import debug as _debug

    @hidden_check("6.1", "four-rank worlds: a pipeline of 4 stages and 1 micro-batch, the odd one out of 4",
                  points=2, timeout=120)
    def _(ctx):
        for kind, report in _debug._reports(ctx, big=True, kinds=("pipeline", "order")).items():
            _debug._diagnose_case(ctx, kind, report)

    @hidden_check("6.2", "a bug of our own at a drawn record, rank and size (and a NaN), in a correct run", points=2,
                  timeout=120)
    def _(ctx):
        rng = random.Random(salted_seed(630))
        base = _debug._cases(ctx)[f"correct {len(_debug.PLANT_GRIDS)}"]
        for size in (rng.choice((1e-5, 3e-4, 0.1)), float("nan")):
            case = ctx.oracle(f"{_debug.ORACLES}:perturbed", base, rng.randrange(2), rng.randrange(200),
                              rng.randrange(4), size)
            _debug._divergence_check(ctx, case, f"our own bug, size {size:g}")

    @hidden_check("6.3", "4 ranks × 2 micro-batches, fresh documents: = one process", timeout=120)
    def _(ctx):
        _debug._accumulate_case(ctx, 4, 2, batch=16, data_seed=salted_seed(631), words="W=4, m=2")
