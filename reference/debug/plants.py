"""Lecture 6, part 2 — silent bugs: one classic per axis, planted in an otherwise correct run.

Each plant changes one thing of a recorded run (:func:`.runs.record_grid`) on chosen ranks, layers or
steps (``where``), by wrapping the course's own code for the length of the run — the course's files
are never edited.  Nothing crashes and nothing hangs: the run trains, its loss looks like a loss.

    plant              axis  grid            what goes wrong                           first_divergence sees first
    ─────────────────  ────  ──────────────  ────────────────────────────────────────  ─────────────────────────────
    dp_sum             dp    dp 2            dense gradients all-reduced, not ÷ dp     step 0, grad: every gradient
    zero_stale         dp    dp 2, ZeRO-1    rank r's shard stepped with the LAST      step 1, param: rank r's slice
                                             step's gradient (a buffer not refreshed)  of the parameters
    tp_no_f            tp    tp 2            a column-parallel layer without f: its    step 0, backward: the layer's
                                             backward all-reduce is missing            grad_input, every tp rank
    tp_dropout_same    tp    tp 2 (blocks)   rank r draws heads 0… dropout streams     step 0, forward: attn.proj
                                             (masks equal where they must differ)      input, rank r only
    tp_dropout_differ  tp    tp 2 (blocks)   rank r seeds the hidden dropout with its  step 0, forward: ln2 input,
                                             rank (differ where they must be equal)    rank r only
    pp_no_accumulate   pp    pp 2, m 2       each micro-batch's backward starts from   step 0, grad: the first
                                             zero: only the last micro-batch counts    stage's first parameter
    cp_causal_block    cp    cp 2            ring attention's own (diagonal) block     step 0, forward: attn.proj
                                             attended in full, future tokens included  input (the attention core)
    moe_aux_ep         ep    dp 2 (ep 1)     the balance loss's gradient scaled by ep  step 0, backward: the
                                             instead of the group it averages over     router's grad_output
                                             (where dp·cp = ep the two agree: no bug)
    clip_group         pp    pp 2, m 2,      ‖g‖ summed over the tp group only, not    step 0, grad: every gradient,
                             clip 0.05       the world: each stage clips by its own    each stage scaled its own way

:func:`apply` plants one in a rank (and returns how to take it out again).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import comm

__all__ = ["Plant", "PLANTS", "apply"]


@dataclass(frozen=True)
class Plant:
    name: str
    axis: str
    title: str
    run: dict                       # record_grid's arguments (family, sizes, options)
    where: dict = field(default_factory=dict)   # the default place: layer, rank
    symptom: str = ""
    expect: tuple = ()              # (step, phase, module, tensor, ranks) first_divergence must name


PLANTS = {p.name: p for p in (
    Plant("dp_sum", "dp", "data-parallel gradients summed, not averaged", dict(sizes={"dp": 2}), {},
          "the gradient norm is dp× one process's; with Adam the loss curve barely moves (Adam divides the scale "
          "out), with SGD it is a dp× larger learning rate", (0, "grad", "tok_emb", "weight.grad", [0, 1])),
    Plant("zero_stale", "dp", "a ZeRO shard updated from a stale gradient", dict(sizes={"dp": 2}, zero=1, steps=3),
          {"rank": 1}, "the loss matches one process for two steps, then drifts; the parameters differ only in "
          "one rank's slice of the flat vector", (1, "param", None, None, [0, 1])),
    Plant("tp_no_f", "tp", "a missing all-reduce in tensor parallelism's backward (no f before fc1)",
          dict(sizes={"tp": 2}), {"layer": 0}, "the loss of step 0 matches one process exactly; from step 1 on "
          "it does not", (0, "backward", "blocks.0.mlp.fc1", "grad_input", [0, 1])),
    Plant("tp_dropout_same", "tp", "dropout masks equal where they must differ (every tp rank draws the first "
          "heads' streams)", dict(family="blocks", sizes={"tp": 2}), {"layer": 0, "rank": 1},
          "the loss differs from one process at step 0 already; nothing else looks wrong",
          (0, "forward", "blocks.0.attn.proj", "input", [1])),
    Plant("tp_dropout_differ", "tp", "dropout masks differing where they must be equal (hidden dropout seeded "
          "by the tp rank)", dict(family="blocks", sizes={"tp": 2}), {"layer": 0, "rank": 1},
          "the tp ranks' \"replicated\" activations disagree: each rank reports another loss",
          (0, "forward", "blocks.0.ln2", "input", [1])),
    Plant("pp_no_accumulate", "pp", "pipeline gradients not accumulated across micro-batches",
          dict(sizes={"pp": 2}, num_microbatches=2), {},
          "the loss of step 0 matches; the gradient norm is about 1/m of one process's",
          (0, "grad", "tok_emb", "weight.grad", [0])),
    Plant("cp_causal_block", "cp", "ring attention's causal mask off by one block (its own block attended in full)",
          dict(sizes={"cp": 2}), {"layer": 0}, "the loss parts from one process's at step 0, then falls faster: "
          "the model sees the future", (0, "forward", "blocks.0.attn.proj", "input", [0, 1])),
    Plant("moe_aux_ep", "ep", "the MoE balance loss divided by ep instead of dp", dict(sizes={"dp": 2},
          **{"num_experts": 4, "top_k": 2, "moe_every": 2}), {"layer": 1},
          "the loss of step 0 matches one process exactly (the value is right, only its gradient is scaled); the "
          "experts' load drifts apart slowly",
          (0, "backward", "blocks.1.mlp.moe.router", "grad_output", [0, 1])),
    Plant("clip_group", "pp", "clipping's norm taken over the wrong group (the tp group, not the world)",
          dict(sizes={"pp": 2}, num_microbatches=2, clip_grad_norm=0.05), {},
          "each rank reports another gradient norm, none of them one process's",
          (0, "grad", "tok_emb", "weight.grad", [0])),
)}


# ----------------------------------------------------------------------------------------------
# The bugs, each a small wrapper around the course's code


def _set(obj, name: str, value, undo: list) -> None:
    """``obj.name = value`` now, the old value back at undo."""
    had, old = name in vars(obj), getattr(obj, name)
    setattr(obj, name, value)
    undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))


def _dp_sum(model, opt, where, undo) -> None:
    from ..compose import train
    sync, calls = train.sync_gradients, [0]

    def summed(model) -> None:                  # compose.train.sync_gradients without its ÷ dp·cp
        calls[0] += 1
        if calls[0] <= where.get("step", 0):    # (from step ``where["step"]`` on: a bug that waits)
            return sync(model)
        grads = [p.grad for p in model.dense_params() if p.grad is not None]
        comm.all_reduce_coalesced(grads, group=model.groups["dp_cp"], what="dense_grads")
    _set(train, "sync_gradients", summed, undo)


class _StaleShard:
    """The shard's optimizer, stepping with the gradient of the step before (the first step: its own)."""

    def __init__(self, optimizer, shard):
        self.optimizer, self.shard, self.previous = optimizer, shard, None

    def step(self):
        now = self.shard.grad.detach().clone()
        if self.previous is not None:
            self.shard.grad.copy_(self.previous)
        self.previous = now
        return self.optimizer.step()

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


