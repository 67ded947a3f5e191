"""The lecture 4a notebook's demos: real runs on a kept-alive world of 4 ranks, cut into
tensor-parallel groups of ``tp`` ranks (``comm.new_group``), returning plain data.

Each ``@recordable`` function is what a notebook cell calls (in the student release it replays a
recording until the exercises it needs pass); the ``*_worker`` functions run on the ranks.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from .. import comm
from ..recorded import live_world, recordable
from ..saved import saved_bytes
from .blocks import MLP, Block, ParallelBlock, ParallelMLP, sync_sequence_parallel_grads
from .costs import collectives
from .vocab import vocab_parallel_cross_entropy

WORLD = 4     # ranks the notebook keeps alive; groups of tp = 1, 2 or 4 of them


def tp_group(tp: int):
    """This rank's tensor-parallel group when the world is cut into groups of ``tp`` consecutive ranks
    (every rank creates every group, in the same order, as torch.distributed requires)."""
    W, r = comm.world_size(), comm.rank()
    if W % tp:
        raise ValueError(f"a world of {W} ranks cannot be cut into groups of {tp}")
    groups = [comm.new_group(list(range(i, i + tp))) for i in range(0, W, tp)]
    return groups[r // tp]


def _world(world):
    """The caller's kept-alive world, or one of WORLD ranks (shared while a release is recorded)."""
    return nullcontext(world) if world is not None else live_world(WORLD)


def _rows(x, tp, group):
    n = x.shape[0] // tp
    r = comm.rank(group)
    return x[r * n:(r + 1) * n]


# ----------------------------------------------------------------------------------------------
# The matrix-split widget's run: one parallel MLP, forward and backward


def mlp_worker(tp: int, sequence_parallel: bool, S: int, d_model: int, d_ff: int) -> dict:
    group = tp_group(tp)
    torch.manual_seed(0)
    mlp = MLP(d_model, d_ff, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, 1, d_model, generator=g, dtype=torch.float64)
    dout = torch.randn(S, 1, d_model, generator=g, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    mlp(xs).backward(dout)                                   # single-process ground truth
    pm = ParallelMLP.from_module(mlp, group, sequence_parallel=sequence_parallel)
    xin, dy = (_rows(x, tp, group), _rows(dout, tp, group)) if sequence_parallel else (x, dout)
    xin = xin.clone().requires_grad_()
    y = pm(xin)
    y.backward(dy)
    if sequence_parallel:
        sync_sequence_parallel_grads([pm.fc2.bias], group)
    want_dx = _rows(xs.grad, tp, group) if sequence_parallel else xs.grad
    return {"max_error": float((xin.grad - want_dx).abs().max())}


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


# ----------------------------------------------------------------------------------------------
# A transformer block: collectives and memory per rank


def block_worker(tp: int, sequence_parallel: bool, S: int, B: int, d_model: int, heads: int) -> dict:
    group = tp_group(tp)
    torch.manual_seed(0)
    block = Block(d_model, heads, dtype=torch.float64)
    x = torch.randn(S, B, d_model, dtype=torch.float64)
    pb = ParallelBlock(block, group, sequence_parallel=sequence_parallel)
    xin = (_rows(x, tp, group) if sequence_parallel else x).clone().requires_grad_()
    params = list(pb.parameters())
    out = {}
    act = saved_bytes(lambda: out.setdefault("y", pb(xin)), params)
    out["y"].backward(torch.ones_like(out["y"]))
    return {"param_bytes": sum(p.numel() * p.element_size() for p in params), "activation_bytes": act}


@recordable("04a.block_costs", needs=("4.1", "4.2"))
def block_costs(S: int = 16, B: int = 2, d_model: int = 32, heads: int = 4, world=None) -> dict:
    """For tp in 1, 2, 4, with and without sequence parallelism: rank 0's collectives for one
    block's forward + backward, its parameter bytes and the activation bytes autograd saved."""
    out = {"S": S, "B": B, "d_model": d_model, "heads": heads, "runs": {}}
    with _world(world) as w:
        for tp in (1, 2, 4):
            for sp in (False, True):
                res = w.run(block_worker, tp, sp, S, B, d_model, heads)
                out["runs"][(tp, sp)] = {"collectives": [c for c in collectives(res.trace, rank=0, W=tp)
                                                         if c["operator"] != "sp-grad-sync"],
                                         **res.values[0]}
    return out


# ----------------------------------------------------------------------------------------------
# The vocabulary-parallel loss


def vocab_worker(tp: int, tokens: int, V: int, scale: float) -> dict:
    group = tp_group(tp)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(tokens, V, generator=g, dtype=torch.float64) * scale
    target = torch.randint(0, V, (tokens,), generator=g)
    n = V // tp
    r = comm.rank(group)
    loss = vocab_parallel_cross_entropy(logits[:, r * n:(r + 1) * n], target, group)
    want = F.cross_entropy(logits, target, reduction="none")
    return {"loss": loss, "want": want}


@recordable("04a.vocab_loss", needs=("4.3",))
def vocab_loss(tp: int = 4, tokens: int = 6, V: int = 32000, scale: float = 30.0, world=None) -> dict:
    """The loss of ``tokens`` tokens over a vocabulary of V split over tp ranks, logits ×scale:
    rank 0's collectives and the per-token losses beside F.cross_entropy's."""
    with _world(world) as w:
        res = w.run(vocab_worker, tp, tokens, V, scale)
    return {"tp": tp, "tokens": tokens, "V": V, "loss": res.values[0]["loss"], "want": res.values[0]["want"],
            "collectives": [{"what": e.meta.get("what"), "nbytes": e.nbytes}
                            for e in res.trace.filter(op="all_reduce", rank=0)]}
