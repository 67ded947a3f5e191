"""The lecture 4a notebook's runs: real runs on a kept-alive world of 4 ranks, cut into
tensor-parallel groups of ``tp`` ranks, returning plain data.

Each ``@recordable`` function is what a notebook cell calls (in the student release it replays a
recording until the exercises it needs pass); their rank functions are in :mod:`.workers`.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..notebook.recorded import live_world, recordable
from .costs import collectives
from .workers import block_worker, dtensor, mlp_worker, parallel, vocab_worker

WORLD = 4     # ranks the notebook keeps alive; groups of tp = 1, 2 or 4 of them


def _world(world):
    """The caller's kept-alive world, or one of WORLD ranks (shared while a release is recorded)."""
    return nullcontext(world) if world is not None else live_world(WORLD)


@recordable("04a.mlp_run", needs=("4.1", "4.2"), variants=[{"sequence_parallel": True}])
def mlp_run(tp: int = 2, sequence_parallel: bool = False, S: int = 4, d_model: int = 6, d_ff: int = 8,
            world=None) -> dict:
    """A parallel MLP on tp ranks, forward + backward: shapes, rank 0's collectives (in order) and
    the largest input-gradient error against one process."""
    with _world(world) as w:
        res = w.run(mlp_worker, tp, sequence_parallel, S, d_model, d_ff)
    return {"tp": tp, "sequence_parallel": sequence_parallel, "S": S, "d_model": d_model, "d_ff": d_ff,
            "collectives": collectives(res.trace, rank=0, W=tp),
            "max_error": max(v["max_error"] for v in res.values)}


@recordable("04a.block_costs", needs=("4.1", "4.2"))
def block_costs(S: int = 16, B: int = 2, d_model: int = 32, heads: int = 4, world=None) -> dict:
    """For tp in 1, 2, 4, with and without sequence parallelism: rank 0's collectives for one
    block's forward + backward, its parameter bytes and the activation bytes autograd saved."""
    out = {"S": S, "B": B, "d_model": d_model, "heads": heads, "runs": {}}
    with _world(world) as w:
        for tp in (1, 2, 4):
            for sp in (False, True):
                res = w.run(block_worker, tp, sp, S, B, d_model, heads)
                out["runs"][(tp, sp)] = {"collectives": [c for c in directed(res.trace, tp)
                                                         if c["operator"] != "sp-grad-sync"], **res.values[0]}
    return out


def directed(trace, tp: int) -> list[dict]:
    """Rank 0's collectives (:func:`.costs.collectives`), each with its direction: its own, or — a learner's f
    and g need not say — "backward" if it started after the run's ``backward_start`` event, else "forward"."""
    began = min(e.start for e in trace.filter(op="backward_start", rank=0))
    events = trace.filter(op=("all_reduce", "all_gather", "reduce_scatter"), rank=0)
    cols = collectives(trace, rank=0, W=tp)
    for c, e in zip(cols, events):
        c["direction"] = c["direction"] or ("backward" if e.start >= began else "forward")
    return cols


@recordable("04a.saved_activations", needs=("4.1", "4.2"))
def saved_activations(S: int = 16, B: int = 2, d_model: int = 32, heads: int = 4, dropout_p: float = 0.1,
                      world=None) -> dict:
    """One block in bfloat16 with dropout — Korthikanti et al.'s setting: 2-byte activations, 1-byte
    masks — forward + backward on tp = 1, 2, 4: the bytes autograd saved on rank 0 and the matmul
    FLOPs it ran, with tensor parallelism ("tp"), with sequence parallelism ("tp+sp"), with sequence
    parallelism through ``column_parallel_linear``, which keeps the gathered input ("tp+sp, gathered"),
    and with sequence parallelism and selective or full recomputation ("tp+sp, selective", "tp+sp, full")."""
    modes = {"tp": (False, True, "none"), "tp+sp": (True, True, "none"), "tp+sp, gathered": (True, False, "none"),
             "tp+sp, selective": (True, True, "selective"), "tp+sp, full": (True, True, "full")}
    out = {"S": S, "B": B, "d_model": d_model, "heads": heads, "dropout_p": dropout_p, "bytes": {}, "flops": {}}
    with _world(world) as w:
        for tp in (1, 2, 4):
            for mode, (sp, save_shard, recompute) in modes.items():
                res = w.run(block_worker, tp, sp, S, B, d_model, heads, dropout_p=dropout_p, dtype=torch.bfloat16,
                            save_shard=save_shard, recompute=recompute)
                out["bytes"][(tp, mode)] = res.values[0]["activation_bytes"]
                out["flops"][(tp, mode)] = res.values[0]["flops"]
    return out


@recordable("04a.vocab_loss", needs=("4.3",))
def vocab_loss(tp: int = 4, tokens: int = 6, V: int = 32000, scale: float = 30.0, world=None) -> dict:
    """The loss of ``tokens`` tokens over a vocabulary of V split over tp ranks, logits ×scale:
    rank 0's collectives and the per-token losses beside F.cross_entropy's."""
    with _world(world) as w:
        res = w.run(vocab_worker, tp, tokens, V, scale)
    return {"tp": tp, "tokens": tokens, "V": V, "loss": res.values[0]["loss"], "want": res.values[0]["want"],
            "collectives": [{"what": e.meta.get("what", "(no what=)"), "nbytes": e.nbytes}
                            for e in res.trace.filter(op="all_reduce", rank=0)]}


# The course's layers beside PyTorch's DTensor plans (workers.dtensor): (kind, sequence parallel, the plan as printed)
PLANS = {"MLP": ("mlp", False, "fc1: ColwiseParallel, fc2: RowwiseParallel"),
         "block": ("block", False, "q, k, v, fc1: ColwiseParallel; proj, fc2: RowwiseParallel"),
         "block + sequence parallel": ("block", True, "+ ln1, ln2: SequenceParallel; attn, mlp: PrepareModuleInput "
                                                      "Shard(0) → Replicate; proj, fc2: RowwiseParallel → Shard(0)")}


@recordable("04a.vs_dtensor", needs=("4.1", "4.2"))
def against_dtensor(tp: int = 2, S: int = 16, B: int = 2, d_model: int = 32, heads: int = 4, world=None) -> dict:
    """The course's ParallelMLP and ParallelBlock (with and without sequence parallelism) beside the same
    float64 modules under DTensor's ``parallelize_module`` (:data:`PLANS`), forward + backward on groups of
    ``tp`` ranks: {"rows": one per plan {"case", "plan", "out", "dx", "grads" (max |ours − DTensor's| over
    the ranks: output, input gradient, every parameter's local gradient), "worst" (the parameter of the
    largest gradient difference), "partial" (the parameters DTensor left with a Partial(sum) gradient)}}."""
    cfg = dict(S=S, B=B, d_model=d_model, heads=heads, d_ff=4 * d_model)
    rows = []
    with _world(world) as w:
        for case, (kind, sp, plan) in PLANS.items():
            ours = w.run(parallel, kind, sp, tp=tp, **cfg).values
            peer = w.run(dtensor, kind, sp, tp=tp, **cfg).values
            diff = {n: max(float((a["grads"][n] - b["grads"][n]).abs().max()) for a, b in zip(ours, peer))
                    for n in ours[0]["grads"]}
            rows.append({"case": case, "plan": plan, "worst": max(diff, key=diff.get), "grads": max(diff.values()),
                         "partial": peer[0]["partial"],
                         **{k: max(float((a[k] - b[k]).abs().max()) for a, b in zip(ours, peer))
                            for k in ("out", "dx")}})
    return {"tp": tp, **cfg, "rows": rows}
