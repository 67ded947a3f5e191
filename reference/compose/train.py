"""Lecture 5c, part 2 — one training step on the rank grid, and the bytes each axis moves.

The step, on every rank (``train_step``)::

    global batch (B, S) of step t  ── get_batch: the same on every rank
      │ rows    dp_rank·B/dp …          (data parallel: my sequences)
      │ columns chunks cp_rank, 2cp−1−cp_rank   (context parallel, zigzag: my tokens)
      ▼
    forward + backward                  pp = 1: model.loss(x, y).backward()
                                        pp > 1: reference.pipeline.run_pipeline (GPipe, 1F1B or ZB-H1,
                                                m micro-batches, loss = mean over the whole batch);
                                                each MoE layer's aux loss enters backward on its own
                                                stage with weight α/N_moe/m (AuxLossAutoScaler)
      ▼
    gradient synchronisation            1. sequence parallelism: Σ over tp of the LayerNorm /
                                           row-bias / pos_emb grads (tensor.sync_sequence_parallel_grads)
                                        2. dense: average over dp_cp, all of them in ONE flat
                                           all-reduce (a DDP bucket, lecture 3); experts: Σ over
                                           edp, ÷ dp·cp (moe.sync_moe_gradients)
      ▼
    (clip_grad_norm=c)                  ‖g‖ of the whole model: each rank's squares of the gradients it
                                        owns, one all-reduce of one number (``what="grad_norm"``);
                                        every gradient × min(1, c/(‖g‖ + 1e-6))  (compose.clip)
      ▼
    Adam step on my shards              elementwise, so sharded Adam = full Adam
      ▼
    loss of the whole batch             one all-reduce of one number (``what="loss"``): the last
                                        stage's cross-entropy (+ aux, pp = 1), + each stage's aux share

Why dp_cp and not dp.  Every rank's loss is the mean over ITS tokens: B/dp sequences × S/cp
positions.  The objective is the mean over all of them, L = (1/(dp·cp)) Σ_r L_r, so every
replicated gradient is the average over the dp·cp ranks that hold the same shard — the context
ranks too: they saw other positions of the same sequences (forget them and each cp rank steps on
its own half of the sequence; the replicas drift apart at once).  Tensor-parallel ranks hold
different shards, or (LayerNorms, biases after a row-parallel layer) equal copies with equal
gradients: they saw the same tokens.  Pipeline stages own disjoint parameters.

Bytes per rank per step (``expected_bytes``; b bytes per element, T = (B/dp)·(S/cp) tokens of
this rank, L_s blocks on its stage, d model width, [first]/[last] stage flags, n = group size).
Wire bytes are what a ring algorithm sends (reference.comm.ring_bytes): all-reduce 2(n−1)/n of
its input, all-gather (n−1)× the shard, reduce-scatter (n−1)/n of the input, p2p the message::

    tp  (n = tp)  2(tp−1)/tp · b · [ T·d·(first + 4·L_dense + 2·L_moe + 2·L_shared + last) + 3·T·last
                                     + 2·d·R ]                            (no sequence parallelism)
                  embedding g, per block f(qkv)ᵇ g(proj)ᶠ f(fc1)ᵇ g(fc2)ᶠ, head f ᵇ, and the loss's
                  3 all-reduces of one number per token (max, Σexp, target logit); R = rows the
                  local experts received (an expert's fc1/fc2 cost f + g on its rows; a shared
                  expert's f + g on all T tokens).  Folded (etp = 1 < tp, .moe_layer): the experts
                  cost no tp message (R drops out); instead each MoE layer all-gathers its rows'
                  outputs and, backward, their gradients, 2·(tp−1)·(T/tp)·d·b, and its router's
                  gradient is summed over tp, 2(tp−1)/tp · b · E·d.
                  sequence parallel: every all-reduce of T·d becomes a reduce-scatter + an all-gather
                  of the same wire bytes, and each column-parallel layer (qkv, fc1, head) all-gathers
                  its input again in the backward (it saved only its T/tp rows: what="sp_regather"),
                  (tp−1)/tp · b · T·d · (2·first + (8 + 2)·L_s + (2 + 1)·last)  (MoE: not supported),
                  + 2(tp−1)/tp · b · (3·T·last + P_sp)  [the loss, and Σ over tp of the P_sp
                  replicated parameters that saw S/tp rows: 6d per block, pos_emb, ln_f]
    cp  (n = cp)  6·(cp−1) · T·(d/tp)·b · L_s    per layer K,V forward (2 blocks × cp−1 hops),
                  K,V again and the dK,dV accumulators backward
    dp_cp         2(n−1)/n · b · P_dense         n = dp·cp, P_dense = dense parameters on this rank
    edp           2(n−1)/n · b · P_expert        n = dp·cp/ep, P_expert = expert parameters on this rank
    pp            T·d_a·b · ([not last] + [not first]),  d_a = d (d/tp with sequence parallelism):
                  each micro-batch's activation forward and its gradient back (the aux losses
                  stay on their stage: nothing more)
    ep            payload per MoE layer: the dispatch and combine.backward all-to-alls hand in k·T·d·b
                  each (routing-independent), combine and dispatch.backward R·d·b each, plus E counts
                  and a 3-number input check; what leaves the rank depends on the routing

The trace does not name groups; :func:`axis_of` reads the axis from what each lecture's layer
writes in the event's meta (``operator`` f/g, ``what`` kv/dkv, dispatch, dense_grads, …).
"""
from __future__ import annotations

