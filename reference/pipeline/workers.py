"""Rank functions of lecture 4b: one pipeline training step on every rank.

Every rank builds the same small model from a seed (:func:`make_model`), cuts it with
:func:`.stages.split_model`, keeps its own chunk(s) and runs one step; it returns the loss (last
stage) and the gradients of its parameters by their names in the full model, so the caller can
put the pipeline's gradients side by side with one process's (:func:`.oracles.single_process_truth`)::

    from reference.launch import run_world
    from reference.pipeline import workers
    res = run_world(workers.pipeline_worker, 4, schedule="1f1b", num_microbatches=8)
    res.values[-1]["loss"], res.trace.filter(op="compute")

:func:`torch_pipeline_worker` runs the same step with ``torch.distributed.pipelining`` (the peer),
recording the order in which it ran its stages' forwards and backwards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm, trace
from .executor import run_pipeline
from .schedules import Action
from .stages import chunks_of_rank, parameter_names, split_model

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def make_model(layers: int = 4, width: int = 8, *, out_features: int = 4, seed: int = 0,
               dtype: str | torch.dtype = "float64", act: str = "tanh") -> nn.Sequential:
    """``layers`` blocks: (layers − 1) × [Linear(width, width), Tanh (or GELU: ``act="gelu"``)], then
    Linear(width, out_features).  Deterministic from ``seed`` (the same on every rank)."""
    dtype = DTYPES.get(dtype, dtype)
    g = torch.Generator().manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), {"tanh": nn.Tanh, "gelu": nn.GELU}[act]())
              for _ in range(layers - 1)]
    model = nn.Sequential(*blocks, nn.Linear(width, out_features)).to(dtype)
    with torch.no_grad():
        for t in model.parameters():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) / width ** 0.5)
    return model


def make_batch(batch: int, width: int = 8, *, out_features: int = 4, seed: int = 0,
               dtype: str | torch.dtype = "float64") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (batch, width) and targets (batch, out_features), N(0, 1) from ``seed + 1``."""
    dtype = DTYPES.get(dtype, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=g, dtype=torch.float64)
    y = torch.randn(batch, out_features, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss every demo uses: mean squared error over a micro-batch."""
    return F.mse_loss(output, target)


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """:func:`mse` written out: it keeps one tensor for the backward, the residual (F.mse_loss keeps
    the output and the target)."""
    return (output - target).pow(2).mean()


def _setup(num_stages, layers, width, batch, num_microbatches, virtual_stages, sizes, seed, dtype, **model_kw):
    layers = layers if layers is not None else 2 * num_stages * virtual_stages
    batch = batch if batch is not None else 2 * num_microbatches
    model = make_model(layers, width, seed=seed, dtype=dtype, **model_kw)
    pieces = split_model(model, num_stages, virtual_stages=virtual_stages, sizes=sizes)
    out = {"out_features": model_kw["out_features"]} if "out_features" in model_kw else {}
    return model, pieces, make_batch(batch, width, seed=seed, dtype=dtype, **out)


def _my_share(stages, layers, width, batch, num_microbatches, virtual_stages, sizes, seed, dtype, placement="loop",
              **model_kw):
    """This rank's part of the run on the first ``stages`` ranks: (group, p, rank in it, full model,
    its chunks, (inputs, targets)); None on a rank outside those stages."""
    group = comm.first_ranks_group(stages or comm.world_size())
    if comm.rank() >= (stages or comm.world_size()):
        return None
    p, r = comm.world_size(group), comm.rank(group)
    model, pieces, batch_xy = _setup(p, layers, width, batch, num_microbatches, virtual_stages, sizes, seed, dtype,
                                     **model_kw)
    return group, p, r, model, chunks_of_rank(pieces, r, p, placement), batch_xy


def pipeline_worker(schedule: str = "1f1b", num_microbatches: int = 4, *, virtual_stages: int = 1,
                    stages: int | None = None, layers: int | None = None, width: int = 8, batch: int | None = None,
                    sizes=None, seed: int = 0, dtype: str = "float64", actions=None, check: bool = True,
                    link_class=None) -> dict | None:
    """One step of :func:`.executor.run_pipeline` on this rank (rank = stage).

    ``stages``: pipeline on the first ``stages`` ranks only (default: all); the others return None.
    Defaults: 2·p·v blocks, batch = 2·m rows.  Returns {"rank", "stages" (this rank's virtual
    stages), "loss" (float on the last stage, else None), "grads" ({full-model name: .grad} of this
    rank's parameters)}.  The schedule, stash and bubble are in the world's trace
    (:func:`.executor.actions_from_trace`, :func:`.executor.peak_stashed_from_trace`).
    """
    share = _my_share(stages, layers, width, batch, num_microbatches, virtual_stages, sizes, seed, dtype)
    if share is None:
        return None
    group, p, r, model, mine, (x, y) = share
    loss = run_pipeline(mine, schedule, x, y, mse, num_microbatches=num_microbatches,
                        virtual_stages=virtual_stages, group=group, actions=actions, check=check,
                        **({"link_class": link_class} if link_class is not None else {}))
    return {"rank": r, "stages": [c * p + r for c in range(virtual_stages)],
            "loss": None if loss is None else float(loss),
            "grads": {n: t.grad.clone() for n, t in parameter_names(model, mine).items()}}


def memory_worker(schedule: str = "1f1b", num_microbatches: int = 8, *, virtual_stages: int = 1,
                  stages: int | None = None, layers: int = 8, width: int = 16, rows: int = 2,
                  seed: int = 0) -> dict | None:
    """One float64 step of :func:`pipeline_worker`'s pipeline, its activation memory measured: the
    model is ``layers`` blocks Linear(w, w) → GELU (the last a bare Linear(w, w)), ``rows`` rows per
    micro-batch, the loss :func:`squared_error`.  Per micro-batch each block keeps two (rows, w) tensors
    for the backward — its Linear's input and its GELU's input (the last block: its Linear's input and
    the loss's residual) — so a chunk of k blocks keeps 2·k·rows·w·8 bytes of each micro-batch in flight.

    Returns {"rank", "peak" (the most bytes autograd held saved at once on this rank during the step:
    :class:`reference.saved.SavedTensorMeter`, parameters left out, a micro-batch's rows of the batch
    counted as its own), "saves" (tensors saved)}; the messages are in the world's trace."""
    from ..saved import SavedTensorMeter
    share = _my_share(stages, layers, width, rows * num_microbatches, num_microbatches, virtual_stages, None, seed,
                      "float64", act="gelu", out_features=width)
    if share is None:
        return None
    group, p, r, model, mine, (x, y) = share
    with SavedTensorMeter(list(model.parameters()), views=True) as meter:
        run_pipeline(mine, schedule, x, y, squared_error, num_microbatches=num_microbatches,
                     virtual_stages=virtual_stages, group=group)
    return {"rank": r, "peak": meter.peak + meter.peak_other, "saves": meter.saves}


# ----------------------------------------------------------------------------------------------
# The peer: torch.distributed.pipelining, same model, same split, same micro-batches


# Schedules beyond ZB-H1 that torch ships, under the course's names; the V-shaped ones hold two chunks
# per rank folded (placement "v": chunk 0 of rank r is stage r, chunk 1 stage 2p − 1 − r).
V_SHAPED = ("zb_v", "dualpipe_v")


def torch_schedule_class(schedule: str):
    from torch.distributed import pipelining as pp
    return {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved_1f1b": pp.ScheduleInterleaved1F1B,
            "zb_h1": pp.ScheduleInterleavedZeroBubble, "breadth_first": pp.ScheduleLoopedBFS,
            "zb_v": pp.ScheduleZBVZeroBubble, "dualpipe_v": pp.ScheduleDualPipeV}[schedule]


def torch_order_as_actions(pipeline_order: dict, num_stages: int, *, split_full_backward: bool = False,
                           overlapped: list | None = None, full: list | None = None) -> list[list[Action]]:
    """torch's ``pipeline_order`` (rank → [_Action(stage_index, type, microbatch) | None]) as our
    actions: compute actions only (F; B or I (input half) → "B"; W), chunk = stage_index // p (either
    placement).  An overlapped pair (DualPipeV's OVERLAP_F_B) gives its two sub-actions in order.
    ``split_full_backward``: a full backward B becomes B then W (for an order that mixes full and split
    backwards, as DualPipeV's does), each such B appended to ``full`` as (rank, B action).
    ``overlapped``: a list to which each overlapped pair is appended as (rank, F action, B action)."""
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    out = []
    for rank in range(num_stages):
        acts: list[Action] = []
        for a in pipeline_order[rank]:
            subs = list(getattr(a, "sub_actions", None) or ()) if a is not None else []
            for sub in subs or ([a] if a is not None else []):
                kind = sub.computation_type.value
                if kind not in kinds:
                    continue
                act = Action(kinds[kind], sub.microbatch_index, sub.stage_index // num_stages)
                acts.append(act)
                if kind == "B" and split_full_backward:
                    acts.append(act._replace(kind="W"))
                    if full is not None:
                        full.append((rank, act))
            if subs and overlapped is not None:
                f, b = (Action(kinds[x.computation_type.value], x.microbatch_index, x.stage_index // num_stages)
                        for x in subs)
                overlapped.append((rank, f, b))
        out.append(acts)
    return out


def torch_pipeline_worker(schedule: str = "1f1b", num_microbatches: int = 4, *, virtual_stages: int = 1,
                          stages: int | None = None, layers: int | None = None, width: int = 8,
                          batch: int | None = None, sizes=None, seed: int = 0, dtype: str = "float64",
                          scale_grads: bool = True) -> dict | None:
    """One step of ``torch.distributed.pipelining`` on this rank, everything else as in
    :func:`pipeline_worker`.  torch applies ``loss_fn`` per micro-batch without dividing by m and,
    with ``scale_grads=True`` (its default), divides the gradients by m at the end.  Returns
    {"loss" (mean of its per-micro-batch losses, last stage), "grads", "order" (its pipeline_order
    as our actions, every stage), "executed" (what this rank ran, in order, as our actions),
    "order_split" (the order with each full backward as B then W, those B's listed in "full_backwards"
    as (rank, B)), "overlapped" ((rank, F, B) of every pair DualPipeV overlaps), "placement" ("v" for
    the V-shaped schedules :data:`V_SHAPED`, else "loop")}."""
    from torch.distributed.pipelining import PipelineStage

    from .schedules import rank_of_stage, virtual_stage
    placement = "v" if schedule in V_SHAPED else "loop"
    share = _my_share(stages, layers, width, batch, num_microbatches, virtual_stages, sizes, seed, dtype, placement)
    if share is None:
        return None
    group, p, r, model, mine, (x, y) = share
    executed: list[Action] = []
    stages = []
    for c, module in enumerate(mine):
        st = PipelineStage(module, virtual_stage(c, r, p, placement), p * virtual_stages, torch.device("cpu"),
                           group=group)
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                           ("backward_weight_one_chunk", "W")):
            setattr(st, name, _recorded(getattr(st, name), kind, c, executed))
        stages.append(st)
    cls = torch_schedule_class(schedule)
    single = schedule in ("gpipe", "1f1b")
    sched = cls(stages[0] if single else stages, num_microbatches, loss_fn=mse, scale_grads=scale_grads)
    losses: list[torch.Tensor] = []
    with trace.quiet():
        last = {"target": y, "losses": losses} if r == rank_of_stage(p * virtual_stages - 1, p, placement) else {}
        sched.step(*([x] if r == 0 else []), **last)     # rank 0 feeds the inputs; the last stage's rank, the targets
    overlapped: list = []
    full: list = []
    return {"rank": r, "loss": float(torch.stack([t.detach() for t in losses]).mean()) if losses else None,
            "grads": {n: t.grad.clone() for n, t in parameter_names(model, mine).items()},
            "order": torch_order_as_actions(sched.pipeline_order, p), "executed": executed,
            "order_split": torch_order_as_actions(sched.pipeline_order, p, split_full_backward=True,
                                                  overlapped=overlapped, full=full),
            "overlapped": overlapped, "full_backwards": full, "placement": placement}


def _recorded(method, kind, chunk, log):
    def run(microbatch, *args, **kwargs):
        log.append(Action(kind, microbatch, chunk))
        return method(microbatch, *args, **kwargs)
    return run