def _zero_stale(model, opt, where, undo) -> None:
    if comm.rank(opt.dense.group) == where.get("rank", 1):
        _set(opt.dense, "optimizer", _StaleShard(opt.dense.optimizer, opt.dense.shard), undo)


def _tp_no_f(model, opt, where, undo) -> None:
    fc1 = model.blocks[str(where.get("layer", 0))].mlp.fc1
    _set(fc1, "forward", lambda x: F.linear(x, fc1.weight, fc1.bias), undo)   # no f: no all-reduce backward


def _tp_dropout_same(model, opt, where, undo) -> None:
    if comm.rank() == where.get("rank", 1):
        _set(model.blocks[where.get("layer", 0)].attn, "first_head", 0, undo)


def _tp_dropout_differ(model, opt, where, undo) -> None:
    if comm.rank() == where.get("rank", 1):
        block = model.blocks[where.get("layer", 0)]
        drop = block._drop
        _set(block, "_drop", lambda x, seed: drop(x, seed + 7919 * comm.rank()), undo)


def _pp_no_accumulate(model, opt, where, undo) -> None:
    from ..pipeline import executor
    backward = executor.backward_step

    def from_zero(microbatch, link, stash):     # every micro-batch's backward starts from zero gradients
        for p in model.parameters():
            p.grad = None
        return backward(microbatch, link, stash)
    _set(executor, "backward_step", from_zero, undo)