import torch

from .. import comm
from ..moe import sync_moe_gradients
from ..pipeline import balanced_sizes, run_pipeline
from ..sequence import shard_sequence
from ..tensor import sync_sequence_parallel_grads
from ..trace import COMM_OPS
from .clip import clip_grad_norm_
from .estimate import step_bytes
from .overlap import overlapped_sync, sync_the_rest
from .parallel_gpt import ParallelGPT, padded_vocab
from .zero import zero_bytes

__all__ = ["local_batch", "sync_gradients", "train_step", "global_loss", "axis_of", "measured_bytes",
           "param_counts", "expected_bytes"]


def local_batch(x: torch.Tensor, y: torch.Tensor, model: ParallelGPT) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (dp) and zigzag columns (cp) of the global batch's inputs and targets."""
    g, c = model.grid, model.coords
    n = x.shape[0] // g.dp
    x, y = x[c["dp"] * n:(c["dp"] + 1) * n], y[c["dp"] * n:(c["dp"] + 1) * n]
    if g.cp > 1:
        x, y = (shard_sequence(t, c["cp"], g.cp, "zigzag", dim=1) for t in (x, y))
    return x, y


def sync_gradients(model: ParallelGPT) -> None:
    """Make every rank's ``.grad`` the gradient of the whole batch's loss, in place (exercise 5c.2).

    After ``backward`` each rank holds the gradient of ITS loss L_r: the mean over its B/dp
    sequences × S/cp positions, computed with its shards.  The step needs the gradient of
    L = (1/(dp·cp)) Σ_r L_r.  What ``model`` offers (a :class:`ParallelGPT`, or anything with these)::

        model.dense_params()               parameters that are not an expert's
        model.expert_params()              this rank's experts (lecture 5b; empty for a dense model)
        model.sequence_parallel_params()   replicated over tp but fed only S/tp rows each under
                                           sequence parallelism (empty without it); also in dense_params()
        model.groups[axis]                 this rank's process group on "tp", "cp", "dp", "dp_cp", "pp",
                                           and with experts "ep", "edp"
        model.grid                         the RankGrid (model.grid.dp, .cp, .tp, .ep, .edp, …)

    Parameters whose ``.grad`` is None are skipped (the same ones on every rank of a group).

    Graded on: every gradient after your sync equal to one process's, on dp × cp, dp × tp with sequence parallelism,
    and dp × cp × ep grids (and dp × pp, hidden).
    """
    sync_sequence_parallel_grads(model.sequence_parallel_params(), group=model.groups["tp"])
    n = model.grid.dp * model.grid.cp
    if n > 1:
        # dense: the mean over dp_cp, in ONE all-reduce of their concatenation (one message per
        # step instead of one per tensor: what DDP's buckets buy, lecture 3)
        grads = [p.grad for p in model.dense_params() if p.grad is not None]
        comm.all_reduce_coalesced(grads, group=model.groups["dp_cp"], what="dense_grads")
        for g in grads:
            g /= n
        # experts: Σ over the ranks holding the same experts, ÷ dp·cp (lecture 5b)
        sync_moe_gradients([], model.expert_params(), dp_group=model.groups["dp_cp"],
                           expert_dp_group=model.groups.get("edp"))


