"""Checks for lecture 4a (the tensor axis): Megatron's f and g, column/row-parallel linears forming
a parallel MLP, and the vocabulary-parallel cross-entropy.

Ground truth is computed here, in float64, from single-process torch (autograd through the full
MLP, ``F.cross_entropy``), never from the learner.  Detectors compare the learner's answer with
the answers the classic mistakes would give (one rank's partial gradient, W× a sum, the bias added
on every rank, the other style's shard), computed here as well.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..core import CheckFailed, exercise
from ..feedback import Mismatch

H = "exercises.grading.harness.tensor"

# What the learner writes: plain all-reduces inside their own autograd functions.  DTensor
# (parallelize_module, ColwiseParallel, loss_parallel) is switched off, and with it the functional
# collectives it communicates through (only the plain c10d all-reduce is offered).  In 4.3 an
# all-reduce carries at most a few numbers per token (XENT_MAX_TOKENS tokens in every case): the
# point is never to gather the vocabulary's logits, by an all-gather or an all-reduce.
XENT_MAX_TOKENS = 16
# Mirrors: the other regions, layers and the vocabulary-parallel embedding of lecture 4a (sequence
# parallelism, gathers, whole layers) are switched off where they sit next to the exercise.
FG = exercise("4.1", "Megatron's f and g: the conjugate all-reduce operators", "tensor",
              ["copy_to_tensor_region", "reduce_from_tensor_region"], comm=("all_reduce",), shortcuts=("dtensor",),
              mirrors=("reference.tensor.regions:*",))
MLP = exercise("4.2", "Column- and row-parallel linears forming a parallel MLP", "tensor",
               ["linear_shard", "column_parallel_linear", "row_parallel_linear"], comm=("all_reduce",),
               shortcuts=("dtensor",), mirrors=("reference.tensor.layers:*", "reference.tensor.regions:*",
                                                "reference.tensor.vocab:*"))
XENT = exercise("4.3", "Vocabulary-parallel cross-entropy", "tensor", ["vocab_parallel_cross_entropy"],
                comm=("all_reduce",), limits={"all_reduce": 3 * XENT_MAX_TOKENS}, shortcuts=("dtensor",),
                mirrors=("reference.tensor.vocab:*",))

HINTS = {
    "4.1": ["f is the identity going forward, g sums the ranks' partial results going forward. Every rank used the "
            "same x: what must f's backward do? And what is the gradient of a sum with respect to each of its terms?",
            "f: every rank used the same x, and each rank's branch contributes part of dL/dx. The true "
            "gradient is the sum of the parts; g is the mirror image.",
            "Write each as a torch.autograd.Function (it may live inside the function). An all-reduce done "
            "outside one (on .detach() or under no_grad) is invisible to autograd.",
            "f: forward returns x.view_as(x); backward returns comm.all_reduce(grad.clone(), group=group, **meta). "
            "g: forward returns comm.all_reduce(x.clone(), group=group, **meta); backward returns grad. "
            "Skip the all-reduce when comm.world_size(group) == 1."],
    "4.2": ['nn.Linear stores weight as (out, in): one style cuts the output features, the other the input features. '
            'Ask of each layer: how does its input enter the tensor-parallel region, where are the partial products '
            'summed, and when is the bias added?',
            "Column-parallel: weight rows r·out/W … (r+1)·out/W and the same bias slice; row-parallel: weight "
            "columns r·in/W … (r+1)·in/W and the WHOLE bias.",
            "Column: x → copy_to_tensor_region (f) → F.linear(x, w, b). Row: F.linear(x, w) without the bias → "
            "reduce_from_tensor_region (g) → + bias. Column then row needs nothing in between.",
            "With sequence_parallel, gather_from_sequence_region replaces f and reduce_scatter_to_sequence_region "
            "replaces g; with gather_output, gather_from_tensor_region; without input_is_parallel, "
            "scatter_to_tensor_region first. Pass **meta to each of them."],
    "4.3": ['Never gather the V logits. Which three numbers per token must the ranks agree on to compute log Σ_v '
            'exp(z_v) - z_target without overflow?',
            "The loss is log Σ_v exp(z_v) - z_target. Each rank has V/W of the z_v: agree on the max, on the "
            "sum of exponentials and on the target logit — one number per token each.",
            "m = all-reduce MAX of the row max; s = all-reduce SUM of Σ exp(z - m); the target logit comes "
            "from the rank whose range r·V/W … (r+1)·V/W - 1 holds it (0 elsewhere), all-reduce SUM. "
            "loss = log s - (z_target - m); 0 where target == ignore_index.",
            "Wrap the forward in a torch.autograd.Function and save exp(z - m)/s; backward: subtract 1 at the "
            "target (on its owner rank only), zero the ignored rows, multiply by grad[:, None]; no messages."],
}


# ----------------------------------------------------------------------------------------------
# Harnesses: run on the ranks, call learner code, return plain values.


# ----------------------------------------------------------------------------------------------
# 4.1 — f and g


def _rand(seed: int, *shape, scale: float = 1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _fg(ctx, which: str, W: int, seed: int):
    xs = [_rand(seed + r, 3, 5) for r in range(W)]
    grads = [_rand(seed + 100 + r, 3, 5) for r in range(W)]
    mine = [(xs[0], grads[r]) if which == "f" else (xs[r], grads[0]) for r in range(W)]
    res = ctx.ranks(W, f"{H}:fg_per_rank", which, per_rank=mine)
    want_out = xs[0] if which == "f" else sum(xs)
    for r, v in enumerate(res.values):
        if not v["has_graph"]:
            raise CheckFailed(f"{which}'s output on rank {r} has no autograd graph back to x: the all-reduce ran "
                              "outside autograd (on .detach(), .data or under no_grad), so no gradient reaches "
                              "the ranks' shards. Put it inside a torch.autograd.Function.")
        ctx.compare(v["out"], want_out, f"{which}'s forward output", rank=r, world_size=W, atol=1e-12, rtol=1e-12,
                    detectors=[fg_forward_mistakes], extra={"which": which, "xs": xs})
        want_grad = sum(grads) if which == "f" else grads[0]
        ctx.compare(v["grad"], want_grad, f"{which}'s input gradient", rank=r, world_size=W, atol=1e-12,
                    rtol=1e-12, detectors=[fg_backward_mistakes],
                    extra={"which": which, "own": grads[r], "grads": grads})
    return res


def fg_forward_mistakes(m: Mismatch) -> str | None:
    which, xs = m.extra["which"], m.extra["xs"]
    W = len(xs)
    if which == "f" and torch.allclose(m.got.double(), W * xs[0]):
        return ("f's forward output is W× x: f all-reduces in the forward as well. f is the identity going "
                "forward (every rank already holds x); only its backward sums.")
    if which == "g" and m.rank is not None and torch.allclose(m.got.double(), xs[m.rank]):
        return "g's forward returned this rank's own partial result: the all-reduce (sum) is missing."
    return None


def fg_backward_mistakes(m: Mismatch) -> str | None:
    which, own, grads = m.extra["which"], m.extra["own"], m.extra["grads"]
    if m.got is None:
        return None
    if which == "f" and torch.allclose(m.got.double(), own):
        return ("the input gradient is this rank's own partial sum: f's backward is missing its all-reduce. "
                "Every rank used the same x, so dL/dx is the SUM of every rank's contribution.")
    if which == "g" and torch.allclose(m.got.double(), len(grads) * grads[0]):
        return (f"the gradient is {len(grads)}× too large: g all-reduces in the backward as well. The gradient of "
                "a sum with respect to each term is the gradient itself: g's backward is the identity.")
    return None


@FG.check("f: identity forward, gradient summed over 2 ranks", points=2)
def _(ctx):
    _fg(ctx, "f", 2, ctx.seed(1))


@FG.check("g: sum forward, gradient passed unchanged, 2 ranks", points=2)
def _(ctx):
    _fg(ctx, "g", 2, ctx.seed(2))


@FG.check("f and g on 3 ranks", points=2)
def _(ctx):
    for which in ("f", "g"):
        _fg(ctx, which, 3, ctx.seed(3))


@FG.check("one all-reduce each, of the tensor's size (trace; feedback only, no points)", points=0)
def _(ctx):
    for which in ("f", "g"):
        res = _fg(ctx, which, 2, ctx.seed(4))
        ar = [e for e in res.events(rank=0) if e["op"] in ("all_reduce", "all_gather", "reduce_scatter")]
        if ar and (len(ar) != 1 or ar[0]["nbytes"] != 3 * 5 * 8):
            raise CheckFailed(f"values are right, but {which} sent {len(ar)} collectives of "
                              f"{[e['nbytes'] for e in ar]} bytes on rank 0; one all-reduce of 120 bytes is enough.")


# ----------------------------------------------------------------------------------------------
# 4.2 — column- and row-parallel linears


def _shard_want(weight, bias, style, r, W):
    """The expected shard, written with plain slicing (rows for column-parallel, columns for row)."""
    if style == "column":
        n = weight.shape[0] // W
        return weight[r * n:(r + 1) * n], bias[r * n:(r + 1) * n]
    n = weight.shape[1] // W
    return weight[:, r * n:(r + 1) * n], bias


def wrong_style(m: Mismatch) -> str | None:
    other = m.extra.get("other")
    if isinstance(m.got, torch.Tensor) and other is not None and m.got.shape == other.shape \
            and torch.equal(m.got.double(), other.double()):
        return (f"this is the {m.extra['other_style']}-parallel shard: nn.Linear stores weight as (out, in); "
                "column-parallel cuts the OUTPUT features (rows, dim 0), row-parallel the INPUT features "
                "(columns, dim 1).")
    if isinstance(m.got, torch.Tensor) and m.extra.get("style") == "row" and m.what == "bias" \
            and m.got.shape != m.expected.shape:
        return ("row-parallel keeps the WHOLE bias: it is added once, after the all-reduce of the partial sums.")
    return None


@MLP.check("linear_shard: contiguous column and row shards, laid out as nn.Linear, 2 and 3 ranks", points=2)
def _(ctx):
    seed = ctx.seed(11)
    weight, bias = _rand(seed, 12, 6), _rand(seed + 1, 12)
    for W in (2, 3):
        for style in ("column", "row"):
            res = ctx.ranks(W, f"{H}:shard_per_rank", weight, bias, style)   # the whole weight: cutting it is 4.2
            other_style = "row" if style == "column" else "column"
            for r, v in enumerate(res.values):
                w, b = _shard_want(weight, bias, style, r, W)
                ow, _ = _shard_want(weight, bias, other_style, r, W)
                if isinstance(v["weight"], torch.Tensor) and v["weight"].shape == ow.shape \
                        and torch.equal(v["weight"], ow):
                    raise CheckFailed(f"{style}-parallel weight shard on rank {r} (world size {W}): "
                                      + wrong_style(Mismatch("weight", v["weight"], w, extra={"other": ow,
                                                             "other_style": other_style})))
                ctx.compare(v["weight"], w, f"{style}-parallel weight shard", rank=r, world_size=W, atol=0, rtol=0,
                            detectors=[wrong_style], extra={"other": ow, "other_style": other_style, "style": style})
                ctx.compare(v["bias"], b, "bias", rank=r, world_size=W, atol=0, rtol=0, detectors=[wrong_style],
                            extra={"style": style}, case=f"{style}-parallel")


def _mlp_truth(fc1, fc2, x, dout, W):
    (w1, b1), (w2, b2) = fc1, fc2
    ps = [t.clone().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    y = F.linear(F.gelu(F.linear(ps[0], ps[1], ps[2])), ps[3], ps[4])
    y.backward(dout)
    full = {"out": y.detach(), "dx": ps[0].grad, "w1": ps[1].grad, "b1": ps[2].grad, "w2": ps[3].grad, "b2": ps[4].grad}
    partial = []       # rank r's own contribution to dx (what a missing f-backward gives)
    n = w1.shape[0] // W
    for r in range(W):
        xr = x.clone().requires_grad_(True)
        yr = F.linear(F.gelu(F.linear(xr, w1[r * n:(r + 1) * n], b1[r * n:(r + 1) * n])), w2[:, r * n:(r + 1) * n])
        yr.backward(dout)
        partial.append(xr.grad)
    return full, partial


def mlp_mistakes(m: Mismatch) -> str | None:
    W, bias, partial = m.world_size, m.extra.get("bias"), m.extra.get("partial")
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape:
        return None
    got = m.got.double()
    if m.what == "output" and bias is not None and torch.allclose(got, m.expected + (W - 1) * bias, atol=1e-9):
        return (f"the output is off by exactly {W - 1}× the bias: the row-parallel bias was added on every rank "
                "before the all-reduce. Sum the partial products first, then add the bias once.")
    if m.what == "input gradient" and partial is not None and m.rank is not None \
            and torch.allclose(got, partial[m.rank], atol=1e-9):
        return ("the input gradient is this rank's partial sum: nothing all-reduces it in the backward. x must "
                "enter the column-parallel layer through f (copy_to_tensor_region).")
    if m.what == "input gradient" and W and torch.allclose(got, W * m.expected, atol=1e-9):
        return (f"the input gradient is {W}× too large: an all-reduce in both directions (g's backward, or f "
                "twice). Exactly one all-reduce per direction.")
    return None


def _mlp(ctx, W: int, seed: int, scale: float = 1.0, dtype=torch.float64, tol: float = 1e-10):
    d, dff, T = 6, 4 * W, 5
    fc1 = (_rand(seed, dff, d, scale=0.5, dtype=dtype), _rand(seed + 1, dff, dtype=dtype))
    fc2 = (_rand(seed + 2, d, dff, scale=0.5, dtype=dtype), _rand(seed + 3, d, dtype=dtype))
    x, dout = _rand(seed + 4, T, d, scale=scale, dtype=dtype), _rand(seed + 5, T, d, dtype=dtype)
    n = dff // W
    mine = [(fc1[0][r * n:(r + 1) * n], fc1[1][r * n:(r + 1) * n], fc2[0][:, r * n:(r + 1) * n], fc2[1], x, dout)
            for r in range(W)]
    res = ctx.ranks(W, f"{H}:mlp_per_rank", per_rank=[tuple(t.contiguous() for t in m) for m in mine])
    d64 = lambda t: t.double()   # noqa: E731
    full, partial = _mlp_truth((d64(fc1[0]), d64(fc1[1])), (d64(fc2[0]), d64(fc2[1])), d64(x), d64(dout), W)
    for r, v in enumerate(res.values):
        kw = dict(rank=r, world_size=W, atol=tol, rtol=tol, detectors=[mlp_mistakes],
                  extra={"bias": full and d64(fc2[1]), "partial": partial})
        ctx.compare(v["out"], full["out"], "output", **kw)
        if not v.get("has_graph"):
            raise CheckFailed(f"the output on rank {r} has no autograd graph: an all-reduce ran outside autograd, "
                              "so no gradient reaches the weights. Use f and g (your 4.1).")
        ctx.compare(v["dx"], full["dx"], "input gradient", **kw)
        ctx.compare(v["w1"], full["w1"][r * n:(r + 1) * n], "gradient of fc1's weight shard", **kw)
        ctx.compare(v["b1"], full["b1"][r * n:(r + 1) * n], "gradient of fc1's bias shard", **kw)
        ctx.compare(v["w2"], full["w2"][:, r * n:(r + 1) * n], "gradient of fc2's weight shard", **kw)
        ctx.compare(v["b2"], full["b2"], "gradient of fc2's (whole) bias", **kw)
    return res


@MLP.check("parallel MLP on 2 ranks: output, input and weight gradients equal one process's", points=3)
def _(ctx):
    _mlp(ctx, 2, ctx.seed(21))


@MLP.check("parallel MLP on 3 ranks, inputs ×30", points=2)
def _(ctx):
    _mlp(ctx, 3, ctx.seed(22), scale=30.0)


@MLP.check("one all-reduce forward, one backward (trace; feedback only, no points)", points=0)
def _(ctx):
    res = _mlp(ctx, 2, ctx.seed(23))
    ar = [e for e in res.events(rank=0) if e["op"] in ("all_reduce", "all_gather", "reduce_scatter")]
    if len(ar) != 2:
        raise CheckFailed(f"values are right, but rank 0 ran {len(ar)} collectives for one forward + backward; "
                          "a parallel MLP needs exactly 2 (g forward, f backward).")


# ----------------------------------------------------------------------------------------------
# 4.3 — vocabulary-parallel cross-entropy


def _targets(V: int, T: int, W: int, seed: int, ignore=(3,)):
    edges = [i for r in range(W) for i in (r * V // W, (r + 1) * V // W - 1)]
    t = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))
    t[:len(edges)] = torch.tensor(edges)
    for i in ignore:
        t[i] = -100
    return t


def xent_mistakes(m: Mismatch) -> str | None:
    if m.has_nonfinite:
        return ("NaN/inf with large logits: exp(z) overflowed. Subtract the GLOBAL max of each row (an "
                "all-reduce with ReduceOp.MAX) before exponentiating.")
    tgt = m.extra.get("target")
    if not isinstance(m.got, torch.Tensor) or m.got.shape != m.expected.shape or tgt is None:
        return None
    bad = ((m.got.double() - m.expected.double()).abs() > 1e-6 * (1 + m.expected.double().abs()))
    if bad.dim() > 1:
        bad = bad.any(1)
    ignored = tgt == -100
    if bool(bad[ignored].any()) and not bool(bad[~ignored].any()):
        return "wrong only at ignored tokens (target == ignore_index): their loss and gradient must be 0."
    edges = m.extra.get("edges", set())
    if bool(bad.any()) and all(int(tgt[i]) in edges for i in torch.nonzero(bad).flatten().tolist()):
        return ("wrong only where the target sits at the edge of a shard: rank r owns ids r·V/W … (r+1)·V/W - 1 "
                "(the first included, the next rank's first excluded).")
    return None


def _xent(ctx, W: int, seed: int, scale: float, dtype=torch.float64, tol: float = 1e-10):
    """One case: T ≤ XENT_MAX_TOKENS tokens, a vocabulary of V = W·(25…32) ids — a row of logits is
    more than an all-reduce may carry here, so only per-token numbers can travel."""
    rng = random.Random(seed)
    V, T = W * rng.randint(25, 32), rng.randint(9, XENT_MAX_TOKENS)
    logits, dloss = _rand(seed, T, V, scale=scale, dtype=dtype), _rand(seed + 1, T, dtype=dtype)
    if scale > 1:      # one confident token: its logits shifted by +100 (the softmax does not change)
        logits[1] += 100
    target = _targets(V, T, W, seed + 2)
    n = V // W
    res = ctx.ranks(W, f"{H}:xent_per_rank",
                    per_rank=[(logits[:, r * n:(r + 1) * n].contiguous(), target, dloss) for r in range(W)])
    z = logits.double().clone().requires_grad_(True)
    loss = F.cross_entropy(z, target, reduction="none")
    loss.backward(dloss.double())
    edges = {i for r in range(W) for i in (r * V // W, (r + 1) * V // W - 1)}
    res.sizes = (T, V)
    for r, v in enumerate(res.values):
        kw = dict(rank=r, world_size=W, atol=tol, rtol=tol, detectors=[xent_mistakes],
                  extra={"target": target, "edges": edges}, case=f"logits ×{scale:g}, {str(dtype)[6:]}")
        ctx.compare(v["loss"], loss.detach(), "per-token loss", **kw)
        if not v["has_graph"]:
            raise CheckFailed("the loss has no autograd graph back to logits_shard: wrap the computation in a "
                              "torch.autograd.Function (or keep it differentiable).")
        ctx.compare(v["grad"], z.grad[:, r * n:(r + 1) * n], "gradient of logits_shard", **kw)
    return res


@XENT.check("2 ranks: loss and gradient equal F.cross_entropy, targets at shard edges, one ignored", points=3)
def _(ctx):
    _xent(ctx, 2, ctx.seed(31), 1.0)


@XENT.check("3 ranks, float32 logits ×30, one token shifted by +100: finite and exact (needs the max)", points=2)
def _(ctx):
    _xent(ctx, 3, ctx.seed(32), 30.0, dtype=torch.float32, tol=2e-4)


@XENT.check("never gathers the vocabulary: 3 all-reduces of one number per token (trace; feedback only, no points)",
            points=0)
def _(ctx):
    res = _xent(ctx, 2, ctx.seed(33), 1.0)
    T, Vw = res.sizes[0], res.sizes[1] // 2
    big = [e for e in res.events(rank=0)
           if e["op"] in ("all_reduce", "all_gather", "reduce_scatter", "send", "all_to_all")
           and e["nbytes"] >= T * Vw * 8]
    small = [e for e in res.events(rank=0) if e["op"] == "all_reduce" and e["nbytes"] == T * 8]
    if big:
        raise CheckFailed(f"rank 0 sent {len(big)} message(s) of vocabulary size ({[e['nbytes'] for e in big]} bytes): "
                          "the point is never to gather V logits; reduce one number per token (max, sum, target).")
    ctx.expect(len(small) <= 3, f"rank 0 ran {len(small)} per-token all-reduces; 3 are enough (max, sum of "
                                "exponentials, target logit).")