def _cp_causal_block(model, opt, where, undo) -> None:
    from ..sequence import ring
    attn = model.blocks[str(where.get("layer", 0))].attn
    plan, forward = ring.block_plan, attn.forward

    def off_by_one(q_rank, k_rank, world_size, layout, causal, local_len):
        pieces = plan(q_rank, k_rank, world_size, layout, causal, local_len)
        if q_rank == k_rank:                    # the diagonal block treated as a past one: no mask
            pieces = [dataclasses.replace(p, causal=False, pairs=local_len * local_len) for p in pieces]
        return pieces

    def planted(x):
        ring.block_plan = off_by_one
        try:
            return forward(x)
        finally:
            ring.block_plan = plan
    _set(attn, "forward", planted, undo)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.c, None


def _moe_aux_ep(model, opt, where, undo) -> None:
    moe = model.blocks[str(where.get("layer", 1))].mlp.moe
    aux_loss = moe._aux_loss
    c = model.grid.ep / (model.grid.dp * model.grid.cp)     # ÷ep where the aux loss's group has dp·cp ranks

    def divided_by_ep(probs, expert_index, *args, **kwargs):
        return _ScaleGrad.apply(aux_loss(probs, expert_index, *args, **kwargs), c)
    _set(moe, "_aux_loss", divided_by_ep, undo)


def _clip_group(model, opt, where, undo) -> None:
    from ..compose import clip, train

    @torch.no_grad()
    def clip_over_tp(model, max_norm):          # compose.clip.clip_grad_norm_ with the wrong group
        sq = torch.zeros((), dtype=torch.float64)
        for s in model.shards.values():
            if s.param.grad is not None and clip.owns(s, model.coords):
                sq += s.param.grad.double().square().sum()
        comm.all_reduce(sq.view(1), group=model.groups["tp"], what="grad_norm")   # BUG: not the world
        total = math.sqrt(float(sq))
        coef = clip.clip_coef(total, max_norm)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return total
    _set(train, "clip_grad_norm_", clip_over_tp, undo)


_APPLY = {"dp_sum": _dp_sum, "zero_stale": _zero_stale, "tp_no_f": _tp_no_f, "tp_dropout_same": _tp_dropout_same,
          "tp_dropout_differ": _tp_dropout_differ, "pp_no_accumulate": _pp_no_accumulate,
          "cp_causal_block": _cp_causal_block, "moe_aux_ep": _moe_aux_ep, "clip_group": _clip_group}


def apply(name: str, model, optimizer, where: dict):
    """Plant ``name`` in this rank's ``model`` (and ``optimizer``) at ``where``; returns the function
    that takes it out again (the wrapped code restored)."""
    if name not in _APPLY:
        raise ValueError(f"unknown plant {name!r}; the plants are {', '.join(_APPLY)}")
    undo: list = []
    _APPLY[name](model, optimizer, dict(where), undo)

    def take_out() -> None:
        for u in reversed(undo):
            u()
    return take_out