def global_loss(model: ParallelGPT, loss: torch.Tensor | None) -> float:
    """The whole batch's loss on every rank: the mean of the dp·cp ranks' losses (tp copies add 0;
    with pp > 1 every stage adds its MoE layers' aux share, the last its cross-entropy).  One
    all-reduce of one number over the world."""
    return _reported(model, _post_loss(model, loss))


def _post_loss(model: ParallelGPT, loss: torch.Tensor | None) -> comm.PendingCollective:
    """global_loss's all-reduce, posted: train_step lets it fly during the clip and the optimizer step."""
    mine = 0.0
    if model.coords["tp"] == 0:
        mine = (float(loss.detach()) if loss is not None else 0.0) + model.aux_share()
    t = torch.tensor([mine], dtype=torch.float64, device=next(model.parameters()).device)
    return comm.all_reduce_async(t, what="loss")


def _reported(model: ParallelGPT, pending: comm.PendingCollective) -> float:
    return float(pending.wait()) / (model.grid.dp * model.grid.cp)


def train_step(model: ParallelGPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               schedule: str = "1f1b", num_microbatches: int = 1, clip_grad_norm: float | None = None,
               overlap: bool = True, bucket_cap_mb: float = 1.0) -> float:
    """One step on the global batch (x, y) (B, S), the same on every rank.  Returns its loss.

    pp > 1: ``schedule`` is one of reference.pipeline's with one chunk per rank ("gpipe", "1f1b",
    "zb_h1"), over ``num_microbatches`` equal micro-batches of this rank's rows.  ``clip_grad_norm``
    c: the synchronised gradients are clipped to global norm c before the step (.clip); the norm
    before clipping is left in ``model.grad_norm`` (None without clipping: no extra message).
    ``overlap``: the dense gradients' mean over dp_cp travels in lecture 3's buckets of ``bucket_cap_mb``
    MiB, each posted from a gradient hook as soon as it is full, during backward (.overlap); False:
    :func:`sync_gradients` after backward, one all-reduce.  With ZeRO the same hooks post its
    reduce-scatters (stage 1: all-reduces) bucket by bucket (.zero); False: one message in its step.
    """
    x, y = local_batch(x, y, model)
    optimizer.zero_grad(set_to_none=True)
    model.scale_aux_losses(num_microbatches)
    zero = getattr(optimizer, "syncs_gradients", False)
    buckets = overlapped_sync(model, bucket_cap_mb=bucket_cap_mb) if overlap else None
    if buckets is not None:                                  # ZeRO: the hooks feed its shard buckets (.zero)
        shards = optimizer.shard_buckets(bucket_cap_mb) if zero and buckets.n > 1 else None
        buckets.arm(num_microbatches if model.grid.pp > 1 else 1, zero=shards)
    if model.grid.pp == 1:
        loss = model.loss(x, y)
        loss.backward()
    else:
        loss = run_pipeline(model, schedule, x, y, model.loss_fn, num_microbatches=num_microbatches,
                            group=model.groups["pp"], shapes=model.stage_shapes(x.shape[0] // num_microbatches))
    norm = None
    if zero:                                                 # ZeRO (compose.zero) reduces (and clips) in its step
        if buckets is not None:
            buckets.finish()                                 # disarms the hooks; the step waits for the buckets
        norm = optimizer.step() if clip_grad_norm is None else optimizer.step(clip_grad_norm)
        model.update_expert_biases()                         # loss-free balancing (.moe_layer)
        reported = _post_loss(model, loss)
    else:
        if buckets is not None:
            buckets.finish()                                 # wait for the buckets in flight, ÷ dp·cp
            sync_the_rest(model)                             # sequence-parallel copies, experts
        else:
            sync_gradients(model)
        # every gradient message has been waited for: the loss's all-reduce (over the world) flies
        # during the clip and Adam; every rank posts the same messages in the same order
        reported = _post_loss(model, loss)
        if clip_grad_norm is not None:
            norm = clip_grad_norm_(model, clip_grad_norm)
        optimizer.step()
        model.update_expert_biases()                         # loss-free balancing (.moe_layer)
    model.grad_norm = norm
    return _reported(model, reported)


# ----------------------------------------------------------------------------------------------
# Bytes per axis: measured from the trace, and the formulas


_TP_WHAT = {"max", "sum_exp", "target_logit"}          # vocab_parallel_cross_entropy's all-reduces
_EP_WHAT = {"dispatch", "combine", "counts", "check_input", "dispatch.backward", "combine.backward"}
_WHAT_AXIS = {"kv": "cp", "dkv": "cp", "dense_grads": "dp_cp", "expert_grads": "edp", "activation": "pp",
              "grads": "dp_cp", "params": "dp_cp",                     # ZeRO's reduce and all-gather (zero.py)
              "gradient": "pp", "aux_loss": "aux", "loss": "report", "unshard": "unshard", "shape": "pp",
              "grad_norm": "clip"}


def axis_of(event) -> str:
    """The axis a communication event belongs to, from its meta ("other" if unknown).

    "aux" is the load-balancing loss's statistics (2E+1 numbers per MoE layer over dp_cp),
    "report" the loss all-reduce, "clip" the gradient norm's (both one number over the world),
    "unshard" the gathering of parameters after training.
    """
    m = event.meta
    what = m.get("what", "")
    if m.get("operator") in ("f", "g", "g-bar", "sp-grad-sync", "moe-gather") or what in _TP_WHAT:
        return "tp"
    if what in _EP_WHAT:
        return "ep"
    return _WHAT_AXIS.get(what, "other")


def _wire(event, n: int, index: int) -> int:
    if event.op == "send":
        return event.nbytes
    if event.op == "all_to_all":                    # what leaves the rank: all but its own block
        return event.nbytes - event.meta.get("send_bytes", [0] * n)[index]
    if event.op in ("all_reduce", "all_gather", "reduce_scatter"):
        return comm.ring_bytes(event.op, event.nbytes, n)
    return 0


def measured_bytes(trace, rank: int, grid, *, wire: bool = True) -> dict[str, int]:
    """Bytes rank ``rank`` moved per axis in ``trace``: wire bytes of a ring algorithm (default) or
    the payload handed to each collective / sent (``wire=False``).  Receives are not counted."""
    group_axis = {"aux": "dp_cp", "unshard": "tp"}          # the rest: their own axis, else the world
    out: dict[str, int] = {}
    for e in trace.filter(rank=rank):
        if e.op not in COMM_OPS or e.op in ("recv", "barrier"):
            continue
        axis = axis_of(e)
        g = group_axis.get(axis, axis)
        members = grid.ranks(g, rank) if g in grid.sizes else list(range(grid.world_size))
        n = _wire(e, len(members), members.index(rank)) if wire else e.nbytes
        out[axis] = out.get(axis, 0) + n
    return out


def _stage_layers(cfg, grid, stage: int) -> range:
    sizes = balanced_sizes(cfg.layers, grid.pp)
    return range(sum(sizes[:stage]), sum(sizes[:stage + 1]))


def param_counts(cfg, grid, stage: int) -> tuple[int, int]:
    """(dense, expert) parameter counts of one rank of pipeline stage ``stage`` (by formula)."""
    d, f, tp = cfg.d_model, cfg.d_ff, grid.tp
    layers = _stage_layers(cfg, grid, stage)
    attn = 4 * d + (3 * d * d + 3 * d + d * d) // tp + d          # ln1, ln2, qkv/tp, proj.weight/tp, proj.bias
    mlp = lambda width, cut: (2 * d * width + width) // cut + d   # noqa: E731  fc1 + fc2.weight cut, fc2.bias whole
    dense = expert = 0
    for i in layers:
        dense += attn
        if cfg.is_moe(i):
            dense += cfg.num_experts * d                          # router
            dense += mlp(cfg.shared_experts * cfg.expert_width, tp) if cfg.shared_experts else 0
            expert += cfg.num_experts // grid.ep * mlp(cfg.expert_width, grid.etp)
        else:
            dense += mlp(f, tp)
    V = padded_vocab(cfg.vocab, tp) // tp * d
    dense += (V + cfg.seq_len * d) * (stage == 0) + (V + 2 * d) * (stage == grid.pp - 1)
    return dense, expert


def expected_bytes(cfg, grid, coords: dict, batch_size: int, *, sequence_parallel: bool = False,
                   expert_rows: int = 0, steps: int = 1, bytes_per_element: int = 8, zero: int = 0) -> dict[str, int]:
    """Wire bytes per axis of one rank at ``coords`` over ``steps`` steps (module docstring formulas;
    ``zero`` 1 or 2: dp_cp is ZeRO's reduce and all-gather instead, :func:`.zero.zero_bytes`).

    expert_rows: rows this rank's experts received over those steps (routing-dependent; read it
    from the trace's ``compute`` events with ``what="experts"``).  Axes of size 1 are left out.
    """
    b, d, tp, cp, pp = bytes_per_element, cfg.d_model, grid.tp, grid.cp, grid.pp
    T = batch_size // grid.dp * (cfg.seq_len // cp)
    first, last = int(coords["pp"] == 0), int(coords["pp"] == pp - 1)
    dense, expert = param_counts(cfg, grid, coords["pp"])
    layers = _stage_layers(cfg, grid, coords["pp"])
    L_moe = sum(cfg.is_moe(i) for i in layers)
    L_s, L_dense = len(layers), len(layers) - L_moe
    L_shared = L_moe if cfg.shared_experts else 0
    folded = grid.etp != tp                                       # .moe_layer: each tp rank routes 1/tp of the tokens
    ar = lambda n, x: 2 * (n - 1) * x // n                       # noqa: E731  ring all-reduce
    out = {}
    if tp > 1:
        if sequence_parallel:
            p_sp = 6 * d * L_s + cfg.seq_len * d * first + 2 * d * last
            out["tp"] = steps * ((tp - 1) * T * d * b * (10 * L_s + 2 * first + 3 * last) // tp
                                 + ar(tp, b * (3 * T * last + p_sp)))
        else:
            out["tp"] = steps * ar(tp, b * (T * d * (first + 4 * L_dense + 2 * L_moe + 2 * L_shared + last)
                                            + 3 * T * last))
            if folded:      # my rows' outputs all-gathered (and their gradients, backward); routers Σ over tp
                out["tp"] += steps * L_moe * (2 * (tp - 1) * (T // tp) * d * b + ar(tp, b * cfg.num_experts * d))
            else:
                out["tp"] += ar(tp, 2 * d * b * expert_rows)
    # dp_cp, cp and pp: the estimate of exercise 5c.3 (with sequence parallelism a stage boundary
    # carries the S/tp rows of this tp rank: d/tp features per token instead of d)
    sizes = {a: grid.sizes[a] for a in ("tp", "cp", "dp", "pp")}
    est = step_bytes(sizes, coords, tokens=T, d_model=d, layers=L_s, dense_params=dense, bytes_per_element=b)
    if sequence_parallel and tp > 1 and pp > 1:
        est["pp"] = step_bytes(sizes, coords, tokens=T, d_model=d // tp, layers=L_s, dense_params=dense,
                               bytes_per_element=b)["pp"]
    out.update({axis: steps * v for axis, v in est.items()})
    if zero and "dp_cp" in out:
        out["dp_cp"] = steps * zero_bytes(zero, dense, grid.dp * cp, b)
    if expert and grid.dp * cp > 1:
        out["edp"] = steps * ar(grid.edp, b * expert)
    return out
